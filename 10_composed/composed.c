// composed.c: see composed.h.
#include "composed.h"

#include <stdio.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "run/run_checkpoint.h"
#include "run/run_setup.h"

// ---- the mesh ---------------------------------------------------------------------------------

void composed_groups_init(ComposedGroups *g, Comm *world, const Config *cfg) {
    const int *d = cfg->tp_dimensions;
    // 05's y splits the hidden dimension of the residual stream, which the pipeline sends whole
    if (d[1] != 1)
        fatal("%s: key 'tp_dimensions' is [%d, %d, %d] but stage 10 splits layers 1-D over x: y must be 1 (a y "
              "split would cut the activations the pipeline stages send each other)", config_source("tp_dimensions"),
              d[0], d[1], d[2]);
    char text[64], source[1200], why[320];
    int size[MESH_DIMS];
    snprintf(text, sizeof text, "tp=%d,cp=%d,pp=%d", d[0], cfg->cp_size, cfg->pp_size);
    snprintf(source, sizeof source, "%s (tp_dimensions), %s (cp_size), %s (pp_size)", config_source("tp_dimensions"),
             config_source("cp_size"), config_source("pp_size"));
    if (!mesh_parse(text, comm_size(world), size, why, sizeof why)) fatal("%s: mesh: %s", source, why);
    Mesh *m = &g->mesh;
    mesh_init(m, world, size, source);
    int stage = m->coord[MESH_PP], replica = m->coord[MESH_DP], pp = m->size[MESH_PP];
    // 07's grid numbers its ranks replica * pp + stage: the mesh's pp x dp group, renumbered
    int t = m->coord[MESH_CP] * m->size[MESH_TP] + m->coord[MESH_TP];  // this rank's (c, t)
    g->slice = comm_split(world, t, replica * pp + stage, "slice");
    g->stage_ranks = mesh_group(m, MESH_ALONG(MESH_DP) | MESH_ALONG(MESH_TP), "stage");
    g->context = m->size[MESH_CP] > 1 ? mesh_group(m, MESH_ALONG(MESH_DP) | MESH_ALONG(MESH_CP), "context") : NULL;
    g->replica_ranks = mesh_group(m, MESH_ALONG(MESH_PP) | MESH_ALONG(MESH_TP), "replica");
    g->checkpoint = mesh_group(m, MESH_ALONG(MESH_DP) | MESH_ALONG(MESH_TP), "checkpoint");
    g->experts = NULL;  // composed_ep_init's, with ep > 1
}

// ---- 05's layers inside 07's stages -----------------------------------------------------------

static void tp_adapt(PipeLayers *l, ActsSpec *spec) {
    TPStageLayers *t = (TPStageLayers *)l;
    spec->shape = t->m->shape;
    spec->seq_shards = t->m->seq_shards;  // sequence parallel: each x rank keeps its rows of the residual
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

static void tp_stage_weight_pass(PipeLayers *l, Activations *a, const Weights *w, void (*run)(void *notes),
                                 void *notes) {
    TPStageLayers *t = (TPStageLayers *)l;
    tp_weight_pass_on(t->m, &t->scratch, a, w, run, notes);
}

void tp_stage_layers_init(TPStageLayers *l, const TPModel *m, const Config *cfg, int B, int T) {
    *l = (TPStageLayers){.base = {tp_adapt, tp_stage_forward, tp_stage_loss, tp_stage_backward, tp_stage_weight_pass},
                         .m = m};
    tp_scratch_alloc(&l->scratch, m, B, T, acts_flags(cfg), false);
}

void tp_stage_layers_free(TPStageLayers *l) { tp_acts_free(&l->scratch); }

double composed_norm_squares(const TPModel *m, const PipeGrid *pg, const float *grads) {
    return tp_norm_squares_of(m, grads, pipe_tensor_counted, pg);
}

// ---- checkpoints ------------------------------------------------------------------------------

void composed_save_checkpoint(const Config *cfg, const ComposedGroups *groups, const PipeGrid *pg, const TPModel *m,
                              const ParamLayout *full, const float *params, const float *adam_m,
                              const float *adam_v, long step) {
    if (m->trained.save) {  // a frozen base: the set that trains saves itself, whole, summed over every stage
        m->trained.save(m->trained.owner, cfg, groups->mesh.world, params);
        return;
    }
    if (groups->experts) {  // the replicas of a stage hold other experts
        composed_ep_save_checkpoint(groups->experts, cfg, groups, pg, m, full, params, adam_m, adam_v, step);
        return;
    }
    size_t bytes = m->full.num_params * sizeof(float);
    const float *mine[3] = {params, adam_m, adam_v};
    float *part[3];
    for (int i = 0; i < 3; i++) {
        part[i] = dev_malloc(bytes);
        tp_assemble(m, part[i], mine[i], groups->checkpoint);  // this stage's part, on each of its ranks
    }
    // one slice saves: t = 0's, of the first chunks (the weights are copies over cp)
    if (groups->mesh.coord[MESH_TP] == 0 && groups->mesh.coord[MESH_CP] == 0)
        pipe_save_checkpoint(cfg, pg, &m->full, full, part[0], part[1], part[2], step);
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
