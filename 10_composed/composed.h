// composed.h: stage 10's mesh and the glue between the pieces it stacks. 07's pipeline runs each
// micro-batch through its stages; inside a stage, 05's tensor-parallel layers split every block
// over tp ranks (1-D: heads, MLP columns and the vocabulary over x, Megatron's column and row
// split); the whole pipeline is replicated over dp data-parallel replicas, as in stage 03.
#ifndef COMPOSED_H
#define COMPOSED_H

#include "comm/comm.h"
#include "comm/mesh.h"
#include "config/config.h"
#include "model/gpt.h"
#include "../07_pipeline_parallel/pipeline.h"
#include "../05_tensor_parallel/tp_model.h"
#include "../05_tensor_parallel/tp_sequence.h"

// The groups stage 10's pieces are made over, from the mesh (comm/mesh.h: pp x dp x cp x tp,
// tensor parallelism innermost, rank = ((stage * dp + replica) * cp + c) * tp + t): a
// tensor-parallel group is tp consecutive ranks (one host: it talks in every layer), the context
// ranks next (keys and values around a ring in every block, behind attention's compute), the
// data-parallel replicas next (one all-reduce a step), the pipeline's stages outermost (a message
// per micro-batch at its edges).
typedef struct {
    Mesh mesh;
    Comm *slice;          // the ranks of this c and t (pp x dp), numbered replica * pp + stage: 07's pipeline grid
    Comm *stage_ranks;    // this pipeline stage's ranks of this c (dp x tp): 05's grid [tp, 1, 1] x dp
    Comm *context;        // cp > 1: this stage's ranks of this t (dp x cp): 09's grid (composed_cp.h); else NULL
    Comm *replica_ranks;  // this replica's pp x tp ranks: the gradient norm's sum
    Comm *checkpoint;     // = stage_ranks, a group of its own so that saving is not counted as training traffic
    const struct ComposedExperts *experts;  // ep > 1: where the experts are (composed_ep.h), else NULL
} ComposedGroups;

// The mesh from tp_dimensions' x, cp_size and pp_size, dp taking the ranks left (fatal() on every rank
// alike, naming the dimension and the number, when they do not fit), and the groups over it:
// the one place stage 10 builds them. Rank 0 prints the mesh, its order and why.
void composed_groups_init(ComposedGroups *g, Comm *world, const Config *cfg);

// 05's tensor-parallel layers as the pipeline's (PipeLayers): every slot's activations at this
// rank's sizes, run by one set of layers, weight stream and loss scratch
typedef struct {
    PipeLayers base;  // first: the pipeline sees a PipeLayers *
    const TPModel *m;
    TPActs scratch;
} TPStageLayers;
// B x T: a micro-batch's rows and longest sequence
void tp_stage_layers_init(TPStageLayers *l, const TPModel *m, const Config *cfg, int B, int T);
void tp_stage_layers_free(TPStageLayers *l);

// this rank's squares of the gradient, each element of the model counted on one rank of the
// replica: 05's owner of a tensor copied over x, 07's first stage for the tied wte
double composed_norm_squares(const TPModel *m, const PipeGrid *pg, const float *grads);

// Checkpoints hold the whole model whatever the mesh: each stage's x ranks put its part together
// (05's tp_assemble), then the x = 0 ranks of replica 0 (and c = 0) assemble the stages (07's); loading takes
// this stage's part by name and this rank's share of it. Returns the step to continue from.
void composed_save_checkpoint(const Config *cfg, const ComposedGroups *groups, const PipeGrid *pg, const TPModel *m,
                              const ParamLayout *full, const float *params, const float *adam_m,
                              const float *adam_v, long step);
// ... and with ep > 1 (groups->experts), composed_ep.c's in its place: the replicas of a stage
// hold other experts, which the ranks of its first expert group put in
struct ComposedExperts;
void composed_ep_save_checkpoint(const struct ComposedExperts *e, const Config *cfg, const ComposedGroups *groups,
                                 const PipeGrid *pg, const TPModel *m, const ParamLayout *full, const float *params,
                                 const float *adam_m, const float *adam_v, long step);
long composed_load_checkpoint(const Config *cfg, const TPModel *m, const ParamLayout *full, float *params,
                              float *adam_m, float *adam_v);

#endif
