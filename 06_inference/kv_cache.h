// kv_cache.h: the KV cache, as a plug-in for the block's layers.
//
// Training runs the whole sequence through the model at once. Generation adds one token at a
// time, and every new token needs attention over all earlier ones: without a cache each step
// recomputes every earlier token's keys and values (a step costs O(length) matmul rows, a whole
// answer O(length^2)); with the cache each step computes one row per sequence and reads the
// earlier keys and values back (a step costs one row of matmuls: the weights, read once).
//
// The block is the one every stage runs (common/model/gpt.c). The cache changes two of its layers and
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

#include "model/gpt.h"

// The cache is paged (PagedAttention, as vLLM's): one pool of blocks per layer, block_size
// positions each, and a block table per sequence naming its blocks in order. A sequence takes
// blocks as it grows and gives them back when it ends, so memory is held for the tokens a
// sequence has, not for the longest one it could have; sequences that start with the same
// tokens can share those blocks (prefix_cache.h). Which blocks a pass's rows use is the
// caller's choice, written into table_host before the pass: kv_cache_slot_tables gives row b the
// blocks b * max_blocks .. (b + 1) * max_blocks - 1, a whole context each (the prompts mode);
// the server's scheduler hands out blocks from block_pool.h.
typedef struct {
    int n_layer;
    int width;            // the keys' (and values') columns held: kv_width of the layers' shape
    int n_blocks;         // blocks in the pool
    int block_size;       // positions per block
    int max_blocks;       // blocks of a whole context: max_seq_len / block_size, rounded up
    int rows;             // a pass's rows at most (each has its table)
    float *pool;          // every layer's keys and values, one allocation, device
    float **k, **v;       // [n_layer] of (n_blocks, block_size, width), in pool
    int *start;           // (rows) device: where each sequence's new rows begin
    int *table;           // (rows, max_blocks) device: each pass row's blocks, uploaded each pass
    int *table_host;      // the same, host: written by the caller before a pass
} KVCache;

// the columns of keys (and of values) a position keeps per layer: one per key head's dimension,
// n_kv_head x head size (C_kv). The one place that says how wide the cache is: a model with fewer
// key heads than query heads (grouped-query attention) keeps n_head / n_kv_head times fewer.
int kv_width(const ModelShape *s);
// everything but the pool: the tables and starts of a pass's rows
void kv_cache_alloc(KVCache *c, int n_layer, int block_size, int maxT, int rows, int width);
// then the pool's n_blocks blocks, last: a pool sized from the free memory (the server's
// kv_cache_memory_fraction) is measured once everything else is allocated
void kv_cache_alloc_pool(KVCache *c, int n_blocks);
void kv_cache_free(KVCache *c);
// the device bytes of the keys and values
size_t kv_cache_bytes(const KVCache *c);
// the blocks of one position's keys and values over all layers, for sizing a pool from bytes
size_t kv_bytes_per_block(int n_layer, int block_size, int width);
// the pool's blocks: as many of per_block bytes as pool_bytes holds, or B whole contexts of maxT
// positions when pool_bytes is 0. Refused when it cannot hold one whole context: a long request
// could never run. At most KV_MAX_BLOCKS.
int kv_pool_blocks(size_t pool_bytes, int B, int maxT, int block_size, size_t per_block);
// the server's steps are broadcast as floats (scheduler.c's plan), block numbers among them, and a
// float holds every whole number up to 2^24 only
enum { KV_MAX_BLOCKS = 1 << 24 };
// rows 0 .. B-1 a whole context each: row b the blocks b * max_blocks .. (b + 1) * max_blocks - 1
// (the pool must hold B * max_blocks)
void kv_cache_slot_tables(KVCache *c, int B);
// row b's table (host), to fill before a pass
int *kv_cache_table(KVCache *c, int b);
// block dst = block src, keys and values of every layer (copy-on-write of a shared block)
void kv_cache_copy_block(KVCache *c, int dst, int src);

// The layers with the cache plugged in: attention against the cache, the embedding at each
// sequence's start; every other layer is inner's. Generation runs no backward: KVLayers has none.
typedef struct {
    LayerOps base;     // first: the block sees a LayerOps *
    LayerOps *inner;   // the layers that run the rest
    KVCache *cache;
} KVLayers;

void kv_layers_init(KVLayers *k, LayerOps *inner, KVCache *cache);

#endif
