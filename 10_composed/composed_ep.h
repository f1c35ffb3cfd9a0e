// composed_ep.h: a mixture of experts inside stage 10's pipeline stages (expert parallelism, the
// ep of dp x tp x pp x ep). As Megatron-LM does, ep folds into the data dimension: each stage's
// dp data replicas (of the same t) form groups of ep_size consecutive replicas, whose ranks each
// hold num_experts / ep_size of every MoE block's experts (and the whole of the rest of the stage's
// share), read their own micro-batches as any replica does, and exchange token rows with 08's
// all-to-all over their group, the "experts" group. Inside a tensor-parallel group the residual
// stream is the same on every x rank, and each x rank routes the same tokens and runs its
// experts whole (expert tensor parallelism 1: nothing of a MoE block is split over x); its copies
// count once, on x = 0, as 05's LayerNorms do. The rest of the model's gradients are summed over
// the stage's replicas (ep x the dp left), the experts' over the replicas holding the same
// experts only ("expert-replicas").
#ifndef COMPOSED_EP_H
#define COMPOSED_EP_H

#include "../08_mixture_of_experts/experts.h"
#include "composed_cp.h"

typedef struct ComposedExperts {
    bool moe;             // the model has MoE blocks: everything below is set
    int ep;               // ranks each MoE block's experts are spread over (key ep_size)
    ExpertGrid grid;      // 08's, over the stage's replicas: replica = group * ep + ep_rank
    ExpertLayers layers;  // 08's MoE MLP, its rows sent to their experts' ranks and back
    LayerOps tp_ops;      // 05's layers as 05 made them: the dense blocks' MLP
    int global_sequences; // the load-balancing loss is averaged over the global batch's sequences
    Comm *savers;         // t = 0 of the first group of each stage (pp x ep ranks): the checkpoint
} ComposedExperts;

// The experts' grid over the stage's replicas (08's expert_grid_init over 07's dp_group), or
// nothing without MoE blocks. Refuses (fatal() on every rank alike, naming the key and the
// numbers) an ep_size that does not divide the replicas, and what stage 10's experts do not run:
// cp_size > 1 and sequence_parallel (each cuts the sequences whose capacity an expert counts).
// Call before the layouts: it gives mc its MoE blocks' MLP.
void composed_ep_init(ComposedExperts *e, const Config *cfg, ComposedGroups *g, const PipeGrid *pg, GPTConfig *mc);
// the stage's layout with this rank's experts only (ep > 1), in place of 07's with all of them
void composed_ep_stage_layout(const ComposedExperts *e, ParamLayout *layout, const GPTConfig *mc,
                              const PipeGrid *pg);
// 08's MoE MLP plugged into the stage's 05 layers (their MoE blocks' MLP), sized for the
// pipeline's micro-batches; m's shape holds this rank's experts. Before the pipeline's activations.
void composed_ep_plug(ComposedExperts *e, TPModel *m, CPStageLayers *l, const Config *cfg, const GPTConfig *mc,
                      const PipeGrid *pg);
// The gradients summed over the replicas: the experts' over those holding the same experts, the
// rest over every replica of the stage (without experts: all of them over `replicas`).
void composed_ep_reduce_gradients(const ComposedExperts *e, Comm *replicas, const ParamLayout *layout,
                                  float *grads, size_t n);
// composed_norm_squares with each expert counted once: the experts' squares summed over the
// expert group (which holds them all), the rest this rank's. Sum over the replica's ranks.
double composed_ep_norm_squares(const ComposedExperts *e, const TPModel *m, const PipeGrid *pg, const float *grads);
// (Checkpoints: composed_ep_save_checkpoint, declared in composed.h, whose composed_save_checkpoint
// calls it: the ranks of the first expert group of each stage (t = 0) put the stage parts and
// their experts together, rank 0 writes.)
// After training: the replicas holding the same tensors agree (the proof that the sums kept them
// equal), and the rows sent to experts go into stats.json
void composed_ep_finish(const ComposedExperts *e, Comm *replicas, const float *params, size_t n);
void composed_ep_free(ComposedExperts *e);

#endif
