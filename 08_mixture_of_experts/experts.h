// experts.h: stage 08's expert parallelism. The ranks form an ep x dp grid: a replica's ep ranks
// each hold E / ep of every MoE block's experts (and all of the rest of the model), and each rank
// trains on its own slice of the batch, as in stage 03. In a MoE block every rank routes its own
// tokens (moe.c), then one all-to-all sends each token row to the rank holding its expert,
// the experts run, and a second all-to-all brings their outputs back; backward sends the
// gradients the same two ways. train.c reads like stage 03 with this layer plugged in and the
// gradient all-reduce split in two.
#ifndef EXPERTS_H
#define EXPERTS_H

#include "comm/comm.h"
#include "config/config.h"
#include "model/gpt.h"
#include "run/metrics.h"

// Where this rank sits. Rank = replica * ep + ep_rank: a replica's ranks, which exchange tokens in
// every MoE block, are consecutive, so that traffic stays on one node.
typedef struct {
    int ep, dp;            // ranks the experts are spread over, replicas
    int ep_rank, replica;
    int first_expert, n_local;  // the experts held: [first_expert, first_expert + n_local)
    Comm *world;
    Comm *ep_group;        // this replica's ranks: the all-to-alls
    Comm *expert_dp;       // the ranks holding the same experts: their gradients' all-reduce
} ExpertGrid;

// Checks the grid against the ranks, the experts and the batch (fatal() on every rank alike),
// then makes the groups.
void expert_grid_init(ExpertGrid *g, Comm *world, const Config *cfg);
// what this rank holds of a block: all of it but the experts, and n_local experts of those
ModelShape expert_shape(const ExpertGrid *g, const GPTConfig *mc);
void print_expert_plan(const ExpertGrid *g, const GPTConfig *mc);

// The LayerOps of this grid: serial_layer_ops() with the MoE blocks' MLP replaced by its
// expert-parallel version. Sized for micro-batches of B x T tokens per rank.
typedef struct {
    LayerOps base;         // what the block calls (first: the block sees a LayerOps *)
    const ExpertGrid *grid;
    int E;
    int *order;            // (R) host, and its device copy: where received row i goes among the
    int *order_dev;        // expert-major rows the experts run on
    float *received;       // (R, C) rows as they arrive, grouped by sending rank
    float *count_buf;      // ((ep + 1) * E) device: the counts' all-gather (this rank's, then all)
    float *count_host;     // (ep * E) host: the same counts, read back
    size_t *send_counts, *send_offsets, *recv_counts, *recv_offsets;  // (ep) each, in floats
    // over the forwards so far: this rank's token rows sent to experts, and the rows its experts
    // ran, which go back. Backward sends each again: all-to-all bytes = 2 x (to + at) x C x 4.
    long rows_to_experts, rows_at_experts;
    MoEStepStats step;     // the last step's figures over every rank (expert_step_stats)
} ExpertLayers;

// With ep 1 every rank holds every expert: nothing to exchange, and the block runs moe.c's
// one-rank MoE.
void expert_layers_init(ExpertLayers *x, const ExpertGrid *g, const GPTConfig *mc, int B, int T);
void expert_layers_free(ExpertLayers *x);
// The activations of this rank for B sequences of at most T tokens, their MoE blocks' MLP run by
// x (expert_layers_init), counting each step's routing against global_sequences per global batch.
void expert_acts_alloc(Activations *a, ExpertLayers *x, const ExpertGrid *g, const GPTConfig *mc, int B, int T,
                       int global_sequences);

// The gradients' all-reduce: the experts' over the ranks holding the same experts, the rest of
// the model (which every rank holds) over every rank. Blocking, after backward.
void all_reduce_gradients(const ExpertGrid *g, const ParamLayout *layout, float *grads);
// what all_reduce_gradients sends, as the planner counts it: the all-reduces (runs of tensors of
// one kind) and their elements, [0] the replicated tensors', [1] the experts'
void count_gradient_runs(const ParamLayout *layout, long runs[2], size_t numel[2]);
// the squared norm of the whole model's gradient: the replicated tensors once, each expert once
double expert_sum_squares(const ExpertGrid *g, const ParamLayout *layout, const float *grads);

// rows_to_experts and rows_at_experts into stats.json
void expert_run_stats(const ExpertLayers *x);
// the step's MoE figures over every rank (x->step, MoEStepStats in metrics.h): sums moe_stats(a),
// then resets it. NULL for a dense model (no experts).
const MoEStepStats *expert_step_stats(ExpertLayers *x, Activations *a, const GPTConfig *mc, int global_sequences);

// checkpoints hold the whole model: replica 0's ranks put their experts together on its rank 0
void expert_save_checkpoint(const Config *cfg, const ExpertGrid *g, const ParamLayout *local,
                            const ParamLayout *whole, const float *params, const float *m, const float *v,
                            long step);

#endif
