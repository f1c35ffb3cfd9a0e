// ceilings: what this machine can do at a model's shapes, so that `make bench` can say what
// share of it each run reaches. Prints lines a shell can evaluate:
//
//   export CEILING_MATMUL_F32=3.41e+11  # 341 GFLOP/s: f32 matmuls of one block and the head ...
//   export CEILING_MATMUL_BF16=...
//   export CEILING_READ=...             # bytes/s read by OMP_NUM_THREADS threads, streaming
//   export CEILING_MATMUL_F32_FWD_768x2304=...  # one linear's forward alone (each of the five)
//   export CEILING_MATMUL_F32_BWD_768x2304=...  # ... and its backward alone (both products)
//   export CEILING_BW_UPDATE_1048576=...        # bytes/s of a read+write op moving 1 MiB a call
//
// The matmul ceiling is the rate of exactly the matmuls a training step of the model runs, alone:
// the forward and backward of a block's four linears and of the head, at N rows. A whole step
// cannot run its matmuls faster than that, and adds everything else (attention, LayerNorm, GELU,
// the loss, AdamW) on top. MFU's peak (build/peak_flops) is a 1024^3 matmul instead: the best
// case, not the model's. Each linear's forward and backward are measured apart, as the step runs
// them: the backward's products read an operand transposed, and run at a rate of their own; each
// is called several times in a row, its operands as warm as a step can have them, and the best
// call kept: a ceiling a step's call cannot beat.
//
// The bandwidth ceilings are measured the way the ops use memory (read only: a sum; write only:
// zeroing; read and write: an in-place add), at sizes from cache-resident to streaming: an op
// whose inputs were just written by the op before it finds them in cache, and a ceiling measured
// over 1 GiB only would be one it beats. Every figure is the best of PASSES timings after a
// warm-up (a linear's of LINEAR_CALLS, a streaming size's of STREAM_PASSES), with the spread
// (slowest / fastest - 1) printed beside it: a wide spread says the machine was busy, and the best
// is the one a bound can trust.
//
// Usage: build/ceilings N C V   (rows per step, width, padded vocabulary)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/device.h"
#include "base/log.h"
#include "ops/ops.h"

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

// the linears of a block have biases; the head, GPT-2's tied to the embedding, has none (and no
// column sums of the logits' gradient in its backward)
static int has_bias(int linear) { return linear < 4; }

static void alloc_buffers(Buffers *k, const Shape *s, int cin, int cout, int bias) {
    size_t nw = (size_t)cin * cout, nin = (size_t)s->N * cin, nout = (size_t)s->N * cout;
    k->w = dev_malloc(nw * 4), k->dw = dev_malloc(nw * 4);
    k->b = bias ? dev_malloc(cout * 4) : NULL, k->db = bias ? dev_malloc(cout * 4) : NULL;
    k->out = dev_malloc(nout * 4), k->dout = dev_malloc(nout * 4), k->in = dev_malloc(nin * 4), k->din = dev_malloc(nin * 4);
    k->w16 = dev_malloc(nw * 2), k->in16 = dev_malloc(nin * 2), k->dout16 = dev_malloc(nout * 2);
    init_normal(k->w, nw, 1, 1, 0, 0.02f);
    init_normal(k->in, nin, 1, 2, 0, 1.0f);
    init_normal(k->dout, nout, 1, 3, 0, 1e-3f);
    cast_to_16(k->w16, k->w, nw);
    cast_to_16(k->in16, k->in, nin);
    cast_to_16(k->dout16, k->dout, nout);
}

static void one_linear_forward(const Buffers *k, const Shape *s, int cin, int cout, int bf16_inputs) {
    if (bf16_inputs) matmul_forward_16(k->out, k->in16, k->w16, k->b, s->N, cin, cout);
    else matmul_forward(k->out, k->in, k->w, k->b, s->N, cin, cout);
}

// the backward as a step runs it: its weight gradients written by the step's first micro-batch
// (GRAD_WRITE, no read of the old gradient) and added by the others (GRAD_ADD)
static void one_linear_backward(const Buffers *k, const Shape *s, int cin, int cout, int bf16_inputs, GradMode grads) {
    if (bf16_inputs)
        matmul_backward_16_mode(k->din, k->dw, k->db, k->dout, k->dout16, k->in16, k->w16, s->N, cin, cout, grads);
    else matmul_backward_mode(k->din, k->dw, k->db, k->dout, k->in, k->w, s->N, cin, cout, grads);
}

// the best (lowest) and the slowest of the PASSES timings kept
typedef struct {
    double best, worst;
} Timings;

static void timings_add(Timings *t, double seconds) {
    if (seconds < t->best) t->best = seconds;
    if (seconds > t->worst) t->worst = seconds;
}

static double timings_spread(const Timings *t) { return t->worst / t->best - 1.0; }

static void free_buffers(Buffers *k) {
    void *all[] = {k->w, k->dw, k->b, k->db, k->out, k->dout, k->in, k->din, k->w16, k->in16, k->dout16};
    for (size_t j = 0; j < sizeof all / sizeof all[0]; j++) dev_free(all[j]);
}

// best of PASSES passes over the five linears, forward and backward, after one warm-up pass: the
// set's rate; its spread in *spread
static double matmul_rate(const Shape *s, int bf16_inputs, double *spread) {
    int in[5], out[5];
    linear_widths(s, in, out);
    Buffers k[5];
    for (int i = 0; i < 5; i++) alloc_buffers(&k[i], s, in[i], out[i], has_bias(i));
    Timings whole = {1e30, 0};
    for (int pass = 0; pass <= PASSES; pass++) {
        dev_synchronize();
        double t0 = wall_seconds();
        for (int i = 0; i < 5; i++) {
            one_linear_forward(&k[i], s, in[i], out[i], bf16_inputs);
            one_linear_backward(&k[i], s, in[i], out[i], bf16_inputs, pass % 2 ? GRAD_WRITE : GRAD_ADD);
        }
        dev_synchronize();
        if (pass > 0) timings_add(&whole, wall_seconds() - t0);
    }
    *spread = timings_spread(&whole);
    for (int i = 0; i < 5; i++) free_buffers(&k[i]);
    return pass_flops(s) / whole.best;
}

// One linear's ceilings, forward and backward apart: each direction called LINEAR_CALLS times in
// a row after a warm-up call, each call timed, the best kept. In a row, each call finds its
// operands where the one before left them, in cache as far as they fit: the best case, which no
// call in a step beats (a step's linear finds its input just written by the op before it). The
// backward's calls alternate the two ways a step runs it (weight gradients written by the first
// micro-batch, added by the others): the best is the faster's. *spread: the wider of the two.
#define LINEAR_CALLS 12
static void linear_ceilings(const Shape *s, int cin, int cout, int bias, int bf16_inputs, double *fwd, double *bwd,
                            double *spread) {
    Buffers k;
    alloc_buffers(&k, s, cin, cout, bias);
    Timings f = {1e30, 0}, b = f;
    for (int call = 0; call <= LINEAR_CALLS; call++) {
        double t0 = wall_seconds();
        one_linear_forward(&k, s, cin, cout, bf16_inputs);
        dev_synchronize();
        if (call > 0) timings_add(&f, wall_seconds() - t0);
    }
    for (int call = 0; call <= LINEAR_CALLS; call++) {
        double t0 = wall_seconds();
        one_linear_backward(&k, s, cin, cout, bf16_inputs, call % 2 ? GRAD_WRITE : GRAD_ADD);
        dev_synchronize();
        if (call > 0) timings_add(&b, wall_seconds() - t0);
    }
    free_buffers(&k);
    *fwd = 2.0 * s->N * cin * cout / f.best, *bwd = 4.0 * s->N * cin * cout / b.best;
    *spread = fmax(timings_spread(&f), timings_spread(&b));
}

// ---- memory bandwidth, the way each kind of op uses it

// the ways an op uses memory: reads only (sum_values, as sum_squares does), writes only (dev_zero,
// the step's one such op), reads and writes (add_inplace: two streams read, one written back
// in place, as AdamW, the casts and the element-wise ops do)
enum { BW_READ, BW_WRITE, BW_UPDATE, BW_KINDS };
static const char *const BW_NAMES[BW_KINDS] = {"READ", "WRITE", "UPDATE"};
// the bytes a call moves, as its trace span counts them: from a few cache-resident sizes (an L2,
// a shared L3) to streaming from memory
static const size_t BW_SIZES[] = {256u << 10, 1u << 20, 4u << 20, 16u << 20, 64u << 20, 1u << 30};
#define BW_SIZE_COUNT (sizeof BW_SIZES / sizeof BW_SIZES[0])
#define BW_BYTES_PER_TIMING (64u << 20)  // a small size is called again until a timing moves this much

// one call of the op of that kind over buffers of n floats moving `bytes`
static void bw_call(int kind, float *x, float *y, size_t bytes) {
    if (kind == BW_READ) sum_values(x, bytes / sizeof(float));
    else if (kind == BW_UPDATE) add_inplace(x, y, bytes / (3 * sizeof(float)));
    else dev_zero(x, bytes);
}

// A streaming size is timed STREAM_PASSES times, about a second at 1 GiB: a shared machine's memory
// rate moves by tens of percent from one moment to the next, and a step's sweep may run at the
// best of it
#define STREAM_PASSES 25

// bytes/s of the kind at that size: calls repeated to BW_BYTES_PER_TIMING a timing, best of PASSES
// (STREAM_PASSES from BW_BYTES_PER_TIMING on) after a warm-up; *spread: the timings' spread
static double bandwidth(int kind, float *x, float *y, size_t bytes, double *spread) {
    size_t calls = bytes >= BW_BYTES_PER_TIMING ? 1 : BW_BYTES_PER_TIMING / bytes;
    int passes = bytes >= BW_BYTES_PER_TIMING ? STREAM_PASSES : PASSES;
    Timings t = {1e30, 0};
    for (int pass = 0; pass <= passes; pass++) {
        double t0 = wall_seconds();
        for (size_t c = 0; c < calls; c++) bw_call(kind, x, y, bytes);
        if (pass > 0) timings_add(&t, wall_seconds() - t0);
    }
    *spread = timings_spread(&t);
    return (double)calls * bytes / t.best;
}

// every kind at every size, one line each; the streaming read is also CEILING_READ (what
// scripts/bench.sh and stage 06's decode bound read)
static void print_bandwidths(void) {
    size_t largest = BW_SIZES[BW_SIZE_COUNT - 1];
    float *x = dev_malloc(largest), *y = dev_malloc(largest);
    fill_constant(x, largest / sizeof(float), 1.0f);
    fill_constant(y, largest / sizeof(float), 1.0f);
    double total = sum_values(x, largest / sizeof(float));
    if (total != (double)(largest / sizeof(float))) fatal("ceilings: the sum of %zu ones is %.0f", largest / sizeof(float), total);
    for (int kind = 0; kind < BW_KINDS; kind++)
        for (size_t i = 0; i < BW_SIZE_COUNT; i++) {
            double spread, rate = bandwidth(kind, x, y, BW_SIZES[i], &spread);
            int passes = BW_SIZES[i] >= BW_BYTES_PER_TIMING ? STREAM_PASSES : PASSES;
            printf("export CEILING_BW_%s_%zu=%.4e  # bytes/s: %s, %zu KiB a call, best of %d (spread %.0f%%)\n",
                   BW_NAMES[kind], BW_SIZES[i], rate,
                   kind == BW_READ ? "sum_values" : kind == BW_WRITE ? "dev_zero" : "add_inplace",
                   BW_SIZES[i] >> 10, passes, 100 * spread);
            if (kind == BW_READ && BW_SIZES[i] == largest)
                printf("export CEILING_READ=%.4e  # bytes/s: a sum over 1 GiB, best of %d (spread %.0f%%)\n", rate,
                       passes, 100 * spread);
            if (kind == BW_UPDATE) fill_constant(x, largest / sizeof(float), 1.0f);  // the adds grew it
        }
    dev_free(x), dev_free(y);
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
    double spread, rate = matmul_rate(&s, 0, &spread);
    printf("export CEILING_MATMUL_F32=%.4e  # f32 matmuls: %s, N=%d C=%d V=%d, best of %d, spread %.0f%% (%s)\n",
           rate, what, s.N, s.C, s.V, PASSES, 100 * spread, ops_matmul_engine());
    rate = matmul_rate(&s, 1, &spread);
    printf("export CEILING_MATMUL_BF16=%.4e  # bf16 matmuls: the same, spread %.0f%% (%s)\n", rate, 100 * spread,
           ops_matmul_engine_16());
    // each linear alone, forward and backward apart: the ceiling for a matmul of its shape and
    // direction (tools/step_bound.py); the attention projection and the MLP's down projection share
    // a shape only when 4C == C
    int in[5], out[5];
    linear_widths(&s, in, out);
    for (int i = 0; i < 5; i++)
        for (int bf = 0; bf < 2; bf++) {
            double fwd, bwd;
            linear_ceilings(&s, in[i], out[i], has_bias(i), bf, &fwd, &bwd, &spread);
            for (int dir = 0; dir < 2; dir++)
                printf("export CEILING_MATMUL_%s_%s_%dx%d=%.4e  # %s: the %d -> %d linear's %s alone, best of %d "
                       "in a row (spread %.0f%%)\n",
                       bf ? "BF16" : "F32", dir ? "BWD" : "FWD", in[i], out[i], dir ? bwd : fwd, bf ? "bf16" : "f32",
                       in[i], out[i], dir ? "backward (data and weights)" : "forward", LINEAR_CALLS, 100 * spread);
        }
    print_bandwidths();
    return 0;
}
