// kernels.h: the math of every op, one element or one row at a time, written once.
//
// Both backends compile this file. ops_cpu.c includes it and lets OpenMP threads walk the rows;
// ops_cuda.cu includes it and lets CUDA threads walk the rows. So the code the CPU tests check is
// the code the GPU runs, and a learner reads each formula in exactly one place.
//
// How one row is shared between several workers. A reduction over a row (a sum, a max) is split
// into three steps:
//   1. each of `nlanes` workers folds its own elements i = lane, lane + nlanes, ... into a
//      partial result (the row_partial_* functions below);
//   2. the partials are combined: on the CPU one thread owns a whole row (lane 0 of 1), so there
//      is nothing to combine; on the GPU a warp shuffle or a shared-memory tree does it;
//   3. every lane uses the combined value for its own elements.
// Only step 2 differs between the backends, so it is the only step not written here. Loops run
// to bounds that depend on sizes (and, for attention, on the query position), never on data, so
// every GPU thread of a block reaches each barrier the caller places between the steps.
//
// What is not here: memory allocation, the matmuls (oneDNN / cuBLAS do them), the thread mapping.
#ifndef KERNELS_H
#define KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "base/numbers.h"  // KERNEL_FN, the 16-bit formats, the random numbers
#include "ops.h"      // Rope

// ----------------------------------------------------------------------------------------------
// small helpers

// Dot product of two length-n vectors (an attention head, n = 64 for GPT-2). Eight running sums
// instead of one: a single sum waits for each add to finish before starting the next (about
// four cycles each), eight independent ones keep the floating-point unit busy, and the compiler
// can put the eight into one vector register.
// Its last steps, which the CPU's vector loops over cache rows (ops_cpu_fast.c) share: the columns from
// i on (the tail, when n is not a multiple of 8) into sum 0, then the eight sums in a tree.
KERNEL_FN float dot_product_finish(float acc[8], const float *a, const float *b, int i, int n) {
    for (; i < n; i++) acc[0] += a[i] * b[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

KERNEL_FN float dot_product(const float *a, const float *b, int n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    return dot_product_finish(acc, a, b, i, n);
}

// expf(x) in arithmetic a compiler vectorizes (plain operations and selects, no call): the CPU's
// loops over many exponentials (GELU's, attention's softmax rows) take it, where a call to the C
// library's expf per element keeps a loop scalar (GELU at GPT-2 124M's bench shape: 9.4M
// exponentials a step, several times faster this way in vectors). Cephes' expf: x = n ln2 + r with
// n = round(x / ln2) (adding and subtracting 1.5 2^23 rounds a float to an integer; floorf does not
// vectorize without -ffast-math), ln2 in two parts whose first times n is exact, e^r by a
// degree-6 polynomial on |r| <= ln2 / 2, 2^n (as 2^(n-1) 2, so that n = 128 fits the exponent
// bits) put into the exponent. Within 1 ulp of glibc's expf on [-86, 88.7] (test_ops sweeps floats
// there), the same bits on 99% of them; +inf above 88.72 (expf overflows there too) and 0
// below -86.6 (expf's results there are below 2.5e-38).
KERNEL_FN float expf_vectorizable(float x) {
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float er = p * r * r + r + 1.0f;
    float n_fits = n < -125.0f ? -125.0f : n > 128.0f ? 128.0f : n;  // fminf, fmaxf: no vectors either
    float half_two_n = float_from_bits((uint32_t)(int)(n_fits + 126.0f) << 23);
    float e = er * half_two_n * 2.0f;
    return x > 88.72283f ? INFINITY : x < -86.6f ? 0.0f : e;
}

// step 1 of a row reduction (see the top of the file): this lane's share of sum(x)
KERNEL_FN float row_partial_sum(const float *x, int n, int lane, int nlanes) {
    float s = 0.0f;
    for (int i = lane; i < n; i += nlanes) s += x[i];
    return s;
}

// A row's sums for one CPU core: 16 lanes (lane j adds elements j, j + 16, ... in order: the lanes
// of the row functions here with nlanes 16), then the lanes in order. A 16-wide vector register
// adds them in a sixteenth of the dependent steps of one lane's sum, which the compiler may not
// regroup itself; a fixed order whatever the threads.
#define ROW_LANES 16

KERNEL_FN float lanes_total(const float lanes[ROW_LANES]) {
    float s = 0.0f;
    for (int j = 0; j < ROW_LANES; j++) s += lanes[j];
    return s;
}

// The loop of every such sum: lanes[j] += TERM for the elements k = j, j + 16, ... in order,
// ROW_LANES at a time and then the tail; TERM names its element k. A macro because the sums
// differ only in their term (C has no closures). SIMD_LOOP: inlined into some callers, GCC
// otherwise leaves the 16 lanes as 16 scalar chains, or vectorizes the outer loop instead.
#define ADD_16_LANES(lanes, n, TERM)                                                               \
    do {                                                                                           \
        int block_ = 0;                                                                            \
        for (; block_ + ROW_LANES <= (n); block_ += ROW_LANES)                                     \
            SIMD_LOOP for (int j_ = 0; j_ < ROW_LANES; j_++) {                                     \
                int k = block_ + j_;                                                               \
                (lanes)[j_] += (TERM);                                                             \
            }                                                                                      \
        for (int j_ = 0; block_ + j_ < (n); j_++) {                                                \
            int k = block_ + j_;                                                                   \
            (lanes)[j_] += (TERM);                                                                 \
        }                                                                                          \
    } while (0)

KERNEL_FN float sum_16_lanes(const float *x, int n) {
    float lanes[ROW_LANES] = {0};
    ADD_16_LANES(lanes, n, x[k]);
    return lanes_total(lanes);
}

KERNEL_FN float dot_16_lanes(const float *x, const float *y, int n) {
    float lanes[ROW_LANES] = {0};
    ADD_16_LANES(lanes, n, x[k] * y[k]);
    return lanes_total(lanes);
}

// The max over 16 lanes: the same value as one running max (a max is exact; the lanes ignore a
// NaN as fmaxf does), without its chain of one dependent compare an element
KERNEL_FN float max_16_lanes(const float *x, int n) {
    float lanes[ROW_LANES], max = -INFINITY;
    for (int j = 0; j < ROW_LANES; j++) lanes[j] = -INFINITY;
    int i = 0;
    for (; i + ROW_LANES <= n; i += ROW_LANES)
        SIMD_LOOP
        for (int j = 0; j < ROW_LANES; j++) lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
    for (; i < n; i++) max = x[i] > max ? x[i] : max;
    for (int j = 0; j < ROW_LANES; j++) max = lanes[j] > max ? lanes[j] : max;
    return max;
}

// The sum of exp(x - max) over 16 lanes, each from expf_vectorizable (within 1 ulp of expf's):
// the CPU's softmax denominator over a vocabulary's row, in vector instructions (with expf, a call
// a logit, and one running sum, a row of GPT-2's 50257 took a fifth of a millisecond)
KERNEL_FN float sumexp_16_lanes(const float *x, float max, int n) {
    float lanes[ROW_LANES] = {0};
    ADD_16_LANES(lanes, n, expf_vectorizable(x[k] - max));
    return lanes_total(lanes);
}

// The same sum, the exponentials of x scale - max written over x as they are added: a softmax's
// numerators and denominator in one pass (scale 1: x's own exponentials, as sumexp_16_lanes's)
KERNEL_FN float exp_in_place_16_lanes(float *x, float scale, float max, int n) {
    float lanes[ROW_LANES] = {0};
    ADD_16_LANES(lanes, n, x[k] = expf_vectorizable(x[k] * scale - max));
    return lanes_total(lanes);
}

// this lane's share of max(x); -INFINITY is the identity of max, so an idle lane is harmless
KERNEL_FN float row_partial_max(const float *x, int n, int lane, int nlanes) {
    float m = -INFINITY;
    for (int i = lane; i < n; i += nlanes) m = fmaxf(m, x[i]);
    return m;
}

// ----------------------------------------------------------------------------------------------
// embedding: out[b,t,:] = wte[token,:] + wpe[position,:], for a rank that holds the vocabulary
// rows [v_lo, v_lo + v_count) of wte (the whole vocabulary on one rank: v_lo 0, v_count Vp). A
// token outside the shard embeds to 0 here: another rank adds it, so a sum over the shards is the
// whole embedding. wpe may be NULL (nothing added: another rank adds the positions).

KERNEL_FN int vocab_shard_index(int token, int v_lo, int v_count) {
    int local = token - v_lo;
    return local >= 0 && local < v_count ? local : -1;
}

KERNEL_FN float embedding_value(const float *wte, const float *wpe, int token, int pos, int c, int C,
                                int v_lo, int v_count) {
    int local = vocab_shard_index(token, v_lo, v_count);
    float e = local >= 0 ? wte[(size_t)local * C + c] : 0.0f;
    return wpe ? e + wpe[(size_t)pos * C + c] : e;
}

// Backward for columns [c0, c1) of every row. The same token can appear many times in a batch,
// so two rows may add into the same dwte row: whoever owns column c walks all BT rows itself, in
// order. No two workers ever touch the same element (no atomics), and the sum is deterministic.
// The CPU gives each of its few threads a block of columns.
KERNEL_FN void embedding_backward_columns(float *dwte, float *dwpe, const float *dout,
                                          const int *tokens, int BT, int T, int C, int v_lo,
                                          int v_count, int c0, int c1) {
    for (int bt = 0; bt < BT; bt++) {
        const float *g = dout + (size_t)bt * C;
        int local = vocab_shard_index(tokens[bt], v_lo, v_count);
        if (local >= 0)
            for (int c = c0; c < c1; c++) dwte[(size_t)local * C + c] += g[c];
        if (dwpe)
            for (int c = c0; c < c1; c++) dwpe[(size_t)(bt % T) * C + c] += g[c];
    }
}

// The same sums with a worker per element (the GPU's way: C workers alone leave it nearly idle).
// dwpe[t][c] adds the B rows at position t, in sequence order; dwte[token][c] adds the rows that
// hold the token, in row order, found by a stable sort of the rows by sort key (the local token;
// tokens outside the shard sort last, as v_count, and are skipped). Each element adds its rows
// one by one into itself in the order embedding_backward_columns does: the same bits.
KERNEL_FN void embedding_position_grad(float *dwpe, const float *dout, int B, int T, int C, int t, int c) {
    float acc = dwpe[(size_t)t * C + c];
    for (int b = 0; b < B; b++) acc += dout[((size_t)b * T + t) * C + c];
    dwpe[(size_t)t * C + c] = acc;
}

KERNEL_FN int embedding_sort_key(int token, int v_lo, int v_count) {
    int local = vocab_shard_index(token, v_lo, v_count);
    return local >= 0 ? local : v_count;
}

// the number of rows from sorted position i on with the same key, when i starts such a run in
// the shard; 0 otherwise (the run is its first position's to sum)
KERNEL_FN int embedding_token_run(const int *sorted_keys, int BT, int v_count, int i) {
    int key = sorted_keys[i];
    if (key >= v_count || (i > 0 && sorted_keys[i - 1] == key)) return 0;
    int n = 1;
    while (i + n < BT && sorted_keys[i + n] == key) n++;
    return n;
}

// dwte_row[c] += the n rows listed in rows (increasing)
KERNEL_FN void embedding_token_grad(float *dwte_row, const float *dout, const int *rows, int n, int C, int c) {
    float acc = dwte_row[c];
    for (int k = 0; k < n; k++) acc += dout[(size_t)rows[k] * C + c];
    dwte_row[c] = acc;
}

// ----------------------------------------------------------------------------------------------
// layernorm over one row of C: out = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps)

#define LAYERNORM_EPS 1e-5f

// The variance is computed in a second pass over (x - mean)^2 rather than as E[x^2] - mean^2:
// when |mean| is large against the spread, the one-pass formula subtracts two nearly equal
// numbers and can lose every significant digit (or even go negative).
KERNEL_FN float row_partial_sqdev(const float *x, float mean, int n, int lane, int nlanes) {
    float s = 0.0f;
    for (int i = lane; i < n; i += nlanes) {
        float d = x[i] - mean;
        s += d * d;
    }
    return s;
}

// row_partial_sqdev's sum over 16 lanes (sum_16_lanes)
KERNEL_FN float sqdev_16_lanes(const float *x, float mean, int n) {
    float lanes[ROW_LANES] = {0};
    ADD_16_LANES(lanes, n, (x[k] - mean) * (x[k] - mean));
    return lanes_total(lanes);
}

KERNEL_FN float layernorm_rstd(float sum_sqdev, int C) {
    return 1.0f / sqrtf(sum_sqdev / (float)C + LAYERNORM_EPS);
}

KERNEL_FN float layernorm_value(float x, float mean, float rstd, float w, float b) {
    return (x - mean) * rstd * w + b;
}

// Backward. With norm = (x - mean) * rstd and dnorm = w * dout, the gradient of one element is
//   dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
// because mean and rstd depend on every x of the row. The two row means are the reduction.
KERNEL_FN void layernorm_backward_partials(float *sum_dnorm, float *sum_dnorm_norm,
                                           const float *dout, const float *x, const float *w,
                                           float mean, float rstd, int C, int lane, int nlanes) {
    float a = 0.0f, b = 0.0f;
    for (int i = lane; i < C; i += nlanes) {
        float norm = (x[i] - mean) * rstd;
        float dnorm = w[i] * dout[i];
        a += dnorm;
        b += dnorm * norm;
    }
    *sum_dnorm = a;
    *sum_dnorm_norm = b;
}

// layernorm_backward_partials' two sums over 16 lanes (sum_16_lanes). Two sums with a row's
// scalars in them: without SIMD_LOOP, GCC vectorizes the outer loop instead, in-order scalar adds
// among thousands of shuffles, and LayerNorm's backward took several times its forward.
KERNEL_FN void layernorm_backward_sums_16_lanes(float *sum_dnorm, float *sum_dnorm_norm, const float *dout,
                                                const float *x, const float *w, float mean, float rstd, int C) {
    float a[ROW_LANES] = {0}, b[ROW_LANES] = {0};
    int i = 0;
    for (; i + ROW_LANES <= C; i += ROW_LANES)
        SIMD_LOOP
        for (int j = 0; j < ROW_LANES; j++) {
            float dnorm = w[i + j] * dout[i + j];
            a[j] += dnorm;
            b[j] += dnorm * ((x[i + j] - mean) * rstd);
        }
    for (int j = 0; i + j < C; j++) {  // the tail, fewer than ROW_LANES, lane j
        float dnorm = w[i + j] * dout[i + j];
        a[j] += dnorm;
        b[j] += dnorm * ((x[i + j] - mean) * rstd);
    }
    *sum_dnorm = lanes_total(a);
    *sum_dnorm_norm = lanes_total(b);
}

KERNEL_FN float layernorm_dinp(float dout, float x, float w, float mean, float rstd,
                               float mean_dnorm, float mean_dnorm_norm) {
    float norm = (x - mean) * rstd;
    return rstd * (w * dout - mean_dnorm - norm * mean_dnorm_norm);
}

// Column sums a block of COLUMN_BLOCK columns at a time, each block's sums kept in locals across
// the rows: summed through memory, every row's add waits on the store of the row before (a CPU
// keeps the locals of a block in one vector register). The same additions in the same order: row 0
// first. A narrower range (a GPU thread's one column) runs the remainder loop alone. Where a row
// brings scalars of its own (LayerNorm's mean and rstd), GCC unrolls the block into 16 scalar
// sums unless told the block is one vector (SIMD_LOOP).
#define COLUMN_BLOCK 16

// dweight += dout * norm and dbias += dout, summed over all N rows, for columns [c0, c1): as in
// the encoder, the owner of a column walks every row, so there are no races and the order of the
// sum is fixed.
KERNEL_FN void layernorm_param_grad_columns(float *dweight, float *dbias, const float *dout,
                                            const float *inp, const float *mean,
                                            const float *rstd, int N, int C, int c0, int c1) {
    int c = c0;
    for (; c + COLUMN_BLOCK <= c1; c += COLUMN_BLOCK) {
        float dw[COLUMN_BLOCK], db[COLUMN_BLOCK];
        for (int j = 0; j < COLUMN_BLOCK; j++) dw[j] = dweight[c + j], db[j] = dbias[c + j];
        for (int n = 0; n < N; n++) {
            const float *g = dout + (size_t)n * C + c, *x = inp + (size_t)n * C + c;
            float row_mean = mean[n], row_rstd = rstd[n];
            SIMD_LOOP
            for (int j = 0; j < COLUMN_BLOCK; j++) {
                dw[j] += g[j] * (x[j] - row_mean) * row_rstd;
                db[j] += g[j];
            }
        }
        for (int j = 0; j < COLUMN_BLOCK; j++) dweight[c + j] = dw[j], dbias[c + j] = db[j];
    }
    for (; c < c1; c++) {
        float dw = dweight[c], db = dbias[c];
        for (int n = 0; n < N; n++) {
            float g = dout[(size_t)n * C + c];
            dw += g * (inp[(size_t)n * C + c] - mean[n]) * rstd[n];
            db += g;
        }
        dweight[c] = dw, dbias[c] = db;
    }
}

// matmul's dbias (OC) += column sums of dout (N, OC), for columns [c0, c1), same pattern
KERNEL_FN void column_sums(float *dbias, const float *dout, int N, int OC, int c0, int c1) {
    int c = c0;
    for (; c + COLUMN_BLOCK <= c1; c += COLUMN_BLOCK) {
        float sums[COLUMN_BLOCK];
        for (int j = 0; j < COLUMN_BLOCK; j++) sums[j] = dbias[c + j];
        for (int n = 0; n < N; n++)
            for (int j = 0; j < COLUMN_BLOCK; j++) sums[j] += dout[(size_t)n * OC + c + j];
        for (int j = 0; j < COLUMN_BLOCK; j++) dbias[c + j] = sums[j];
    }
    for (; c < c1; c++) {
        float sum = dbias[c];
        for (int n = 0; n < N; n++) sum += dout[(size_t)n * OC + c];
        dbias[c] = sum;
    }
}

// ----------------------------------------------------------------------------------------------
// mixture of experts: moving token rows to the rows their experts run on and back. Token n went
// to k experts; slot[j] is the packed row of its j-th (-1: dropped, over capacity). The packed
// rows are distinct, so each token row is written, and read back, by one worker alone.

// packed rows of token n = its input row x (columns lane, lane + nlanes, ...)
KERNEL_FN void moe_dispatch_row(float *packed, const float *x, const int *slot, int k, int C, int lane, int nlanes) {
    for (int j = 0; j < k; j++) {
        if (slot[j] < 0) continue;
        float *row = packed + (size_t)slot[j] * C;
        for (int c = lane; c < C; c += nlanes) row[c] = x[c];
    }
}

// dx += the gradients of token n's packed rows
KERNEL_FN void moe_dispatch_backward_row(float *dx, const float *dpacked, const int *slot, int k, int C,
                                         int lane, int nlanes) {
    for (int c = lane; c < C; c += nlanes) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++)
            if (slot[j] >= 0) acc += dpacked[(size_t)slot[j] * C + c];
        dx[c] += acc;
    }
}

// out row of token n = sum over its kept experts of weight[j] x that expert's output row
KERNEL_FN void moe_combine_row(float *out, const float *y, const int *slot, const float *weight, int k, int C,
                               int lane, int nlanes) {
    for (int c = lane; c < C; c += nlanes) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++)
            if (slot[j] >= 0) acc += weight[j] * y[(size_t)slot[j] * C + c];
        out[c] = acc;
    }
}

// the expert rows' gradient: dy row slot[j] = weight[j] x dout row n
KERNEL_FN void moe_combine_backward_row(float *dy, const float *dout, const int *slot, const float *weight, int k,
                                        int C, int lane, int nlanes) {
    for (int j = 0; j < k; j++) {
        if (slot[j] < 0) continue;
        float *row = dy + (size_t)slot[j] * C;
        for (int c = lane; c < C; c += nlanes) row[c] = weight[j] * dout[c];
    }
}

// this lane's part of the weight's gradient: dout row . expert output row (0 when dropped)
KERNEL_FN float moe_weight_grad_partial(const float *dout, const float *y, int slot, int C, int lane, int nlanes) {
    float acc = 0.0f;
    if (slot < 0) return acc;
    for (int c = lane; c < C; c += nlanes) acc += dout[c] * y[(size_t)slot * C + c];
    return acc;
}

// ----------------------------------------------------------------------------------------------
// GELU, GPT-2's tanh approximation: gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
//
// Since 0.5 (1 + tanh(a)) = sigmoid(2a) = 1 / (1 + exp(-2a)), this is x * sigmoid(z) with z = 2a,
// and we compute it that way on purpose: 1 + tanh(a) for negative a subtracts two numbers close
// to 1 and loses digits, the sigmoid form loses none. It also costs one expf instead of one
// tanhf (several times cheaper on the CPU). For very negative z, expf(-z) overflows to +inf and
// x / inf = 0 is exactly the right limit; no branch is needed (a data-dependent branch here
// mispredicts half the time on real activations, and doubled the CPU time when we tried one).

#define GELU_K 0.044715f
#define GELU_2A 1.5957691216057308f  // 2 * sqrt(2 / pi)

KERNEL_FN float gelu_z(float x) { return GELU_2A * (x + GELU_K * x * x * x); }

// gelu(x) and gelu'(x) from e = expf(-z(x)): apart, so that the CPU can take e from
// expf_vectorizable (ops_cpu.c)
KERNEL_FN float gelu_value_of_exp(float x, float e) { return x / (1.0f + e); }

// d/dx [x sigmoid(z(x))] = sigmoid(z) + x sigmoid(z) (1 - sigmoid(z)) z'(x)
KERNEL_FN float gelu_grad_of_exp(float x, float e) {
    float sig = 1.0f / (1.0f + e);
    float dz = GELU_2A * (1.0f + 3.0f * GELU_K * x * x);
    return sig + x * sig * (1.0f - sig) * dz;
}

KERNEL_FN float gelu_value(float x) { return gelu_value_of_exp(x, expf(-gelu_z(x))); }
KERNEL_FN float gelu_grad(float x) { return gelu_grad_of_exp(x, expf(-gelu_z(x))); }

// ----------------------------------------------------------------------------------------------
// Rotary position embedding (phi-1_5, Llama; Hugging Face's rotate_half layout): within one head,
// dims i and i + rot_dim/2 (i < rot_dim/2) turn together by the angle pos * inv_freq(i), with
// inv_freq(i) = theta^(-2i/rot_dim); the dims past rot_dim pass through. The angle is computed in
// f32 in the order transformers does (inverse frequency first, then times the position), so both
// give the same rounding. direction -1 turns back by the same angle: a rotation's transpose is its
// inverse, so that is the backward of direction +1.
//
// Llama 3 stretches the long wavelengths to reach a longer context than it was trained on
// (rope_scaling {"rope_type": "llama3"}): wavelengths 2 pi / inv_freq longer than
// original_max_positions / low_freq_factor turn `factor` times slower, those shorter than
// original_max_positions / high_freq_factor as before, and the ones between blend the two
// (transformers' _compute_llama3_parameters, in f32 as there).
KERNEL_FN float rope_inv_freq(int i, int rot_dim, Rope rope) {
    float inv_freq = 1.0f / powf(rope.theta, (float)(2 * i) / (float)rot_dim);
    if (rope.factor == 0.0f) return inv_freq;
    float wavelen = 2.0f * 3.14159265358979f / inv_freq;
    float low_freq_wavelen = rope.original_max_positions / rope.low_freq_factor;
    float high_freq_wavelen = rope.original_max_positions / rope.high_freq_factor;
    if (wavelen > low_freq_wavelen) return inv_freq / rope.factor;
    if (wavelen < high_freq_wavelen) return inv_freq;
    float smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) /
                   (rope.high_freq_factor - rope.low_freq_factor);
    return (1.0f - smooth) * inv_freq / rope.factor + smooth * inv_freq;
}

KERNEL_FN void rotary_pair(float *head, int i, int rot_dim, int pos, Rope rope, float direction) {
    int half = rot_dim / 2;
    float angle = (float)pos * rope_inv_freq(i, rot_dim, rope);
    float c = cosf(angle), s = direction * sinf(angle);
    float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
}

// pair p of the rotary work over qkv (B*T rows of 3 C_attn): row, query or key, head, index
KERNEL_FN void rotary_qkv_pair(float *qkv, const int *start, long p, int T, int C_attn, int NH,
                               int rot_dim, Rope rope, float direction) {
    int half = rot_dim / 2, hs = C_attn / NH;
    int i = (int)(p % half), h = (int)(p / half % NH), qk = (int)(p / half / NH % 2);
    long bt = p / half / NH / 2;
    int pos = (start ? start[bt / T] : 0) + (int)(bt % T);
    float *head = qkv + bt * 3 * C_attn + (size_t)qk * C_attn + (size_t)h * hs;
    rotary_pair(head, i, rot_dim, pos, rope, direction);
}

// ----------------------------------------------------------------------------------------------
// Grouped-query attention (Llama): NKV key/value heads, each shared by a group of NH / NKV query
// heads. A projection row holds q (NH heads) | k (NKV heads) | v (NKV heads); the attention runs
// on rows of q | k | v with every key and value head repeated for each query head of its group
// (transformers' repeat_kv), and backward sums a group's gradients back into its one head.

// element c of an expanded (3 C_attn) row, from its projection row (C_attn + 2 NKV hs)
KERNEL_FN float gqa_expanded_value(const float *proj, int c, int C_attn, int NH, int NKV) {
    if (c < C_attn) return proj[c];
    int hs = C_attn / NH, kv = (c - C_attn) / C_attn, h = (c - C_attn) % C_attn / hs, i = c % hs;
    return proj[C_attn + kv * NKV * hs + h / (NH / NKV) * hs + i];
}

// the first column of query head h's key/value head in a row of the NKV heads' keys (or values):
// the KV cache keeps each group's one head, not the expanded row's copies
KERNEL_FN int gqa_kv_column(int h, int hs, int NH, int NKV) { return h / (NH / NKV) * hs; }

// column c of a row of the NKV heads' keys (or values) in the expanded row's keys (or values):
// the copy its group's first query head holds
KERNEL_FN int gqa_expanded_column(int c, int hs, int NH, int NKV) { return c / hs * (NH / NKV) * hs + c % hs; }

// element c of a projection row's gradient: the sum over the group's heads of the expanded row's
KERNEL_FN float gqa_reduced_grad(const float *dexp, int c, int C_attn, int NH, int NKV) {
    if (c < C_attn) return dexp[c];
    int hs = C_attn / NH, Ckv = NKV * hs, group = NH / NKV;
    int kv = (c - C_attn) / Ckv, j = (c - C_attn) % Ckv / hs, i = c % hs;
    float sum = 0.0f;
    for (int h = j * group; h < (j + 1) * group; h++) sum += dexp[C_attn + kv * C_attn + h * hs + i];
    return sum;
}

// ----------------------------------------------------------------------------------------------
// RMSNorm (Llama) over one row of C: out = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps). No
// mean is taken out and there is no bias. Backward, with norm = x * rstd and dnorm = w * dout:
//   dx = rstd * (dnorm - norm * mean(dnorm * norm))
// (LayerNorm's formula without its mean(dnorm) term, which came from subtracting the mean).

KERNEL_FN float rmsnorm_rstd(float sum_sq, int C, float eps) { return 1.0f / sqrtf(sum_sq / (float)C + eps); }

// this lane's share of sum(dnorm * norm) over the row
KERNEL_FN float rmsnorm_backward_partial(const float *dout, const float *x, const float *w, float rstd, int C,
                                         int lane, int nlanes) {
    float s = 0.0f;
    for (int i = lane; i < C; i += nlanes) s += w[i] * dout[i] * x[i] * rstd;
    return s;
}

// rmsnorm_backward_partial's sum over 16 lanes (sum_16_lanes)
KERNEL_FN float rmsnorm_backward_sum_16_lanes(const float *dout, const float *x, const float *w, float rstd, int C) {
    float lanes[ROW_LANES] = {0};
    ADD_16_LANES(lanes, C, w[k] * dout[k] * x[k] * rstd);
    return lanes_total(lanes);
}

KERNEL_FN float rmsnorm_dinp(float dout, float x, float w, float rstd, float mean_dnorm_norm) {
    return rstd * (w * dout - x * rstd * mean_dnorm_norm);
}

// dweight += dout * norm summed over all N rows, for columns [c0, c1) (a column's owner walks
// every row, as for LayerNorm)
KERNEL_FN void rmsnorm_param_grad_columns(float *dweight, const float *dout, const float *inp, const float *rstd,
                                          int N, int C, int c0, int c1) {
    for (int n = 0; n < N; n++) {
        const float *g = dout + (size_t)n * C, *x = inp + (size_t)n * C;
        for (int c = c0; c < c1; c++) dweight[c] += g[c] * x[c] * rstd[n];
    }
}

// ----------------------------------------------------------------------------------------------
// SwiGLU (Llama's MLP): h = silu(gate) * up, silu(x) = x sigmoid(x) = x / (1 + exp(-x)); a row of
// the MLP's first projection holds gate (F) | up (F).
//   d gate = dh * up * silu'(gate), silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)));  d up = dh * silu(gate)

KERNEL_FN float silu_value(float x) { return x / (1.0f + expf(-x)); }

KERNEL_FN float silu_grad(float x) {
    float sig = 1.0f / (1.0f + expf(-x));
    return sig * (1.0f + x * (1.0f - sig));
}

// element i = (n, f) of h (N, F) from gate_up (N, 2F)
KERNEL_FN float swiglu_value(const float *gate_up, size_t i, int F) {
    size_t n = i / F, f = i % F;
    const float *row = gate_up + n * 2 * F;
    return silu_value(row[f]) * row[F + f];
}

// dgate_up (N, 2F) = the gradient of element i = (n, f) of h, into its gate and its up (written)
KERNEL_FN void swiglu_grad(float *dgate_up, const float *gate_up, const float *dh, size_t i, int F) {
    size_t n = i / F, f = i % F;
    const float *row = gate_up + n * 2 * F;
    float *drow = dgate_up + n * 2 * F;
    drow[f] = dh[i] * row[F + f] * silu_grad(row[f]);
    drow[F + f] = dh[i] * silu_value(row[f]);
}

// ----------------------------------------------------------------------------------------------
// softmax + cross-entropy over one row of logits (only its first V columns are real vocabulary).
// loss = -log softmax(x)[target] = log(sum_i exp(x_i - max)) + max - x_target.
// Subtracting the row max first keeps every exp in (0, 1]: exp(x) alone overflows a float for
// x > 88, which untrained logits can reach.

// step 1 of the sum of exponentials; the max is the combined max of step 2
KERNEL_FN float row_partial_sumexp(const float *x, float max, int n, int lane, int nlanes) {
    float s = 0.0f;
    for (int i = lane; i < n; i += nlanes) s += expf(x[i] - max);
    return s;
}

KERNEL_FN float softmax_exp(float x, float max) { return expf(x - max); }

KERNEL_FN float cross_entropy_loss(float logit_target, float max, float sumexp) {
    return logf(sumexp) + max - logit_target;
}

// d loss / d logit_i = softmax_i - [i == target], times the upstream gradient dloss (1 / the
// number of target tokens, for a mean). p is softmax_i = exp(x_i - max) / sumexp.
KERNEL_FN float cross_entropy_dlogit(float p, int is_target, float dloss) {
    return dloss * (p - (is_target ? 1.0f : 0.0f));
}

// A gradient's value rounded to 16 bits (cast_gradient_to_16, and the cross-entropy's copy of the
// logits' gradient), counted for ops_half_underflow: if nonzero, and if it rounded to zero.
KERNEL_FN half16 gradient_to_16(float x, int fp16, unsigned long long *nonzero, unsigned long long *flushed) {
    half16 h = half_from_float(x, fp16);
    *nonzero += x != 0.0f;
    *flushed += x != 0.0f && (h & 0x7FFFu) == 0;
    return h;
}

// ----------------------------------------------------------------------------------------------
// causal self-attention on the CPU: its matmul-shaped parts (scores = Q K^T, out = P V, and the
// four products of backward) are oneDNN matmuls over all of a sequence's heads at once
// (ops_cpu.c), and between them each (sequence, head, query position t) row of the (T, T)
// square goes through the functions below: a thread owns a row, which stays in its cache.
// The CUDA backend takes the keys a block at a time instead (further below).
// qkv holds one sequence's (T, 3C) block: row t holds q | k | v, each C = NH * hs wide, and
// head h owns columns h*hs .. h*hs + hs - 1 of each. Query t may look at keys t2 = 0..t only.

// scores are q . k / sqrt(hs): keeps their variance near 1 whatever hs is
KERNEL_FN float attention_scale(int hs) { return 1.0f / sqrtf((float)hs); }

// Forward of one query row t: att holds its T products q . k[t2] (the whole row, future
// included, as the matmul wrote them) and gets the probabilities softmax(scale q . k[t2]) over
// t2 = 0..t, zero for the future (backward reads the whole row, and P V adds nothing from it).
KERNEL_FN void attention_row_probabilities(float *att, int t, int T, float scale) {
    // the max of the scaled scores is the scaled max (scale > 0, and rounding keeps the order;
    // where +0 and -0 tie, x - max and so the exponentials are the same for either); then the
    // exponentials, stored and summed in one pass
    float max = max_16_lanes(att, t + 1) * scale;
    float inv_sum = 1.0f / exp_in_place_16_lanes(att, scale, max, t + 1);
    for (int t2 = 0; t2 <= t; t2++) att[t2] *= inv_sum;
    for (int t2 = t + 1; t2 < T; t2++) att[t2] = 0.0f;  // the future: masked out
}

// Backward of one query row t through the softmax: datt holds dprob[t2] = dout_t . v[t2] (the
// whole row) and gets the scores' gradient times scale, what dq, dk (the products with k and q)
// need:  dpre[t2] = att[t2] (dprob[t2] - sum_j att[j] dprob[j]) scale;  0 for the future.
KERNEL_FN void attention_row_softmax_backward(float *datt, const float *att, int t, int T, float scale) {
    float att_dot_datt = dot_16_lanes(att, datt, t + 1);
    for (int t2 = 0; t2 <= t; t2++) datt[t2] = att[t2] * (datt[t2] - att_dot_datt) * scale;
    for (int t2 = t + 1; t2 < T; t2++) datt[t2] = 0.0f;
}

// ----------------------------------------------------------------------------------------------
// attention a block of keys at a time: the KV cache (stage 06) and the CUDA backend's kernels
//
// The row functions above keep each query row's T probabilities in memory and read them back in
// backward: (T, T) floats per head written and read again. Here one query meets a block of keys
// at a time, rows `stride` floats apart: the whole KV cache ((maxT, C) per sequence, head h in
// columns h*hs .. h*hs + hs - 1; stride C), or a tile of keys a GPU block holds in shared memory.
// Each call is split between `nlanes` workers as at the top of the file: a lane takes keys
// j = lane, lane + nlanes, ... for scores and column i = lane, lane + nlanes, ... for outputs;
// between the steps the caller combines the partials (max, sum) and makes every lane's scores
// visible to the others. Loop bounds depend on sizes and positions only, never on data.
//
// Nothing of size T x T survives the forward: softmax over blocks is done online (below), and
// the forward keeps each row's log-sum-exp, from which backward recomputes any probability.

// The steps are built from two pieces that take one key or value row, which the CPU's decode
// also calls in its own order (each cache row's heads together, reading the cache front to back).
// one score: query q against one key row k (hs values each), times scale
KERNEL_FN float attention_score(const float *q, const float *k, float scale, int hs) {
    return dot_product(q, k, hs) * scale;
}

// one row r (hs values), weighted by w, added into out for this lane's columns
KERNEL_FN void attention_add_row(float *out, float w, const float *r, int hs, int lane, int nlanes) {
    for (int i = lane; i < hs; i += nlanes) out[i] += w * r[i];
}

// step 1: scores[j] = q . k[j] * scale for this lane's keys; returns this lane's max
KERNEL_FN float attention_scores(float *scores, const float *q, const float *keys, int stride, int nkeys,
                                 int hs, int lane, int nlanes) {
    float scale = attention_scale(hs), max = -INFINITY;
    for (int j = lane; j < nkeys; j += nlanes) {
        scores[j] = attention_score(q, keys + (size_t)j * stride, scale, hs);
        max = fmaxf(max, scores[j]);
    }
    return max;
}

// step 2: scores[j] = exp(scores[j] - max) for this lane's keys; returns this lane's sum
KERNEL_FN float attention_exp(float *scores, float max, int nkeys, int lane, int nlanes) {
    float sum = 0.0f;
    for (int j = lane; j < nkeys; j += nlanes) {
        scores[j] = softmax_exp(scores[j], max);
        sum += scores[j];
    }
    return sum;
}

// out[i] += sum over rows j of weights[j] * rows[j][i], for this lane's columns i: the weighted
// sum of value rows in the forward, and in the backward dq (key rows weighted by the scores'
// gradients), dk (query rows) and dv (output-gradient rows). Walked row by row, each row's
// columns added into out: a row is contiguous, so the inner loop is vector adds into independent
// columns. Walking a column down the rows instead makes one chain of dependent adds per column,
// each waiting for the last (at batch 8 on a CPU that chain cost more than all the matmuls of a
// decode step). Each out[i] adds the same terms in the same order either way: the same bits.
KERNEL_FN void attention_add_rows(float *out, const float *weights, const float *rows, int stride,
                                  int nrows, int hs, int lane, int nlanes) {
    for (int j = 0; j < nrows; j++) attention_add_row(out, weights[j], rows + (size_t)j * stride, hs, lane, nlanes);
}

// The KV cache is paged: a sequence's rows lie in blocks of block_size rows, table[i] naming
// the pool block that holds its rows i * block_size ..; this is where position pos lies.
KERNEL_FN const float *cache_row(const float *pool, const int *table, int pos, int block_size, int C) {
    return pool + ((size_t)table[pos / block_size] * block_size + pos % block_size) * C;
}

// step 1 against the KV cache: a query at position p reads npos = p + 1 cache rows (its own key
// was written there just before), block by block; returns this lane's max
KERNEL_FN float attention_cached_scores(float *scores, const float *q, const float *k_pool, const int *table,
                                        int block_size, int npos, int hs, int C, int lane, int nlanes) {
    float max = -INFINITY;
    for (int first = 0; first < npos; first += block_size) {
        int n = npos - first < block_size ? npos - first : block_size;
        max = fmaxf(max, attention_scores(scores + first, q, cache_row(k_pool, table, first, block_size, C), C, n,
                                          hs, lane, nlanes));
    }
    return max;
}

// step 3 against the KV cache: out[i] = sum over j of p[j] v[j][i] / sum, the rows block by block
// (each out[i] adds the same terms in the same order as over one contiguous block)
KERNEL_FN void attention_cached_values(float *out, const float *p, float inv_sum, const float *v_pool,
                                       const int *table, int block_size, int npos, int hs, int C, int lane,
                                       int nlanes) {
    for (int i = lane; i < hs; i += nlanes) out[i] = 0.0f;
    for (int first = 0; first < npos; first += block_size) {
        int n = npos - first < block_size ? npos - first : block_size;
        attention_add_rows(out, p + first, cache_row(v_pool, table, first, block_size, C), C, n, hs, lane, nlanes);
    }
    for (int i = lane; i < hs; i += nlanes) out[i] *= inv_sum;
}

// Online softmax over blocks of keys (FlashAttention's): a row keeps the largest score seen so
// far and the sum of exp(score - that max); its output accumulates the values weighted by the
// same exponentials. When a block brings a larger max, everything summed so far was taken against
// a max that is now too small, and multiplying it by exp(old max - new max) puts it on the new
// one. After the last block the output divided by the sum is softmax(scores) @ v, with no pass
// over the row's scores before the values are read.
typedef struct {
    float max, sum;
} OnlineSoftmax;

KERNEL_FN OnlineSoftmax online_softmax_start(void) {
    OnlineSoftmax run;
    run.max = -INFINITY;
    run.sum = 0.0f;
    return run;
}

// step 2 of a block, its scores' max combined: moves the running max up to the block's and
// returns the factor that rescales what was accumulated before (0 for the first block: exp(-inf)).
// Then the lanes take attention_exp(scores, run->max, ...) and their combined sum is added to
// run->sum.
KERNEL_FN float online_softmax_rescale(OnlineSoftmax *run, float block_max) {
    float max = fmaxf(run->max, block_max);
    float alpha = expf(run->max - max);
    run->max = max;
    run->sum *= alpha;
    return alpha;
}

// step 3 of a block: o = alpha * o + sum over j of p[j] v[j], this lane's columns of the row's
// unnormalised output
KERNEL_FN void attention_block_values(float *o, float alpha, const float *p, const float *v, int stride,
                                      int nkeys, int hs, int lane, int nlanes) {
    for (int i = lane; i < hs; i += nlanes) o[i] *= alpha;
    attention_add_rows(o, p, v, stride, nkeys, hs, lane, nlanes);
}

// after the last block: out = o / sum, this lane's columns. Returns the row's log-sum-exp,
// max + log(sum), what backward recomputes each probability from: p = exp(score - lse).
KERNEL_FN float attention_finish(float *out, const float *o, const OnlineSoftmax *run, int hs, int lane,
                                 int nlanes) {
    float inv_sum = 1.0f / run->sum;
    for (int i = lane; i < hs; i += nlanes) out[i] = o[i] * inv_sum;
    return run->max + logf(run->sum);
}

// Backward from the log-sum-exp, for one (query i, key j) pair:
//   p  = exp(q_i . k_j * scale - lse_i)              the probability, recomputed
//   dp = dout_i . v_j                                 its gradient (out_i = sum_j p v_j)
//   ds = scale * p * (dp - delta_i), delta_i = sum_j p dp over the row   (softmax backward)
// and then dq_i += sum_j ds k_j, dk_j += sum_i ds q_i, dv_j += sum_i p dout_i (attention_add_rows).
// delta needs the whole row first: it is a reduction of its own, before any ds.
KERNEL_FN float attention_prob(const float *q, const float *k, int hs, float lse) {
    return expf(dot_product(q, k, hs) * attention_scale(hs) - lse);
}

KERNEL_FN float attention_dscore(float p, float dp, float delta, int hs) {
    return p * (dp - delta) * attention_scale(hs);
}

// Query i against a block of keys, lanes over the keys. This lane's share of delta_i:
KERNEL_FN float attention_row_delta(const float *q, const float *dout, const float *k, const float *v,
                                    int stride, int nkeys, int hs, float lse, int lane, int nlanes) {
    float delta = 0.0f;
    for (int j = lane; j < nkeys; j += nlanes)
        delta += attention_prob(q, k + (size_t)j * stride, hs, lse) * dot_product(dout, v + (size_t)j * stride, hs);
    return delta;
}

// ... and, with delta_i combined, ds[j] for this lane's keys (then dq_i += sum_j ds[j] k_j)
KERNEL_FN void attention_row_dscores(float *ds, const float *q, const float *dout, const float *k,
                                     const float *v, int stride, int nkeys, int hs, float lse, float delta,
                                     int lane, int nlanes) {
    for (int j = lane; j < nkeys; j += nlanes) {
        const float *kj = k + (size_t)j * stride, *vj = v + (size_t)j * stride;
        ds[j] = attention_dscore(attention_prob(q, kj, hs, lse), dot_product(dout, vj, hs), delta, hs);
    }
}

// Key j against a block of queries (rows `stride` apart, with their lse and delta), lanes over
// the queries: p[i] and ds[i] for this lane's queries (then dv_j += sum_i p[i] dout_i and
// dk_j += sum_i ds[i] q_i)
KERNEL_FN void attention_column_grads(float *p, float *ds, const float *k, const float *v, const float *q,
                                      const float *dout, int stride, const float *lse, const float *delta,
                                      int nq, int hs, int lane, int nlanes) {
    for (int i = lane; i < nq; i += nlanes) {
        const float *qi = q + (size_t)i * stride, *di = dout + (size_t)i * stride;
        p[i] = attention_prob(qi, k, hs, lse[i]);
        ds[i] = attention_dscore(p[i], dot_product(di, v, hs), delta[i], hs);
    }
}

// ----------------------------------------------------------------------------------------------
// AdamW, one parameter. bc1 = 1 - beta1^t and bc2 = 1 - beta2^t are the bias corrections (the
// moments start at zero, so early on they underestimate; dividing by bc fixes that); the host
// computes them once per step. Weight decay is decoupled: it shrinks the parameter directly
// instead of being added to the gradient, so it is not rescaled by the adaptive denominator.
KERNEL_FN void adamw_element(float *param, float *m, float *v, float grad, float lr, float beta1,
                             float beta2, float eps, float weight_decay, float bc1, float bc2) {
    float mi = beta1 * *m + (1.0f - beta1) * grad;
    float vi = beta2 * *v + (1.0f - beta2) * grad * grad;
    *m = mi;
    *v = vi;
    float m_hat = mi / bc1;
    float v_hat = vi / bc2;
    *param -= lr * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * *param);
}

// One element rounded onto the FP8 grid under a scale and returned as bf16 bits (cast_to_fp8_grid)
KERNEL_FN uint16_t fp8_grid_element(float x, Fp8Format f, float scale) {
    return bf16_from_float(fp8_to_float(fp8_from_float(x * scale, f, 1), f) / scale);
}
// what that rounding clipped, for FP8 training's counts: x x scale beyond the format's largest
// finite (it saturated), or x nonzero and its grid value 0 (it underflowed)
KERNEL_FN int fp8_saturates(float x, Fp8Format f, float scale) { return fabsf(x * scale) > fp8_max(f); }
KERNEL_FN int fp8_flushes(float x, uint16_t grid_bits) { return x != 0.0f && (grid_bits & 0x7FFFu) == 0; }

// Whether a cuBLASLt FP8 GEMM takes an fp8-tensorwise product (matmul_forward_fp8) of an m x k and a
// k x n operand on a GPU of compute capability cc_major.cc_minor: FP8 tensor cores that take one
// scale a tensor (8.9, 9.0; later GPUs are left to the emulation), and m, n and k multiples of 16,
// what cuBLASLt's FP8 kernels ask of the TN layout's sizes and leading dimensions.
KERNEL_FN int fp8_gemm_fits(int cc_major, int cc_minor, int m, int n, int k) {
    int fp8_tensorwise_cores = (cc_major == 8 && cc_minor == 9) || (cc_major == 9 && cc_minor == 0);
    return fp8_tensorwise_cores && m % 16 == 0 && n % 16 == 0 && k % 16 == 0;
}

// A group's scale from its amax (cast_to_fp8_grid_grouped): rowwise, the power of two at or below
// the format's largest finite / amax (fp8_scale_pow2); MX, the reciprocal of the block's E8M0
// scale 2^(floor(log2 amax) - emax) (mx_scale_e8m0). Both powers of two, so the grid values
// divided back stay bf16 values exactly.
KERNEL_FN float fp8_group_scale(float amax, Fp8Format f, int mx) {
    return mx ? 1.0f / e8m0_to_float(mx_scale_e8m0(amax, f)) : fp8_scale_pow2(amax, f);
}

// One group of cast_to_fp8_grid_grouped, `len` elements `stride` apart from `first`: its amax,
// its scale, each element onto the grid; adds the values it saturates and flushes to zero.
KERNEL_FN void fp8_cast_group(uint16_t *out, const float *in, size_t first, size_t stride, int len, Fp8Format f,
                              int mx, unsigned long long *saturated, unsigned long long *flushed) {
    float amax = 0.0f;
    for (int i = 0; i < len; i++) amax = fmaxf(amax, fabsf(in[first + i * stride]));
    float scale = fp8_group_scale(amax, f, mx);
    for (int i = 0; i < len; i++) {
        size_t at = first + i * stride;
        out[at] = fp8_grid_element(in[at], f, scale);
        *saturated += fp8_saturates(in[at], f, scale);
        *flushed += fp8_flushes(in[at], out[at]);
    }
}

// Muon's momentum, one element, as torch's lerp writes it (start + weight x (end - start)): the
// momentum moves toward the gradient by 1 - beta; the update is the gradient moved toward the new
// momentum by beta (Nesterov: a look ahead), or the momentum itself. Returns the update.
KERNEL_FN float muon_momentum_element(float *momentum, float grad, float beta, int nesterov) {
    float mi = *momentum + (1.0f - beta) * (grad - *momentum);
    *momentum = mi;
    return nesterov ? grad + beta * (mi - grad) : mi;
}

// ----------------------------------------------------------------------------------------------
// vocab-parallel cross-entropy

// row n's max over the nmax shards' maxes (stored (nmax, N)): the max of the whole row
KERNEL_FN float max_over_shards(const float *maxes, int nmax, int N, int n) {
    float m = -INFINITY;
    for (int i = 0; i < nmax; i++) m = fmaxf(m, maxes[(size_t)i * N + n]);
    return m;
}

// dropout's factor for element (n, c) of N rows (ops.h: DropoutMask): 0, or 1 / (1 - p) if kept.
// The top 24 bits of the hash are a uniform in [0, 1) with steps of 2^-24.
KERNEL_FN float dropout_factor(const DropoutMask *m, int N, int n, int c) {
    int per_chunk = N / m->n_chunks, g = n / per_chunk, r = n % per_chunk;
    uint64_t seq = (uint64_t)(m->first_seq + r / m->T), pos = (uint64_t)(m->pos0[g] + r % m->T);
    uint64_t index = (seq << 40) | (pos << 20) | (uint64_t)(m->col0 + c);
    float u = (float)(rng_hash(m->seed, m->stream, index) >> 40) * (1.0f / 16777216.0f);
    return u < m->p ? 0.0f : 1.0f / (1.0f - m->p);
}

#endif
