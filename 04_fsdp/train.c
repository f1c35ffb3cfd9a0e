// Stage 04: stage 03 with the model sharded (FSDP: fully sharded data parallelism).
//
// Each rank still takes its own slice of every global batch, but no rank holds the whole model:
// rank r keeps shard r of every unit's (block's, and the root's) parameters, gradients and AdamW
// state, 1/P of DDP's. A unit's full weights are all-gathered just before it computes and freed
// after; its gradient is reduce-scattered so that each rank receives the sum for its shard only,
// and AdamW updates the shards. With the same seed and global batch, P ranks give the losses of one.
//   overlap_communication=false  gather each unit when it is needed
//   overlap_communication=true   prefetch: gather the next block while this one computes
//   zero_stage=1|2, hsdp_replicas=R   the lower rungs of the sharding ladder, hybrid sharding (fsdp.h)
// The technique is in fsdp.c; read `diff -u 03_ddp/train.c 04_fsdp/train.c` first.
//
// Run: mpirun -np 4 build/stage-4 --config configs/tiny.json      (see README.md)
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "comm/comm.h"
#include "config/config.h"
#include "data/alpaca.h"
#include "data/tokenizer.h"
#include "fsdp.h"
#include "model/activations.h"
#include "model/gpt.h"
#include "ops/ops.h"
#include "run/evaluate.h"
#include "run/lora.h"
#include "run/loss_scale.h"
#include "run/metrics.h"
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
    config_load(&cfg, argc, argv, STAGE_FSDP);
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

    // ---- model: this rank's shard of every unit's parameters, gradients and AdamW moments ----
    GPTConfig mc = model_shape(&cfg, tok);
    ParamLayout layout;
    gpt_layout(&layout, &mc);
    // bf16: each gathered unit is cast to bf16 on arrival (the shards and the gathers stay fp32)
    bool half_mode = config_is_half(&cfg), pure_bf16 = cfg.prec == PREC_BF16;
    Fsdp fsdp;
    fsdp_init(&fsdp, world, &layout, &cfg, half_mode);  // zero_stage, hsdp_replicas: fsdp.h's ladder
    // sharded initialisation: each rank computes only its own elements (never the whole model)
    long step = 0;
    if (cfg.resume || starts_from_checkpoint(&cfg)) step = fsdp_load_checkpoint(&fsdp, &cfg);
    else fsdp_init_shards(&fsdp, (uint64_t)cfg.seed);

    // activations for one micro-batch of the longest sequences: this rank's share of the batch
    int micro_batch = cfg.global_batch_size / cfg.gradient_acc_steps / P;
    Activations acts;
    acts_alloc(&acts, &mc, micro_batch, mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len,
               acts_flags(&cfg));

    // only rank 0 prints and writes metrics; saving a checkpoint needs every rank's shard
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    print_stage_banner(4, P, &cfg, &mc, layout.num_params);
    fsdp_print_sharding(&fsdp);
    print_batch_plan(&cfg, data, P, "ranks", total_steps);
    Lora lora;  // lora_rank > 0: the adapters train, whole on every rank, beside the frozen base's shards
    fsdp_freeze_base(&fsdp, lora_attach_blocks(&lora, &cfg, fsdp.layout, &acts));
    fsdp_print_memory(&fsdp, parameters_label(&cfg), acts.bytes);
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

        // forward + backward over the micro-batches; gradients add up in `mb.grads`. Each token's
        // loss is divided by the number of target tokens in the WHOLE global batch, so the
        // gradient is the mean over the global batch however it is cut into micro-batches.
        // (A batch whose responses were all cut off by max_seq_len has no targets: loss 0.)
        // This rank's micro-batches are slices rank * acc ... of P * acc, and the sum of the
        // ranks' gradients is exactly the one-process gradient, even when ranks hold different
        // numbers of response tokens. Each micro-batch gathers the units and reduce-scatters their
        // gradients, which add up in this rank's gradient shards, fsdp.grads.
        dev_zero(fsdp.grads, fsdp.grads_numel * sizeof(float));
        double loss_sum = 0;
        long tokens = 0, n_targets = 0;
        int acc = cfg.gradient_acc_steps;
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              rank * acc + micro, P * acc, &batch);
            lora_training(&lora, step, (rank * acc + micro) * batch.rows, batch.T);  // where its dropout masks lie
            n_targets = batch.n_targets_global;
            float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
            loss_sum += fsdp_forward_backward(&fsdp, &acts, &mc, batch.inputs, batch.targets,
                                              batch.rows, batch.T, dloss);
            tokens += (long)batch.rows * batch.T;
        }
        lora_training_done(&lora);  // evaluation runs without dropout
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);
        fsdp_reduce_gradients(&fsdp);  // ZeRO-1's reduce-scatter, HSDP's all-reduce over the replicas

        // clip the global gradient norm (summed over the shards), then AdamW on the shards; in
        // 16-mixed the gradients are first divided by the loss scale, and an overflow skips the step
        double norm = fsdp_grad_norm(&fsdp);
        if (loss_scaler_unscale(&scaler, fsdp.grads, fsdp.grads_numel, &norm)) {
            float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
            fsdp_optimizer_step(&fsdp, &cfg, lr, step + 1, clip);
        }
        // pure bf16 keeps no fp32 master: the updated weights are rounded back to bf16, and an
        // update smaller than half a bf16 step (1/256 of the weight) is lost
        if (pure_bf16) fsdp_round_to_bf16(&fsdp);
        dev_synchronize();

        StepStats s = {.step = step + 1, .total_steps = total_steps, .loss = loss, .lr = lr, .grad_norm = norm,
                       .val_loss = -1, .scaler = &scaler, .has_comm = true,
                       .has_state = true, .state_bytes = (double)fsdp_state_bytes(&fsdp)};
        step_stats_measure(&s, &cfg, t0, tokens, flops_per_token(&mc, batch.T), P);
        comm_since(&comm_before, &s.comm_bytes, &s.comm_ms);
        bool last = step + 1 == total_steps;
        if (evaluation_due(&cfg, step + 1, last)) {
            double val[2];  // the validation loss summed over its target tokens, and their count
            evaluate_sums_with(&acts, fsdp_forward, &fsdp, &mc, data, &cfg, rank, P, val);
            comm_sum_doubles(world, val, 2);
            s.val_loss = val[1] ? val[0] / val[1] : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (checkpoint_due(&cfg, step + 1, last))
            fsdp_save_checkpoint(&fsdp, &cfg, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            fsdp_save_checkpoint(&fsdp, &cfg, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    // the proof that sharding saves memory: every rank's peak resident memory (VmHWM) in training
    fsdp_print_peak_memory(&fsdp);
    fsdp_save_checkpoint(&fsdp, &cfg, total_steps);
    printf("saved %s/%s (step %ld)\n", cfg.out_dir, lora.rank ? "adapter_model.safetensors" : "model.safetensors",
           total_steps);
    if (!lora.rank) printf("  rank 0 held the whole model for it: peak %.1f MiB\n", peak_resident_bytes() / 1048576.0);
    comm_print_table(world);
    if (rank == 0) run_stats_write(&cfg, 4, P, (RunLayout){.dp = P, .sharded = true}, comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    batch_free(&batch);
    lora_free(&lora);
    acts_free(&acts);
    fsdp_free(&fsdp);
    gpt_layout_free(&layout);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
