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

#include "alpaca.h"
#include "buckets.h"  // check_replicas_identical
#include "comm.h"
#include "config.h"
#include "experts.h"
#include "gpt.h"
#include "log.h"
#include "moe.h"
#include "ops.h"
#include "tokenizer.h"
#include "trace.h"
#include "trainer.h"

int main(int argc, char **argv) {
    Comm *world = comm_init(&argc, &argv);
    int rank = comm_rank(world), P = comm_size(world);
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_MIXTURE_OF_EXPERTS);
    comm_select_backend(world, cfg.comm_backend);  // NCCL, or MPI where ranks share a GPU
    ops_set_half_format(config_half_format(&cfg));  // 16-mixed: the 16-bit copies are fp16
    // every rank must train the same model on the same batches: compare the configs
    char *config_json = config_to_json(&cfg);
    comm_check_same(world, "the config", config_json);
    free(config_json);
    if (cfg.global_batch_size % (P * cfg.gradient_acc_steps) != 0)
        fatal("key 'global_batch_size': %d sequences do not split into %d ranks x %d micro-batches",
              cfg.global_batch_size, P, cfg.gradient_acc_steps);
    ops_init();
    ExpertGrid grid;
    expert_grid_init(&grid, world, &cfg);

    // ---- data: alpaca records -> prompt template -> tokens with the prompt masked ----
    Tokenizer *tok = tokenizer_load(cfg.tokenizer_path);
    Dataset *data = load_dataset(&cfg, tok);
    // the learning-rate schedule spans every epoch; stop_iteration only ends the run early
    long batches_per_epoch, schedule_steps, total_steps;
    plan_steps(&cfg, data, &batches_per_epoch, &schedule_steps, &total_steps);

    // ---- model: one flat buffer each for parameters, gradients and AdamW's two moments, with
    // this rank's experts only; the whole model's layout is what checkpoints hold ----
    GPTConfig mc = model_shape(&cfg, tok);
    ParamLayout layout, whole_layout;
    gpt_layout_experts(&layout, &mc, grid.first_expert, grid.n_local);
    gpt_layout(&whole_layout, &mc);
    size_t n = layout.num_params, bytes = n * sizeof(float);
    float *params = dev_malloc(bytes), *grads = dev_malloc(bytes);
    float *adam_m = dev_malloc(bytes), *adam_v = dev_malloc(bytes);
    Weights w, g;
    weights_point(&w, &layout, params);
    weights_point(&g, &layout, grads);
    // the bf16 working copy of the weights, which every matmul reads
    bool half_mode = config_is_half(&cfg), pure_bf16 = strcmp(cfg.precision, "bf16") == 0;
    bf16 *params16 = NULL;
    if (half_mode) {
        params16 = dev_malloc(n * sizeof(bf16));
        weights_point_bf16(&w, &layout, params16);
    }
    long step = 0;
    if (cfg.resume || starts_from_checkpoint(&cfg))
        step = load_checkpoint_part(&cfg, &layout, &whole_layout, params, adam_m, adam_v);
    else gpt_init_range(params, &layout, 0, n, (uint64_t)cfg.seed);  // each expert as one rank would

    // activations for one micro-batch of the longest sequences: this rank's share of the batch,
    // through the expert-parallel MoE layer
    int micro_batch = cfg.global_batch_size / cfg.gradient_acc_steps / P;
    int T_max = mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len;
    ExpertLayers experts;
    expert_layers_init(&experts, &grid, &mc, micro_batch, T_max);
    ActsSpec spec = whole_model_acts(&mc, micro_batch, T_max, acts_flags(&cfg) & ACTS_BF16, false);
    spec.shape = expert_shape(&grid, &mc);
    spec.ops = &experts.base;
    Activations acts;
    acts_alloc_spec(&acts, &spec);
    moe_set_global_batch(&acts, &mc, cfg.global_batch_size);
    int moe_blocks = gpt_moe_blocks(&mc, 0, mc.n_layer);
    long *expert_load = calloc_or_die((size_t)moe_blocks * mc.n_experts + 1, sizeof(long));
    // only rank 0 prints, writes metrics and saves checkpoints: the replicas are identical
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    printf("stage 08 | %d ranks | %s backend (%s) | precision %s | %s L=%d H=%d C=%d V=%d | %.2fM parameters\n",
           P, ops_backend_name(), half_mode ? ops_matmul_engine_bf16() : ops_matmul_engine(), cfg.precision, gpt_arch(&mc)->name, mc.n_layer, mc.n_head, mc.n_embd,
           mc.vocab_size, n / 1e6);
    printf("MFU peak: %s\n", ops_peak_flops_source(half_mode));
    print_expert_plan(&grid, &mc);
    print_batch_plan(&cfg, data, P, "ranks", total_steps);
    MemoryItem memory[] = {{parameters_label(&cfg), bytes}, {copy_label(&cfg), half_mode ? n * sizeof(bf16) : 0},
                           {"gradients (fp32)", bytes}, {"AdamW m and v (fp32)", 2 * bytes},
                           {activations_label(&cfg), acts.bytes}};
    print_memory_report("device memory (this rank's experts only):", memory, 5);
    print_bf16_activation_saving(&acts);

    // ---- the training loop ----
    LossScaler scaler;  // 16-mixed: fp16's loss scale (trainer.h); otherwise 1, never skipping
    loss_scaler_init(&scaler, &cfg);
    if (cfg.resume) loss_scaler_resume(&scaler, &cfg);
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
        if (half_mode) cast_to_bf16(params16, params, n);

        // forward + backward over this rank's micro-batches (slices rank * acc ... of P * acc);
        // gradients add up in `grads`. Each token's loss is divided by the number of target
        // tokens in the WHOLE global batch, over all ranks: then the sum of the ranks' gradients
        // is exactly the one-process gradient, even when ranks hold different numbers of
        // response tokens. (A batch whose responses were all cut off has no targets: loss 0.)
        // No communication until the last micro-batch: the gradients just accumulate.
        dev_zero(grads, bytes);
        moe_stats_reset(&acts);  // evaluation routes tokens too: count this step's alone
        double loss_sum = 0;
        long tokens = 0, n_targets = 0;
        int acc = cfg.gradient_acc_steps;
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              rank * acc + micro, P * acc, &batch);
            n_targets = batch.n_targets_global;
            float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
            loss_sum += gpt_forward_backward(&acts, &w, &g, &mc, batch.inputs, batch.targets, batch.rows, batch.T,
                                             dloss);
            tokens += (long)batch.rows * batch.T;
        }
        // sum the gradients: the experts' over the ranks holding them, the rest over every rank
        all_reduce_gradients(&grid, &layout, grads);
        MoEStepStats moe = {.load = expert_load, .blocks = moe_blocks, .experts = mc.n_experts};
        reduce_expert_stats(&grid, &acts, &mc, cfg.global_batch_size, expert_load, &moe.aux_loss, &moe.dropped);
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm, then one AdamW step
        double norm = sqrt(expert_sum_squares(&grid, &layout, grads));
        if (loss_scaler_unscale(&scaler, grads, n, &norm)) {
            float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
            adamw_step(&layout, params, grads, adam_m, adam_v, 0, n, &cfg, lr, step + 1, clip);
        }
        // pure bf16 keeps no fp32 master: the updated weights are rounded back to bf16, and an
        // update smaller than half a bf16 step (1/256 of the weight) is lost
        if (pure_bf16) {
            cast_to_bf16(params16, params, n);
            cast_to_float(params, params16, n);
        }
        dev_synchronize();

        double seconds = wall_seconds() - t0;
        CommStats comm_after = comm_totals();
        StepStats s = {.step = step + 1, .total_steps = total_steps, .loss = loss, .lr = lr,
                       .grad_norm = norm, .ms = 1e3 * seconds, .tokens_per_sec = tokens / seconds, .scaler = &scaler,
                       .mem_bytes = dev_bytes_in_use(), .val_loss = -1, .has_comm = true,
                       .comm_bytes = comm_stats_bytes(&comm_after) - comm_stats_bytes(&comm_before),
                       .comm_ms = 1e3 * (comm_stats_seconds(&comm_after) - comm_stats_seconds(&comm_before)),
                       .moe = mc.n_experts ? &moe : NULL};
        s.mfu = flops_per_token(&mc, batch.T) * s.tokens_per_sec / (P * ops_peak_flops(half_mode));
        bool last = step + 1 == total_steps;
        if ((cfg.eval_interval && (step + 1) % cfg.eval_interval == 0) || last) {
            if (half_mode) cast_to_bf16(params16, params, n);  // evaluate the updated weights
            double val_sum;
            long val_count;
            evaluate_sums(&acts, &w, &mc, data, &cfg, rank, P, &val_sum, &val_count);
            val_sum = comm_sum_double(world, val_sum);
            val_count = comm_sum_long(world, val_count);
            s.val_loss = val_count ? val_sum / (double)val_count : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (cfg.checkpoint_interval && (step + 1) % cfg.checkpoint_interval == 0 && !last)
            expert_save_checkpoint(&cfg, &grid, &layout, &whole_layout, params, adam_m, adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            expert_save_checkpoint(&cfg, &grid, &layout, &whole_layout, params, adam_m, adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    expert_save_checkpoint(&cfg, &grid, &layout, &whole_layout, params, adam_m, adam_v, total_steps);
    printf("saved %s/model.safetensors (step %ld)\n", cfg.out_dir, total_steps);
    // the replicas holding the same experts stayed identical: their weights agree
    check_replicas_identical(grid.expert_dp, params, n);
    comm_print_table(world);
    run_stats_number("rows_to_experts", (double)experts.rows_to_experts);
    run_stats_number("rows_at_experts", (double)experts.rows_at_experts);
    if (rank == 0) run_stats_write(&cfg, 8, P, (RunLayout){.dp = grid.dp, .ep = grid.ep}, comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    batch_free(&batch);
    acts_free(&acts);
    expert_layers_free(&experts);
    free(expert_load);
    weights_free(&w);
    weights_free(&g);
    dev_free(params16);
    dev_free(params);
    dev_free(grads);
    dev_free(adam_m);
    dev_free(adam_v);
    gpt_layout_free(&layout);
    gpt_layout_free(&whole_layout);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
