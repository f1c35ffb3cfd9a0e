// ring_math.h: ring attention's math, one (query row, head) or (key row, head) at a time, written
// once for both backends (ring_blocks.h's CPU loops and CUDA kernels call it), from the block
// pieces of common/ops/kernels.h: the online softmax forward, and the backward from each row's
// log-sum-exp.
//
// A rank's rows: its two chunks of each of B sequences, chunk `chunk[0]` of every sequence first
// (rows (0 * B + b) * c + t), then chunk `chunk[1]` (rows (1 * B + b) * c + t); a chunk is c tokens,
// chunk i holding the sequence's positions i * c .. i * c + c - 1. Queries come from this rank's
// qkv (N, 3C); keys and values from a block kv (N, 2C) of the same layout (k | v per row), which
// holds another rank's chunks `kv_chunk[0]`, `kv_chunk[1]` of the same sequences. Causality
// between chunks: a query chunk sees an earlier key chunk whole, its own chunk up to its own
// position, and nothing of a later one.
#ifndef RING_MATH_H
#define RING_MATH_H

#include "ops/kernels.h"

typedef struct {
    int B, c, C, NH;         // sequences, tokens per chunk, width and heads of q, k and v
    int chunk[2];            // the query chunks: this rank's
    int kv_chunk[2];         // the key/value block's
} RingBlock;

// keys of the block's half `half` that query (half q_half, position t) sees: all c, t + 1 or none
KERNEL_FN int ring_keys_seen(const RingBlock *r, int q_half, int t, int half) {
    int qi = r->chunk[q_half], kj = r->kv_chunk[half];
    return kj < qi ? r->c : kj == qi ? t + 1 : 0;
}

// row n's half, sequence and position in its chunk
KERNEL_FN void ring_row(const RingBlock *r, int n, int *half, int *b, int *t) {
    *t = n % r->c;
    *b = (n / r->c) % r->B;
    *half = n / (r->c * r->B);
}

// the first row of sequence b's chunk in half `half`
KERNEL_FN size_t ring_chunk_row(const RingBlock *r, int half, int b) { return ((size_t)half * r->B + b) * r->c; }

// Forward, query row n, head h: each of the block's key chunks it sees is one online-softmax step
// (kernels.h), o (unnormalised output, hs floats), run (max and sum) carried from the blocks before;
// scores: c floats of scratch.
KERNEL_FN void ring_query_forward(const RingBlock *r, int n, int h, float *o, OnlineSoftmax *run, float *scores,
                                  const float *qkv, const float *kv) {
    int half, b, t, hs = r->C / r->NH;
    ring_row(r, n, &half, &b, &t);
    const float *q = qkv + (size_t)n * 3 * r->C + h * hs;
    for (int kh = 0; kh < 2; kh++) {
        int nkeys = ring_keys_seen(r, half, t, kh);
        if (!nkeys) continue;
        const float *k = kv + ring_chunk_row(r, kh, b) * 2 * r->C + h * hs, *v = k + r->C;
        float block_max = attention_scores(scores, q, k, 2 * r->C, nkeys, hs, 0, 1);
        float alpha = online_softmax_rescale(run, block_max);
        run->sum += attention_exp(scores, run->max, nkeys, 0, 1);
        attention_block_values(o, alpha, scores, v, 2 * r->C, nkeys, hs, 0, 1);
    }
}

// Backward, query row n, head h: dq += sum over the keys it sees of ds k (ds: c floats of scratch)
KERNEL_FN void ring_query_backward(const RingBlock *r, int n, int h, float *dq, float *ds, const float *qkv,
                                   const float *dout, float lse, float delta, const float *kv) {
    int half, b, t, hs = r->C / r->NH;
    ring_row(r, n, &half, &b, &t);
    const float *q = qkv + (size_t)n * 3 * r->C + h * hs, *d = dout + (size_t)n * r->C + h * hs;
    for (int kh = 0; kh < 2; kh++) {
        int nkeys = ring_keys_seen(r, half, t, kh);
        if (!nkeys) continue;
        const float *k = kv + ring_chunk_row(r, kh, b) * 2 * r->C + h * hs, *v = k + r->C;
        attention_row_dscores(ds, q, d, k, v, 2 * r->C, nkeys, hs, lse, delta, 0, 1);
        attention_add_rows(dq, ds, k, 2 * r->C, nkeys, hs, 0, 1);
    }
}

// Backward, key row n of the block, head h: over this rank's queries that see it,
// dk += sum ds q and dv += sum p dout (dkv: the block's (N, 2C) gradient)
KERNEL_FN void ring_key_backward(const RingBlock *r, int n, int h, float *dkv, const float *qkv, const float *dout,
                                 const float *lse, const float *delta, const float *kv) {
    int half, b, j, hs = r->C / r->NH;
    ring_row(r, n, &half, &b, &j);
    const float *k = kv + (size_t)n * 2 * r->C + h * hs, *v = k + r->C;
    float *dk = dkv + (size_t)n * 2 * r->C + h * hs, *dv = dk + r->C;
    for (int qh = 0; qh < 2; qh++) {
        int qi = r->chunk[qh], kj = r->kv_chunk[half];
        if (kj > qi) continue;
        size_t row0 = ring_chunk_row(r, qh, b);
        for (int t = kj == qi ? j : 0; t < r->c; t++) {
            size_t m = row0 + t;
            const float *q = qkv + m * 3 * r->C + h * hs, *d = dout + m * r->C + h * hs;
            float p = attention_prob(q, k, hs, lse[m * r->NH + h]);
            float s = attention_dscore(p, dot_product(d, v, hs), delta[m * r->NH + h], hs);
            attention_add_row(dk, s, q, hs, 0, 1);
            attention_add_row(dv, p, d, hs, 0, 1);
        }
    }
}

#endif
