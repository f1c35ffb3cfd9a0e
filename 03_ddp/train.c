// Stage 03: stage 02 on P ranks with data parallelism (DDP).
//
// Every rank holds the whole model and takes its own slice of every global batch. After
// backward, the ranks add up their gradients with one all-reduce, so every rank holds the
// gradient of the whole global batch and takes the same optimizer step: the replicas never
// drift apart. With the same seed and global batch, P ranks give the losses of one.
//   overlap_communication=false  one all-reduce of the flat gradient buffer after backward
//   overlap_communication=true   gradient buckets all-reduced during backward, as they fill
// Read `diff -u 02_mixed_precision/train.c 03_ddp/train.c`.
//
// Run: mpirun -np 4 build/stage-3 --config configs/tiny.json      (see README.md)
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "buckets.h"
#include "comm/comm.h"
#include "config/config.h"
#include "data/alpaca.h"
#include "data/tokenizer.h"
#include "model/activations.h"
#include "model/gpt.h"
#include "ops/ops.h"
#include "run/evaluate.h"
#include "run/lora.h"
#include "run/loss_scale.h"
#include "run/metrics.h"
#include "run/muon.h"
#include "run/optimizer.h"
#include "run/preemption.h"
#include "run/run_checkpoint.h"
#include "run/run_setup.h"
#include "run/run_stats.h"
#include "run/stage_run.h"

int main(int argc, char **argv) {
    Comm *world = comm_init(&argc, &argv);
    int rank = comm_rank(world), P = comm_size(world);
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_DDP);
    resolve_resume(&cfg);  // continue the run saved in out_dir, or start one (key resume)
    ops_set_half_format(config_half_format(&cfg));  // 16-mixed: the 16-bit copies are fp16
    // every rank must train the same model on the same batches: the configs are compared (and
    // the backend that moves the bytes chosen: NCCL, or MPI where ranks share a GPU)
    comm_configure(world, &cfg);
    check_batch_splits(&cfg, P);  // into P ranks x gradient_acc_steps micro-batches
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
    // ... and the bf16 working copy of the weights, mb.params16, which every matmul reads
    bool half_mode = config_is_half(&cfg), pure_bf16 = cfg.prec == PREC_BF16;
    ModelBuffers mb;  // mb.params, mb.grads, mb.adam_m, mb.adam_v; mb.w and mb.g name their tensors
    model_buffers_alloc(&mb, &layout, half_mode);
    long step = 0;
    if (cfg.resume) step = resume_checkpoint(&cfg, &layout, mb.params, mb.adam_m, mb.adam_v);
    else if (starts_from_checkpoint(&cfg)) load_initial_weights(&cfg, &layout, mb.params);
    else gpt_init_range(mb.params, &layout, 0, mb.n, (uint64_t)cfg.seed);

    // activations for one micro-batch of the longest sequences: this rank's share of the batch
    int micro_batch = cfg.global_batch_size / cfg.gradient_acc_steps / P;
    Activations acts;
    acts_alloc(&acts, &mc, micro_batch, mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len,
               acts_flags(&cfg));

    // only rank 0 prints, writes metrics and saves checkpoints: the replicas are identical
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    print_stage_banner(3, P, &cfg, &mc, mb.n);
    print_batch_plan(&cfg, data, P, "ranks", total_steps);
    Lora lora;  // lora_rank > 0: the base frozen; from here on layout and mb are its adapters' (run/lora.h)
    lora_attach(&lora, &cfg, &layout, &mb, &acts);
    Muon muon = muon_create(&cfg, &layout);  // optimizer muon: scratch to orthogonalize a matrix
    BucketPlan buckets;  // of the gradients that train: with LoRA, the adapters' only
    plan_buckets(&buckets, &layout, cfg.bucket_size_mb, mb.grads, world);
    print_gradient_sync(&buckets, cfg.overlap_communication, cfg.bucket_size_mb);
    MemoryItem memory[MODEL_MEMORY_ITEMS];
    model_memory_items(memory, &cfg, mb.n, acts.bytes);
    trainable_add_memory(&lora.trained, memory);  // the frozen base, its 16-bit copy, what the adapters keep
    print_memory_report("device memory:", memory, MODEL_MEMORY_ITEMS);
    print_16bit_activation_saving(&acts);

    // ---- the training loop ----
    LossScaler scaler;  // 16-mixed: fp16's loss scale (loss_scale.h); otherwise 1, never skipping
    loss_scaler_init(&scaler, &cfg);
    comm_trace_open(world, cfg.trace, cfg.trace_steps);
    Metrics metrics = {0};
    if (rank == 0) metrics_open(&metrics, cfg.out_dir, cfg.resume, step);
    Batch batch = {0};
    preemption_watch();
    for (; step < total_steps; step++) {
        trace_step();
        double t0 = wall_seconds();
        int epoch = (int)(step / batches_per_epoch);
        long b = step % batches_per_epoch;
        double lr = learning_rate(&cfg, step, schedule_steps);
        CommStats comm_before = comm_totals();

        // the bf16 copy of this step's weights: made once, read by every matmul of the step
        if (half_mode) cast_to_16(mb.params16, mb.params, mb.n);

        // forward + backward over the micro-batches; gradients add up in `mb.grads`. Each token's
        // loss is divided by the number of target tokens in the WHOLE global batch, so the
        // gradient is the mean over the global batch however it is cut into micro-batches.
        // (A batch whose responses were all cut off by max_seq_len has no targets: loss 0.)
        // This rank's micro-batches are slices rank * acc ... of P * acc, and the sum of the
        // ranks' gradients is exactly the one-process gradient, even when ranks hold different
        // numbers of response tokens. No gradient is communicated until the last micro-batch.
        gpt_gradients_begin(&acts, &mb.g, mb.grads, mb.bytes);  // the first backward writes them
        double loss_sum = 0;
        long tokens = 0, n_targets = 0;
        int acc = cfg.gradient_acc_steps;
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              rank * acc + micro, P * acc, &batch);
            lora_training(&lora, step, (rank * acc + micro) * batch.rows, batch.T);  // where its dropout masks lie
            n_targets = batch.n_targets_global;
            float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
            bool overlap = cfg.overlap_communication && micro == acc - 1;
            loss_sum += gpt_forward_backward_hooked(&acts, &mb.w, &mb.g, &mc, batch.inputs, batch.targets,
                                                    batch.rows, batch.T, dloss,
                                                    overlap ? launch_ready_buckets : NULL, &buckets);
            tokens += (long)batch.rows * batch.T;
        }
        lora_training_done(&lora);  // evaluation runs without dropout
        // sum the gradients over the ranks: afterwards every rank holds the global gradient
        if (cfg.overlap_communication) wait_buckets(&buckets);
        else comm_all_reduce(world, mb.grads, mb.n);
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm, then one AdamW step; in 16-mixed the gradients are first
        // divided by the loss scale, and a step whose gradients overflowed is skipped
        double norm = sqrt(sum_squares(mb.grads, mb.n));
        if (loss_scaler_unscale(&scaler, mb.grads, mb.n, &norm)) {
            float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
            optimizer_step(&muon, &layout, mb.params, NULL, mb.grads, mb.adam_m, mb.adam_v, 0, mb.n, &cfg, lr, step + 1,
                           clip);  // every replica holds whole matrices: Muon runs as on one rank
        }
        // pure bf16 keeps no fp32 master: the updated weights are rounded back to bf16, and an
        // update smaller than half a bf16 step (1/256 of the weight) is lost
        if (pure_bf16) {
            cast_to_16(mb.params16, mb.params, mb.n);
            cast_to_float(mb.params, mb.params16, mb.n);
        }
        dev_synchronize();

        StepStats s = {.step = step + 1, .total_steps = total_steps, .loss = loss, .lr = lr, .grad_norm = norm,
                       .val_loss = -1, .scaler = &scaler, .has_comm = true};
        step_stats_measure(&s, &cfg, t0, tokens, flops_per_token(&mc, batch.T), P);
        comm_since(&comm_before, &s.comm_bytes, &s.comm_ms);
        bool last = step + 1 == total_steps;
        if (evaluation_due(&cfg, step + 1, last)) {
            if (half_mode) cast_to_16(mb.params16, mb.params, mb.n);  // evaluate the updated weights
            double val[2];  // the validation loss summed over its target tokens, and their count
            evaluate_sums(&acts, &mb.w, &mc, data, &cfg, rank, P, val);
            comm_sum_doubles(world, val, 2);
            s.val_loss = val[1] ? val[0] / val[1] : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (rank == 0 && checkpoint_due(&cfg, step + 1, last))
            save_checkpoint(&cfg, &layout, mb.params, mb.adam_m, mb.adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            if (rank == 0) save_checkpoint(&cfg, &layout, mb.params, mb.adam_m, mb.adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    if (rank == 0) save_checkpoint(&cfg, &layout, mb.params, mb.adam_m, mb.adam_v, total_steps);
    printf("saved %s/%s (step %ld)\n", cfg.out_dir, lora.rank ? "adapter_model.safetensors" : "model.safetensors",
           total_steps);
    // the proof that data parallelism kept the replicas identical: their weights agree
    comm_check_replicas_identical(world, mb.params, mb.n);
    comm_print_table(world);
    if (rank == 0) run_stats_write(&cfg, 3, P, (RunLayout){.dp = P}, comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    batch_free(&batch);
    lora_free(&lora);
    muon_free(&muon);
    acts_free(&acts);
    model_buffers_free(&mb);
    gpt_layout_free(&layout);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
