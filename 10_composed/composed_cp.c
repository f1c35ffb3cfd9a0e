// composed_cp.c: see composed_cp.h.
#include "composed_cp.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "run/evaluate.h"

// 05's block calls the ops table inside tp.scratch.layers: the stage's layers around it
static CPStageLayers *of_ops(LayerOps *ops) {
    return (CPStageLayers *)((char *)ops - offsetof(CPStageLayers, tp.scratch.layers.base));
}

// ---- 05's layers at the chunks' positions, with 09's ring attention ----------------------------

// one call for both chunks: the rows' first positions, which the pipeline's forward has set
static void chunk_embed_forward(LayerOps *ops, float *out, const int *tokens, const int *start, const Weights *w,
                                const ModelShape *s, int B, int T) {
    (void)start;
    CPStageLayers *l = of_ops(ops);
    l->tp_ops.embed_forward(ops, out, tokens, l->ring.start, w, s, B, T);
}

// the embedding's backward adds wpe's gradient at positions 0 .. T - 1: each half's rows are one
// chunk position, so each half adds into wpe's gradient from that position on
static void chunk_embed_backward(LayerOps *ops, Weights *g, const float *dout, const int *tokens,
                                 const ModelShape *s, int B, int T) {
    CPStageLayers *l = of_ops(ops);
    int rows = B / 2;
    for (int half = 0; half < 2; half++) {
        Weights at = *g;
        if (g->wpe) at.wpe = g->wpe + (size_t)l->ring.start_host[half * rows] * s->C;
        size_t first = (size_t)half * rows * T;
        l->tp_ops.embed_backward(ops, &at, dout + first * s->C, tokens + first, s, rows, T);
    }
}

// s is this tp rank's share (its heads): 09's ring runs on it as on a whole model's
static void ring_forward(LayerOps *ops, int layer, float *out, float *att, const float *qkv, const ModelShape *s,
                         int B, int T) {
    CPLayers *ring = &of_ops(ops)->ring;
    ring->base.attention_forward(&ring->base, layer, out, att, qkv, s, B, T);
}

static void ring_backward(LayerOps *ops, int layer, float *dqkv, float *datt, const float *dout, const float *qkv,
                          const float *out, const float *att, const ModelShape *s, int B, int T) {
    CPLayers *ring = &of_ops(ops)->ring;
    ring->base.attention_backward(&ring->base, layer, dqkv, datt, dout, qkv, out, att, s, B, T);
}

// ---- the pipeline's view: slots of chunks, each stage at the chunks' positions ----------------

// 16-bit runs: a block keeps only the 16-bit copy of attention's output, and 09's ring keeps the
// fp32 one for its backward (kept_out, one a block). The pipeline has several micro-batches in
// flight, each in a slot of its own: each slot keeps its own outputs, which kept_out points at
// while the slot runs.
struct SlotOutputs {
    const Activations *slot;
    float **out;  // [n_layer]: the slot's blocks' (N, C_attn), NULL for the others
};

static float **slot_outputs_alloc(const Activations *a, int n_layer) {
    float **out = calloc_or_die((size_t)n_layer, sizeof *out);
    size_t bytes = (size_t)a->spec.B * a->spec.T * a->spec.shape.C_attn * sizeof(float);
    for (int b = a->spec.first_layer; b < a->spec.first_layer + a->spec.n_layers; b++) out[b] = dev_malloc(bytes);
    return out;
}

static void use_slot_outputs(CPStageLayers *l, const Activations *a) {
    if (!l->half) return;
    int i = 0;
    while (i < l->n_kept && l->kept[i].slot != a) i++;
    if (i == l->n_kept) {  // a slot's first forward
        l->kept = realloc(l->kept, (size_t)(l->n_kept + 1) * sizeof *l->kept);
        if (!l->kept) fatal("out of host memory");
        l->kept[l->n_kept++] = (struct SlotOutputs){a, slot_outputs_alloc(a, l->tp.m->cfg.n_layer)};
    }
    l->ring.kept_out = l->kept[i].out;
}

static void slot_outputs_free(CPStageLayers *l) {
    for (int i = 0; i < l->n_kept; i++) {
        for (int b = 0; b < l->tp.m->cfg.n_layer; b++) dev_free(l->kept[i].out[b]);
        free(l->kept[i].out);
    }
    free(l->kept);
    l->ring.kept_out = NULL;  // not 09's to free
}

// a slot holds 2 B chunks of c tokens, and attention keeps one log-sum-exp per row and head
static void chunk_adapt(PipeLayers *p, ActsSpec *spec) {
    CPStageLayers *l = (CPStageLayers *)p;
    l->tp_stage.adapt(p, spec);
    spec->B *= 2;
    spec->T = cp_chunk_len(&l->grid, spec->T);
    spec->keys = 1;
}

// every stage sets the positions: the first stage's embedding reads them, every stage's rotary
// embedding turns by them
static void chunk_forward(PipeLayers *p, Activations *a, const Weights *w, const int *inputs, int B, int T) {
    CPStageLayers *l = (CPStageLayers *)p;
    cp_layers_set_positions(&l->ring, B, T);
    a->start = l->ring.start;
    use_slot_outputs(l, a);
    l->tp_stage.forward(p, a, w, inputs, B, T);
}

static void chunk_backward(PipeLayers *p, Activations *a, const Weights *w, Weights *g, int B, int T) {
    CPStageLayers *l = (CPStageLayers *)p;
    use_slot_outputs(l, a);
    l->tp_stage.backward(p, a, w, g, B, T);
}

static void refuse_what_cp_does_not_run(const Config *cfg, int cp, int T) {
    if (strcmp(cfg->cp_impl, "ring") != 0)
        fatal("%s: key 'cp_impl' is '%s' but stage 10 runs cp as a ring (each tp rank's heads, which Ulysses would "
              "split again): set it to ring", config_source("cp_impl"), cfg->cp_impl);
    if (cfg->sequence_parallel)  // its rows are a slice of B x T, which cuts across the chunks' positions
        fatal("%s: key 'sequence_parallel' is true but cp_size is %d: stage 10 does not yet split a cp chunk's "
              "residual rows over the tp ranks; set one of them otherwise", config_source("sequence_parallel"), cp);
    if (T % (2 * cp) != 0)
        fatal("%s: keys 'max_seq_len' and 'cp_size': stage 10 cuts each sequence into 2 x cp_size = %d chunks, and a "
              "sequence of the longest length must fill them (a padded last chunk would run past the position "
              "table): expected a multiple of %d, found max_seq_len %d", config_source("max_seq_len"), 2 * cp,
              2 * cp, T);
}

void cp_stage_layers_init(CPStageLayers *l, const TPModel *m, const Config *cfg, const ComposedGroups *g,
                          const GPTConfig *mc, int B, int T) {
    memset(l, 0, sizeof *l);
    l->cp = g->mesh.size[MESH_CP];
    if (l->cp == 1) {
        tp_stage_layers_init(&l->tp, m, cfg, B, T);
        return;
    }
    refuse_what_cp_does_not_run(cfg, l->cp, T);
    cp_grid_init(&l->grid, g->context, cfg, mc);
    int c = cp_chunk_len(&l->grid, T);
    tp_stage_layers_init(&l->tp, m, cfg, 2 * B, c);
    cp_layers_init(&l->ring, &l->grid, mc, B, c, false);
    l->half = config_is_half(cfg);
    l->tp_stage = l->tp.base;
    l->tp.base.adapt = chunk_adapt;
    l->tp.base.forward = chunk_forward;
    l->tp.base.backward = chunk_backward;
    LayerOps *ops = &l->tp.scratch.layers.base;
    l->tp_ops = *ops;
    ops->embed_forward = chunk_embed_forward;
    ops->embed_backward = chunk_embed_backward;
    ops->attention_forward = ring_forward;
    ops->attention_backward = ring_backward;
}

void cp_stage_layers_free(CPStageLayers *l) {
    tp_stage_layers_free(&l->tp);
    if (l->cp == 1) return;
    slot_outputs_free(l);
    cp_layers_free(&l->ring);
    for (int i = 0; i < l->n_chunks; i++) batch_free(&l->chunks[i]);
    free(l->chunks);
}

void print_cp_stage_plan(const CPStageLayers *l, const Config *cfg) {
    if (l->cp == 1) return;
    int T = l->tp.m->cfg.max_seq_len < cfg->max_seq_len ? l->tp.m->cfg.max_seq_len : cfg->max_seq_len;
    print_context_plan(&l->grid, cfg, &l->tp.m->shape, cp_chunk_len(&l->grid, T));
}

const Batch *cp_stage_batches(CPStageLayers *l, const Batch *batches, int m) {
    if (l->cp == 1) return batches;
    if (l->n_chunks < m) {
        l->chunks = realloc(l->chunks, (size_t)m * sizeof *l->chunks);
        if (!l->chunks) fatal("out of host memory");
        memset(l->chunks + l->n_chunks, 0, (size_t)(m - l->n_chunks) * sizeof *l->chunks);
        l->n_chunks = m;
    }
    for (int micro = 0; micro < m; micro++) cp_local_batch(&l->grid, &batches[micro], &l->chunks[micro]);
    return l->chunks;
}

typedef struct {
    CPStageLayers *l;
    Pipeline *p;
} ChunkEval;

static double chunk_eval_loss(void *ctx, const Batch *batch) {
    ChunkEval *e = ctx;
    return pipeline_eval_loss(e->p, cp_stage_batches(e->l, batch, 1));
}

void cp_stage_evaluate(CPStageLayers *l, Pipeline *p, const Dataset *data, const Config *cfg, int replica,
                       int dp, double sums[2]) {
    if (l->cp == 1) {
        evaluate_batches(pipeline_eval_loss, p, data, cfg, replica, dp, sums);
        return;
    }
    ChunkEval e = {l, p};
    evaluate_batches(chunk_eval_loss, &e, data, cfg, replica, dp, sums);
    if (l->grid.cp_rank != 0) sums[1] = 0;  // every cp rank of a replica saw its targets: count them once
}

Comm *composed_replicas(const CPStageLayers *l, const PipeGrid *pg) { return l->cp > 1 ? l->grid.world : pg->dp_group; }
