// kv_model.h: GPT-2's forward pass for generation, with a KV cache (kv_cache.h).
//
//   prefill: the prompt's T rows in one pass, writing cache rows 0..T-1   (matmuls: compute-bound)
//   decode:  one row per sequence, writing cache row `pos` and reading 0..pos (weight reads: bound
//            by memory bandwidth)
//
// The block is the one every stage runs (common/model/gpt.c) with the cache plugged into its layers; the
// same block code runs both passes: T new rows per sequence that start at start[b] (0 in the
// prefill, the sequence's length in a decode step).
//
// On one device (kv_model_alloc) the cache wraps the serial layers, serial_layer_ops(). On a
// tensor-parallel grid [x, y, 1] (kv_model_alloc_grid, kv_grid.h) the same cache wraps stage 05's
// layers and this file's pass adds the grid's two steps where m->grid is set.
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include <stdbool.h>

#include "kv_cache.h"
#include "model/activations.h"
#include "model/gpt.h"
#include "ops/ops.h"

typedef struct KVGrid KVGrid;

typedef struct KVModel {
    GPTConfig cfg;
    ParamLayout full;          // the whole model's layout (checkpoints; on one device, params')
    size_t num_params;         // the parameters this process holds: the whole model, or its rank's share
    float *params;             // flat (device)
    half16 *params16;            // its bf16 copy (precision bf16-mixed), else NULL
    Weights w;                 // named views into params (and params16)
    ModelShape shape;          // what this process holds of a block (common/model/gpt.h)
    KVCache cache;
    KVLayers layers;           // the cache plugged into the layers that run the rest
    Activations acts;          // one block's activations for B * T rows, reused by every layer:
                               // nothing is kept for a backward
    int B, T, maxT;            // capacity: B sequences, T new rows each, maxT cached positions
    int block_size;            // the cache's positions per block
    size_t pool_free_bytes;    // the free memory the pool is a share of (kv_cache_memory_fraction:
                               // the least of the ranks'), or 0 (kv_cache_bytes, or whole contexts)
    float *last;               // (B x T, C) the rows whose logits a pass takes, the head's input
    float *logits;             // (B, Vp) the whole vocabulary (device)
    size_t bytes;              // device memory of everything above but the weights and the cache
    void *graph;               // the captured decode step (CUDA graph), or NULL
    int graph_B;               // ... and the batch size it was captured for
    KVGrid *grid;              // tensor parallelism's part (kv_grid.h); NULL on one device
    struct KVModel *draft;     // the server's draft model for speculative decoding (rank 0), or NULL
    long graph_replays;        // decode steps that replayed it (the GPU test asserts some did)
} KVModel;

// Allocates the model's buffers for cfg on one device, the cache (in blocks of block_size
// positions) around serial_layer_ops(), all but the cache's pool. Load the weights with
// kv_model_load, then give the cache its pool (kv_cache_alloc_pool): last, so that a pool sized
// from the free memory is measured after everything else.
void kv_model_alloc(KVModel *m, const GPTConfig *cfg, int B, int T, int maxT, int block_size, bool half_mode);
// The two halves of kv_model_alloc, which kv_model_alloc_grid calls with the grid's parts. First
// the sizes and the parameters this process holds, laid out as `held` (NULL: the whole model).
void kv_model_alloc_params(KVModel *m, const GPTConfig *cfg, const ParamLayout *held, int B, int T, int maxT,
                           int block_size, bool half_mode);
// Then the rest: the cache (but its pool), the layers (inner with the cache
// plugged in), the activations at `shape`'s sizes (what this process holds of a block), the
// head's buffers.
void kv_model_alloc_passes(KVModel *m, LayerOps *inner, const ModelShape *shape, bool half_mode);
// Takes what this process holds of full (device, the layout m->full) and makes the bf16 copy
// when bf16 was asked for.
void kv_model_load(KVModel *m, const float *full);
void kv_model_free(KVModel *m);
// the cache's bytes per block on this process (all layers, keys and values of its heads)
size_t kv_model_bytes_per_block(const KVModel *m);

// One forward pass over T new rows of B sequences: tokens (B, T) and start (B) are host arrays;
// sequence b's rows sit at positions start[b] .. start[b] + T - 1, its cache blocks are
// kv_cache_table(&m->cache, b), and its logits are taken at row last_row[b] (NULL: row T - 1).
// Fills m->logits (B, Vp) on the device, on every rank.
void kv_forward(KVModel *m, const int *tokens, const int *start, int B, int T, const int *last_row);
// One forward pass over R rows that may belong to different sequences and stand at any
// positions: row r is token tokens[r] at position pos[r] of the sequence whose blocks are
// kv_cache_table(&m->cache, r), and sees that sequence's positions 0 .. pos[r]. So one pass can
// hold one sequence's next token and another's prompt (all of it, or a chunk: the rows of a
// chunk see the chunk's earlier rows, whose keys are written first). Logits of rows
// logit_rows[0 .. L) into m->logits (L, Vp). Row r's table is overwritten from r = R on.
void kv_forward_rows(KVModel *m, const int *tokens, const int *pos, int R, const int *logit_rows, int L);
// A decode step (T = 1). With use_graph (CUDA backend, one device) the step's ops are captured as
// a CUDA graph the first time (for this B) and replayed afterwards: the inputs are copied into the
// same device buffers before each replay, which is all that changes between steps.
void kv_decode(KVModel *m, const int *tokens, const int *start, int B, bool use_graph);

// Without a cache: the training model's forward (gpt_forward) over each sequence's whole text
// so far, tokens (B, T) right-padded; logits at row len[b] - 1 into host (B, Vp). The reference
// that the cached path must reproduce (kv_cache: false). It runs the whole model on each rank:
// nocache_alloc takes over full (the whole model's parameters, device).
typedef struct NoCacheModel NoCacheModel;
NoCacheModel *nocache_alloc(const KVModel *m, float *full, int B, int T);
void nocache_forward(NoCacheModel *nc, const KVModel *m, const int *tokens, const int *len, int B,
                     int T, float *logits_host);
void nocache_free(NoCacheModel *nc);

#endif
