// Stage 10: the techniques composed, data x tensor x pipeline (x context, x expert) parallelism on one mesh.
//
// The P ranks form a mesh pp x dp x cp x tp (composed.h; tensor parallelism innermost; cp_size > 1
// cuts every sequence into 09's chunks, attention a ring over cp: composed_cp.h; a mixture of
// experts spreads its experts over ep of the replicas: composed_ep.h). 07's pipeline
// cuts the blocks into pp_size stages and runs num_microbatches micro-batches through them in the
// order pp_schedule says (gpipe, 1f1b, interleaved, zb-h1); inside each stage, 05's tensor-parallel layers split every
// block over tp_dimensions' x ranks (heads, MLP columns, the vocabulary); the pipelines are
// replicated over dp = P / (pp x tp) data-parallel replicas, as in stage 03 (or 04's ZeRO-1:
// composed_zero.h), and LoRA trains adapters on the frozen base (composed_lora.h). Each piece is called
// with the group it works over, and what each used to do for the whole world is done here over
// the mesh: tied wte's two halves summed between the first and the last stage, the gradients over
// the replicas, the norm over one replica with each element counted once, the loss and tokens by
// one rank of each tensor-parallel group. Any mesh gives the losses of one process.
// Read `diff -u 03_ddp/train.c 10_composed/train.c`, then composed.c.
//
// Run: mpirun -np 8 build/stage-10 --config configs/tiny.json --tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "comm/comm.h"
#include "composed_cp.h"
#include "composed_lora.h"
#include "composed_ep.h"
#include "composed_zero.h"
#include "config/config.h"
#include "data/alpaca.h"
#include "data/tokenizer.h"
#include "model/activations.h"
#include "model/gpt.h"
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
    config_load(&cfg, argc, argv, STAGE_COMPOSED);
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

    // ---- the mesh: each piece's grid made over its ranks, refused before any work if it does
    // not fit the model and the batch ----
    GPTConfig mc = model_shape(&cfg, tok);
    ComposedGroups groups;  // the mesh pp x dp x tp, and the ranks each piece's grid is made over
    composed_groups_init(&groups, world, &cfg);
    PipeGrid grid;  // 07's: pp stages x dp replicas, over the ranks of this tensor-parallel rank
    pipe_grid_init(&grid, groups.slice, &cfg, &mc);
    ComposedExperts experts;  // a mixture of experts: its experts spread over ep of the stage's replicas
    composed_ep_init(&experts, &cfg, &groups, &grid, &mc);
    int m = cfg.num_microbatches;
    tp_check_grid(&mc, cfg.tp_dimensions, comm_size(groups.stage_ranks), cfg.global_batch_size, m);
    TPGrid tp_grid;  // 05's: [tp, 1, 1] x dp, over the ranks of this pipeline stage
    tp_grid_init(&tp_grid, groups.stage_ranks, cfg.tp_dimensions);
    ParamLayout stage_layout, full_layout;
    pipe_stage_layout(&stage_layout, &mc, &grid);  // its blocks, embedding, head
    composed_ep_stage_layout(&experts, &stage_layout, &mc, &grid);  // ... and its experts
    gpt_layout(&full_layout, &mc);
    TPModel model;  // this rank's share of them
    tp_model_layout_part(&model, &mc, &tp_grid, cfg.vocab_parallel_loss, stage_layout);
    tp_sequence_apply(&model, &cfg);  // sequence_parallel: the residual stream split over x
    ParamLayout layout = model.layout;
    // ... and the bf16 working copy of the weights, mb.params16, which every matmul reads
    bool half_mode = config_is_half(&cfg), pure_bf16 = cfg.prec == PREC_BF16;
    ModelBuffers mb;  // mb.params, mb.grads, mb.adam_m, mb.adam_v; mb.w and mb.g name their tensors
    model_buffers_alloc(&mb, &layout, half_mode);
    long step = 0;
    if (cfg.resume || starts_from_checkpoint(&cfg))
        step = composed_load_checkpoint(&cfg, &model, &full_layout, mb.params, mb.adam_m, mb.adam_v);
    else tp_init_params(&model, mb.params, (uint64_t)cfg.seed);  // a share initialises as the whole model

    // activations for one micro-batch of the longest sequences, once per micro-batch in flight,
    // at this rank's sizes and run by 05's layers
    int T = mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len;
    CPStageLayers tp_layers;  // with cp > 1: of each rank's two chunks, attention a ring over cp
    cp_stage_layers_init(&tp_layers, &model, &cfg, &groups, &mc, cfg.global_batch_size / grid.dp / m, T);
    composed_ep_plug(&experts, &model, &tp_layers, &cfg, &mc, &grid);  // MoE blocks: 08's MLP
    ComposedZero zero;  // zero_stage 1: AdamW's state sharded over the replicas (composed_zero.h)
    composed_zero_init(&zero, composed_replicas(&tp_layers, &grid), &cfg, &mb, &layout);
    Pipeline pipe;
    pipeline_init_layers(&pipe, &grid, &mc, &cfg, &mb.w, &tp_layers.tp.base);
    // only rank 0 prints, writes metrics and saves checkpoints: the replicas are identical
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    print_stage_banner(10, P, &cfg, &mc, mb.n);
    print_mesh_plan(&groups.mesh);
    print_cp_stage_plan(&tp_layers, &cfg);
    print_pipeline_plan(&grid, &cfg, &mc, mb.n, pipe.n_slots);
    print_batch_plan(&cfg, data, grid.dp, "replicas", total_steps);
    Lora lora;  // lora_rank > 0: the base frozen; layout and mb become this rank's adapter slices (composed_lora.h)
    pipe.trained = composed_lora_attach(&lora, &cfg, &model, &full_layout, &layout, &mb, &pipe);
    pipeline_print_memory(&pipe, &cfg, mb.n);
    composed_zero_print_memory(&zero);

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

        // this replica's micro-batches (slices replica * m ... of dp * m: sharded by the data
        // dimension only), each stage and each x rank fetching the same ones: the first stage reads
        // their tokens, the last their targets, every stage their shape.
        // Each token's loss is divided by the target tokens of the WHOLE global batch, as in 03.
        for (int micro = 0; micro < m; micro++)
            dataset_get_batch(data, 0, (uint64_t)cfg.seed, epoch, b, cfg.global_batch_size,
                              grid.replica * m + micro, grid.dp * m, &batches[micro]);
        long n_targets = batches[0].n_targets_global, tokens = 0;
        float dloss = loss_scaler_dloss(&scaler, n_targets, step);  // 1 / n_targets x the loss scale
        // the schedule: forwards and backwards of the micro-batches through the stages;
        // gradients add up in `mb.grads`, the loss on the last stage
        dev_zero(mb.grads, mb.bytes);
        lora_training(&lora, step, grid.replica * m * batches[0].rows, batches[0].T);  // LoRA dropout's masks, as 07
        double loss_sum = pipeline_step(&pipe, &mb.g, cp_stage_batches(&tp_layers, batches, m), dloss);
        lora_training_done(&lora);  // evaluation runs without dropout
        // every x rank of a tensor-parallel group ran the same rows: one of them counts them
        if (!tp_grid.counts_rows) loss_sum = 0;
        if (grid.is_first && tp_grid.counts_rows && groups.mesh.coord[MESH_CP] == 0)
            for (int micro = 0; micro < m; micro++) tokens += (long)batches[micro].rows * batches[micro].T;
        // GPT-2's lm_head is wte: the first stage holds its embedding half of the gradient, the
        // last its head half, each x rank its vocabulary rows; summed over the two stages, both
        // copies take the same AdamW step and stay equal
        if (grid.tied && !lora.rank) comm_all_reduce(grid.tied, mb.g.wte, (size_t)model.Vl * mc.n_embd);
        // sum each stage's gradients over the replicas, as stage 03 does for the whole model
        // (over x the copies of a small tensor saw the same rows: 05's rule; over cp the copies of
        // every tensor saw other tokens, and are summed too)
        Comm *replicas = composed_replicas(&tp_layers, &grid);
        if (zero.on) composed_zero_reduce_gradients(&zero, &mb);  // zero_stage 1: reduce-scattered
        else composed_ep_reduce_gradients(&experts, replicas, &layout, mb.grads, mb.n);  // the experts' over their replicas
        tp_sequence_reduce_norm_grads(&model, mb.grads);  // sequence_parallel: each x rank saw its rows
        // one host reduction for the step's numbers: loss, tokens, and whether a signal came
        double totals[3] = {loss_sum, (double)tokens, (double)preemption_signalled()};
        comm_sum_doubles(world, totals, 3);
        tokens = (long)totals[1];
        double loss = n_targets ? totals[0] / (double)n_targets : 0.0;
        if (!isfinite(loss)) fatal("step %ld: the loss is %f; lower lr or check the data", step + 1, loss);

        // clip the global gradient norm (one replica's squares summed, each element once), then
        // one AdamW step on this rank's tensors; in 16-mixed the gradients are first divided by
        // the loss scale, and a step whose gradients overflowed is skipped
        double norm = zero.on ? composed_zero_grad_norm(&zero, &groups, &model, &grid, mb.grads)
                              : sqrt(comm_sum_double(groups.replica_ranks,
                                                     composed_ep_norm_squares(&experts, &model, &grid, mb.grads)));
        if (loss_scaler_unscale(&scaler, mb.grads, mb.n, &norm)) {
            float clip = clip_factor(norm, cfg.grad_clip);  // AdamW reads the gradients times clip
            composed_zero_step(&zero, &layout, &mb, &cfg, lr, step + 1, clip);
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
            cp_stage_evaluate(&tp_layers, &pipe, data, &cfg, grid.replica, grid.dp, val);
            if (!grid.is_last || !tp_grid.counts_rows) val[0] = val[1] = 0;  // one rank's of the last stage
            comm_sum_doubles(world, val, 2);
            s.val_loss = val[1] ? val[0] / val[1] : -1;
        }
        if (rank == 0) metrics_log(&metrics, &s, (step + 1) % cfg.log_interval == 0 || last);
        print_first_schedule(groups.slice, &pipe);  // after step 1 only: its traced schedule (x = 0's pipelines)
        if (checkpoint_due(&cfg, step + 1, last))
            composed_zero_save(&zero, &cfg, &groups, &grid, &model, &full_layout, mb.params, mb.adam_m, mb.adam_v,
                                     step + 1);
        // a signal (Slurm's warning, scancel): save this step and stop, to be resumed
        if (!last && totals[2] > 0) {
            composed_zero_save(&zero, &cfg, &groups, &grid, &model, &full_layout, mb.params, mb.adam_m, mb.adam_v,
                                     step + 1);
            print_stopped_to_be_resumed(&cfg, step + 1);
            comm_finalize(world);
            exit(EXIT_TO_BE_RESUMED);
        }
    }
    print_bubble(groups.slice, &pipe);
    composed_zero_save(&zero, &cfg, &groups, &grid, &model, &full_layout, mb.params, mb.adam_m, mb.adam_v, total_steps);
    printf("saved %s/%s (step %ld)\n", cfg.out_dir, lora.rank ? "adapter_model.safetensors" : "model.safetensors", total_steps);
    // the proof that data (and context) parallelism kept each stage's replicas identical
    Comm *replicas = composed_replicas(&tp_layers, &grid);
    composed_ep_finish(&experts, replicas, mb.params, mb.n);
    comm_print_table(world);
    if (rank == 0)
        run_stats_write(&cfg, 10, P,
                        (RunLayout){.dp = grid.dp, .pp = grid.pp, .tp_dimensions = {tp_grid.X, 1, 1},
                                    .cp = tp_layers.cp > 1 ? tp_layers.cp : 0},
                        comm_stats_json());

    comm_trace_write(world, cfg.out_dir, cfg.trace);
    metrics_close(&metrics);
    for (int micro = 0; micro < m; micro++) batch_free(&batches[micro]);
    free(batches);
    lora_free(&lora);
    pipeline_free(&pipe);
    cp_stage_layers_free(&tp_layers);
    composed_ep_free(&experts);
    composed_zero_free(&zero);
    model_buffers_free(&mb);
    tp_model_free(&model);
    gpt_layout_free(&full_layout);
    dataset_free(data);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
