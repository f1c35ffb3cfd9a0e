// kv_cache.h: the KV cache, as a plug-in for the block's layers.
//
// Training runs the whole sequence through the model at once. Generation adds one token at a
// time, and every new token needs attention over all earlier ones: without a cache each step
// recomputes every earlier token's keys and values (a step costs O(length) matmul rows, a whole
// answer O(length^2)); with the cache each step computes one row per sequence and reads the
// earlier keys and values back (a step costs one row of matmuls: the weights, read once).
//
// The block is the one every stage runs (common/gpt.c). The cache changes two of its layers and
// nothing else:
//   attention   the new rows' keys and values are written into the cache of their layer, then
//               their queries attend to every cached row of their sequence;
//   embedding   sequence b's new rows sit at positions start[b], start[b] + 1, ... (0 in a
//               prefill, the sequence's length in a decode step), not at 0, 1, ...
// KVLayers wraps whatever layers run the rest: serial_layer_ops() on one device (kv_model.c),
// stage 05's tensor-parallel layers on a grid (kv_grid.c), where each rank caches its own heads.
#ifndef KV_CACHE_H
#define KV_CACHE_H

#include <stddef.h>

#include "gpt.h"

typedef struct {
    int n_layer, B, maxT;
    int width;            // the keys' (and values') columns held: the heads' C_attn of ModelShape
    float **k, **v;       // [n_layer] of (B, maxT, width), device
    int *start;           // (B) device: where each sequence's new rows begin
    size_t slot_offset;   // a pass of one sequence into slot s reads and writes s's rows: s * maxT
                          // * width; 0 when the pass's B sequences are slots 0 .. B-1
} KVCache;

void kv_cache_alloc(KVCache *c, int n_layer, int B, int maxT, int width);
void kv_cache_free(KVCache *c);
// the device bytes of the keys and values
size_t kv_cache_bytes(const KVCache *c);

// The layers with the cache plugged in: attention against the cache, the embedding at each
// sequence's start; every other layer is inner's. Generation runs no backward: KVLayers has none.
typedef struct {
    LayerOps base;     // first: the block sees a LayerOps *
    LayerOps *inner;   // the layers that run the rest
    KVCache *cache;
} KVLayers;

void kv_layers_init(KVLayers *k, LayerOps *inner, KVCache *cache);

#endif
