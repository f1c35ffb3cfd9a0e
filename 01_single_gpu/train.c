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

#include "alpaca.h"
#include "config.h"
#include "device.h"
#include "evaluate.h"
#include "gpt.h"
#include "log.h"
#include "metrics.h"
#include "ops.h"
#include "optimizer.h"
#include "preemption.h"
#include "run_checkpoint.h"
#include "run_setup.h"
#include "run_stats.h"
#include "tokenizer.h"
#include "trace.h"

int main(int argc, char **argv) {
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_SINGLE_GPU);
    resolve_resume(&cfg);  // continue the run saved in out_dir, or start one (key resume)
    ops_init();

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
    size_t n = layout.num_params, bytes = n * sizeof(float);
    float *params = dev_malloc(bytes), *grads = dev_malloc(bytes);
    float *adam_m = dev_malloc(bytes), *adam_v = dev_malloc(bytes);
    Weights w, g;
    weights_point(&w, &layout, params);
    weights_point(&g, &layout, grads);
    long step = 0;
    if (cfg.resume) step = resume_checkpoint(&cfg, &layout, params, adam_m, adam_v);
    else if (starts_from_checkpoint(&cfg)) load_initial_weights(&cfg, &layout, params);
    else gpt_init_range(params, &layout, 0, n, (uint64_t)cfg.seed);

    // activations for one micro-batch of the longest sequences
    int micro_batch = cfg.global_batch_size / cfg.gradient_acc_steps;
    Activations acts;
    acts_alloc(&acts, &mc, micro_batch, mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len,
               acts_flags(&cfg));

    printf("stage 01 | %s backend (%s) | %s L=%d H=%d C=%d V=%d | %.2fM parameters\n",
           ops_backend_name(), ops_matmul_engine(), gpt_arch(&mc)->name, mc.n_layer, mc.n_head, mc.n_embd, mc.vocab_size,
           n / 1e6);
    printf("MFU peak: %s\n", ops_peak_flops_source(0));
    print_batch_plan(&cfg, data, 1, "", total_steps);
    MemoryItem memory[] = {{"parameters (fp32)", bytes}, {"gradients (fp32)", bytes},
                           {"AdamW m and v (fp32)", 2 * bytes}, {"activations", acts.bytes}};
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

        // forward + backward over the micro-batches; gradients add up in `grads`. Each token's
        // loss is divided by the number of target tokens in the WHOLE global batch, so the
        // gradient is the mean over the global batch however it is cut into micro-batches.
        // (A batch whose responses were all cut off by max_seq_len has no targets: loss 0.)
        dev_zero(grads, bytes);
        double loss_sum = 0;
        long tokens = 0, n_targets = 0;
        for (int micro = 0; micro < cfg.gradient_acc_steps; micro++) {
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size, micro,
                              cfg.gradient_acc_steps, &batch);
            n_targets = batch.n_targets_global;
            float dloss = n_targets ? 1.0f / (float)n_targets : 0.0f;
            loss_sum += gpt_forward_backward(&acts, &w, &g, &mc, batch.inputs, batch.targets,
                                             batch.rows, batch.T, dloss);
            tokens += (long)batch.rows * batch.T;
        }
        double loss = n_targets ? loss_sum / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm, then one AdamW step
        double norm = sqrt(sum_squares(grads, n));
        float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
        adamw_step(&layout, params, grads, adam_m, adam_v, 0, n, &cfg, lr, step + 1, clip);
        dev_synchronize();

        double seconds = wall_seconds() - t0;
        StepStats s = {.step = step + 1, .total_steps = total_steps, .loss = loss, .lr = lr,
                       .grad_norm = norm, .ms = 1e3 * seconds, .tokens_per_sec = tokens / seconds,
                       .mem_bytes = dev_bytes_in_use(), .val_loss = -1};
        s.mfu = flops_per_token(&mc, batch.T) * s.tokens_per_sec / ops_peak_flops(0);
        bool last = step + 1 == total_steps;
        if ((cfg.eval_interval && (step + 1) % cfg.eval_interval == 0) || last) {
            double val_sum;
            long val_count;
            evaluate_sums(&acts, &w, &mc, data, &cfg, 0, 1, &val_sum, &val_count);
            s.val_loss = val_count ? val_sum / (double)val_count : -1;
        }
        metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (cfg.checkpoint_interval && (step + 1) % cfg.checkpoint_interval == 0 && !last)
            save_checkpoint(&cfg, &layout, params, adam_m, adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && preemption_signalled()) {
            save_checkpoint(&cfg, &layout, params, adam_m, adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    save_checkpoint(&cfg, &layout, params, adam_m, adam_v, total_steps);
    printf("saved %s/model.safetensors (step %ld)\n", cfg.out_dir, total_steps);
    run_stats_write(&cfg, 1, 1, (RunLayout){.dp = 1}, NULL);

    trace_write(cfg.out_dir);
    metrics_close(&metrics);
    batch_free(&batch);
    acts_free(&acts);
    weights_free(&w);
    weights_free(&g);
    dev_free(params);
    dev_free(grads);
    dev_free(adam_m);
    dev_free(adam_v);
    gpt_layout_free(&layout);
    dataset_free(data);
    tokenizer_free(tok);
    return 0;
}
