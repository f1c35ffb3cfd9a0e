// kv_cache.c: the KV cache and the two layers it changes (see kv_cache.h).
#include "kv_cache.h"

#include <stdlib.h>

#include "base/device.h"
#include "base/log.h"

int kv_width(const ModelShape *s) { return s->C_kv; }

void kv_cache_alloc(KVCache *c, int n_layer, int block_size, int maxT, int rows, int width) {
    *c = (KVCache){.n_layer = n_layer, .width = width, .block_size = block_size,
                   .max_blocks = (maxT + block_size - 1) / block_size, .rows = rows};
    c->k = calloc_or_die((size_t)n_layer, sizeof(float *));
    c->v = calloc_or_die((size_t)n_layer, sizeof(float *));
    c->start = dev_malloc((size_t)rows * sizeof(int));
    c->table = dev_malloc((size_t)rows * c->max_blocks * sizeof(int));
    c->table_host = calloc_or_die((size_t)rows * c->max_blocks, sizeof(int));
}

void kv_cache_alloc_pool(KVCache *c, int n_blocks) {
    if (c->n_blocks) fatal("internal: the KV cache's pool was allocated already");
    c->n_blocks = n_blocks;
    size_t per_layer = (size_t)n_blocks * c->block_size * c->width;
    // one allocation for all layers: at GPT-2's shape and 256 positions a layer's keys are 768 KB,
    // below the size dev_malloc puts on huge pages, and a decode step reads a head's piece of
    // every cache row, a page apart (GPT-2 124M, batch 1, 220 positions, timed standalone with a
    // cold cache: attention 1.55-1.58 ms a step on 4 KiB pages, 1.40-1.46 on 2 MiB ones)
    c->pool = dev_malloc(2 * c->n_layer * per_layer * sizeof(float));
    for (int l = 0; l < c->n_layer; l++) c->k[l] = c->pool + 2 * l * per_layer, c->v[l] = c->k[l] + per_layer;
}

void kv_cache_free(KVCache *c) {
    dev_free(c->pool);
    free(c->k);
    free(c->v);
    dev_free(c->start);
    dev_free(c->table);
    free(c->table_host);
}

size_t kv_bytes_per_block(int n_layer, int block_size, int width) {
    return 2 * (size_t)n_layer * block_size * width * sizeof(float);
}

int kv_pool_blocks(size_t pool_bytes, int B, int maxT, int block_size, size_t per_block) {
    int whole = (maxT + block_size - 1) / block_size;
    if (!pool_bytes) return B * whole;
    size_t n = pool_bytes / per_block;
    if (n < (size_t)whole)
        fatal("key 'kv_cache_bytes': expected at least %zu bytes per rank (one whole context: %d blocks of %d "
              "positions, %zu bytes each), found %zu", whole * per_block, whole, block_size, per_block, pool_bytes);
    return n > KV_MAX_BLOCKS ? KV_MAX_BLOCKS : (int)n;
}

size_t kv_cache_bytes(const KVCache *c) {
    return (size_t)c->n_blocks * kv_bytes_per_block(c->n_layer, c->block_size, c->width);
}

void kv_cache_slot_tables(KVCache *c, int B) {
    if ((size_t)B * c->max_blocks > (size_t)c->n_blocks)
        fatal("internal: %d whole contexts need %d cache blocks, the pool has %d", B, B * c->max_blocks,
              c->n_blocks);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < c->max_blocks; i++) c->table_host[(size_t)b * c->max_blocks + i] = b * c->max_blocks + i;
}

int *kv_cache_table(KVCache *c, int b) { return c->table_host + (size_t)b * c->max_blocks; }

void kv_cache_copy_block(KVCache *c, int dst, int src) {
    size_t n = (size_t)c->block_size * c->width;
    for (int l = 0; l < c->n_layer; l++) {
        dev_copy(c->k[l] + dst * n, c->k[l] + src * n, n * sizeof(float));
        dev_copy(c->v[l] + dst * n, c->v[l] + src * n, n * sizeof(float));
    }
}

// ---- the two layers the cache changes -----------------------------------------------------------

// The new keys and values join the cache, then the new queries attend to all of it. Heads are
// independent: on a grid each rank writes and reads its own heads' share, and no rank needs
// another's cache. With grouped-query attention the block hands over every query head's copy of
// its group's key and value (gqa_expand); the cache keeps the key/value heads only, and each query
// head reads its group's.
static void cached_attention(LayerOps *ops, int layer, float *out, float *scores, const float *qkv,
                             const ModelShape *s, int B, int T) {
    KVCache *c = ((KVLayers *)ops)->cache;
    kv_cache_write(c->k[layer], c->v[layer], qkv, c->start, c->table, B, T, s->C_attn, s->n_head, s->n_kv_head,
                   c->block_size, c->max_blocks);
    attention_cached_forward(out, scores, qkv, c->k[layer], c->v[layer], c->start, c->table, B, T, s->C_attn,
                             s->n_head, s->n_kv_head, c->block_size, c->max_blocks);
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
// 08_mixture_of_experts/moe.c) stays inner's as it is; the backward ops are cleared: nothing here
// keeps what a backward would need.
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
