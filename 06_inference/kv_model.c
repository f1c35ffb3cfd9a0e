// kv_model.c: the GPT-2 forward pass with a KV cache (see kv_model.h): the common block with the
// cache plugged into its layers.
#include "kv_model.h"

#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "kv_grid.h"

// ---- the model --------------------------------------------------------------------------------

void kv_model_alloc_params(KVModel *m, const GPTConfig *cfg, const ParamLayout *held, int B, int T, int maxT,
                           int block_size, bool half_mode) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->B = B;
    m->T = T;
    m->maxT = maxT;
    m->block_size = block_size;
    gpt_layout(&m->full, cfg);
    if (!held) held = &m->full;
    m->num_params = held->num_params;
    m->params = dev_malloc(m->num_params * sizeof(float));
    weights_point(&m->w, held, m->params);
    if (half_mode) {
        m->params16 = dev_malloc(m->num_params * sizeof(half16));
        weights_point_16(&m->w, held, m->params16);
    }
}

void kv_model_alloc_passes(KVModel *m, LayerOps *inner, const ModelShape *shape, bool half_mode) {
    m->shape = *shape;
    kv_cache_alloc(&m->cache, m->cfg.n_layer, m->block_size, m->maxT, m->B * m->T, kv_width(shape));
    kv_layers_init(&m->layers, inner, &m->cache);
    ActsSpec spec = whole_model_acts(&m->cfg, m->B, m->T, half_mode, true);  // one block's set, for every layer
    spec.keys = m->cache.max_blocks * m->block_size;  // the attention scores of T new rows against a whole context
    spec.shape = *shape;
    spec.ops = &m->layers.base;
    acts_alloc_spec(&m->acts, &spec);
    m->acts.start = m->cache.start;  // rotary embeddings turn each new row by its position in the cache
    m->last = dev_malloc((size_t)m->B * m->T * shape->C * sizeof(float));
    m->logits = m->acts.logits;  // the whole vocabulary's rows (a grid with x > 1 gathers them elsewhere)
}

void kv_model_alloc(KVModel *m, const GPTConfig *cfg, int B, int T, int maxT, int block_size, bool half_mode) {
    kv_model_alloc_params(m, cfg, NULL, B, T, maxT, block_size, half_mode);
    ModelShape shape = whole_model_shape(cfg);
    kv_model_alloc_passes(m, serial_layer_ops(), &shape, half_mode);
}

size_t kv_model_bytes_per_block(const KVModel *m) {
    return kv_bytes_per_block(m->cfg.n_layer, m->block_size, kv_width(&m->shape));
}

void kv_model_load(KVModel *m, const float *full) {
    if (m->grid) kv_grid_extract(m->grid, m->params, full);
    else dev_copy(m->params, full, m->num_params * sizeof(float));
    if (m->params16) cast_to_16(m->params16, m->params, m->num_params);
}

void kv_model_free(KVModel *m) {
    ops_graph_free(m->graph);
    if (m->grid) kv_grid_free(m->grid);
    kv_cache_free(&m->cache);
    dev_free(m->params);
    dev_free(m->params16);
    dev_free(m->last);
    acts_free(&m->acts);
    weights_free(&m->w);
    gpt_layout_free(&m->full);
    memset(m, 0, sizeof *m);
}

// ---- the forward pass -------------------------------------------------------------------------

// the final layernorm and the lm_head, for B rows of `rows` (B, C)
static void head_forward(KVModel *m, const float *rows, int B) {
    gpt_head_forward(&m->acts, rows, &m->w, B);
    if (m->grid) kv_grid_gather_logits(m->grid, m->logits, m->acts.logits, B);
}

// everything between the uploaded inputs and the logits: what a CUDA graph can record. The head
// takes rows rows[0 .. n) of the pass's B * T (NULL: every row, T = 1: a decode step's).
static void forward_on_device(KVModel *m, int B, int T, const int *rows, int n) {
    Activations *a = &m->acts;
    if (m->grid) kv_grid_begin_pass(m->grid, &m->w);
    gpt_embed_forward(a, &m->w, B, T);  // at each sequence's own positions: start[b] + t
    for (int l = 0; l < m->cfg.n_layer; l++) gpt_block_forward(a, l, &m->w.h[l], B, T);
    if (!rows) {  // decode: the rows are the sequences' last rows already
        head_forward(m, head_input(a), B);
        return;
    }
    // prefill: only each sequence's last prompt row predicts a token; the lm_head (the biggest
    // matmul at GPT-2's vocabulary) runs on those rows, not on all B * T
    size_t C = (size_t)m->shape.C;
    for (int i = 0; i < n; i++)
        dev_copy(m->last + i * C, head_input(a) + (size_t)rows[i] * C, C * sizeof(float));
    head_forward(m, m->last, n);
}

// the pass's tokens, positions and block tables (rows 0 .. B-1 of the cache's host tables)
static void upload_inputs(KVModel *m, const int *tokens, const int *start, int B, int T) {
    if ((size_t)B * T > (size_t)m->B * m->T || T > m->T)
        fatal("internal: %d x %d new rows exceed the model's %d x %d", B, T, m->B, m->T);
    KVCache *c = &m->cache;
    for (int b = 0; b < B; b++)
        if (start[b] + T > m->maxT)
            fatal("internal: sequence %d would reach position %d of a %d-position cache", b,
                  start[b] + T, m->maxT);
    copy_to_device(m->acts.inputs, tokens, (size_t)B * T * sizeof(int));
    copy_to_device(c->start, start, (size_t)B * sizeof(int));
    copy_to_device(c->table, c->table_host, (size_t)B * c->max_blocks * sizeof(int));
}

void kv_forward(KVModel *m, const int *tokens, const int *start, int B, int T, const int *last_row) {
    if (B > m->B) fatal("internal: %d sequences exceed the model's %d", B, m->B);
    upload_inputs(m, tokens, start, B, T);
    int rows[B];
    for (int b = 0; b < B; b++) rows[b] = b * T + (last_row ? last_row[b] : T - 1);
    forward_on_device(m, B, T, rows, B);
}

// n as it is up to 16, else rounded up to a multiple of 16, at most most
static int padded(int n, int most) {
    int p = n <= 16 ? n : (n + 15) / 16 * 16;
    return p < most ? p : most;
}

// The CPU backend keeps a matmul primitive per shape (ops_cpu.c, at most 512 of them), and the
// server's passes have every number of rows: past 16 rows they are padded to a multiple of 16
// with copies of the last one (which writes the same keys and values to the same place again),
// and the logit rows likewise. Up to 16 rows (decode steps at small batches, speculative
// decoding's passes) take the few-rows matmul, which keeps no primitive: padding them would make
// a batch-1 step cost a 16-row one.
void kv_forward_rows(KVModel *m, const int *tokens, const int *pos, int R, const int *logit_rows, int L) {
    if (L > R || R > m->B * m->T) fatal("internal: logits of %d rows of %d (at most %d)", L, R, m->B * m->T);
    int Rp = padded(R, m->B * m->T), Lp = padded(L, Rp);
    int *t = malloc_or_die((size_t)Rp * sizeof(int)), *p = malloc_or_die((size_t)Rp * sizeof(int));
    int *l = malloc_or_die((size_t)Lp * sizeof(int));
    for (int r = 0; r < Rp; r++) {
        t[r] = tokens[r < R ? r : R - 1], p[r] = pos[r < R ? r : R - 1];
        if (r >= R) memcpy(kv_cache_table(&m->cache, r), kv_cache_table(&m->cache, R - 1),
                           (size_t)m->cache.max_blocks * sizeof(int));
    }
    for (int i = 0; i < Lp; i++) l[i] = logit_rows[i < L ? i : L - 1];
    upload_inputs(m, t, p, Rp, 1);
    forward_on_device(m, Rp, 1, l, Lp);
    free(t), free(p), free(l);
}

void kv_decode(KVModel *m, const int *tokens, const int *start, int B, bool use_graph) {
    upload_inputs(m, tokens, start, B, 1);
    if (!use_graph) {
        forward_on_device(m, B, 1, NULL, B);
        return;
    }
    if (m->graph && m->graph_B == B) {
        ops_graph_replay(m->graph);
        m->graph_replays++;
        return;
    }
    // First step at this batch size: run it for real (cuBLAS picks its kernels, the ops' lazy
    // set-up happens), then record the same step. Replaying a recording computes exactly what
    // this step computed, so the recording is not run now; later steps replay it.
    forward_on_device(m, B, 1, NULL, B);
    ops_graph_free(m->graph);
    ops_graph_begin();
    forward_on_device(m, B, 1, NULL, B);
    m->graph = ops_graph_end();
    m->graph_B = B;
}

// ---- without a cache: the training model's own forward ----------------------------------------

struct NoCacheModel {
    float *params;   // the whole model's (taken over from the caller)
    half16 *params16;
    Weights w;
    Activations acts;
};

NoCacheModel *nocache_alloc(const KVModel *m, float *full, int B, int T) {
    NoCacheModel *nc = calloc_or_die(1, sizeof *nc);
    const ParamLayout *layout = &m->full;
    nc->params = full;
    weights_point(&nc->w, layout, full);
    if (m->params16) {
        nc->params16 = dev_malloc(layout->num_params * sizeof(half16));
        cast_to_16(nc->params16, full, layout->num_params);
        weights_point_16(&nc->w, layout, nc->params16);
    }
    acts_alloc(&nc->acts, &m->cfg, B, T, m->params16 ? ACTS_16BIT : 0);
    return nc;
}

void nocache_forward(NoCacheModel *nc, const KVModel *m, const int *tokens, const int *len, int B,
                     int T, float *logits_host) {
    size_t Vp = (size_t)m->cfg.padded_vocab_size;
    gpt_forward(&nc->acts, &nc->w, tokens, B, T);
    for (int b = 0; b < B; b++)
        copy_to_host(logits_host + b * Vp, nc->acts.logits + ((size_t)b * T + len[b] - 1) * Vp,
                     Vp * sizeof(float));
}

void nocache_free(NoCacheModel *nc) {
    if (!nc) return;
    acts_free(&nc->acts);
    weights_free(&nc->w);
    dev_free(nc->params);
    dev_free(nc->params16);
    free(nc);
}
