// kv_cache.c: the KV cache and the two layers it changes (see kv_cache.h).
#include "kv_cache.h"

#include <stdlib.h>

#include "device.h"
#include "log.h"

void kv_cache_alloc(KVCache *c, int n_layer, int B, int maxT, int width) {
    *c = (KVCache){.n_layer = n_layer, .B = B, .maxT = maxT, .width = width};
    size_t per_layer = (size_t)B * maxT * width * sizeof(float);
    c->k = calloc_or_die((size_t)n_layer, sizeof(float *));
    c->v = calloc_or_die((size_t)n_layer, sizeof(float *));
    for (int l = 0; l < n_layer; l++) c->k[l] = dev_malloc(per_layer), c->v[l] = dev_malloc(per_layer);
    c->start = dev_malloc((size_t)B * sizeof(int));
}

void kv_cache_free(KVCache *c) {
    for (int l = 0; l < c->n_layer; l++) dev_free(c->k[l]), dev_free(c->v[l]);
    free(c->k);
    free(c->v);
    dev_free(c->start);
}

size_t kv_cache_bytes(const KVCache *c) {
    return 2 * (size_t)c->n_layer * c->B * c->maxT * c->width * sizeof(float);
}

// ---- the two layers the cache changes -----------------------------------------------------------

// The new keys and values join the cache, then the new queries attend to all of it. Heads are
// independent: on a grid each rank writes and reads its own heads' share, and no rank needs
// another's cache.
static void cached_attention(LayerOps *ops, int layer, float *out, float *scores, const float *qkv,
                             const ModelShape *s, int B, int T) {
    KVCache *c = ((KVLayers *)ops)->cache;
    float *k = c->k[layer] + c->slot_offset, *v = c->v[layer] + c->slot_offset;
    kv_cache_write(k, v, qkv, c->start, B, T, s->C_attn, c->maxT);
    attention_cached_forward(out, scores, qkv, k, v, c->start, B, T, s->C_attn, s->n_head, c->maxT);
}

// the embedding of row t of sequence b at position start[b] + t (the block's own call asks for
// 0 + t)
static void embed_at_start(LayerOps *ops, float *out, const int *tokens, const int *start, const Weights *w,
                           const ModelShape *s, int B, int T) {
    (void)start;
    KVLayers *k = (KVLayers *)ops;
    k->inner->embed_forward(k->inner, out, tokens, k->cache->start, w, s, B, T);
}

// ---- every other layer is inner's ----------------------------------------------------------------
// inner's functions expect inner's table (a tensor-parallel layer reads its grid from it), so
// each is called with it

static void inner_linear(LayerOps *ops, LinearKind kind, float *out, const float *inp, half16 *inp16,
                         const Linear *w, int N, int in_dim, int out_dim) {
    LayerOps *inner = ((KVLayers *)ops)->inner;
    inner->linear_forward(inner, kind, out, inp, inp16, w, N, in_dim, out_dim);
}

static void inner_norm(LayerOps *ops, float *out, float *mean, float *rstd, const float *inp, const Norm *w,
                       const ModelShape *s, int N) {
    LayerOps *inner = ((KVLayers *)ops)->inner;
    inner->norm_forward(inner, out, mean, rstd, inp, w, s, N);
}

static void inner_mlp(LayerOps *ops, Activations *a, int layer, const BlockWeights *w, int B, int T) {
    LayerOps *inner = ((KVLayers *)ops)->inner;
    inner->mlp_forward(inner, a, layer, w, B, T);
}

// Starts from inner's table, so that an op without state of its own (a mixture of experts' MLP,
// common/moe.c) stays inner's as it is; the backward ops are cleared: nothing here keeps what a
// backward would need.
void kv_layers_init(KVLayers *k, LayerOps *inner, KVCache *cache) {
    *k = (KVLayers){.base = *inner, .inner = inner, .cache = cache};
    k->base.attention_forward = cached_attention;
    k->base.embed_forward = embed_at_start;
    k->base.linear_forward = inner_linear;
    k->base.norm_forward = inner_norm;
    k->base.mlp_forward = inner_mlp;
    k->base.embed_backward = NULL;
    k->base.linear_backward = NULL;
    k->base.norm_backward = NULL;
    k->base.attention_backward = NULL;
    k->base.mlp_backward = NULL;
}
