// kv_grid.c: the KV cache around stage 05's tensor-parallel layers (see kv_grid.h).
#include "kv_grid.h"

#include <stdlib.h>

#include "base/device.h"
#include "base/log.h"

void kv_model_alloc_grid(KVModel *m, Comm *world, const GPTConfig *cfg, const int dims[3], int B, int T,
                         int maxT, int block_size, bool half_mode) {
    KVGrid *g = calloc_or_die(1, sizeof *g);
    tp_model_init(&g->tp, world, cfg, dims, true);
    kv_model_alloc_params(m, cfg, &g->tp.layout, B, T, maxT, block_size, half_mode);
    m->grid = g;
    tp_stream_init(&g->stream, &g->tp.grid, g->tp.max_block, false, half_mode);
    g->stats = dev_malloc(2 * (size_t)B * T * sizeof(float));
    tp_layers_init(&g->layers, &g->tp, &g->stream, NULL, false, g->stats);
    kv_model_alloc_passes(m, &g->layers.base, &g->tp.shape, half_mode);
    if (g->tp.grid.X > 1) {  // with x = 1 the head's logits are the whole rows already
        size_t Vp = (size_t)cfg->padded_vocab_size;
        // a pass takes the logits of up to B x T rows (the server's steps: kv_forward_rows)
        g->gathered = dev_malloc((size_t)B * T * Vp * sizeof(float));
        g->logits = dev_malloc((size_t)B * T * Vp * sizeof(float));
        m->logits = g->logits;
    }
}

void kv_grid_extract(const KVGrid *g, float *params, const float *full) { tp_extract(&g->tp, params, full); }

void kv_grid_begin_pass(KVGrid *g, const Weights *w) { tp_stream_forward(&g->tp, &g->stream, w); }

// the head is a normal layer (vocabulary over x): each x rank computed its shard, and an
// all-gather puts the rows together for the sampler
void kv_grid_gather_logits(KVGrid *g, float *logits, const float *shard, int B) {
    if (g->tp.grid.X > 1) tp_gather_vocab(&g->tp, logits, g->gathered, shard, B);
}

void kv_grid_free(KVGrid *g) {
    tp_stream_free(&g->stream);
    tp_model_free(&g->tp);
    dev_free(g->stats);
    dev_free(g->gathered);
    dev_free(g->logits);
    free(g);
}
