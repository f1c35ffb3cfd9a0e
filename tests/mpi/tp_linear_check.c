// tp_linear_check.c: stage 05's parallel linear layer against the serial one, on every grid
// that fits the world size (1, 2 or 4 ranks; the rest of the ranks is data parallelism).
// For a normal and a transposed layer: the forward output block, dX and the weight and bias
// gradients (after their reduce-scatter over z and all-reduce over data) must equal the serial
// products, computed here in double, within 1e-5. Overlap on and off.
// Prints "tp_linear_check: N passed, N failed" on rank 0; tests/test_tp_linear.sh runs it.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/device.h"
#include "base/log.h"
#include "comm/comm.h"
// The layer lives in its stage's directory, where the learner reads it; the Makefile links its
// object into this program.
#include "../../05_tensor_parallel/tp_linear.h"

enum { K = 24, M = 40, ROWS = 8 };  // in, out, rows per row group: divisible by 1, 2 and 4

static long g_passed, g_failed;

static float value(int which, int i, int j) {  // deterministic inputs, the same on every rank
    return (float)sin(1.3 * which + 0.37 * i + 0.11 * j * (which + 1));
}

static void check(const char *what, const int dims[3], int D, int tr, int ov, const float *got,
                  const double *want, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs(got[i] - want[i]) / (1.0 + fabs(want[i]));  // atol = rtol = 1e-5: float sums of K terms
        if (e > worst) worst = e;
    }
    if (worst <= 1e-5) g_passed++;
    else {
        g_failed++;
        printf("FAIL (rank %d): [%d,%d,%d] x data %d %s overlap=%d: %s off by %.2e\n", log_rank(), dims[0],
               dims[1], dims[2], D, tr ? "transposed" : "normal", ov, what, worst);
    }
}

// one layer on one grid: l's groups give this rank's block indices
static void test_layer(const TPGrid *g, const int dims[3], bool transposed, bool overlap) {
    TPLinear l = tp_linear_make(g, K, M, transposed);
    int in_i = comm_rank(l.in_group), out_i = comm_rank(l.out_group), dz = comm_rank(l.depth);
    int Kl = l.in_local, Ml = l.out_local, R = g->Z * g->D, NT = ROWS * R, rg = g->d * g->Z + g->z;
    // serial reference over all NT rows, in double
    double *Y = calloc_or_die((size_t)NT * M, sizeof(double)), *dX = calloc_or_die((size_t)NT * K, sizeof(double));
    double *dW = calloc_or_die((size_t)M * K, sizeof(double)), *db = calloc_or_die(M, sizeof(double));
    for (int n = 0; n < NT; n++)
        for (int o = 0; o < M; o++) {
            double y = value(2, 0, o);
            for (int k = 0; k < K; k++) {
                y += (double)value(0, n, k) * value(1, o, k);
                dX[(size_t)n * K + k] += (double)value(3, n, o) * value(1, o, k);
                dW[(size_t)o * K + k] += (double)value(3, n, o) * value(0, n, k);
            }
            Y[(size_t)n * M + o] = y;
            db[o] += value(3, n, o);
        }
    // this rank's pieces: rows of its row group, columns of its blocks
    float *x = malloc_or_die(sizeof(float) * ROWS * Kl), *dy = malloc_or_die(sizeof(float) * ROWS * Ml);
    float *block = malloc_or_die(sizeof(float) * l.block), *bias = malloc_or_die(sizeof(float) * Ml);
    double *wantY = malloc_or_die(sizeof(double) * ROWS * Ml), *wantdX = malloc_or_die(sizeof(double) * ROWS * Kl);
    double *wantdW = malloc_or_die(sizeof(double) * l.shard), *wantdb = malloc_or_die(sizeof(double) * Ml);
    for (int n = 0; n < ROWS; n++) {
        for (int k = 0; k < Kl; k++) {
            x[n * Kl + k] = value(0, rg * ROWS + n, in_i * Kl + k);
            wantdX[n * Kl + k] = dX[(size_t)(rg * ROWS + n) * K + in_i * Kl + k];
        }
        for (int o = 0; o < Ml; o++) {
            dy[n * Ml + o] = value(3, rg * ROWS + n, out_i * Ml + o);
            wantY[n * Ml + o] = Y[(size_t)(rg * ROWS + n) * M + out_i * Ml + o];
        }
    }
    for (int o = 0; o < Ml; o++) {
        bias[o] = value(2, 0, out_i * Ml + o);
        wantdb[o] = db[out_i * Ml + o];
        for (int k = 0; k < Kl; k++) block[o * Kl + k] = value(1, out_i * Ml + o, in_i * Kl + k);
    }
    for (size_t i = 0; i < l.shard; i++) {
        size_t e = dz * l.shard + i;  // element of the flattened block
        wantdW[i] = dW[(size_t)(out_i * Ml + e / Kl) * K + in_i * Kl + e % Kl];
    }
    // device copies; the stored weight is the shard, gathered as the model does
    float *d_x = dev_malloc(sizeof(float) * ROWS * Kl), *d_dy = dev_malloc(sizeof(float) * ROWS * Ml);
    float *d_shard = dev_malloc(sizeof(float) * l.shard), *d_bias = dev_malloc(sizeof(float) * Ml);
    float *d_y = dev_malloc(sizeof(float) * ROWS * Ml), *d_dx = dev_malloc(sizeof(float) * ROWS * Kl);
    float *d_grad = dev_malloc(sizeof(float) * l.shard), *d_db = dev_malloc(sizeof(float) * Ml);
    copy_to_device(d_x, x, sizeof(float) * ROWS * Kl);
    copy_to_device(d_dy, dy, sizeof(float) * ROWS * Ml);
    copy_to_device(d_shard, block + dz * l.shard, sizeof(float) * l.shard);
    copy_to_device(d_bias, bias, sizeof(float) * Ml);
    TPWeightStream s;
    tp_stream_init(&s, g, l.block, overlap, false);
    s.uses[0] = s.uses[1] = (TPWeightUse){&l, d_shard, NULL};
    s.n = 2;
    tp_stream_begin(&s);
    Linear W = tp_stream_next(&s);
    W.b = d_bias;
    tp_linear_forward(&l, d_y, d_x, NULL, W, ROWS);
    TPGradSlot slot;
    tp_grad_slot_alloc(&slot, l.block);
    float *dw = g->Z > 1 ? tp_grad_slot_open(&slot, &l, d_grad) : d_grad;
    tp_linear_backward(&l, d_dx, dw, d_db, d_dy, NULL, d_x, NULL, tp_stream_next(&s), ROWS, overlap);
    if (g->Z > 1) {
        tp_grad_slot_launch(&slot);
        tp_grad_slot_finish(&slot);
    }
    // the bias gradient is a copy on every z rank that saw other rows; data sums both
    tp_all_reduce(g->gz, d_db, Ml);
    tp_all_reduce(g->gdata, d_grad, l.shard);
    tp_all_reduce(g->gdata, d_db, Ml);
    float *got = malloc_or_die(sizeof(float) * (ROWS * (Ml > Kl ? Ml : Kl) + l.shard));
    int tr = transposed, ov = overlap;
    copy_to_host(got, d_y, sizeof(float) * ROWS * Ml);
    check("forward output", dims, g->D, tr, ov, got, wantY, (size_t)ROWS * Ml);
    copy_to_host(got, d_dx, sizeof(float) * ROWS * Kl);
    check("dX", dims, g->D, tr, ov, got, wantdX, (size_t)ROWS * Kl);
    copy_to_host(got, d_grad, sizeof(float) * l.shard);
    check("dW shard", dims, g->D, tr, ov, got, wantdW, l.shard);
    copy_to_host(got, d_db, sizeof(float) * Ml);
    check("dbias", dims, g->D, tr, ov, got, wantdb, Ml);
    tp_stream_free(&s);
    tp_grad_slot_free(&slot);
    void *host[] = {Y, dX, dW, db, x, dy, block, bias, wantY, wantdX, wantdW, wantdb, got};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
    void *dev[] = {d_x, d_dy, d_shard, d_bias, d_y, d_dx, d_grad, d_db};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) dev_free(dev[i]);
}

int main(int argc, char **argv) {
    Comm *world = comm_init(&argc, &argv);
    ops_init();
    int P = comm_size(world), grids = 0;
    static const int all[][3] = {{1, 1, 1}, {2, 1, 1}, {1, 2, 1}, {1, 1, 2}, {4, 1, 1}, {1, 4, 1},
                                 {2, 2, 1}, {2, 1, 2}, {1, 2, 2}, {1, 1, 4}};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        int XYZ = all[i][0] * all[i][1] * all[i][2];
        if (P % XYZ) continue;
        TPGrid g;
        tp_grid_init(&g, world, all[i]);
        grids++;
        for (int tr = 0; tr < 2; tr++)
            for (int ov = 0; ov < 2; ov++) test_layer(&g, all[i], tr, ov);
    }
    long failed = comm_sum_long(world, g_failed), passed = comm_sum_long(world, g_passed);
    if (comm_rank(world) == 0)
        printf("tp_linear_check on %d ranks, %d grids: %ld passed, %ld failed\n", P, grids, passed, failed);
    comm_finalize(world);
    return failed ? 1 : 0;
}
