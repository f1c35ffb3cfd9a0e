// composed.h: stage 10's mesh and the glue between the pieces it stacks. 07's pipeline runs each
// micro-batch through its stages; inside a stage, 05's tensor-parallel layers split every block
// over tp ranks (1-D: heads, MLP columns and the vocabulary over x, Megatron's column and row
// split); the whole pipeline is replicated over dp data-parallel replicas, as in stage 03.
#ifndef COMPOSED_H
#define COMPOSED_H

#include "comm/comm.h"
#include "config/config.h"
#include "model/gpt.h"
#include "../07_pipeline_parallel/pipeline.h"
#include "../05_tensor_parallel/tp_model.h"

// Where this rank sits on the mesh dp x pp x tp, tensor parallelism innermost:
//   rank = (replica * pp + stage) * tp + t
// A tensor-parallel group is tp consecutive ranks (one host: it talks in every layer), a
// pipeline's stages are the next coordinate (a message per micro-batch), the replicas outermost
// (one all-reduce a step).
typedef struct {
    int dp, pp, tp;
    int replica, stage, t;
    Comm *stage_ranks;  // this pipeline stage on every replica (dp x tp): 05's grid [tp, 1, 1] x dp is made over it
    Comm *slice;        // the ranks with this t (dp x pp): 07's pipeline grid is made over it
    Comm *replica_ranks;  // this replica's pp x tp ranks: the gradient norm's sum
    Comm *checkpoint;   // = stage_ranks, a group of its own so that saving is not counted as training traffic
} Mesh;

// Checks the mesh against the ranks (fatal() on every rank alike, naming the dimension and the
// numbers) and makes its groups: the one place stage 10 builds them.
void mesh_init(Mesh *m, Comm *world, const Config *cfg);
void print_mesh(const Mesh *m);

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
// (05's tp_assemble), then the x = 0 ranks of replica 0 assemble the stages (07's); loading takes
// this stage's part by name and this rank's share of it. Returns the step to continue from.
void composed_save_checkpoint(const Config *cfg, const Mesh *mesh, const PipeGrid *pg, const TPModel *m,
                              const ParamLayout *full, const float *params, const float *adam_m,
                              const float *adam_v, long step);
long composed_load_checkpoint(const Config *cfg, const TPModel *m, const ParamLayout *full, float *params,
                              float *adam_m, float *adam_v);

#endif
