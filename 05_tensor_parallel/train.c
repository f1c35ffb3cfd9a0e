// Stage 05: stage 03 with AxoNN-style 3D tensor parallelism over an [x, y, z] grid.
//
// Every linear layer of the model is split over a grid of ranks (tp_linear.h): out-features over
// x, in-features over y, and each rank's block cut once more into z depth shards. Attention heads
// go to x, the hidden dimension between blocks to y, and the rows of the batch to z and to the
// data dimension (world = x*y*z*data, data slowest). So one model that no rank holds whole
// trains with the losses of one process.
//   tp_dimensions [x, y, z]     the grid; the rest of the ranks is data parallelism
//   overlap_communication       prefetch the next layer's depth all-gather; overlap the backward
//                               all-reduce with the weight-gradient matmul and the reduce-scatter
//                               with the next layers
//   vocab_parallel_loss=false   the lesson's first version: gather the logits, then the loss
// Read `diff -u 03_ddp/train.c 05_tensor_parallel/train.c`, then tp_linear.c and tp_model.c.
//
// Run: mpirun -np 4 build/stage-5 --config configs/tiny.json --tp_dimensions=2,2,1   (README.md)
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alpaca.h"
#include "comm.h"
#include "config.h"
#include "gpt.h"
#include "log.h"
#include "ops.h"
#include "tokenizer.h"
#include "tp_linear.h"
#include "tp_model.h"
#include "trace.h"
#include "trainer.h"

int main(int argc, char **argv) {
    Comm *world = comm_init(&argc, &argv);
    int rank = comm_rank(world), P = comm_size(world);
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_TENSOR_PARALLEL);
    comm_select_backend(world, cfg.comm_backend);  // NCCL, or MPI where ranks share a GPU
    ops_set_half_format(config_half_format(&cfg));  // 16-mixed: the 16-bit copies are fp16
    char *config_json = config_to_json(&cfg);
    comm_check_same(world, "the config", config_json);
    free(config_json);
    ops_init();

    // ---- data ----
    Tokenizer *tok = tokenizer_load(cfg.tokenizer_path);
    Dataset *data = load_dataset(&cfg, tok);
    // the learning-rate schedule spans every epoch; stop_iteration only ends the run early
    long batches_per_epoch, schedule_steps, total_steps;
    plan_steps(&cfg, data, &batches_per_epoch, &schedule_steps, &total_steps);

    // ---- the grid: refused before any work if it does not fit the model and the batch ----
    GPTConfig mc = model_shape(&cfg, tok);
    tp_check_grid(&mc, cfg.tp_dimensions, P, cfg.global_batch_size, cfg.gradient_acc_steps);
    TPModel model;
    tp_model_init(&model, world, &mc, cfg.tp_dimensions, cfg.vocab_parallel_loss);
    const TPGrid *grid = &model.grid;
    Comm *ckpt_group = comm_split(world, 0, rank, "checkpoint");
    // rows: the global batch is cut into z * data * acc slices; the x, y ranks of a slice share it
    int row_ranks = grid->Z * grid->D, row_rank = grid->d * grid->Z + grid->z;
    bool counts_rows = grid->x == 0 && grid->y == 0;

    // ---- this rank's share of the model: flat buffers in the local layout ----
    size_t n = model.layout.num_params, bytes = n * sizeof(float);
    float *params = dev_malloc(bytes), *grads = dev_malloc(bytes);
    float *adam_m = dev_malloc(bytes), *adam_v = dev_malloc(bytes);
    Weights w, g;
    weights_point(&w, &model.layout, params);
    weights_point(&g, &model.layout, grads);
    bool half_mode = config_is_half(&cfg), pure_bf16 = strcmp(cfg.precision, "bf16") == 0;
    bf16 *params16 = NULL;
    if (half_mode) {
        params16 = dev_malloc(n * sizeof(bf16));
        weights_point_bf16(&w, &model.layout, params16);
    }
    long step = 0;
    if (cfg.resume || starts_from_checkpoint(&cfg)) step = tp_load_checkpoint(&cfg, &model, params, adam_m, adam_v);
    else tp_init_params(&model, params, (uint64_t)cfg.seed);

    int micro_batch = cfg.global_batch_size / cfg.gradient_acc_steps / row_ranks;
    bool overlap = cfg.overlap_communication;
    TPWeightStream stream;
    tp_stream_init(&stream, grid, model.max_block, overlap, half_mode);
    TPGradSlots slots = {0};
    if (grid->Z > 1) {
        tp_grad_slot_alloc(&slots.wte, model.head.block);
        for (int i = 0; i < 2; i++) tp_grad_slot_alloc(&slots.mat[i], model.max_block);
    }
    TPActs acts;
    tp_acts_alloc(&acts, &model, &stream, &slots, micro_batch,
                  mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len, acts_flags(&cfg), overlap);
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    printf("stage 05 | %d ranks | %s backend (%s) | precision %s | %s L=%d H=%d C=%d V=%d | %.2fM parameters\n",
           P, ops_backend_name(), half_mode ? ops_matmul_engine_bf16() : ops_matmul_engine(), cfg.precision, gpt_arch(&mc)->name, mc.n_layer, mc.n_head, mc.n_embd,
           mc.vocab_size, model.full.num_params / 1e6);
    printf("MFU peak: %s\n", ops_peak_flops_source(half_mode));
    tp_print_grid(&model, P);
    printf("overlap_communication: %s\n", overlap ? "on (depth all-gathers prefetched, backward collectives "
                                                    "started before the weight-gradient matmul)" : "off");
    print_batch_plan(&cfg, data, row_ranks, "row groups (z x data)", total_steps);
    size_t full_weights = model.full_weight_numel;
    printf("parallel weights on this rank: %zu of %zu elements (1/%zu); replicated small tensors: %zu\n",
           model.weight_numel, full_weights, full_weights / (model.weight_numel ? model.weight_numel : 1),
           model.small_numel);
    run_stats_number("parallel_weight_elements", (double)full_weights);
    run_stats_number("parallel_weight_elements_per_rank", (double)model.weight_numel);
    run_stats_number("small_elements_per_rank", (double)model.small_numel);
    MemoryItem memory[TP_MEMORY_ITEMS];
    tp_memory_items(&model, &cfg, acts.bytes, memory);
    print_memory_report("device memory (this rank):", memory, TP_MEMORY_ITEMS);
    double state_bytes = 4.0 * bytes;
    run_stats_number("state_bytes", state_bytes);

    // ---- the training loop ----
    LossScaler scaler;  // 16-mixed: fp16's loss scale (trainer.h); otherwise 1, never skipping
    loss_scaler_init(&scaler, &cfg);
    if (cfg.resume) loss_scaler_resume(&scaler, &cfg);
    comm_trace_open(world, cfg.trace, cfg.trace_steps);
    Metrics metrics = {0};
    if (rank == 0) metrics_open(&metrics, cfg.out_dir, cfg.resume, step);
    Batch batch = {0};
    long tokens_trained = 0;  // the global batches' tokens (padding included): x and y traffic scales with it
    preemption_watch();
    for (; step < total_steps; step++) {
        trace_step();
        double t0 = wall_seconds();
        int epoch = (int)(step / batches_per_epoch);
        long b = step % batches_per_epoch;
        double lr = learning_rate(&cfg, step, schedule_steps);
        CommStats comm_before = comm_totals();
        if (half_mode) cast_to_bf16(params16, params, n);

        // forward + backward over this row group's micro-batches. Every x, y rank of the group
        // holds the same rows and computes the same loss; gradients add up in `grads`.
        dev_zero(grads, bytes);
        double loss_sum = 0;
        long tokens = 0, n_targets = 0;
        int acc = cfg.gradient_acc_steps;
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              row_rank * acc + micro, row_ranks * acc, &batch);
            n_targets = batch.n_targets_global;
            float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
            tp_forward(&model, &acts, &w, batch.inputs, batch.rows, batch.T);
            double l = tp_loss(&model, &acts, batch.targets, batch.rows, batch.T, dloss, true);
            tp_backward(&model, &acts, &w, &g, batch.rows, batch.T);
            if (counts_rows) loss_sum += l, tokens += (long)batch.rows * batch.T;
        }
        // the gradient of a tensor with copies on several ranks must be summed over exactly the
        // copies that saw different rows: the small tensors over z (the weights' reduce-scatter
        // already did), then everything over the data replicas. Over x or y the copies saw the
        // same rows and hold the same gradient: summing there would count it twice (AxoNN's
        // bias bug is the opposite mistake: its biases were never summed over depth).
        tp_all_reduce(grid->gz, grads, model.small_numel);
        tp_all_reduce(grid->gdata, grads, n);
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        tokens_trained += tokens;
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        double norm = sqrt(comm_sum_double(grid->tp, tp_norm_squares(&model, grads)));
        if (loss_scaler_unscale(&scaler, grads, n, &norm)) {
            float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
            adamw_step(&model.layout, params, grads, adam_m, adam_v, 0, n, &cfg, lr, step + 1, clip);
        }
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
                       .has_state = true, .state_bytes = state_bytes};
        s.mfu = flops_per_token(&mc, batch.T) * s.tokens_per_sec / (P * ops_peak_flops(half_mode));
        bool last = step + 1 == total_steps;
        if ((cfg.eval_interval && (step + 1) % cfg.eval_interval == 0) || last) {
            if (half_mode) cast_to_bf16(params16, params, n);
            double val_sum;
            long val_count;
            tp_evaluate(&model, &acts, &w, data, &cfg, row_rank, row_ranks, counts_rows, &val_sum, &val_count);
            val_sum = comm_sum_double(world, val_sum);
            val_count = comm_sum_long(world, val_count);
            s.val_loss = val_count ? val_sum / (double)val_count : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (cfg.checkpoint_interval && (step + 1) % cfg.checkpoint_interval == 0 && !last)
            tp_save_checkpoint(&cfg, &model, ckpt_group, params, adam_m, adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            tp_save_checkpoint(&cfg, &model, ckpt_group, params, adam_m, adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    tp_save_checkpoint(&cfg, &model, ckpt_group, params, adam_m, adam_v, total_steps);
    printf("saved %s/model.safetensors (step %ld, the full model)\n", cfg.out_dir, total_steps);
    comm_print_table(world);
    run_stats_number("tokens_trained", (double)tokens_trained);
    if (rank == 0)
        run_stats_write(&cfg, 5, P, (RunLayout){.dp = grid->D, .tp_dimensions = {grid->X, grid->Y, grid->Z}},
                        comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    batch_free(&batch);
    tp_acts_free(&acts);
    tp_stream_free(&stream);
    if (grid->Z > 1) {
        tp_grad_slot_free(&slots.wte);
        for (int i = 0; i < 2; i++) tp_grad_slot_free(&slots.mat[i]);
    }
    weights_free(&w);
    weights_free(&g);
    dev_free(params16);
    dev_free(params);
    dev_free(grads);
    dev_free(adam_m);
    dev_free(adam_v);
    tp_model_free(&model);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
