// composed.c: see composed.h.
#include "composed.h"

#include <stdio.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "run/run_checkpoint.h"
#include "run/run_setup.h"

// ---- the mesh ---------------------------------------------------------------------------------

void mesh_init(Mesh *m, Comm *world, const Config *cfg) {
    int rank = comm_rank(world), P = comm_size(world);
    const int *d = cfg->tp_dimensions;
    // 05's y splits the hidden dimension of the residual stream, which the pipeline sends whole
    if (d[1] != 1)
        fatal("key 'tp_dimensions' is [%d, %d, %d] but stage 10 splits layers 1-D over x: y must be 1 (a y split "
              "would cut the activations the pipeline stages send each other)", d[0], d[1], d[2]);
    int tp = d[0], pp = cfg->pp_size;
    if (P % (tp * pp) != 0)
        fatal("the mesh does not fit %d ranks: tp (tp_dimensions x, %d) x pp (pp_size, %d) = %d must divide them "
              "(the rest is data parallelism)", P, tp, pp, tp * pp);
    *m = (Mesh){.dp = P / (tp * pp), .pp = pp, .tp = tp};
    m->t = rank % tp;
    m->stage = rank / tp % pp;
    m->replica = rank / (tp * pp);
    m->stage_ranks = comm_split(world, m->stage, m->replica * tp + m->t, "stage");
    m->slice = comm_split(world, m->t, m->replica * pp + m->stage, "slice");
    m->replica_ranks = comm_split(world, m->replica, m->stage * tp + m->t, "replica");
    m->checkpoint = comm_split(world, m->stage, m->replica * tp + m->t, "checkpoint");
}

void print_mesh(const Mesh *m) {
    printf("mesh: dp %d x pp %d x tp %d = %d ranks, rank = (replica * %d + stage) * %d + t: tensor parallelism "
           "innermost (its all-reduces run in every layer: keep them inside a host), then the pipeline's "
           "stages (one message per micro-batch), the data-parallel replicas outermost (one all-reduce a step)\n",
           m->dp, m->pp, m->tp, m->dp * m->pp * m->tp, m->pp, m->tp);
}

// ---- 05's layers inside 07's stages -----------------------------------------------------------

static void tp_adapt(PipeLayers *l, ActsSpec *spec) {
    TPStageLayers *t = (TPStageLayers *)l;
    spec->shape = t->m->shape;
    spec->ops = &t->scratch.layers.base;
}

static void tp_stage_forward(PipeLayers *l, Activations *a, const Weights *w, const int *inputs, int B, int T) {
    TPStageLayers *t = (TPStageLayers *)l;
    tp_forward_on(t->m, &t->scratch, a, w, inputs, B, T);
}

static double tp_stage_loss(PipeLayers *l, Activations *a, const GPTConfig *mc, const int *targets, int B, int T,
                            float dloss, bool backward) {
    (void)mc;
    TPStageLayers *t = (TPStageLayers *)l;
    return tp_loss_on(t->m, &t->scratch, a, targets, B, T, dloss, backward);
}

static void tp_stage_backward(PipeLayers *l, Activations *a, const Weights *w, Weights *g, int B, int T) {
    TPStageLayers *t = (TPStageLayers *)l;
    tp_backward_on(t->m, &t->scratch, a, w, g, B, T);
}

void tp_stage_layers_init(TPStageLayers *l, const TPModel *m, const Config *cfg, int B, int T) {
    *l = (TPStageLayers){.base = {tp_adapt, tp_stage_forward, tp_stage_loss, tp_stage_backward}, .m = m};
    tp_scratch_alloc(&l->scratch, m, B, T, acts_flags(cfg), false);
}

void tp_stage_layers_free(TPStageLayers *l) { tp_acts_free(&l->scratch); }

double composed_norm_squares(const TPModel *m, const PipeGrid *pg, const float *grads) {
    return tp_norm_squares_of(m, grads, pipe_tensor_counted, pg);
}

// ---- checkpoints ------------------------------------------------------------------------------

void composed_save_checkpoint(const Config *cfg, const Mesh *mesh, const PipeGrid *pg, const TPModel *m,
                              const ParamLayout *full, const float *params, const float *adam_m,
                              const float *adam_v, long step) {
    size_t bytes = m->full.num_params * sizeof(float);
    const float *mine[3] = {params, adam_m, adam_v};
    float *part[3];
    for (int i = 0; i < 3; i++) {
        part[i] = dev_malloc(bytes);
        tp_assemble(m, part[i], mine[i], mesh->checkpoint);  // this stage's part, on each of its ranks
    }
    if (mesh->t == 0) pipe_save_checkpoint(cfg, pg, &m->full, full, part[0], part[1], part[2], step);
    for (int i = 0; i < 3; i++) dev_free(part[i]);
}

long composed_load_checkpoint(const Config *cfg, const TPModel *m, const ParamLayout *full, float *params,
                              float *adam_m, float *adam_v) {
    size_t bytes = m->full.num_params * sizeof(float);
    float *part[3];
    for (int i = 0; i < 3; i++) {
        part[i] = dev_malloc(bytes);
        dev_zero(part[i], bytes);  // AdamW's moments start at 0 unless resumed
    }
    long step = load_checkpoint_part(cfg, &m->full, full, part[0], part[1], part[2]);
    tp_extract(m, params, part[0]);
    tp_extract(m, adam_m, part[1]);
    tp_extract(m, adam_v, part[2]);
    for (int i = 0; i < 3; i++) dev_free(part[i]);
    return step;
}
