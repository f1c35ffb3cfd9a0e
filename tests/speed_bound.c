// speed_bound.c: the speed exercises' check (exercises/catalogue.json: decode-matvec-speed,
// gelu-speed). A kernel is graded by the share of this machine's bound it reaches, never by a time:
// the bound is an op that moves the same bytes the same way and does nothing else, timed in this
// process, interleaved with the kernel (one call of each, in turn): a busy machine slows both alike,
// so their ratio holds where either time alone swings by a factor of several. The working sets are
// larger than any cache, so the bound is the memory's, whatever the cache.
//
// One thread: on a machine shared with other work, a thread of a parallel region that loses its core
// stalls the region's end for every other thread, and a single stream of work loses only its own
// time. The median of the pairs' ratios, not the ratio of the best times, is the share: a pair's two
// calls meet the same moment of the machine, and the median ignores the pairs a burst of other work
// split.
//
// The answer is checked first, against a double-precision reference: a wrong answer is not timed.
//
// Usage: build/tests/speed_bound matvec|gelu THRESHOLD
//   matvec: matmul_forward_16 of one bf16 row (a decode step) against reading the weights' bytes
//           and nothing else (xor_bytes: no arithmetic to wait on, unlike a float sum)
//   gelu:   gelu_forward against add_inplace over the same buffers (one stream read, one read and
//           written back: the traffic of writing a buffer that is not in cache)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "base/device.h"  // ops_init
#include "base/log.h"
#include "check.h"
#include "ops/kernels.h"
#include "ops/ops.h"

// passes: at least PASSES_MIN, then more while the calls so far took under BUDGET_S (a fast kernel
// gets many chances at a quiet moment, a slow one still ends soon)
#define PASSES_MIN 5
#define PASSES_MAX 64
#define BUDGET_S 2.0

// matvec: a decode step's largest product (an MLP's down projection, widened): ~67 MB of bf16
// weights, twice the largest last-level cache this workbook has met. Neither width divides by 32.
#define MV_C 8200
#define MV_OC 4099
// gelu: 12M floats, 48 MB a buffer
#define GELU_N (12u << 20)

typedef void (*Call)(void *ctx);

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// the share of the bound reached: bound and kernel called in turn (after one warm-up each), each
// pair's ratio of times; the median of the pairs' ratios, and in *best_share the ratio of the best
// times. Returns the pairs timed.
static int share_of_bound(Call bound, Call kernel, void *ctx, double *median, double *best_share) {
    double ratio[PASSES_MAX], bound_s = 1e30, kernel_s = 1e30, start = wall_seconds();
    int pairs = 0;
    for (int pass = 0; pass <= PASSES_MIN || (pass <= PASSES_MAX && wall_seconds() - start < BUDGET_S); pass++) {
        double t0 = wall_seconds();
        bound(ctx);
        double t1 = wall_seconds();
        kernel(ctx);
        double t2 = wall_seconds();
        if (pass == 0) continue;  // the warm-up: first touches, thread start
        ratio[pairs++] = (t1 - t0) / (t2 - t1);
        bound_s = fmin(bound_s, t1 - t0), kernel_s = fmin(kernel_s, t2 - t1);
    }
    qsort(ratio, pairs, sizeof ratio[0], by_value);
    *median = pairs % 2 ? ratio[pairs / 2] : 0.5 * (ratio[pairs / 2 - 1] + ratio[pairs / 2]);
    *best_share = bound_s / kernel_s;
    return pairs;
}

static void check_share(const char *what, Call bound, Call kernel, void *ctx, double threshold) {
    double share, best_share;
    int pairs = share_of_bound(bound, kernel, ctx, &share, &best_share);
    printf("%s: share of the bound %.2f (median of %d pairs; ratio of the best times %.2f), threshold %.2f\n", what,
           share, pairs, best_share, threshold);
    CHECK(share >= threshold, "%s: too slow: %.2f of the bound, want at least %.2f", what, share, threshold);
}

// ---- matvec

typedef struct {
    int N, C, OC;
    half16 *x, *w;
    float *bias, *out;
} Matvec;

static void matvec_alloc(Matvec *m, int N, int C, int OC, uint64_t seed) {
    size_t nw = (size_t)OC * C;
    float *x = malloc_or_die((size_t)N * C * sizeof(float)), *w = malloc_or_die(nw * sizeof(float));
    *m = (Matvec){N, C, OC, malloc_or_die((size_t)N * C * 2), malloc_or_die(nw * 2),
                  malloc_or_die((size_t)OC * sizeof(float)), malloc_or_die((size_t)N * OC * sizeof(float))};
    init_normal(x, (size_t)N * C, seed, 1, 0, 1.0f);
    init_normal(w, nw, seed, 2, 0, 0.02f);
    init_normal(m->bias, OC, seed, 3, 0, 0.1f);
    cast_to_16(m->x, x, (size_t)N * C);
    cast_to_16(m->w, w, nw);
    free(x), free(w);
}

static void matvec_free(Matvec *m) { free(m->x), free(m->w), free(m->bias), free(m->out); }

static void matvec_kernel(void *ctx) {
    Matvec *m = ctx;
    matmul_forward_16(m->out, m->x, m->w, m->bias, m->N, m->C, m->OC);
}

// the xor of n bytes, read by every thread: the read bound, as nothing waits on arithmetic (bytes:
// any memory may be read as bytes, and the compiler makes the loop vectors)
static unsigned char xor_bytes(const unsigned char *p, size_t n) {
    unsigned char acc = 0;
#pragma omp parallel for schedule(static) reduction(^ : acc)
    for (size_t i = 0; i < n; i++) acc ^= p[i];
    return acc;
}

static void matvec_bound(void *ctx) {
    Matvec *m = ctx;
    volatile unsigned char x = xor_bytes((const unsigned char *)m->w, (size_t)m->OC * m->C * sizeof(half16));
    (void)x;
}

// every output against the double-precision product: within a small share of the sum of its terms'
// sizes (bf16 products are exact in f32; only the f32 sums round)
static void check_matvec_answer(Matvec *m) {
    matvec_kernel(m);
    size_t wrong = 0, first = 0;
    double first_got = 0, first_want = 0;
    for (int n = 0; n < m->N; n++)
        for (int o = 0; o < m->OC; o++) {
            double want = m->bias[o], size = fabs(m->bias[o]);
            for (int c = 0; c < m->C; c++) {
                double t = (double)bf16_to_float(m->w[(size_t)o * m->C + c]) *
                           bf16_to_float(m->x[(size_t)n * m->C + c]);
                want += t, size += fabs(t);
            }
            double got = m->out[(size_t)n * m->OC + o];
            if (!(fabs(got - want) <= 2e-5 * size)) {
                if (!wrong++) first = (size_t)n * m->OC + o, first_got = got, first_want = want;
            }
        }
    CHECK(wrong == 0, "matvec %d x %d, %d rows: %zu outputs wrong, the first (row %zu, output %zu): got %.9g, "
          "want %.9g", m->OC, m->C, m->N, wrong, first / m->OC, first % m->OC, first_got, first_want);
}

static void matvec(double threshold) {
    ops_set_half_format(HALF_BF16);
    const int shapes[][3] = {{3, 771, 41}, {1, 33, 5}, {1, MV_C, MV_OC}};  // (rows, C, OC): the last is timed
    Matvec m;
    for (int i = 0; i < 3; i++) {
        matvec_alloc(&m, shapes[i][0], shapes[i][1], shapes[i][2], 7 + i);
        check_matvec_answer(&m);
        if (i < 2) matvec_free(&m);
    }
    if (!check_failed_)
        check_share("decode matvec (bf16 weights)", matvec_bound, matvec_kernel, &m, threshold);
    matvec_free(&m);
}

// ---- gelu

typedef struct {
    size_t n;
    float *inp, *out;
} Gelu;

static void gelu_kernel(void *ctx) {
    Gelu *g = ctx;
    gelu_forward(g->out, g->inp, g->n);
}

static void gelu_bound(void *ctx) {
    Gelu *g = ctx;
    add_inplace(g->out, g->inp, g->n);
}

// every value against the tanh form in double; inputs over [-8, 8] and the edges beyond
static void check_gelu_answer(Gelu *g) {
    gelu_kernel(g);
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < g->n; i++) {
        double x = g->inp[i], want = 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
        if (!(fabs(g->out[i] - want) <= 1e-5 * fabs(want) + 1e-6) && !wrong++) first = i;
    }
    CHECK(wrong == 0, "gelu of %zu values: %zu wrong, the first gelu(%.9g): got %.9g", g->n, wrong,
          (double)g->inp[first], (double)g->out[first]);
}

static void gelu(double threshold) {
    Gelu g = {GELU_N, malloc_or_die(GELU_N * sizeof(float)), malloc_or_die(GELU_N * sizeof(float))};
    init_normal(g.inp, g.n, 11, 1, 0, 3.0f);
    const float edges[] = {0.0f, -0.0f, 20.0f, -20.0f, 1e-30f, -1e-30f, 90.0f, -90.0f};
    memcpy(g.inp + g.n - 8, edges, sizeof edges);
    check_gelu_answer(&g);
    if (!check_failed_)
        check_share("gelu_forward", gelu_bound, gelu_kernel, &g, threshold);
    free(g.inp), free(g.out);
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "matvec") && strcmp(argv[1], "gelu"))) {
        fprintf(stderr, "usage: %s matvec|gelu THRESHOLD (the share of the bound to reach)\n", argv[0]);
        return 2;
    }
    ops_init();
    omp_set_num_threads(1);
    double threshold = atof(argv[2]);
    if (!strcmp(argv[1], "matvec")) matvec(threshold);
    else gelu(threshold);
    char name[64];
    snprintf(name, sizeof name, "speed_bound %s", argv[1]);
    return test_summary(name);
}
