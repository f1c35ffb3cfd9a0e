// ring_blocks_cpu.c: ring_blocks.h on the CPU; a thread owns a (row, head) at a time.
#include "../ring_blocks.h"

#include <math.h>
#include <stddef.h>

void ring_pack_kv(float *kv, const float *qkv, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int i = 0; i < 2 * C; i++) kv[(size_t)n * 2 * C + i] = qkv[(size_t)n * 3 * C + C + i];
}

void ring_add_dkv(float *dqkv, const float *dkv, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int i = 0; i < 2 * C; i++) dqkv[(size_t)n * 3 * C + C + i] += dkv[(size_t)n * 2 * C + i];
}

void ring_forward_start(float *o, float *run_max, float *run_sum, int N, int C, int NH) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        for (int i = 0; i < C; i++) o[(size_t)n * C + i] = 0.0f;
        for (int h = 0; h < NH; h++) {
            OnlineSoftmax run = online_softmax_start();
            run_max[n * NH + h] = run.max;
            run_sum[n * NH + h] = run.sum;
        }
    }
}

void ring_forward_block(const RingBlock *r, float *o, float *run_max, float *run_sum, float *scores,
                        const float *qkv, const float *kv) {
    int N = 2 * r->B * r->c, hs = r->C / r->NH;
#pragma omp parallel for schedule(static)
    for (int nh = 0; nh < N * r->NH; nh++) {
        int n = nh / r->NH, h = nh % r->NH;
        OnlineSoftmax run = {run_max[nh], run_sum[nh]};
        ring_query_forward(r, n, h, o + (size_t)n * r->C + h * hs, &run, scores + (size_t)nh * r->c, qkv, kv);
        run_max[nh] = run.max;
        run_sum[nh] = run.sum;
    }
}

void ring_forward_finish(float *out, float *lse, const float *o, const float *run_max, const float *run_sum,
                         int N, int C, int NH) {
    int hs = C / NH;
#pragma omp parallel for schedule(static)
    for (int nh = 0; nh < N * NH; nh++) {
        size_t at = (size_t)(nh / NH) * C + (nh % NH) * hs;
        OnlineSoftmax run = {run_max[nh], run_sum[nh]};
        lse[nh] = attention_finish(out + at, o + at, &run, hs, 0, 1);
    }
}

void ring_backward_delta(float *delta, const float *dout, const float *out, int N, int C, int NH) {
    int hs = C / NH;
#pragma omp parallel for schedule(static)
    for (int nh = 0; nh < N * NH; nh++) {
        size_t at = (size_t)(nh / NH) * C + (nh % NH) * hs;
        delta[nh] = dot_product(dout + at, out + at, hs);
    }
}

// the queries' pass and the keys' pass write different buffers (dq, dkv): no two threads ever add
// into the same row, and the sums do not depend on thread timing
void ring_backward_block(const RingBlock *r, float *dqkv, float *dkv, float *ds, const float *qkv,
                         const float *dout, const float *lse, const float *delta, const float *kv) {
    int N = 2 * r->B * r->c, hs = r->C / r->NH;
#pragma omp parallel for schedule(static)
    for (int nh = 0; nh < N * r->NH; nh++) {
        int n = nh / r->NH, h = nh % r->NH;
        ring_query_backward(r, n, h, dqkv + (size_t)n * 3 * r->C + h * hs, ds + (size_t)nh * r->c, qkv, dout,
                            lse[nh], delta[nh], kv);
    }
#pragma omp parallel for schedule(static)
    for (int nh = 0; nh < N * r->NH; nh++) ring_key_backward(r, nh / r->NH, nh % r->NH, dkv, qkv, dout, lse, delta, kv);
}

void cp_copy_rows(float *dst, int dst_stride, int dst_col, const float *src, int src_stride, int src_col, int rows,
                  int width, bool add) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < rows; n++) {
        float *d = dst + (size_t)n * dst_stride + dst_col;
        const float *x = src + (size_t)n * src_stride + src_col;
        for (int i = 0; i < width; i++) d[i] = add ? d[i] + x[i] : x[i];
    }
}
