// ring_blocks_cuda.cu: ring_blocks.h on the GPU, on the ops stream (dev_stream()): one thread per
// (row, head), each running ring_math.h's math as one lane of one. Plain rather than fast: the
// lesson is the ring around these steps.
#include <cuda_runtime.h>

#include "../ring_math.h"  // C++ linkage: the math headers it includes are C++ under nvcc
extern "C" {  // C headers, without extern "C" of their own
#include "../ring_blocks.h"
#include "base/device.h"
#include "base/log.h"
}

static const int THREADS = 128;

static int blocks_for(long n) { return (int)((n + THREADS - 1) / THREADS); }

static void launched(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) fatal("launch of %s: CUDA error %d: %s", what, (int)e, cudaGetErrorString(e));
}

#define RING_LAUNCH(kernel, n, ...)                                                                   \
    do {                                                                                              \
        kernel<<<blocks_for(n), THREADS, 0, (cudaStream_t)dev_stream()>>>(__VA_ARGS__);               \
        launched(#kernel);                                                                            \
    } while (0)

__global__ static void pack_kv_kernel(float *kv, const float *qkv, int N, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * 2 * C) return;
    long n = i / (2 * C), j = i % (2 * C);
    kv[i] = qkv[n * 3 * C + C + j];
}

__global__ static void add_dkv_kernel(float *dqkv, const float *dkv, int N, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * 2 * C) return;
    long n = i / (2 * C), j = i % (2 * C);
    dqkv[n * 3 * C + C + j] += dkv[i];
}

__global__ static void forward_start_kernel(float *o, float *run_max, float *run_sum, int N, int C, int NH) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long)N * C) o[i] = 0.0f;
    if (i < (long)N * NH) {
        OnlineSoftmax run = online_softmax_start();
        run_max[i] = run.max;
        run_sum[i] = run.sum;
    }
}

__global__ static void forward_block_kernel(RingBlock r, float *o, float *run_max, float *run_sum, float *scores,
                                            const float *qkv, const float *kv) {
    int nh = blockIdx.x * blockDim.x + threadIdx.x;
    if (nh >= 2 * r.B * r.c * r.NH) return;
    int n = nh / r.NH, h = nh % r.NH, hs = r.C / r.NH;
    OnlineSoftmax run = {run_max[nh], run_sum[nh]};
    ring_query_forward(&r, n, h, o + (size_t)n * r.C + h * hs, &run, scores + (size_t)nh * r.c, qkv, kv);
    run_max[nh] = run.max;
    run_sum[nh] = run.sum;
}

__global__ static void forward_finish_kernel(float *out, float *lse, const float *o, const float *run_max,
                                             const float *run_sum, int N, int C, int NH) {
    int nh = blockIdx.x * blockDim.x + threadIdx.x;
    if (nh >= N * NH) return;
    int hs = C / NH;
    size_t at = (size_t)(nh / NH) * C + (nh % NH) * hs;
    OnlineSoftmax run = {run_max[nh], run_sum[nh]};
    lse[nh] = attention_finish(out + at, o + at, &run, hs, 0, 1);
}

__global__ static void backward_delta_kernel(float *delta, const float *dout, const float *out, int N, int C, int NH) {
    int nh = blockIdx.x * blockDim.x + threadIdx.x;
    if (nh >= N * NH) return;
    int hs = C / NH;
    size_t at = (size_t)(nh / NH) * C + (nh % NH) * hs;
    delta[nh] = dot_product(dout + at, out + at, hs);
}

__global__ static void backward_queries_kernel(RingBlock r, float *dqkv, float *ds, const float *qkv,
                                               const float *dout, const float *lse, const float *delta,
                                               const float *kv) {
    int nh = blockIdx.x * blockDim.x + threadIdx.x;
    if (nh >= 2 * r.B * r.c * r.NH) return;
    int n = nh / r.NH, h = nh % r.NH, hs = r.C / r.NH;
    ring_query_backward(&r, n, h, dqkv + (size_t)n * 3 * r.C + h * hs, ds + (size_t)nh * r.c, qkv, dout, lse[nh],
                        delta[nh], kv);
}

__global__ static void backward_keys_kernel(RingBlock r, float *dkv, const float *qkv, const float *dout,
                                            const float *lse, const float *delta, const float *kv) {
    int nh = blockIdx.x * blockDim.x + threadIdx.x;
    if (nh >= 2 * r.B * r.c * r.NH) return;
    ring_key_backward(&r, nh / r.NH, nh % r.NH, dkv, qkv, dout, lse, delta, kv);
}

extern "C" void ring_pack_kv(float *kv, const float *qkv, int N, int C) {
    RING_LAUNCH(pack_kv_kernel, (long)N * 2 * C, kv, qkv, N, C);
}

extern "C" void ring_add_dkv(float *dqkv, const float *dkv, int N, int C) {
    RING_LAUNCH(add_dkv_kernel, (long)N * 2 * C, dqkv, dkv, N, C);
}

extern "C" void ring_forward_start(float *o, float *run_max, float *run_sum, int N, int C, int NH) {
    RING_LAUNCH(forward_start_kernel, (long)N * (C > NH ? C : NH), o, run_max, run_sum, N, C, NH);
}

extern "C" void ring_forward_block(const RingBlock *r, float *o, float *run_max, float *run_sum, float *scores,
                                   const float *qkv, const float *kv) {
    RING_LAUNCH(forward_block_kernel, 2L * r->B * r->c * r->NH, *r, o, run_max, run_sum, scores, qkv, kv);
}

extern "C" void ring_forward_finish(float *out, float *lse, const float *o, const float *run_max,
                                    const float *run_sum, int N, int C, int NH) {
    RING_LAUNCH(forward_finish_kernel, (long)N * NH, out, lse, o, run_max, run_sum, N, C, NH);
}

extern "C" void ring_backward_delta(float *delta, const float *dout, const float *out, int N, int C, int NH) {
    RING_LAUNCH(backward_delta_kernel, (long)N * NH, delta, dout, out, N, C, NH);
}

// two launches: the keys' pass after the queries' on the one stream, each writing its own buffer
extern "C" void ring_backward_block(const RingBlock *r, float *dqkv, float *dkv, float *ds, const float *qkv,
                                    const float *dout, const float *lse, const float *delta, const float *kv) {
    long n = 2L * r->B * r->c * r->NH;
    RING_LAUNCH(backward_queries_kernel, n, *r, dqkv, ds, qkv, dout, lse, delta, kv);
    RING_LAUNCH(backward_keys_kernel, n, *r, dkv, qkv, dout, lse, delta, kv);
}

__global__ static void copy_rows_kernel(float *dst, int dst_stride, int dst_col, const float *src, int src_stride,
                                        int src_col, int rows, int width, bool add) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * width) return;
    int n = (int)(i / width), k = (int)(i % width);
    float *d = dst + (size_t)n * dst_stride + dst_col + k;
    float x = src[(size_t)n * src_stride + src_col + k];
    *d = add ? *d + x : x;
}

extern "C" void cp_copy_rows(float *dst, int dst_stride, int dst_col, const float *src, int src_stride, int src_col,
                             int rows, int width, bool add) {
    RING_LAUNCH(copy_rows_kernel, (long)rows * width, dst, dst_stride, dst_col, src, src_stride, src_col, rows, width,
                add);
}
