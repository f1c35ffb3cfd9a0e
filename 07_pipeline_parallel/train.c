// Stage 07: stage 03 with the blocks split over pp pipeline stages (pipeline parallelism).
//
// The P ranks form pp_size stages x P / pp_size data-parallel replicas. A stage holds a range
// of blocks (the embedding on the first, the head and the loss on the last); each replica's rows
// are cut into num_microbatches micro-batches that flow through the stages, activations forward
// and gradients back, in the order pp_schedule says (gpipe, 1f1b, interleaved, zb-h1: pipeline.c). Then
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
#include "pipeline.h"
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
    config_load(&cfg, argc, argv, STAGE_PIPELINE_PARALLEL);
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

    // ---- model: this stage's blocks, one flat buffer each for parameters, gradients and AdamW's
    // two moments; the whole model's layout is what checkpoints hold ----
    GPTConfig mc = model_shape(&cfg, tok);
    PipeGrid grid;
    pipe_grid_init(&grid, world, &cfg, &mc);
    ParamLayout layout, full_layout;
    pipe_stage_layout(&layout, &mc, &grid);  // its blocks (every chunk's), embedding, head
    gpt_layout(&full_layout, &mc);
    // ... and the bf16 working copy of the weights, mb.params16, which every matmul reads
    bool half_mode = config_is_half(&cfg), pure_bf16 = cfg.prec == PREC_BF16;
    ModelBuffers mb;  // mb.params, mb.grads, mb.adam_m, mb.adam_v; mb.w and mb.g name their tensors
    model_buffers_alloc(&mb, &layout, half_mode);
    long step = 0;
    if (cfg.resume || starts_from_checkpoint(&cfg))
        step = load_checkpoint_part(&cfg, &layout, &full_layout, mb.params, mb.adam_m, mb.adam_v);
    else gpt_init_range(mb.params, &layout, 0, mb.n, (uint64_t)cfg.seed);  // a range initialises as the whole model

    // activations for one micro-batch of the longest sequences, once per micro-batch in flight
    int m = cfg.num_microbatches;
    Pipeline pipe;
    pipeline_init(&pipe, &grid, &mc, &cfg, &mb.w);
    // only rank 0 prints, writes metrics and saves checkpoints: the replicas are identical
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    print_stage_banner(7, P, &cfg, &mc, mb.n);
    print_pipeline_plan(&grid, &cfg, &mc, mb.n, pipe.n_slots);
    print_batch_plan(&cfg, data, grid.dp, "replicas", total_steps);
    // zb-h1 defers the linears' weight gradients to a later pass; the adapters' would have to be deferred too
    if (cfg.lora_rank && pipe.deferred)
        fatal("%s: key 'pp_schedule' is '%s', but LoRA (lora_rank %d) runs under gpipe, 1f1b and interleaved only",
              config_source("pp_schedule"), pipe_schedule_name(pipe.schedule), cfg.lora_rank);
    Lora lora;  // lora_rank > 0: layout and mb become this stage's adapters', full_layout the whole model's
    pipe.trained = lora_attach_part(&lora, &cfg, &layout, &full_layout, &mb, pipe.slots, pipe.n_slots);
    pipeline_print_memory(&pipe, &cfg, mb.n);

    // ---- the training loop ----
    LossScaler scaler;  // 16-mixed: fp16's loss scale (loss_scale.h); otherwise 1, never skipping
    loss_scaler_init(&scaler, &cfg);
    comm_trace_open(world, cfg.trace, cfg.trace_steps);
    Metrics metrics = {0};
    if (rank == 0) metrics_open(&metrics, cfg.out_dir, cfg.resume, step);
    Batch *batches = calloc_or_die((size_t)m, sizeof *batches);
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

        // this replica's micro-batches (slices replica * m ... of dp * m), each stage fetching the
        // same ones: the first reads their tokens, the last their targets, every stage their shape.
        // Each token's loss is divided by the target tokens of the WHOLE global batch, as in 03.
        for (int micro = 0; micro < m; micro++)
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              grid.replica * m + micro, grid.dp * m, &batches[micro]);
        long n_targets = batches[0].n_targets_global, tokens = 0;
        float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
        // the schedule: forwards and backwards of the micro-batches through the stages;
        // gradients add up in `mb.grads`, the loss on the last stage
        dev_zero(mb.grads, mb.bytes);
        // LoRA dropout's masks: the replica's first sequence (pipeline.c adds each micro-batch's place)
        lora_training(&lora, step, grid.replica * m * batches[0].rows, batches[0].T);
        double loss_sum = pipeline_step(&pipe, &mb.g, batches, dloss);
        lora_training_done(&lora);  // evaluation runs without dropout
        if (grid.is_first)
            for (int micro = 0; micro < m; micro++) tokens += (long)batches[micro].rows * batches[micro].T;
        // GPT-2's lm_head is wte: the first stage holds its embedding half of the gradient, the
        // last its head half; summed, both copies take the same AdamW step and stay equal (LoRA: frozen)
        if (grid.tied && !lora.rank) comm_all_reduce(grid.tied, mb.g.wte, (size_t)mc.padded_vocab_size * mc.n_embd);
        // sum each stage's gradients over the replicas, as stage 03 does for the whole model
        if (grid.dp > 1) comm_all_reduce(grid.dp_group, mb.grads, mb.n);
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm (the stages' squares summed, the shared wte once), then
        // one AdamW step on this stage's tensors; in 16-mixed the gradients are first divided by
        // the loss scale, and a step whose gradients overflowed is skipped
        double norm = sqrt(comm_sum_double(grid.pipe, stage_sum_squares(&grid, &layout, mb.grads)));
        if (loss_scaler_unscale(&scaler, mb.grads, mb.n, &norm)) {
            float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
            adamw_step(&layout, mb.params, mb.grads, mb.adam_m, mb.adam_v, 0, mb.n, &cfg, lr, step + 1, clip);
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
        step_stats_measure(&s, &cfg, t0, tokens, flops_per_token(&mc, batches[0].T), P);
        comm_since(&comm_before, &s.comm_bytes, &s.comm_ms);
        bool last = step + 1 == total_steps;
        if (evaluation_due(&cfg, step + 1, last)) {
            if (half_mode) cast_to_16(mb.params16, mb.params, mb.n);  // evaluate the updated weights
            double val[2];  // the validation loss summed over its target tokens, and their count
            evaluate_batches(pipeline_eval_loss, &pipe, data, &cfg, grid.replica, grid.dp, val);
            if (!grid.is_last) val[1] = 0;  // the loss and its targets are the last stage's
            comm_sum_doubles(world, val, 2);
            s.val_loss = val[1] ? val[0] / val[1] : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        print_first_schedule(world, &pipe);  // after step 1 only: its traced schedule
        if (checkpoint_due(&cfg, step + 1, last))
            pipe_save_checkpoint(&cfg, &grid, &layout, &full_layout, mb.params, mb.adam_m, mb.adam_v, step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            pipe_save_checkpoint(&cfg, &grid, &layout, &full_layout, mb.params, mb.adam_m, mb.adam_v, step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    print_bubble(world, &pipe);
    pipe_save_checkpoint(&cfg, &grid, &layout, &full_layout, mb.params, mb.adam_m, mb.adam_v, total_steps);
    printf("saved %s/%s (step %ld)\n", cfg.out_dir, lora.rank ? "adapter_model.safetensors" : "model.safetensors",
           total_steps);
    // the proof that data parallelism kept each stage's replicas identical
    if (grid.dp > 1) comm_check_replicas_identical(grid.dp_group, mb.params, mb.n);
    comm_print_table(world);
    if (rank == 0) run_stats_write(&cfg, 7, P, (RunLayout){.dp = grid.dp, .pp = grid.pp}, comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    for (int micro = 0; micro < m; micro++) batch_free(&batches[micro]);
    free(batches);
    lora_free(&lora);
    pipeline_free(&pipe);
    model_buffers_free(&mb);
    gpt_layout_free(&layout);
    gpt_layout_free(&full_layout);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
