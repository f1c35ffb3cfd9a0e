// Stage 01: train a GPT-2 on one device.
//
// The whole training loop of a language model, with nothing distributed yet:
//   read the config -> build the model -> for each step {global batch -> forward -> backward ->
//   clip -> AdamW} -> progress line + metrics.jsonl -> checkpoint.
// Every later stage is this file plus one technique; `diff -u` against the next stage shows it.
//
// Run: build/stage-1 --config configs/tiny.json      (see README.md)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "config/config.h"
#include "data/alpaca.h"
#include "data/tokenizer.h"
#include "model/activations.h"
#include "model/gpt.h"
#include "ops/ops.h"
#include "run/evaluate.h"
#include "run/lora.h"
#include "run/metrics.h"
#include "run/muon.h"
#include "run/optimizer.h"
#include "run/preemption.h"
#include "run/run_checkpoint.h"
#include "run/run_setup.h"
#include "run/run_stats.h"
#include "run/stage_run.h"

int main(int argc, char **argv) {
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_SINGLE_GPU);
    resolve_resume(&cfg);  // continue the run saved in out_dir, or start one (key resume)
    ops_init();
    ops_set_tf32(cfg.tf32);  // the lesson of key tf32: f32 matmuls with 10-bit inputs (README)

    // ---- data: alpaca records -> prompt template -> tokens with the prompt masked ----
    Tokenizer *tok = tokenizer_load(cfg.tokenizer_path);
    Dataset *data = load_dataset(&cfg, tok);
    // the learning-rate schedule spans every epoch; stop_iteration only ends the run early
    long batches_per_epoch, schedule_steps, total_steps;
    plan_steps(&cfg, data, &batches_per_epoch, &schedule_steps, &total_steps);

    // ---- model: one flat buffer each for parameters, gradients and AdamW's two moments ----
    GPTConfig mc = model_shape(&cfg, tok);
    ParamLayout layout;
    gpt_layout(&layout, &mc);
    ModelBuffers mb;  // mb.params, mb.grads, mb.adam_m, mb.adam_v; mb.w and mb.g name their tensors
    model_buffers_alloc(&mb, &layout, false);
    long step = 0;
    if (cfg.resume) step = resume_checkpoint(&cfg, &layout, mb.params, mb.adam_m, mb.adam_v);
    else if (starts_from_checkpoint(&cfg)) load_initial_weights(&cfg, &layout, mb.params);
    else gpt_init_range(mb.params, &layout, 0, mb.n, (uint64_t)cfg.seed);

    // activations for one micro-batch of the longest sequences
    int micro_batch = cfg.global_batch_size / cfg.gradient_acc_steps;
    Activations acts;
    acts_alloc(&acts, &mc, micro_batch, mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len,
               acts_flags(&cfg));

    print_stage_banner(1, 1, &cfg, &mc, mb.n);
    print_batch_plan(&cfg, data, 1, "", total_steps);
    Lora lora;  // lora_rank > 0: the base frozen; from here on layout and mb are its adapters' (run/lora.h)
    lora_attach(&lora, &cfg, &layout, &mb, &acts);
    Muon muon = muon_create(&cfg, &layout);  // optimizer muon: scratch to orthogonalize a matrix
    MemoryItem memory[] = {{"parameters (fp32)", lora.trained.base_bytes + mb.bytes}, {"gradients (fp32)", mb.bytes},
                           {"AdamW m and v (fp32)", 2 * mb.bytes}, {"activations", acts.bytes + lora.trained.acts_bytes}};
    print_memory_report("device memory:", memory, 4);

    // ---- the training loop ----
    trace_open(cfg.trace, cfg.trace_steps, 0, wall_seconds());
    Metrics metrics;
    metrics_open(&metrics, cfg.out_dir, cfg.resume, step);
    Batch batch = {0};
    preemption_watch();
    for (; step < total_steps; step++) {
        trace_step();
        double t0 = wall_seconds();
        int epoch = (int)(step / batches_per_epoch);
        long b = step % batches_per_epoch;
        double lr = learning_rate(&cfg, step, schedule_steps);

        // forward + backward over the micro-batches; gradients add up in `mb.grads`. Each token's
        // loss is divided by the number of target tokens in the WHOLE global batch, so the
        // gradient is the mean over the global batch however it is cut into micro-batches.
        // (A batch whose responses were all cut off by max_seq_len has no targets: loss 0.)
        gpt_gradients_begin(&acts, &mb.g, mb.grads, mb.bytes);  // the first backward writes them
        double loss_sum = 0;
        long tokens = 0, n_targets = 0;
        int acc = cfg.gradient_acc_steps;
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              micro, acc, &batch);
            lora_training(&lora, step, micro * batch.rows, batch.T);  // where its dropout masks lie
            n_targets = batch.n_targets_global;
            float dloss = n_targets ? 1.0f / (float)n_targets : 0.0f;
            loss_sum += gpt_forward_backward(&acts, &mb.w, &mb.g, &mc, batch.inputs, batch.targets,
                                             batch.rows, batch.T, dloss);
            tokens += (long)batch.rows * batch.T;
        }
        lora_training_done(&lora);  // evaluation runs without dropout
        double loss = n_targets ? loss_sum / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm, then one AdamW step
        double norm = sqrt(sum_squares(mb.grads, mb.n));
        float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
        optimizer_step(&muon, &layout, mb.params, NULL, mb.grads, mb.adam_m, mb.adam_v, 0, mb.n, &cfg, lr, step + 1,
                       clip);
        dev_synchronize();

        StepStats s = {.step = step + 1, .total_steps = total_steps, .loss = loss, .lr = lr, .grad_norm = norm,
                       .val_loss = -1};
        step_stats_measure(&s, &cfg, t0, tokens, flops_per_token(&mc, batch.T), 1);
        bool last = step + 1 == total_steps;
        if (evaluation_due(&cfg, step + 1, last)) {
            double val[2];  // the validation loss summed over its target tokens, and their count
            evaluate_sums(&acts, &mb.w, &mc, data, &cfg, 0, 1, val);
            s.val_loss = val[1] ? val[0] / val[1] : -1;
        }
        metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (checkpoint_due(&cfg, step + 1, last))
            save_checkpoint(&cfg, &layout, mb.params, mb.adam_m, mb.adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && preemption_signalled()) {
            save_checkpoint(&cfg, &layout, mb.params, mb.adam_m, mb.adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    save_checkpoint(&cfg, &layout, mb.params, mb.adam_m, mb.adam_v, total_steps);
    printf("saved %s/%s (step %ld)\n", cfg.out_dir, lora.rank ? "adapter_model.safetensors" : "model.safetensors",
           total_steps);
    run_stats_write(&cfg, 1, 1, (RunLayout){.dp = 1}, NULL);

    trace_write(cfg.out_dir);
    metrics_close(&metrics);
    batch_free(&batch);
    lora_free(&lora);
    muon_free(&muon);
    acts_free(&acts);
    model_buffers_free(&mb);
    gpt_layout_free(&layout);
    dataset_free(data);
    tokenizer_free(tok);
    return 0;
}
