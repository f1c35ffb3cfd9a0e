// Stage 08: stage 03 with a mixture of experts, spread over the ranks (expert parallelism).
//
// In each MoE block the MLP is num_experts MLPs and a router that sends each token to its
// experts_per_token most probable ones. The ranks form an ep x dp grid: every rank holds the
// model except the experts, of which each of a replica's ep ranks holds E / ep, and takes its own
// slice of every global batch, as in stage 03. In a MoE block each rank routes its tokens, an
// all-to-all carries every token row to the rank of its expert and a second one carries the
// output back (experts.c). After backward the experts' gradients are all-reduced over the ranks
// holding the same experts, the rest over every rank. With the same seed and global batch, any
// grid gives the losses, and drops the same tokens, as one rank.
// Read `diff -u 03_ddp/train.c 08_mixture_of_experts/train.c`.
//
// Run: mpirun -np 4 build/stage-8 --config configs/moe.json --ep_size=4      (see README.md)
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
#include "experts.h"
#include "model/activations.h"
#include "model/gpt.h"
#include "moe.h"
#include "ops/ops.h"
#include "run/evaluate.h"
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
    config_load(&cfg, argc, argv, STAGE_MIXTURE_OF_EXPERTS);
    resolve_resume(&cfg);  // continue the run saved in out_dir, or start one (key resume)
    ops_set_half_format(config_half_format(&cfg));  // 16-mixed: the 16-bit copies are fp16
    // every rank must train the same model on the same batches: the configs are compared (and
    // the backend that moves the bytes chosen: NCCL, or MPI where ranks share a GPU)
    comm_configure(world, &cfg);
    check_batch_splits(&cfg, P);  // into P ranks x gradient_acc_steps micro-batches
    ops_init();
    ExpertGrid grid;
    expert_grid_init(&grid, world, &cfg);

    // ---- data: alpaca records -> prompt template -> tokens with the prompt masked ----
    Tokenizer *tok = tokenizer_load(cfg.tokenizer_path);
    Dataset *data = load_dataset(&cfg, tok);
    // the learning-rate schedule spans every epoch; stop_iteration only ends the run early
    long batches_per_epoch, schedule_steps, total_steps;
    plan_steps(&cfg, data, &batches_per_epoch, &schedule_steps, &total_steps);

    // ---- model: one flat buffer each for parameters, gradients and AdamW's two moments ----
    // (this rank's experts only, in fp32; the whole model's layout is what checkpoints hold)
    GPTConfig mc = model_shape(&cfg, tok);
    moe_model(&mc);  // the MoE blocks' MLP is moe.c's
    ParamLayout layout, whole_layout;
    moe_layout_experts(&layout, &mc, grid.first_expert, grid.n_local);
    gpt_layout(&whole_layout, &mc);
    ModelBuffers mb;  // mb.params, mb.grads, mb.adam_m, mb.adam_v; mb.w and mb.g name their tensors
    model_buffers_alloc(&mb, &layout, false);
    long step = 0;
    if (cfg.resume || starts_from_checkpoint(&cfg))
        step = load_checkpoint_part(&cfg, &layout, &whole_layout, mb.params, mb.adam_m, mb.adam_v);
    else gpt_init_range(mb.params, &layout, 0, mb.n, (uint64_t)cfg.seed);  // each expert as one rank would

    // activations for one micro-batch of the longest sequences: this rank's share of the batch
    int micro_batch = cfg.global_batch_size / cfg.gradient_acc_steps / P;
    ExpertLayers experts;  // the MoE blocks' MLP, its rows sent to their experts' ranks and back
    Activations acts;
    expert_acts_alloc(&acts, &experts, &grid, &mc, micro_batch,
                      mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len, cfg.global_batch_size);
    // only rank 0 prints, writes metrics and saves checkpoints: the replicas are identical
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    print_stage_banner(8, P, &cfg, &mc, mb.n);
    print_expert_plan(&grid, &mc);
    print_batch_plan(&cfg, data, P, "ranks", total_steps);
    MemoryItem memory[MODEL_MEMORY_ITEMS];
    model_memory_items(memory, &cfg, mb.n, acts.bytes);
    print_memory_report("device memory (this rank's experts only):", memory, MODEL_MEMORY_ITEMS);

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
        // numbers of response tokens. No gradient is communicated until the last micro-batch.
        gpt_gradients_begin(&acts, &mb.g, mb.grads, mb.bytes);  // the first backward writes them
        moe_stats_reset(&acts);  // evaluation routes tokens too: count this step's alone
        double loss_sum = 0;
        long tokens = 0, n_targets = 0;
        int acc = cfg.gradient_acc_steps;
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              rank * acc + micro, P * acc, &batch);
            n_targets = batch.n_targets_global;
            float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
            loss_sum += gpt_forward_backward(&acts, &mb.w, &mb.g, &mc, batch.inputs, batch.targets, batch.rows, batch.T,
                                             dloss);
            tokens += (long)batch.rows * batch.T;
        }
        // sum the gradients: the experts' over the ranks holding them, the rest over every rank
        all_reduce_gradients(&grid, &layout, mb.grads);
        const MoEStepStats *moe = expert_step_stats(&experts, &acts, &mc, cfg.global_batch_size);
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm, then one AdamW step; in 16-mixed the gradients are first
        // divided by the loss scale, and a step whose gradients overflowed is skipped
        double norm = sqrt(expert_sum_squares(&grid, &layout, mb.grads));
        if (loss_scaler_unscale(&scaler, mb.grads, mb.n, &norm)) {
            float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
            adamw_step(&layout, mb.params, mb.grads, mb.adam_m, mb.adam_v, 0, mb.n, &cfg, lr, step + 1, clip);
        }
        dev_synchronize();

        StepStats s = {.step = step + 1, .total_steps = total_steps, .loss = loss, .lr = lr, .grad_norm = norm,
                       .val_loss = -1, .scaler = &scaler, .has_comm = true, .moe = moe};
        step_stats_measure(&s, &cfg, t0, tokens, flops_per_token(&mc, batch.T), P);
        comm_since(&comm_before, &s.comm_bytes, &s.comm_ms);
        bool last = step + 1 == total_steps;
        if (evaluation_due(&cfg, step + 1, last)) {
            double val[2];  // the validation loss summed over its target tokens, and their count
            evaluate_sums(&acts, &mb.w, &mc, data, &cfg, rank, P, val);
            comm_sum_doubles(world, val, 2);
            s.val_loss = val[1] ? val[0] / val[1] : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (checkpoint_due(&cfg, step + 1, last))
            expert_save_checkpoint(&cfg, &grid, &layout, &whole_layout, mb.params, mb.adam_m, mb.adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            expert_save_checkpoint(&cfg, &grid, &layout, &whole_layout, mb.params, mb.adam_m, mb.adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    expert_save_checkpoint(&cfg, &grid, &layout, &whole_layout, mb.params, mb.adam_m, mb.adam_v, total_steps);
    printf("saved %s/model.safetensors (step %ld)\n", cfg.out_dir, total_steps);
    // the proof that data parallelism kept the replicas identical: their weights agree
    comm_check_replicas_identical(grid.expert_dp, mb.params, mb.n);
    comm_print_table(world);
    expert_run_stats(&experts);  // the rows sent to experts, into stats.json
    if (rank == 0) run_stats_write(&cfg, 8, P, (RunLayout){.dp = grid.dp, .ep = grid.ep}, comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    batch_free(&batch);
    acts_free(&acts);
    expert_layers_free(&experts);
    model_buffers_free(&mb);
    gpt_layout_free(&layout);
    gpt_layout_free(&whole_layout);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
