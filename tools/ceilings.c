// ceilings: what this machine can do at a model's shapes, so that `make bench` can say what
// share of it each run reaches. Prints lines a shell can evaluate:
//
//   export CEILING_MATMUL_F32=3.41e+11  # 341 GFLOP/s: f32 matmuls of one block and the head ...
//   export CEILING_MATMUL_BF16=...
//   export CEILING_READ=...             # bytes/s read by OMP_NUM_THREADS threads
//   export CEILING_MATMUL_F32_768x2304=...  # one linear's forward and backward, alone (each of the five)
//
// The matmul ceiling is the rate of exactly the matmuls a training step of the model runs, alone:
// the forward and backward of a block's four linears and of the head, at N rows. A whole step
// cannot run its matmuls faster than that, and adds everything else (attention, LayerNorm, GELU,
// the loss, AdamW) on top. MFU's peak (build/peak_flops) is a 1024^3 matmul instead: the best
// case, not the model's.
//
// Usage: build/ceilings N C V   (rows per step, width, padded vocabulary)
#include <stdio.h>
#include <stdlib.h>

#include "base/device.h"
#include "base/log.h"
#include "ops/ops.h"
#include "run/run_stats.h"

#define PASSES 5

typedef struct {
    int N, C, V;
} Shape;

// the (in, out) widths of a GPT-2 block's linears (qkv, attention projection, MLP up and down) and
// of the head
static void linear_widths(const Shape *s, int in[5], int out[5]) {
    const int C = s->C, ins[5] = {C, C, C, 4 * C, C}, outs[5] = {3 * C, C, 4 * C, C, s->V};
    for (int i = 0; i < 5; i++) in[i] = ins[i], out[i] = outs[i];
}

// FLOP of one forward (2 N in out) and backward (4 N in out) of every linear
static double pass_flops(const Shape *s) {
    int in[5], out[5];
    linear_widths(s, in, out);
    double f = 0;
    for (int i = 0; i < 5; i++) f += 6.0 * s->N * in[i] * out[i];
    return f;
}

typedef struct {
    float *w, *dw, *b, *db, *out, *dout, *in, *din;
    half16 *w16, *in16, *dout16;
} Buffers;

static void alloc_buffers(Buffers *k, const Shape *s, int cin, int cout) {
    size_t nw = (size_t)cin * cout, nin = (size_t)s->N * cin, nout = (size_t)s->N * cout;
    k->w = dev_malloc(nw * 4), k->dw = dev_malloc(nw * 4), k->b = dev_malloc(cout * 4), k->db = dev_malloc(cout * 4);
    k->out = dev_malloc(nout * 4), k->dout = dev_malloc(nout * 4), k->in = dev_malloc(nin * 4), k->din = dev_malloc(nin * 4);
    k->w16 = dev_malloc(nw * 2), k->in16 = dev_malloc(nin * 2), k->dout16 = dev_malloc(nout * 2);
    init_normal(k->w, nw, 1, 1, 0, 0.02f);
    init_normal(k->in, nin, 1, 2, 0, 1.0f);
    init_normal(k->dout, nout, 1, 3, 0, 1e-3f);
    cast_to_16(k->w16, k->w, nw);
    cast_to_16(k->in16, k->in, nin);
    cast_to_16(k->dout16, k->dout, nout);
}

static void one_linear(const Buffers *k, const Shape *s, int cin, int cout, int bf16_inputs) {
    if (bf16_inputs) {
        matmul_forward_16(k->out, k->in16, k->w16, k->b, s->N, cin, cout);
        matmul_backward_16(k->din, k->dw, k->db, k->dout, k->dout16, k->in16, k->w16, s->N, cin, cout);
    } else {
        matmul_forward(k->out, k->in, k->w, k->b, s->N, cin, cout);
        matmul_backward(k->din, k->dw, k->db, k->dout, k->in, k->w, s->N, cin, cout);
    }
}

// best of PASSES passes over the five linears, forward and backward, after one warm-up pass;
// rate[i]: linear i's own (its FLOP over its best time in those passes)
static double matmul_rate(const Shape *s, int bf16_inputs, double rate[5]) {
    int in[5], out[5];
    linear_widths(s, in, out);
    Buffers k[5];
    for (int i = 0; i < 5; i++) alloc_buffers(&k[i], s, in[i], out[i]);
    double best = 1e30, best_one[5] = {1e30, 1e30, 1e30, 1e30, 1e30};
    for (int pass = 0; pass <= PASSES; pass++) {
        dev_synchronize();
        double t0 = wall_seconds();
        for (int i = 0; i < 5; i++) {
            double t = wall_seconds();
            one_linear(&k[i], s, in[i], out[i], bf16_inputs);
            dev_synchronize();
            if (pass > 0 && wall_seconds() - t < best_one[i]) best_one[i] = wall_seconds() - t;
        }
        if (pass > 0 && wall_seconds() - t0 < best) best = wall_seconds() - t0;
    }
    for (int i = 0; i < 5; i++) rate[i] = 6.0 * s->N * in[i] * out[i] / best_one[i];
    for (int i = 0; i < 5; i++) {
        void *all[] = {k[i].w, k[i].dw, k[i].b, k[i].db, k[i].out, k[i].dout, k[i].in, k[i].din,
                       k[i].w16, k[i].in16, k[i].dout16};
        for (size_t j = 0; j < sizeof all / sizeof all[0]; j++) dev_free(all[j]);
    }
    return pass_flops(s) / best;
}

// bytes/s of a sum over 1 GiB: what reading weights that do not fit in a cache costs
static double read_rate_of_a_gib(void) {
    const size_t n = (size_t)1 << 28;
    float *x = dev_malloc(n * sizeof(float));
    fill_constant(x, n, 1.0f);
    double rate = read_rate(x, n, PASSES), total = sum_values(x, n);
    if (total != (double)n) fatal("ceilings: the sum of %zu ones is %.0f", n, total);
    dev_free(x);
    return rate;
}

static int positive_arg(const char *s, const char *what) {
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v <= 0 || v > 1 << 24) fatal("ceilings: %s is '%s': expected a positive number", what, s);
    return (int)v;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: build/ceilings N C V   (rows per step, width, padded vocabulary)\n");
        return 2;
    }
    Shape s = {positive_arg(argv[1], "N"), positive_arg(argv[2], "C"), positive_arg(argv[3], "V")};
    ops_init();
    const char *what = "the forward and backward of one block's four linears and the head";
    double f32[5], bf16[5];
    int in[5], out[5];
    linear_widths(&s, in, out);
    printf("export CEILING_MATMUL_F32=%.4e  # f32 matmuls: %s, N=%d C=%d V=%d, best of %d (%s)\n",
           matmul_rate(&s, 0, f32), what, s.N, s.C, s.V, PASSES, ops_matmul_engine());
    printf("export CEILING_MATMUL_BF16=%.4e  # bf16 matmuls: the same (%s)\n", matmul_rate(&s, 1, bf16),
           ops_matmul_engine_16());
    printf("export CEILING_READ=%.4e  # bytes/s: a sum over 1 GiB, best of %d\n", read_rate_of_a_gib(), PASSES);
    // each linear alone: the ceiling for a matmul of its shape (tools/step_bound.py); the
    // attention projection and the MLP's down projection share a shape only when 4C == C
    for (int i = 0; i < 5; i++)
        for (int bf = 0; bf < 2; bf++)
            printf("export CEILING_MATMUL_%s_%dx%d=%.4e  # %s: the %d -> %d linear alone, forward and backward\n",
                   bf ? "BF16" : "F32", in[i], out[i], bf ? bf16[i] : f32[i], bf ? "bf16" : "f32", in[i], out[i]);
    return 0;
}
