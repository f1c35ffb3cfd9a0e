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

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "comm/comm.h"
#include "config/config.h"
#include "data/alpaca.h"
#include "data/tokenizer.h"
#include "model/activations.h"
#include "model/gpt.h"
#include "ops/ops.h"
#include "run/lora.h"
#include "run/loss_scale.h"
#include "run/metrics.h"
#include "run/optimizer.h"
#include "run/preemption.h"
#include "run/run_checkpoint.h"
#include "run/run_setup.h"
#include "run/run_stats.h"
#include "run/stage_run.h"
#include "tp_linear.h"
#include "tp_lora.h"
#include "tp_model.h"
#include "tp_muon.h"
#include "tp_sequence.h"

int main(int argc, char **argv) {
    Comm *world = comm_init(&argc, &argv);
    int rank = comm_rank(world), P = comm_size(world);
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_TENSOR_PARALLEL);
    resolve_resume(&cfg);  // continue the run saved in out_dir, or start one (key resume)
    ops_set_half_format(config_half_format(&cfg));  // 16-mixed: the 16-bit copies are fp16
    // every rank must train the same model on the same batches: the configs are compared (and
    // the backend that moves the bytes chosen: NCCL, or MPI where ranks share a GPU)
    comm_configure(world, &cfg);
    ops_init();

    // ---- data: alpaca records -> prompt template -> tokens with the prompt masked ----
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
    tp_sequence_apply(&model, &cfg);  // sequence_parallel: the residual stream split over x
    const TPGrid *grid = &model.grid;
    Comm *ckpt_group = comm_split(world, 0, rank, "checkpoint");

    // ---- model: this rank's share, one flat buffer each in the local layout ----
    bool half_mode = config_is_half(&cfg), pure_bf16 = cfg.prec == PREC_BF16;
    ModelBuffers mb;  // mb.params, mb.grads, mb.adam_m, mb.adam_v; mb.w and mb.g name their tensors
    model_buffers_alloc(&mb, &model.layout, half_mode);
    long step = 0;
    if (cfg.resume || starts_from_checkpoint(&cfg))
        step = tp_load_checkpoint(&cfg, &model, mb.params, mb.adam_m, mb.adam_v);
    else tp_init_params(&model, mb.params, (uint64_t)cfg.seed);

    // activations for one micro-batch of the longest sequences: this row group's share
    int micro_batch = cfg.global_batch_size / cfg.gradient_acc_steps / grid->row_ranks;
    TPActs acts;  // with the weight stream and the weight-gradient slots
    tp_acts_alloc(&acts, &model, micro_batch, mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len,
                  acts_flags(&cfg), cfg.overlap_communication);
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    print_stage_banner(5, P, &cfg, &mc, model.full.num_params);
    tp_print_grid(&model, P, cfg.overlap_communication);
    print_batch_plan(&cfg, data, grid->row_ranks, "row groups (z x data)", total_steps);
    Lora lora;  // lora_rank > 0: the base frozen; layout and mb become its adapters' slices (tp_lora.h)
    ParamLayout layout = model.layout;  // what AdamW steps: this rank's share of the model, or of the adapters
    tp_lora_attach(&lora, &cfg, &model, &layout, &mb, &acts);
    TPMuon muon = tp_muon_create(&cfg, &model, world);  // optimizer muon: the whole model's updates (tp_muon.h)
    MemoryItem memory[TP_MEMORY_ITEMS + 1];
    tp_memory_items(&model, &cfg, acts.bytes, memory);
    tp_lora_memory(&lora, memory);  // LoRA: the base without gradients or moments, the adapters
    memory[TP_MEMORY_ITEMS] = (MemoryItem){"Muon: whole model + scratch", muon.bytes};
    print_memory_report("device memory (this rank):", memory, TP_MEMORY_ITEMS + cfg.muon);
    tp_sequence_report(&model, &acts.acts);
    run_stats_number("state_bytes", 4.0 * mb.bytes);

    // ---- the training loop ----
    LossScaler scaler;  // 16-mixed: fp16's loss scale (loss_scale.h); otherwise 1, never skipping
    loss_scaler_init(&scaler, &cfg);
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

        if (half_mode) cast_to_16(mb.params16, mb.params, mb.n);

        // forward + backward over this row group's micro-batches. Every x, y rank of the group
        // holds the same rows and computes the same loss; gradients add up in `mb.grads`.
        dev_zero(mb.grads, mb.bytes);
        double loss_sum = 0;
        long tokens = 0, n_targets = 0;
        int acc = cfg.gradient_acc_steps;
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              grid->row_rank * acc + micro, grid->row_ranks * acc, &batch);
            lora_training(&lora, step, (grid->row_rank * acc + micro) * batch.rows, batch.T);  // its dropout masks
            n_targets = batch.n_targets_global;
            float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
            tp_forward(&model, &acts, &mb.w, batch.inputs, batch.rows, batch.T);
            double l = tp_loss(&model, &acts, batch.targets, batch.rows, batch.T, dloss, true);
            tp_backward(&model, &acts, &mb.w, &mb.g, batch.rows, batch.T);
            if (grid->counts_rows) loss_sum += l, tokens += (long)batch.rows * batch.T;
        }
        lora_training_done(&lora);  // evaluation runs without dropout
        // the gradient of a tensor with copies on several ranks must be summed over exactly the
        // copies that saw different rows: the small tensors over z (the weights' reduce-scatter
        // already did), then everything over the data replicas. Over x or y the copies saw the
        // same rows and hold the same gradient: summing there would count it twice (AxoNN's
        // bias bug is the opposite mistake: its biases were never summed over depth).
        // (LoRA's adapters are copies on every z rank: all of them)
        tp_all_reduce(grid->gz, mb.grads, lora.rank ? mb.n : model.small_numel);
        tp_all_reduce(grid->gdata, mb.grads, mb.n);
        tp_sequence_reduce_norm_grads(&model, mb.grads);  // sequence_parallel: each x rank saw its rows
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        tokens_trained += tokens;
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm, then one AdamW step; in 16-mixed the gradients are first
        // divided by the loss scale, and a step whose gradients overflowed is skipped
        double norm = sqrt(comm_sum_double(grid->tp, tp_norm_squares(&model, mb.grads)));
        if (loss_scaler_unscale(&scaler, mb.grads, mb.n, &norm)) {
            float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
            tp_optimizer_step(&muon, &model, &layout, mb.params, mb.grads, mb.adam_m, mb.adam_v, &cfg, lr, step + 1, clip);
        }
        // pure bf16 keeps no fp32 master: the updated weights are rounded back to bf16, and an
        // update smaller than half a bf16 step (1/256 of the weight) is lost
        if (pure_bf16) {
            cast_to_16(mb.params16, mb.params, mb.n);
            cast_to_float(mb.params, mb.params16, mb.n);
        }
        dev_synchronize();

        StepStats s = {.step = step + 1, .total_steps = total_steps, .loss = loss, .lr = lr, .grad_norm = norm,
                       .val_loss = -1, .scaler = &scaler, .has_comm = true, .has_state = true,
                       .state_bytes = 4.0 * mb.bytes};
        step_stats_measure(&s, &cfg, t0, tokens, flops_per_token(&mc, batch.T), P);
        comm_since(&comm_before, &s.comm_bytes, &s.comm_ms);
        bool last = step + 1 == total_steps;
        if (evaluation_due(&cfg, step + 1, last)) {
            if (half_mode) cast_to_16(mb.params16, mb.params, mb.n);  // evaluate the updated weights
            double val[2];  // the validation loss summed over its target tokens, and their count
            tp_evaluate(&model, &acts, &mb.w, data, &cfg, grid->row_rank, grid->row_ranks, grid->counts_rows, val);
            comm_sum_doubles(world, val, 2);
            s.val_loss = val[1] ? val[0] / val[1] : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        if (checkpoint_due(&cfg, step + 1, last))
            tp_save_checkpoint(&cfg, &model, ckpt_group, mb.params, mb.adam_m, mb.adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            tp_save_checkpoint(&cfg, &model, ckpt_group, mb.params, mb.adam_m, mb.adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    tp_save_checkpoint(&cfg, &model, ckpt_group, mb.params, mb.adam_m, mb.adam_v, total_steps);
    printf("saved %s/%s (step %ld, the full model)\n", cfg.out_dir,
           lora.rank ? "adapter_model.safetensors" : "model.safetensors", total_steps);
    comm_print_table(world);
    run_stats_number("tokens_trained", (double)tokens_trained);
    if (rank == 0)
        run_stats_write(&cfg, 5, P, (RunLayout){.dp = grid->D, .tp_dimensions = {grid->X, grid->Y, grid->Z}},
                        comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    batch_free(&batch);
    lora_free(&lora);
    tp_muon_free(&muon);
    tp_acts_free(&acts);
    model_buffers_free(&mb);
    tp_model_free(&model);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
