// kv_grid.h: generation on a tensor-parallel grid [x, y, 1]: the KV cache (kv_cache.h) plugged
// into stage 05's layers (05_tensor_parallel/tp_model.h) instead of the serial ones.
//
// Rank (x, y) holds the heads n_head/x (its qkv rows and its share of the KV cache, a pool of the
// same blocks on every rank, C_kv/x columns each per layer: its n_kv_head/x key/value heads; the
// cache is split by heads and never moves, and one block table serves every rank), the MLP's
// columns 4C/x, the vocabulary Vp/x, and the hidden dimension C/y of each. Around the pass (kv_model.c) the grid
// adds two steps: before it, stage 05's weight stream is told the pass's order of weights; after
// the head, the x ranks' logit shards are gathered into whole rows on every rank.
#ifndef KV_GRID_H
#define KV_GRID_H

#include <stdbool.h>

#include "../05_tensor_parallel/tp_model.h"
#include "comm/comm.h"
#include "kv_model.h"

struct KVGrid {
    TPModel tp;              // the grid and this rank's share of every tensor (stage 05)
    TPWeightStream stream;   // hands out the blocks in the forward's order (z = 1: no copies)
    TPLayers layers;         // stage 05's layers, which the cache wraps
    float *stats;            // (2 B T) LayerNorm's row sums (all-reduced over y)
    float *gathered;         // (x, B x T, Vp/x) every x rank's logits (x > 1)
    float *logits;           // (B x T, Vp) the whole vocabulary, on every rank (x > 1)
};

// kv_model_alloc on the grid dims = [x, y, 1] of world (every rank calls it; the grid was checked
// with tp_check_grid), all but the cache's pool, as kv_model_alloc.
void kv_model_alloc_grid(KVModel *m, Comm *world, const GPTConfig *cfg, const int dims[3], int B, int T,
                         int maxT, int block_size, bool half_mode);

// kv_model.c's calls, where m->grid is set:
// params = this rank's share of full (device, the whole model's layout)
void kv_grid_extract(const KVGrid *g, float *params, const float *full);
// before a pass: the weights in the forward's order (wte, the blocks', the lm_head)
void kv_grid_begin_pass(KVGrid *g, const Weights *w);
// after the head: logits (B, Vp) = the x ranks' shards (B, Vp/x) side by side (x = 1: they are
// the whole rows already, and logits is shard)
void kv_grid_gather_logits(KVGrid *g, float *logits, const float *shard, int B);
void kv_grid_free(KVGrid *g);

#endif
