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
// The same block code does both: T new rows per sequence that start at start[b] (0 in the
// prefill, the sequence's length in a decode step).
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include <stdbool.h>

#include "gpt.h"
#include "ops.h"

typedef struct {
    GPTConfig cfg;
    ParamLayout layout;
    float *params;             // the flat parameter buffer (device)
    bf16 *params16;            // its bf16 copy (precision bf16-mixed), else NULL
    Weights w;
    int B, T, maxT;            // capacity: B sequences, T new rows each, maxT cached positions
    float **k_cache, **v_cache;  // [L] of (B, maxT, C)
    // scratch for one forward of N = B * T rows
    float *x;                  // (N, C) the residual stream
    float *ln, *mean, *rstd;   // (N, C), (N), (N) layernorm output; also the projections' output
    float *qkv, *atty, *fch;   // (N, 3C), (N, C), (N, 4C)
    float *scores;             // (B, NH, T, maxT) attention scratch
    bf16 *inp16;               // (N, 4C) bf16 copy of a matmul input (bf16 mode)
    float *last;               // (B, C) each sequence's last row, the head's input
    float *logits;             // (B, Vp)
    int *tokens, *start;       // (B, T) and (B), device
    size_t bytes;              // device memory of everything above but the weights
    void *graph;               // the captured decode step (CUDA graph), or NULL
    int graph_B;               // ... and the batch size it was captured for
} KVModel;

// Allocates the model's buffers for cfg (weights zero: fill m->params, then call kv_model_ready).
void kv_model_alloc(KVModel *m, const GPTConfig *cfg, int B, int T, int maxT, bool bf16);
// Makes the bf16 copy of the weights when bf16 was asked for (after params are filled).
void kv_model_ready(KVModel *m);
void kv_model_free(KVModel *m);

// One forward pass over T new rows of B sequences: tokens (B, T) and start (B) are host arrays;
// sequence b's rows sit at positions start[b] .. start[b] + T - 1 and its logits are taken at
// row last_row[b] (NULL: row T - 1). Fills m->logits (B, Vp) on the device.
void kv_forward(KVModel *m, const int *tokens, const int *start, int B, int T, const int *last_row);
// A decode step (T = 1). With use_graph (CUDA backend only) the step's ops are captured as a CUDA
// graph the first time (for this B) and replayed afterwards: the inputs are copied into the same
// device buffers before each replay, which is all that changes between steps.
void kv_decode(KVModel *m, const int *tokens, const int *start, int B, bool use_graph);

// Without a cache: the training model's forward (gpt_forward) over each sequence's whole text
// so far, tokens (B, T) right-padded; logits at row len[b] - 1 into host (B, Vp). The reference
// that the cached path must reproduce (kv_cache: false).
typedef struct NoCacheModel NoCacheModel;
NoCacheModel *nocache_alloc(const KVModel *m, int B, int T);
void nocache_forward(NoCacheModel *nc, const KVModel *m, const int *tokens, const int *len, int B,
                     int T, float *logits_host);
void nocache_free(NoCacheModel *nc);

#endif
