// ops.h: every computation the model does, as one interface with one implementation per
// backend (ops_cpu.c: oneDNN + OpenMP; ops_cuda.cu: cuBLAS + kernels). The model code is plain C
// and only ever calls these functions, always with pointers to *device* memory (which, on the
// CPU backend, is ordinary host memory) that device.h allocates and fills.
//
// Conventions, as in llm.c:
//  - outputs first, then inputs and weights, then sizes;
//  - shapes are written in comments, row-major, e.g. inp is (N, C);
//  - backward functions ADD into their gradient outputs (dinp, dweight, dbias), so residual
//    branches, the tied embedding and gradient accumulation need no special case; the linear
//    layer's and the norms' (the *_mode ones) can WRITE their weight gradients instead, so that a
//    step's first backward needs no zeroing pass over the gradients before it (GradMode);
//  - a linear layer's weight is (OC, C): out = inp @ weight^T + bias.
#ifndef OPS_H
#define OPS_H

#include <stddef.h>
#include <stdint.h>

// ----------------------------------------------------------------------------------------------
// the backend (ops_init, which starts it, and its memory, copies, streams and marks are device.h's)

const char *ops_backend_name(void);  // "cpu" or "cuda"
// what does the f32 matmuls, e.g. "oneDNN 3.6.2 f32 matmul (brg:avx512_core), 2 threads"
const char *ops_matmul_engine(void);
// what does the bf16 ones (matmul_*_bf16), e.g. "oneDNN 3.6.2 bf16 matmul (brg:avx512_core_bf16),
// 2 threads", or "bf16 widened to f32 (why): <the f32 engine>" where ops_bf16_native() is 0
const char *ops_matmul_engine_16(void);
// MFU's peak: the matmul FLOP/s of this process's device for f32 or (bf16 != 0) bf16 inputs,
// found on the first call and kept. CPU: measured (oneDNN's best rate at a large square product
// with this run's OpenMP threads, a fraction of a second); CUDA: derived from the device (SMs x clock x
// FLOPs per clock per SM). OPS_PEAK_FLOPS_F32 / OPS_PEAK_FLOPS_BF16 (FLOP/s) replace it. Ranks
// sharing a machine should ask at the same point (before the first step), so they measure
// together and each gets its share of the cores.
double ops_peak_flops(int bf16);
// that peak as one sentence: the figure and where it came from, e.g. "812 GFLOP/s bf16, measured:
// best of 9 oneDNN bf16 matmuls 1024x1024x1024 (brg:avx512_core_bf16) on 2 threads, 0.16 s"
const char *ops_peak_flops_source(int bf16);

// ----------------------------------------------------------------------------------------------
// initialisation: a counter-based normal RNG, so element i of tensor `stream` gets the same value
// whichever rank computes it and whatever slice it computes. Fills out[0..n) with the values of
// elements first..first+n of that tensor: out[j] = std * normal(seed, stream, first + j).

void init_normal(float *out, size_t n, uint64_t seed, uint64_t stream, uint64_t first, float std);
void fill_constant(float *out, size_t n, float value);

// ----------------------------------------------------------------------------------------------
// numbers: the 16-bit copies and their casts. A bf16 number is the top 16 bits of a float32: the
// same 8-bit exponent (so the same range) with 8 bits of mantissa instead of 24. An fp16 number
// (IEEE half, precision 16-mixed) has 5 exponent bits and 11 of mantissa: more precision, far
// less range (largest 65504, smallest subnormal 2^-24).
//
// The copies are bf16 unless the run asks for fp16 with ops_set_half_format, once, before any
// cast: then the `half16` buffers below hold fp16 numbers, and the casts and the 16-bit matmuls
// read and write fp16. (One set of buffers and functions for both formats, named for 16 bits:
// what differs is only the rounding, the type is 16 bits either way.)

typedef uint16_t half16;
#include "base/numbers.h"  // Fp8Format
typedef enum { HALF_BF16, HALF_FP16 } HalfFormat;
void ops_set_half_format(HalfFormat format);
HalfFormat ops_half_format(void);

void cast_to_16(half16 *out, const float *in, size_t n);  // round to nearest, ties to even
void cast_to_float(float *out, const half16 *in, size_t n);
// cast_to_16 for a gradient, counting for ops_half_underflow the nonzero values and those that
// rounded to zero: what an fp16 run loses below its smallest subnormal (2^-24)
void cast_gradient_to_16(half16 *out, const float *in, size_t n);
// since the last call (which resets them): the nonzero gradient values cast, and how many of them
// became zero
void ops_half_underflow(double *nonzero, double *flushed);

// FP8 emulated on the bf16 matmuls (the fp8-* precisions, stage 02's fp8.c): in rounded onto the
// grid of FP8 numbers under a power-of-two scale, out = bf16(fp8(in x scale) / scale),
// saturating. Each such value is a bf16 value exactly, so a bf16 matmul of two of them multiplies
// the FP8 numbers an FP8 matmul would (with fp32 accumulation), and its output needs no unscaling.
// clips, when not NULL, is a device array of FP8_CLIPS counters the cast adds to: the values that
// saturated at the format's largest finite, and the nonzero values that became 0.
enum { FP8_SATURATED, FP8_FLUSHED, FP8_CLIPS };
void cast_to_fp8_grid(half16 *out, const float *in, size_t n, Fp8Format format, float scale,
                      unsigned long long *clips);
// the same with a scale per group (fp8-rowwise, mxfp8): the (rows, cols) matrix in, cut into
// groups of `group` consecutive elements along each row (along_columns 0) or down each column (1),
// the last group of a row or column shorter where group does not divide it; each group scaled by
// its own amax, fp8_group_scale's way (mx 0: a power of two, 1: MX's E8M0 block scale)
void cast_to_fp8_grid_grouped(half16 *out, const float *in, int rows, int cols, int group, int along_columns,
                              Fp8Format format, int mx, unsigned long long *clips);
// the largest |x[i]|, returned to the host: a tensor's amax, which its FP8 scale maps to the
// format's largest finite
double abs_max(const float *x, size_t n);

// How a backward op puts a weight's gradient (dweight, dbias) into its buffer: GRAD_ADD adds it to
// what the buffer holds (a later micro-batch of the step, the second use of a tied weight);
// GRAD_WRITE writes it over whatever the buffer holds (the step's first backward, so the buffer
// needs no zeroing pass before it). The input gradient dinp is always added.
typedef enum { GRAD_ADD, GRAD_WRITE } GradMode;

// ----------------------------------------------------------------------------------------------
// matmuls: the linear layer. out = inp @ weight^T + bias, weight (OC, C).

// out (N, OC) = inp (N, C) @ weight (OC, C)^T + bias (OC); bias may be NULL
void matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                    int N, int C, int OC);
// dinp (N, C) += dout @ weight; dweight (OC, C) += dout^T @ inp; dbias (OC) += column sums of dout.
// dinp, dweight and dbias may be NULL (skip).
// matmul_backward_mode: the same, dweight and dbias added or written as `grads` says
void matmul_backward_mode(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                          const float *weight, int N, int C, int OC, GradMode grads);
static inline void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                   const float *inp, const float *weight, int N, int C, int OC) {
    matmul_backward_mode(dinp, dweight, dbias, dout, inp, weight, N, C, OC, GRAD_ADD);
}

// f32 matmuls in TF32 (on: inputs rounded to 10 mantissa bits on the tensor cores, f32
// accumulation; stage 01's tf32 lesson) or in full f32 (off, the default). Only the CUDA backend on
// compute capability 8.0 or newer has TF32; elsewhere asking for it stops the program with why.
void ops_set_tf32(int on);

// 1 when the bf16 matmuls below run on bf16 hardware (AVX512-BF16/AMX, tensor cores); 0 when the
// backend converts the bf16 inputs to f32 and multiplies those (the same products): where there is
// no bf16 hardware, and on the CPU also where oneDNN's bf16 matmul is measured slower than its f32
// one, or OPS_BF16_MATMUL=f32 asks (common/ops/ops_cpu.c, choose_bf16_engine)
int ops_bf16_native(void);
// out (N, OC) = inp (N, C) @ weight (OC, C)^T + bias: 16-bit inputs (the run's format), f32
// accumulation and output
void matmul_forward_16(float *out, const half16 *inp, const half16 *weight, const float *bias,
                       int N, int C, int OC);
// dinp (N, C) += dout16 @ weight; dweight (OC, C) += dout16^T @ inp; dbias (OC) += column sums of
// dout (the f32 gradient; dout16 is its 16-bit copy). Outputs f32; dinp, dweight and dbias may be NULL,
// and so may weight without dinp and inp without dweight.
void matmul_backward_16_mode(float *dinp, float *dweight, float *dbias, const float *dout, const half16 *dout16,
                             const half16 *inp, const half16 *weight, int N, int C, int OC, GradMode grads);
static inline void matmul_backward_16(float *dinp, float *dweight, float *dbias, const float *dout,
                                      const half16 *dout16, const half16 *inp, const half16 *weight, int N,
                                      int C, int OC) {
    matmul_backward_16_mode(dinp, dweight, dbias, dout, dout16, inp, weight, N, C, OC, GRAD_ADD);
}
// The same products for fp8-tensorwise (stage 02's fp8.c), their operands on the FP8 grid
// (cast_to_fp8_grid) with the scale each was cast with: inp and weight e4m3, dout8 e5m2. The CPU
// multiplies the grid values (matmul_forward_16, matmul_backward_16: the emulation, exact); CUDA
// multiplies the FP8 numbers themselves in a cuBLASLt FP8 GEMM where fp8_gemm_fits (kernels.h) says
// the GPU and the shape allow, and the emulation elsewhere, which it says once.
void matmul_forward_fp8(float *out, const half16 *inp, float inp_scale, const half16 *weight, float weight_scale,
                        const float *bias, int N, int C, int OC);
void matmul_backward_fp8(float *dinp, float *dweight, float *dbias, const float *dout, const half16 *dout8,
                         float dout_scale, const half16 *inp, float inp_scale, const half16 *weight,
                         float weight_scale, int N, int C, int OC);

// ----------------------------------------------------------------------------------------------
// the embedding: token rows of wte plus position rows of wpe, for a rank holding the vocabulary
// rows [v_lo, v_lo + v_count) of wte (one rank with the whole vocabulary: 0, Vp). A token outside
// those rows embeds to 0 (the rank holding it adds it: a sum over the vocabulary shards is the
// whole embedding); wpe may be NULL (no positions added here).

// out (B, T, C) = wte[tokens[b, t] - v_lo] + wpe[pos], pos = t, or start[b] + t when start (B, a
// device array) is given: rows that continue a sequence whose first start[b] positions came
// before (generation with a KV cache)
void embedding_forward(float *out, const int *tokens, const int *start, const float *wte,
                       const float *wpe, int v_lo, int v_count, int B, int T, int C);
// dwte (v_count, C) += dout rows of the shard's tokens; dwpe (maxT, C) += dout (may be NULL)
void embedding_backward(float *dwte, float *dwpe, const float *dout, const int *tokens, int v_lo,
                        int v_count, int B, int T, int C);

// ----------------------------------------------------------------------------------------------
// LayerNorm

// out (N, C) = (inp - mean) * rstd * weight + bias; mean, rstd (N) saved for backward
void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                       const float *weight, const float *bias, int N, int C);
// dinp (N, C) +=; dweight, dbias (C) added or written as `grads` says (layernorm_backward: added)
void layernorm_backward_mode(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                             const float *weight, const float *mean, const float *rstd, int N, int C,
                             GradMode grads);
static inline void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                      const float *inp, const float *weight, const float *mean,
                                      const float *rstd, int N, int C) {
    layernorm_backward_mode(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, GRAD_ADD);
}

// LayerNorm over rows split into shards of C columns (the full row has C_total), in steps with
// a sum over the shards between them (the ops never communicate; one shard is the whole row).
// Forward: sums (N) = row sums of inp (mean == NULL) or of (inp - mean)^2; add over shards, then
// mean = sum / C_total, and layernorm_forward_stats normalises with the added sum_sqdev.
void layernorm_row_sums(float *sums, const float *inp, const float *mean, int N, int C);
// out (N, C) = (inp - mean) * rstd * weight + bias with rstd (N) = 1/sqrt(sum_sqdev/C_total + eps)
void layernorm_forward_stats(float *out, float *rstd, const float *inp, const float *weight,
                             const float *bias, const float *mean, const float *sum_sqdev,
                             int N, int C, int C_total);
// Backward: sums (N, 2) = this shard's (sum of dnorm, sum of dnorm * norm) per row; add over
// shards, then layernorm_backward_stats: dinp (N, C) +=, dweight, dbias (C) += as layernorm_backward.
void layernorm_backward_row_sums(float *sums, const float *dout, const float *inp,
                                 const float *weight, const float *mean, const float *rstd, int N, int C);
void layernorm_backward_stats(float *dinp, float *dweight, float *dbias, const float *dout,
                              const float *inp, const float *weight, const float *mean,
                              const float *rstd, const float *sums, int N, int C, int C_total);

// RMSNorm (Llama): out (N, C) = inp * rstd * weight, rstd (N) = 1/sqrt(mean(inp^2) + eps), saved
// for backward; no mean taken out, no bias
void rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C, float eps);
// dinp (N, C) +=, dweight (C) added or written as `grads` says (rmsnorm_backward: added)
void rmsnorm_backward_mode(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                           const float *rstd, int N, int C, GradMode grads);
static inline void rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                                    const float *weight, const float *rstd, int N, int C) {
    rmsnorm_backward_mode(dinp, dweight, dout, inp, weight, rstd, N, C, GRAD_ADD);
}
// RMSNorm over rows split into shards of C columns (the full row has C_total), as LayerNorm's
// above: sum_sq (N) = this shard's row sums of inp^2; add over shards, then forward_stats
// normalises with rstd = 1/sqrt(sum_sq/C_total + eps). Backward: sums (N) = this shard's row sums
// of dnorm * norm; add over shards, then backward_stats: dinp (N, C) +=, dweight (C) +=.
void rmsnorm_row_sums(float *sum_sq, const float *inp, int N, int C);
void rmsnorm_forward_stats(float *out, float *rstd, const float *inp, const float *weight, const float *sum_sq,
                           int N, int C, int C_total, float eps);
void rmsnorm_backward_row_sums(float *sums, const float *dout, const float *inp, const float *weight,
                               const float *rstd, int N, int C);
void rmsnorm_backward_stats(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                            const float *rstd, const float *sums, int N, int C, int C_total);

// ----------------------------------------------------------------------------------------------
// attention

// causal self-attention. qkv (B, T, 3C) holds q, k, v side by side, each (NH heads x hs);
// out (B, T, C). att (B, NH, T, T) keeps what backward needs, as the backend lays it out: the
// CPU, the softmax probabilities (zero above the diagonal); CUDA, each query row's log-sum-exp
// of its scores in the first B*NH*T floats (backward recomputes the probabilities from it).
void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH);
// dqkv (B, T, 3C) +=; datt is scratch of att's size
void attention_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, int B, int T, int C, int NH);
// the same in the 16-bit precisions: on the CPU the products (QK^T, PV and backward's four) read
// their operands rounded to bf16, on the bf16 engine, the softmax stays f32 (fp16: the f32 ops);
// CUDA runs the ops above (its attention kernels are chosen by OPS_CUDA_KERNELS)
void attention_forward_16(float *out, float *att, const float *qkv, int B, int T, int C, int NH);
void attention_backward_16(float *dqkv, float *datt, const float *dout, const float *qkv,
                           const float *att, int B, int T, int C, int NH);

// With a KV cache (generation): T new rows per sequence that continue where the sequence's cache
// ends. start (B) is a *device* array: sequence b's new rows sit at positions start[b] ..
// start[b] + T - 1 (so sequences of a batch may have different lengths, and a CUDA graph can
// replay a step with new positions). The cache is paged: a pool of blocks of block_size rows per
// layer for keys and another for values, (n_blocks, block_size, C_kv), the NKV key/value heads
// side by side in C_kv = NKV x C / NH (C without grouped-query attention, where NKV = NH);
// table (B, max_blocks), a *device* array, names sequence b's blocks in order (its position p
// lies in block table[b][p / block_size], row p % block_size).
// copies the k and v parts of qkv (B, T, 3C) into positions start[b] + t of the pools: of each
// group of NH / NKV heads, which gqa_expand made copies of one key/value head, the first
void kv_cache_write(float *k_pool, float *v_pool, const float *qkv, const int *start, const int *table,
                    int B, int T, int C, int NH, int NKV, int block_size, int max_blocks);
// causal attention of the new rows against the cache (written first with kv_cache_write): query
// (b, t) sees positions 0 .. start[b] + t, query head h the keys and values of head h / (NH /
// NKV). qkv (B, T, 3C) (only q is read); out (B, T, C); scores (B, NH, T, max_blocks *
// block_size) scratch.
void attention_cached_forward(float *out, float *scores, const float *qkv, const float *k_pool,
                              const float *v_pool, const int *start, const int *table, int B, int T, int C,
                              int NH, int NKV, int block_size, int max_blocks);

// grouped-query attention (Llama): NKV key and value heads, each serving NH / NKV query heads.
// qkv (N, 3 C_attn) = the projection proj (N, C_attn + 2 NKV hs) with each key and value head
// repeated for every query head of its group, so that attention_forward runs it as NH heads
void gqa_expand(float *qkv, const float *proj, int N, int C_attn, int NH, int NKV);
// dproj (N, C_attn + 2 NKV hs) = dqkv (N, 3 C_attn) with each group's key and value gradients summed
void gqa_reduce(float *dproj, const float *dqkv, int N, int C_attn, int NH, int NKV);

// ----------------------------------------------------------------------------------------------
// element-wise

// how rotary embeddings turn: base theta, and Llama 3's stretch of the long wavelengths (its
// rope_scaling; factor 0: none)
typedef struct {
    float theta;
    float factor, low_freq_factor, high_freq_factor, original_max_positions;
} Rope;
// rotary position embedding on the queries and keys of qkv (B, T, 3 C_attn), in place: the first
// rot_dim dims of each of the NH heads, at positions t (or start[b] + t, start on the device)
void rotary_forward(float *qkv, const int *start, int B, int T, int C_attn, int NH, int rot_dim, Rope rope);
// its backward on dqkv, in place (the inverse rotation)
void rotary_backward(float *dqkv, const int *start, int B, int T, int C_attn, int NH, int rot_dim, Rope rope);
// GELU, tanh approximation (GPT-2's "gelu_new"); dinp = dout * gelu'(inp), written (the MLP's
// only producer of that gradient: no zeroing pass before it)
void gelu_forward(float *out, const float *inp, size_t n);
void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n);
// SwiGLU (Llama's MLP): h (N, F) = silu(gate) * up, gate_up (N, 2F) holding gate | up per row;
// dgate_up (N, 2F) = its gradient, written
void swiglu_forward(float *h, const float *gate_up, int N, int F);
void swiglu_backward(float *dgate_up, const float *gate_up, const float *dh, int N, int F);
// the two backwards that also write the gradient's 16-bit copy, rounded and counted as
// cast_gradient_to_16 would (the fc layer's backward multiplies it): no pass of its own over them
void gelu_backward_16(float *dinp, half16 *dinp16, const float *inp, const float *dout, size_t n);
void swiglu_backward_16(float *dgate_up, half16 *dgate_up16, const float *gate_up, const float *dh, int N, int F);

void add_forward(float *out, const float *a, const float *b, size_t n);  // out = a + b
void add_inplace(float *acc, const float *x, size_t n);                  // acc += x
void scale_inplace(float *x, float s, size_t n);                         // x *= s
// dst (N rows, stride dst_stride) += s * src (N rows of width, stride src_stride): a column slice of
// one into the other (LoRA's adapter on q, k or v: a slice of the fused qkv projection)
void add_columns_scaled(float *dst, int dst_stride, const float *src, int src_stride, int N, int width, float s);

// Dropout whose mask is a pure function of each element's place in the global batch (LoRA's
// dropout): element (n, c) of N rows of `width` is kept with probability 1 - p, and then scaled
// by 1 / (1 - p), when rng_hash(seed, stream, (sequence << 40) | (position << 20) | (col0 + c))
// says so. Local row n is position pos0[g] + n % T of sequence first_seq + (n % (S T)) / T, in
// chunk g = n / (S T) of n_chunks, S = N / (n_chunks T): so any rank holding any rows, positions
// or columns of the batch draws the elements' global masks.
typedef struct {
    uint64_t seed, stream;
    float p;
    int first_seq, T, col0;
    int n_chunks, pos0[2];  // 1 and {0}, but under context parallelism (a rank's two chunks)
} DropoutMask;
// out (N, width) = mask(inp), or with add, out += mask(inp); out may be inp
void dropout_apply(float *out, const float *inp, int N, int width, const DropoutMask *m, int add);

// ----------------------------------------------------------------------------------------------
// mixture of experts: token rows to their experts' rows and back. slot (N, k) (device): the row
// of packed that token n's j-th expert runs, -1 when it was dropped; the rows are distinct.

// packed (rows, C): row slot[n, j] = x row n
void moe_dispatch(float *packed, const float *x, const int *slot, int N, int k, int C);
// dx (N, C) += sum over j of dpacked row slot[n, j]
void moe_dispatch_backward(float *dx, const float *dpacked, const int *slot, int N, int k, int C);
// out (N, C) = sum over j of weight[n, j] x y row slot[n, j] (zero when every expert dropped it)
void moe_combine(float *out, const float *y, const int *slot, const float *weight, int N, int k, int C);
// dy row slot[n, j] = weight[n, j] x dout row n (rows no token uses are left alone);
// dweight (N, k) = dout row n . y row slot[n, j] (0 when dropped)
void moe_combine_backward(float *dy, float *dweight, const float *dout, const float *y, const int *slot,
                          const float *weight, int N, int k, int C);

// ----------------------------------------------------------------------------------------------
// the loss: softmax + cross-entropy

// Over the first V of each row's Vp logits (the rest is vocab padding). targets < 0 carry no
// loss. losses (N) gets each row's loss (0 where ignored).
void cross_entropy_forward(float *losses, const float *logits, const int *targets,
                           int N, int V, int Vp);
// Overwrites logits (N, Vp) with dlogits = dloss * (softmax - onehot(target)) per row; zero for
// ignored rows and for the padded columns. Fused with the forward: also fills losses (N). With
// dlogits16 (N, Vp) set, also writes there what cast_gradient_to_16 would make of dlogits, and
// counts its nonzero and flushed values the same way; NULL: no 16-bit copy.
void cross_entropy_forward_backward(float *logits_then_dlogits, half16 *dlogits16, float *losses,
                                    const int *targets, float dloss, int N, int V, int Vp);

// Over a vocabulary split into shards: logits (N, Vl) hold the shard [v_lo, v_lo + Vl), of which
// the first v_count columns are real tokens (the rest is padding). Three steps, with a sum or
// gather over the shards after each of the first two:
//   1. max (N) = each row's max over the shard's real columns  -> all-gather: maxes (nmax, N)
//   2. sums (N, 2) = (sum of exp(x - M), the target's logit if the shard has it, else 0), with
//      M = the max over the nmax gathered maxes                 -> all-reduce (sum)
//   3. losses (N) and, when dlogits is not NULL, dlogits (N, Vl) = dloss * (softmax - onehot)
//      (dlogits may be logits itself). Rows with target < 0 get loss 0 and gradient 0.
void cross_entropy_shard_max(float *max, const float *logits, int N, int v_count, int Vl);
void cross_entropy_shard_sums(float *sums, const float *logits, const float *maxes, int nmax,
                              const int *targets, int v_lo, int v_count, int N, int Vl);
void cross_entropy_shard_finish(float *losses, float *dlogits, const float *logits,
                                const float *maxes, int nmax, const float *sums, const int *targets,
                                float dloss, int v_lo, int v_count, int N, int Vl);

// ----------------------------------------------------------------------------------------------
// reductions and the optimizer

// sum of x[i]^2 in double, returned to the host
double sum_squares(const float *x, size_t n);
// sum of x[i], returned to the host
double sum_values(const float *x, size_t n);

// AdamW (decoupled weight decay) on one contiguous range; t is the 1-based step number. Each
// gradient is read as grad[i] x grad_scale (gradient clipping's factor, 1 for none).
void adamw_update(float *param, const float *grad, float grad_scale, float *m, float *v, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int t);
// ... and, where param16 is not NULL, the same pass writes the updated parameters' 16-bit copy
// too (param16[i] = param[i] rounded as cast_to_16 rounds it): the next step's matmul weights
// without a pass over the parameters of their own
void adamw_update_16(float *param, half16 *param16, const float *grad, float grad_scale, float *m, float *v,
                     size_t n, float lr, float beta1, float beta2, float eps, float weight_decay, int t);
// Muon's momentum on one contiguous range (common/run/muon.h): momentum = lerp(momentum, g, 1 - beta)
// with g = grad[i] x grad_scale, then grad[i] becomes the update Newton-Schulz orthogonalizes:
// lerp(g, momentum, beta) with nesterov, else the momentum itself.
void muon_momentum(float *grad, float grad_scale, float *momentum, size_t n, float beta, int nesterov);

// ----------------------------------------------------------------------------------------------
// CUDA graphs: between ops_graph_begin and ops_graph_end the ops are recorded instead of run;
// ops_graph_replay runs the recording again, with whatever the same buffers hold by then. Only
// ops that neither allocate nor copy to the host may be recorded. ops_graphs_supported() is 0 on
// the CPU backend, where the other three must not be called.
int ops_graphs_supported(void);
void ops_graph_begin(void);
void *ops_graph_end(void);
void ops_graph_replay(void *graph);
void ops_graph_free(void *graph);

#endif
