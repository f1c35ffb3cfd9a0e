// kv_model.h: GPT-2's forward pass for generation, with a KV cache.
//
// Training runs the whole sequence through the model at once. Generation adds one token at a
// time, and every new token needs attention over all earlier ones: without a cache each step
// recomputes every earlier token's keys and values (a step costs O(length) matmul rows, a whole
// answer O(length^2)); with the cache each step computes one row per sequence and reads the
// earlier keys and values back (a step costs one row of matmuls: the weights, read once).
//
//   prefill: the prompt's T rows in one pass, writing cache rows 0..T-1   (matmuls: compute-bound)
//   decode:  one row per sequence, writing cache row `pos` and reading 0..pos (weight reads: bound
//            by memory bandwidth)
//
// The block is the one every stage runs (common/gpt.c): generation plugs in an attention that
// reads keys and values from the cache (KVLayers below) and runs the same block code for both:
// T new rows per sequence that start at start[b] (0 in the prefill, the sequence's length in a
// decode step).
//
// Tensor parallelism over [x, y, 1]: the other layers are stage 05's (05_tensor_parallel/
// tp_model.h), built from its parallel linear layer. Rank (x, y) holds the heads n_head/x (its qkv rows and
// its share of the KV cache, (B, maxT, C/x) per layer: the cache is split by heads and never
// moves), the MLP's columns 4C/x, the vocabulary Vp/x, and the hidden dimension C/y of each.
// [1, 1, 1] is the serial model: every collective is skipped.
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include <stdbool.h>

#include "../05_tensor_parallel/tp_model.h"
#include "comm.h"
#include "gpt.h"
#include "ops.h"

// Stage 05's layers with attention against the KV cache: the new rows' keys and values join
// the cache of their layer, then their queries attend to all of it.
typedef struct {
    TPLayers tp;                 // first: the block sees a LayerOps *
    float **k_cache, **v_cache;  // [L] of (B, maxT, C/x): this rank's heads
    const int *start;            // (B) device: where each sequence's new rows begin
    int maxT;
} KVLayers;

typedef struct {
    GPTConfig cfg;
    TPModel tp;                // the grid and this rank's share of every tensor (stage 05)
    float *params;             // this rank's share, flat (device)
    bf16 *params16;            // its bf16 copy (precision bf16-mixed), else NULL
    Weights w;                 // named views into params (and params16)
    TPWeightStream stream;     // hands out the blocks in the forward's order (z = 1: no copies)
    KVLayers layers;
    Activations acts;          // one block's activations for B * T rows, reused by every layer:
                               // nothing is kept for a backward
    int B, T, maxT;            // capacity: B sequences, T new rows each, maxT cached positions
    float *stats;              // (2 B T) LayerNorm's row sums (all-reduced over y)
    float *last;               // (B, C/y) each sequence's last prompt row, the head's input
    float *gathered;           // (x, B, Vp/x) every x rank's logits (x > 1)
    float *logits;             // (B, Vp) the whole vocabulary, on every rank
    int *start;                // (B) device
    size_t bytes;              // device memory of everything above but the weights and the cache
    void *graph;               // the captured decode step (CUDA graph), or NULL
    int graph_B;               // ... and the batch size it was captured for
    long graph_replays;        // decode steps that replayed it (the GPU test asserts some did)
} KVModel;

// Allocates the model's buffers for cfg on the grid dims = [x, y, 1] of world (every rank calls
// it; the grid was checked with tp_check_grid). Load the weights with kv_model_load.
void kv_model_alloc(KVModel *m, Comm *world, const GPTConfig *cfg, const int dims[3], int B, int T,
                    int maxT, bool half_mode);
// Takes this rank's share of full (device, the serial model's layout: m->tp.full) and makes the
// bf16 copy when bf16 was asked for.
void kv_model_load(KVModel *m, const float *full);
void kv_model_free(KVModel *m);

// One forward pass over T new rows of B sequences: tokens (B, T) and start (B) are host arrays;
// sequence b's rows sit at positions start[b] .. start[b] + T - 1 and its logits are taken at
// row last_row[b] (NULL: row T - 1). Fills m->logits (B, Vp) on the device, on every rank.
void kv_forward(KVModel *m, const int *tokens, const int *start, int B, int T, const int *last_row);
// The prefill of one sequence, T rows from position 0, into cache slot `slot` of the B: the
// other slots are untouched (the server admits each request into whichever slot is free). Its
// logits are row 0 of m->logits.
void kv_prefill_slot(KVModel *m, int slot, const int *tokens, int T);
// A decode step (T = 1). With use_graph (CUDA backend, one rank) the step's ops are captured as a
// CUDA graph the first time (for this B) and replayed afterwards: the inputs are copied into the
// same device buffers before each replay, which is all that changes between steps.
void kv_decode(KVModel *m, const int *tokens, const int *start, int B, bool use_graph);

// Without a cache: the training model's forward (gpt_forward) over each sequence's whole text
// so far, tokens (B, T) right-padded; logits at row len[b] - 1 into host (B, Vp). The reference
// that the cached path must reproduce (kv_cache: false). It runs the whole model on each rank:
// nocache_alloc takes over full (the serial model's parameters, device).
typedef struct NoCacheModel NoCacheModel;
NoCacheModel *nocache_alloc(const KVModel *m, float *full, int B, int T);
void nocache_forward(NoCacheModel *nc, const KVModel *m, const int *tokens, const int *len, int B,
                     int T, float *logits_host);
void nocache_free(NoCacheModel *nc);

#endif
