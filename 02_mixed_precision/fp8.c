// fp8.c: see fp8.h.
#include "fp8.h"

#include "base/device.h"
#include "model/activations.h"
#include "ops/ops.h"

// x onto the FP8 grid of `format`, scaled by this step's amax (current scaling), into out as bf16
static void round_to_fp8(half16 *out, const float *x, size_t n, Fp8Format format) {
    cast_to_fp8_grid(out, x, n, format, fp8_scale_pow2((float)abs_max(x, n), format));
}

// the head (and a layer without a 16-bit copy) stays with the wrapped layers
static bool runs_in_fp8(LinearKind k, const Linear *w) { return k != LIN_HEAD && w->w16; }

static void fp8_linear_forward(LayerOps *ops, LinearKind k, float *out, const float *inp, half16 *inp16,
                               const Linear *w, int N, int in_dim, int out_dim) {
    Fp8Layers *f = (Fp8Layers *)ops;
    if (!runs_in_fp8(k, w)) {
        f->inner->linear_forward(f->inner, k, out, inp, inp16, w, N, in_dim, out_dim);
        return;
    }
    round_to_fp8(inp16, inp, (size_t)N * in_dim, FP8_E4M3);  // also what backward reads
    round_to_fp8(f->weight8, w->w, (size_t)out_dim * in_dim, FP8_E4M3);
    matmul_forward_16(out, inp16, f->weight8, w->b, N, in_dim, out_dim);
}

static void fp8_linear_backward(LayerOps *ops, LinearKind k, float *dinp, Linear *g, const float *dout,
                                half16 *dout16, const float *inp, const half16 *inp16, const Linear *w, int N,
                                int in_dim, int out_dim) {
    Fp8Layers *f = (Fp8Layers *)ops;
    if (!runs_in_fp8(k, w)) {
        f->inner->linear_backward(f->inner, k, dinp, g, dout, dout16, inp, inp16, w, N, in_dim, out_dim);
        return;
    }
    round_to_fp8(dout16, dout, (size_t)N * out_dim, FP8_E5M2);
    round_to_fp8(f->weight8, w->w, (size_t)out_dim * in_dim, FP8_E4M3);  // the forward's weight again
    matmul_backward_16(dinp, g->w, g->b, dout, dout16, inp16, f->weight8, N, in_dim, out_dim);
}

void fp8_attach(Fp8Layers *f, Activations *acts, const ParamLayout *layout) {
    f->inner = acts->ops;
    f->ops = *acts->ops;
    f->ops.linear_forward = fp8_linear_forward;
    f->ops.linear_backward = fp8_linear_backward;
    f->bytes = layout_block_numel(layout, layout->first_block) * sizeof(half16);
    f->weight8 = dev_malloc(f->bytes);
    acts->ops = &f->ops;
}

void fp8_free(Fp8Layers *f) { dev_free(f->weight8); }
