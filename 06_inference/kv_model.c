// kv_model.c: the GPT-2 forward pass with a KV cache (see kv_model.h): the common block with
// stage 05's tensor-parallel layers and an attention that reads the cache.
#include "kv_model.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

static float *alloc_floats(KVModel *m, size_t n) {
    m->bytes += n * sizeof(float);
    return dev_malloc(n * sizeof(float));
}

// ---- attention against the cache --------------------------------------------------------------

// this rank's heads' new keys and values join its share of the cache, then its new queries attend
// to all of it: heads are independent, so no rank needs another's cache
static void cached_attention(LayerOps *ops, int layer, float *out, float *scores, const float *qkv,
                             const ModelShape *s, int B, int T) {
    KVLayers *k = (KVLayers *)ops;
    kv_cache_write(k->k_cache[layer], k->v_cache[layer], qkv, k->start, B, T, s->C_attn, k->maxT);
    attention_cached_forward(out, scores, qkv, k->k_cache[layer], k->v_cache[layer], k->start, B, T,
                             s->C_attn, s->n_head, k->maxT);
}

static void alloc_caches(KVModel *m) {
    size_t L = (size_t)m->cfg.n_layer, per_layer = (size_t)m->B * m->maxT * m->tp.Cx;
    KVLayers *k = &m->layers;
    k->k_cache = calloc_or_die(L, sizeof(float *));
    k->v_cache = calloc_or_die(L, sizeof(float *));
    for (size_t l = 0; l < L; l++) {
        k->k_cache[l] = dev_malloc(per_layer * sizeof(float));
        k->v_cache[l] = dev_malloc(per_layer * sizeof(float));
    }
    k->start = m->start;
    k->maxT = m->maxT;
    k->tp.base.attention_forward = cached_attention;
}

// ---- the model --------------------------------------------------------------------------------

void kv_model_alloc(KVModel *m, Comm *world, const GPTConfig *cfg, const int dims[3], int B, int T,
                    int maxT, bool half_mode) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->B = B;
    m->T = T;
    m->maxT = maxT;
    tp_model_init(&m->tp, world, cfg, dims, true);
    m->params = dev_malloc(m->tp.layout.num_params * sizeof(float));
    weights_point(&m->w, &m->tp.layout, m->params);
    if (half_mode) {
        m->params16 = dev_malloc(m->tp.layout.num_params * sizeof(bf16));
        weights_point_bf16(&m->w, &m->tp.layout, m->params16);
    }
    tp_stream_init(&m->stream, &m->tp.grid, m->tp.max_block, false, half_mode);
    size_t N = (size_t)B * T;
    m->stats = alloc_floats(m, 2 * N);
    m->start = dev_malloc((size_t)B * sizeof(int));
    m->bytes += (size_t)B * sizeof(int);
    tp_layers_init(&m->layers.tp, &m->tp, &m->stream, NULL, false, m->stats);
    alloc_caches(m);
    ActsSpec spec = whole_model_acts(cfg, B, T, half_mode, true);  // one block's set, for every layer
    spec.keys = maxT;  // the attention scores of T new rows against the whole cache
    spec.shape = m->tp.shape;
    spec.ops = &m->layers.tp.base;
    acts_alloc_spec(&m->acts, &spec);
    m->acts.start = m->start;  // rotary embeddings turn each new row by its position in the cache
    m->bytes += m->acts.bytes;
    m->last = alloc_floats(m, (size_t)B * m->tp.Cy);
    if (m->tp.grid.X > 1) {  // with x = 1 the head's logits are the whole rows already
        m->gathered = alloc_floats(m, (size_t)B * cfg->padded_vocab_size);
        m->logits = alloc_floats(m, (size_t)B * cfg->padded_vocab_size);
    } else {
        m->logits = m->acts.logits;
    }
}

void kv_model_load(KVModel *m, const float *full) {
    tp_extract(&m->tp, m->params, full);
    if (m->params16) cast_to_bf16(m->params16, m->params, m->tp.layout.num_params);
}

void kv_model_free(KVModel *m) {
    ops_graph_free(m->graph);
    for (int l = 0; l < m->cfg.n_layer; l++) {
        dev_free(m->layers.k_cache[l]);
        dev_free(m->layers.v_cache[l]);
    }
    free(m->layers.k_cache);
    free(m->layers.v_cache);
    if (m->gathered) dev_free(m->logits);
    void *bufs[] = {m->params, m->params16, m->stats, m->start, m->last, m->gathered};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dev_free(bufs[i]);
    acts_free(&m->acts);
    tp_stream_free(&m->stream);
    weights_free(&m->w);
    tp_model_free(&m->tp);
    memset(m, 0, sizeof *m);
}

// ---- the forward pass -------------------------------------------------------------------------

// the final layernorm and the tied lm_head, for B rows of `rows` (B, Cy): the head is a normal
// layer (vocabulary over x), so each x rank computes its shard and an all-gather puts the rows
// together for the sampler
static void head_forward(KVModel *m, const float *rows, int B) {
    gpt_head_forward(&m->acts, rows, &m->w, B);
    if (m->tp.grid.X > 1) tp_gather_vocab(&m->tp, m->logits, m->gathered, m->acts.logits, B);
}

// everything between the uploaded inputs and the logits: what a CUDA graph can record
static void forward_on_device(KVModel *m, int B, int T, const int *last_row) {
    Activations *a = &m->acts;
    LayerOps *ops = a->ops;
    tp_stream_forward(&m->tp, &m->stream, &m->w);  // wte, the blocks', wte
    // the embedding at each sequence's own positions: start[b] + t
    ops->embed_forward(ops, a->encoded, a->inputs, m->start, &m->w, &m->tp.shape, B, T);
    for (int l = 0; l < m->cfg.n_layer; l++) gpt_block_forward(a, l, &m->w.h[l], B, T);
    if (T == 1) {  // decode: the rows are the sequences' last rows already
        head_forward(m, head_input(a), B);
        return;
    }
    // prefill: only each sequence's last prompt row predicts a token; the lm_head (the biggest
    // matmul at GPT-2's vocabulary) runs on those B rows, not on all B * T
    size_t Cy = (size_t)m->tp.Cy;
    for (int b = 0; b < B; b++) {
        int row = last_row ? last_row[b] : T - 1;
        dev_copy(m->last + b * Cy, head_input(a) + ((size_t)b * T + row) * Cy, Cy * sizeof(float));
    }
    head_forward(m, m->last, B);
}

static void upload_inputs(KVModel *m, const int *tokens, const int *start, int B, int T) {
    if (B > m->B || T > m->T) fatal("internal: %d x %d new rows exceed the model's %d x %d", B, T, m->B, m->T);
    for (int b = 0; b < B; b++)
        if (start[b] + T > m->maxT)
            fatal("internal: sequence %d would reach position %d of a %d-position cache", b,
                  start[b] + T, m->maxT);
    copy_to_device(m->acts.inputs, tokens, (size_t)B * T * sizeof(int));
    copy_to_device(m->start, start, (size_t)B * sizeof(int));
}

void kv_forward(KVModel *m, const int *tokens, const int *start, int B, int T, const int *last_row) {
    upload_inputs(m, tokens, start, B, T);
    forward_on_device(m, B, T, last_row);
}

// a one-sequence forward pass whose cache is slot `slot`'s: the layers' cache pointers are moved
// to that slot for the pass (a captured decode graph keeps the unmoved ones)
void kv_prefill_slot(KVModel *m, int slot, const int *tokens, int T) {
    if (slot < 0 || slot >= m->B) fatal("internal: cache slot %d of %d", slot, m->B);
    size_t offset = (size_t)slot * m->maxT * m->tp.Cx;
    for (int l = 0; l < m->cfg.n_layer; l++) m->layers.k_cache[l] += offset, m->layers.v_cache[l] += offset;
    int start = 0;
    kv_forward(m, tokens, &start, 1, T, NULL);
    for (int l = 0; l < m->cfg.n_layer; l++) m->layers.k_cache[l] -= offset, m->layers.v_cache[l] -= offset;
}

void kv_decode(KVModel *m, const int *tokens, const int *start, int B, bool use_graph) {
    upload_inputs(m, tokens, start, B, 1);
    if (!use_graph) {
        forward_on_device(m, B, 1, NULL);
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
    forward_on_device(m, B, 1, NULL);
    ops_graph_free(m->graph);
    ops_graph_begin();
    forward_on_device(m, B, 1, NULL);
    m->graph = ops_graph_end();
    m->graph_B = B;
}

// ---- without a cache: the training model's own forward ----------------------------------------

struct NoCacheModel {
    float *params;   // the serial model's (taken over from the caller)
    bf16 *params16;
    Weights w;
    Activations acts;
};

NoCacheModel *nocache_alloc(const KVModel *m, float *full, int B, int T) {
    NoCacheModel *nc = calloc_or_die(1, sizeof *nc);
    const ParamLayout *layout = &m->tp.full;
    nc->params = full;
    weights_point(&nc->w, layout, full);
    if (m->params16) {
        nc->params16 = dev_malloc(layout->num_params * sizeof(bf16));
        cast_to_bf16(nc->params16, full, layout->num_params);
        weights_point_bf16(&nc->w, layout, nc->params16);
    }
    acts_alloc(&nc->acts, &m->cfg, B, T, m->params16 ? ACTS_BF16 : 0);
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
