// Stage 07: stage 03 with the blocks split over pp pipeline stages (pipeline parallelism).
//
// The P ranks form pp_size stages x P / pp_size data-parallel replicas. A stage holds a range
// of blocks (the embedding on the first, the head and the loss on the last); each replica's rows
// are cut into num_microbatches micro-batches that flow through the stages, activations forward
// and their gradients back, in the order pp_schedule says (gpipe or 1f1b: pipeline.c). Then the
// tied wte's two halves are summed between the first and the last stage, each stage's gradients
// are all-reduced over the replicas as in stage 03, and every stage takes its AdamW step on its
// own tensors. With the same seed and global batch, any grid gives the losses of one process.
// Read `diff -u 03_ddp/train.c 07_pipeline_parallel/train.c`.
//
// Run: mpirun -np 4 build/stage-7 --config configs/tiny.json --n_layer=4 --pp_size=4 --num_microbatches=4
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alpaca.h"
#include "buckets.h"
#include "comm.h"
#include "config.h"
#include "gpt.h"
#include "log.h"
#include "ops.h"
#include "pipeline.h"
#include "tokenizer.h"
#include "trace.h"
#include "trainer.h"

int main(int argc, char **argv) {
    Comm *world = comm_init(&argc, &argv);
    int rank = comm_rank(world), P = comm_size(world);
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_PIPELINE_PARALLEL);
    comm_select_backend(world, cfg.comm_backend);  // NCCL, or MPI where ranks share a GPU
    ops_set_half_format(config_half_format(&cfg));  // 16-mixed: the 16-bit copies are fp16
    // every rank must train the same model on the same batches: compare the configs
    char *config_json = config_to_json(&cfg);
    comm_check_same(world, "the config", config_json);
    free(config_json);
    // stage 03's bucketed all-reduce is not part of this stage: refused, not silently ignored
    if (cfg.overlap_communication)
        fatal("key 'overlap_communication': stage 07 has no overlapped variant (stage 03 and 04 do); set it to false");
    ops_init();

    // ---- data: alpaca records -> prompt template -> tokens with the prompt masked ----
    Tokenizer *tok = tokenizer_load(cfg.tokenizer_path);
    Dataset *data = load_dataset(&cfg, tok);
    // the learning-rate schedule spans every epoch; stop_iteration only ends the run early
    long batches_per_epoch, schedule_steps, total_steps;
    plan_steps(&cfg, data, &batches_per_epoch, &schedule_steps, &total_steps);

    // ---- model: this stage's blocks, one flat buffer each for parameters, gradients and AdamW's
    // two moments; the whole model's layout is what checkpoints hold ----
    GPTConfig mc = model_shape(&cfg, tok);
    PipeGrid grid;
    pipe_grid_init(&grid, world, &cfg, &mc);
    ParamLayout layout, full_layout;
    gpt_layout_range(&layout, &mc, grid.first_block, grid.n_blocks, grid.is_first, grid.is_last);
    gpt_layout(&full_layout, &mc);
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
        step = load_checkpoint_part(&cfg, &layout, &full_layout, params, adam_m, adam_v);
    else gpt_init_range(params, &layout, 0, n, (uint64_t)cfg.seed);  // a range initialises as the whole model

    // activations for one micro-batch of the longest sequences, once per micro-batch in flight
    int m = cfg.num_microbatches, micro_batch = cfg.global_batch_size / grid.dp / m;
    int flags = acts_flags(&cfg);
    ActsSpec spec = whole_model_acts(&mc, micro_batch, mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len,
                                     flags & ACTS_BF16, flags & ACTS_RECOMPUTE);
    Pipeline pipe;
    pipeline_init(&pipe, &grid, &mc, &cfg, spec, &w);

    // only rank 0 prints, writes metrics and saves checkpoints: the replicas are identical
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    printf("stage 07 | %d ranks | %s backend (%s) | precision %s | %s L=%d H=%d C=%d V=%d | %.2fM parameters\n",
           P, ops_backend_name(), half_mode ? ops_matmul_engine_bf16() : ops_matmul_engine(), cfg.precision, gpt_arch(&mc)->name, mc.n_layer, mc.n_head, mc.n_embd,
           mc.vocab_size, n / 1e6);
    printf("MFU peak: %s\n", ops_peak_flops_source(half_mode));
    print_pipeline_plan(&grid, &cfg, &mc, n, pipe.n_slots);
    Config plan_cfg = cfg;
    plan_cfg.gradient_acc_steps = m;  // the batch plan's micro-batches are the pipeline's
    print_batch_plan(&plan_cfg, data, grid.dp, "replicas", total_steps);
    MemoryItem memory[] = {{"parameters (fp32 master)", bytes}, {copy_label(&cfg), half_mode ? n * sizeof(bf16) : 0},
                           {"gradients (fp32)", bytes}, {"AdamW m and v (fp32)", 2 * bytes},
                           {activations_label(&cfg),
                            pipeline_activation_bytes(&pipe)}};
    print_memory_report("device memory (rank 0: stage 0):", memory, 5);
    printf("  activations: %d micro-batches in flight x %.2f MB (%s keeps %s)\n", pipe.n_slots,
           pipe.slots[0].bytes / 1e6, cfg.pp_schedule, strcmp(cfg.pp_schedule, "gpipe") == 0 ? "all m" : "min(m, p - stage)");
    run_stats_number("activation_slots", pipe.n_slots);
    print_bf16_activation_saving(&pipe.slots[0]);

    // ---- the training loop ----
    LossScaler scaler;  // 16-mixed: fp16's loss scale (trainer.h); otherwise 1, never skipping
    loss_scaler_init(&scaler, &cfg);
    if (cfg.resume) loss_scaler_resume(&scaler, &cfg);
    comm_trace_open(world, cfg.trace, cfg.trace_steps);
    Metrics metrics = {0};
    if (rank == 0) metrics_open(&metrics, cfg.out_dir, cfg.resume, step);
    Batch *batches = calloc_or_die((size_t)m, sizeof *batches);
    long first_step = step;
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

        // this replica's micro-batches (slices replica * m ... of dp * m), each stage fetching the
        // same ones: the first reads their tokens, the last their targets, every stage their shape.
        // Each token's loss is divided by the target tokens of the WHOLE global batch, as in 03.
        for (int micro = 0; micro < m; micro++)
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              grid.replica * m + micro, grid.dp * m, &batches[micro]);
        long n_targets = batches[0].n_targets_global, tokens = 0;
        float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
        // the schedule: forwards and backwards of the micro-batches through the stages;
        // gradients add up in `grads`, the loss on the last stage
        dev_zero(grads, bytes);
        pipe.tracing = step == first_step;
        double loss_sum = pipeline_step(&pipe, &g, batches, dloss);
        if (grid.is_first)
            for (int micro = 0; micro < m; micro++) tokens += (long)batches[micro].rows * batches[micro].T;
        // GPT-2's lm_head is wte: the first stage holds its embedding half of the gradient, the
        // last its head half; summed, both copies take the same AdamW step and stay equal
        if (grid.tied) comm_all_reduce(grid.tied, g.wte, (size_t)mc.padded_vocab_size * mc.n_embd);
        // sum each stage's gradients over the replicas, as stage 03 does for the whole model
        if (grid.dp > 1) comm_all_reduce(grid.dp_group, grads, n);
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm (the stages' squares summed, the shared wte once), then
        // one AdamW step on this stage's tensors
        double norm = sqrt(comm_sum_double(grid.pipe, stage_sum_squares(&grid, &layout, grads)));
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
                       .comm_ms = 1e3 * (comm_stats_seconds(&comm_after) - comm_stats_seconds(&comm_before))};
        s.mfu = flops_per_token(&mc, batches[0].T) * s.tokens_per_sec / (P * ops_peak_flops(half_mode));
        bool last = step + 1 == total_steps;
        if ((cfg.eval_interval && (step + 1) % cfg.eval_interval == 0) || last) {
            if (half_mode) cast_to_bf16(params16, params, n);  // evaluate the updated weights
            // the pipeline's forward on each replica's micro-batches; the last stages count
            double val_sum;
            long val_count;
            Config eval_cfg = cfg;
            eval_cfg.gradient_acc_steps = m;  // evaluate_batches cuts a replica's rows like training
            evaluate_batches(pipeline_eval_loss, &pipe, data, &eval_cfg, grid.replica, grid.dp, &val_sum, &val_count);
            val_sum = comm_sum_double(world, val_sum);
            val_count = comm_sum_long(world, grid.is_last ? val_count : 0);
            s.val_loss = val_count ? val_sum / (double)val_count : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (pipe.tracing) {
            print_schedule(world, &pipe);
            pipe.compute_s = pipe.schedule_s = 0;  // the run's bubble: from step 2 on
        }
        if (cfg.checkpoint_interval && (step + 1) % cfg.checkpoint_interval == 0 && !last)
            pipe_save_checkpoint(&cfg, &grid, &layout, &full_layout, params, adam_m, adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            pipe_save_checkpoint(&cfg, &grid, &layout, &full_layout, params, adam_m, adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    if (total_steps - first_step > 1) print_bubble(world, &pipe, "over steps 2 on");
    pipe_save_checkpoint(&cfg, &grid, &layout, &full_layout, params, adam_m, adam_v, total_steps);
    printf("saved %s/model.safetensors (step %ld)\n", cfg.out_dir, total_steps);
    // the proof that data parallelism kept each stage's replicas identical
    if (grid.dp > 1) check_replicas_identical(grid.dp_group, params, n);
    comm_print_table(world);
    if (rank == 0) run_stats_write(&cfg, 7, P, (RunLayout){.dp = grid.dp, .pp = grid.pp}, comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    for (int micro = 0; micro < m; micro++) batch_free(&batches[micro]);
    free(batches);
    pipeline_free(&pipe);
    weights_free(&w);
    weights_free(&g);
    dev_free(params16);
    dev_free(params);
    dev_free(grads);
    dev_free(adam_m);
    dev_free(adam_v);
    gpt_layout_free(&layout);
    gpt_layout_free(&full_layout);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
