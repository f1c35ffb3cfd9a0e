// fp8.c: see fp8.h.
#include "fp8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "model/activations.h"
#include "model/checkpoint.h"
#include "ops/ops.h"
#include "run/run_checkpoint.h"

// MX's block: 32 elements share a scale (OCP Microscaling)
#define MX_BLOCK 32

// the head (and a layer without a 16-bit copy) stays with the wrapped layers
static bool runs_in_fp8(LinearKind k, const Linear *w) { return k != LIN_HEAD && w->w16; }

static unsigned long long *clips_of(Fp8Layers *f, int operand) { return f->clips + operand * FP8_CLIPS; }

// ---- tensorwise: a scale a tensor, from its amax now or from its history --------------------------

static AmaxHistory *history_of(Fp8Layers *f, const float *weight, int operand) {
    for (int i = 0; i < f->n_histories; i++)
        if (f->histories[i].weight == weight && f->histories[i].operand == operand) return &f->histories[i];
    if (f->n_histories == f->max_histories)
        fatal("fp8: more FP8 linears than the layout's %d blocks hold", f->max_histories / (FP8_OPERANDS * LIN_HEAD));
    AmaxHistory *h = &f->histories[f->n_histories];
    *h = (AmaxHistory){.weight = weight, .operand = operand,
                       .amax = f->history_len ? calloc_or_die((size_t)f->history_len, sizeof(float)) : NULL};
    if (f->resumed)  // the checkpoint's row of this history, oldest first: the next amax replaces the oldest
        memcpy(h->amax, f->resumed + (size_t)f->n_histories * f->history_len, (size_t)f->history_len * sizeof(float));
    f->n_histories++;
    return h;
}

// ---- delayed scaling's histories in the checkpoint ---------------------------------------------

#define HISTORY_TENSOR "fp8_amax_history"

// a row a history, rotated to start at its oldest amax (where its next goes), zeros for those not made
static void write_histories(const void *ctx, float *out) {
    const Fp8Layers *f = ctx;
    int len = f->history_len;
    memset(out, 0, (size_t)f->max_histories * len * sizeof(float));
    for (int i = 0; i < f->n_histories; i++)
        for (int j = 0; j < len; j++) out[(size_t)i * len + j] = f->histories[i].amax[(f->histories[i].next + j) % len];
}

// keeps the histories in every checkpoint and, resuming, reads the saved ones back; a checkpoint saved
// before they were kept starts them empty, as the run's first steps did
static void keep_histories(Fp8Layers *f, const Config *cfg) {
    checkpoint_keep_extra(HISTORY_TENSOR, f->max_histories, f->history_len, write_histories, f);
    if (!cfg->resume) return;
    f->resumed = malloc_or_die((size_t)f->max_histories * f->history_len * sizeof(float));
    if (checkpoint_load_optimizer_extra(cfg->out_dir, HISTORY_TENSOR, f->max_histories, f->history_len, f->resumed))
        return;
    fprintf(stderr, "warning: %s/optimizer.safetensors holds no %s (saved before the histories were kept): "
            "delayed scaling resumes with empty histories, so the losses part from an uninterrupted run's\n",
            cfg->out_dir, HISTORY_TENSOR);
    free(f->resumed);
    f->resumed = NULL;
}

// the largest amax of the last casts: 0 before the first, so that the first scale is 1
static float history_amax(const AmaxHistory *h, int len) {
    float m = 0.0f;
    for (int i = 0; i < len; i++) m = fmaxf(m, h->amax[i]);
    return m;
}

// current scaling: this cast's amax; delayed: the history's, which then records this cast's; none: 1
static float tensorwise_scale(Fp8Layers *f, AmaxHistory *h, const float *x, size_t n, Fp8Format format) {
    if (f->unscaled) return h->last_scale = 1.0f;
    float amax = (float)abs_max(x, n);
    if (!f->history_len) return h->last_scale = fp8_scale_pow2(amax, format);
    h->last_scale = fp8_scale_pow2(history_amax(h, f->history_len), format);
    h->amax[h->next] = amax;
    h->next = (h->next + 1) % f->history_len;
    return h->last_scale;
}

static void cast_with_scale(Fp8Layers *f, half16 *out, const float *x, size_t n, Fp8Format format, int operand,
                            float scale) {
    cast_to_fp8_grid(out, x, n, format, scale, clips_of(f, operand));
    f->values[operand] += (double)n;
}

// returns the scale it cast with
static float cast_tensorwise(Fp8Layers *f, half16 *out, const float *x, size_t n, Fp8Format format,
                             const Linear *w, int operand) {
    AmaxHistory *h = history_of(f, w->w, operand);
    float scale = tensorwise_scale(f, h, x, n, format);
    cast_with_scale(f, out, x, n, format, operand, scale);
    return scale;
}

// ---- rowwise and MX: a scale a group along the matmul's reduction dimension -------------------------

// x (rows, cols) onto the grid with a scale per row (along_columns 0) or per column (1): the whole
// line under rowwise, each block of 32 of it under MX
static void cast_grouped(Fp8Layers *f, half16 *out, const float *x, int rows, int cols, int along_columns,
                         int operand) {
    bool mx = f->prec == PREC_MXFP8;
    int group = mx ? MX_BLOCK : along_columns ? rows : cols;
    cast_to_fp8_grid_grouped(out, x, rows, cols, group, along_columns, FP8_E4M3, mx, clips_of(f, operand));
    f->values[operand] += (double)rows * cols;
}

static half16 *input8_buffer(Fp8Layers *f, size_t numel) {
    if (numel > f->input8_numel) {
        dev_free(f->input8);
        f->input8 = dev_malloc(numel * sizeof(half16));
        f->input8_numel = numel;
    }
    return f->input8;
}

// ---- the inputs kept for backward --------------------------------------------------------------

static SavedInput *saved_input_of(Fp8Layers *f, const half16 *inp16) {
    for (int i = 0; i < f->n_inputs; i++)
        if (f->inputs[i].inp16 == inp16) return &f->inputs[i];
    return NULL;
}

static void save_input(Fp8Layers *f, const half16 *inp16, const float *inp, int N, int in_dim) {
    SavedInput *s = saved_input_of(f, inp16);
    if (!s) {
        if (f->n_inputs == f->max_inputs) fatal("fp8: more linear inputs than the layout's linears");
        s = &f->inputs[f->n_inputs++];
        *s = (SavedInput){.inp16 = inp16, .x = dev_malloc(f->max_tokens * in_dim * sizeof(float))};
    }
    dev_copy(s->x, inp, (size_t)N * in_dim * sizeof(float));
}

static const float *saved_input(Fp8Layers *f, const half16 *inp16) {
    SavedInput *s = saved_input_of(f, inp16);
    if (!s) fatal("fp8: a linear's backward before its forward");
    return s->x;
}

// ---- the linear layer --------------------------------------------------------------------------

static void fp8_linear_forward(LayerOps *ops, LinearKind k, float *out, const float *inp, half16 *inp16,
                               const Linear *w, int N, int in_dim, int out_dim) {
    Fp8Layers *f = (Fp8Layers *)ops;
    if (!runs_in_fp8(k, w)) {
        f->inner->linear_forward(f->inner, k, out, inp, inp16, w, N, in_dim, out_dim);
        return;
    }
    save_input(f, inp16, inp, N, in_dim);
    if (f->prec == PREC_FP8_TENSORWISE) {  // on the FP8 tensor cores where the GPU has them (ops.h)
        float inp_scale = cast_tensorwise(f, inp16, inp, (size_t)N * in_dim, FP8_E4M3, w, FP8_INPUT);
        float w_scale = cast_tensorwise(f, f->weight8, w->w, (size_t)out_dim * in_dim, FP8_E4M3, w, FP8_WEIGHT);
        matmul_forward_fp8(out, inp16, inp_scale, f->weight8, w_scale, w->b, N, in_dim, out_dim);
        return;
    }
    // rowwise and MX: both along in_dim, the reduction dimension, multiplied as the grid values
    cast_grouped(f, inp16, inp, N, in_dim, 0, FP8_INPUT);
    cast_grouped(f, f->weight8, w->w, out_dim, in_dim, 0, FP8_WEIGHT);
    matmul_forward_16(out, inp16, f->weight8, w->b, N, in_dim, out_dim);
}

// the forward's input and weight again under the forward's scales (a linear sharing its input with
// another, as phi's parallel attention and MLP do, finds inp16 cast the other's way under delayed
// scaling), dout in e5m2
static void tensorwise_backward(Fp8Layers *f, float *dinp, Linear *g, const float *dout, half16 *dout16,
                                const float *inp, const Linear *w, int N, int in_dim, int out_dim) {
    float dout_scale = cast_tensorwise(f, dout16, dout, (size_t)N * out_dim, FP8_E5M2, w, FP8_OUTPUT_GRAD);
    half16 *input8 = input8_buffer(f, (size_t)N * in_dim);
    float inp_scale = history_of(f, w->w, FP8_INPUT)->last_scale, w_scale = history_of(f, w->w, FP8_WEIGHT)->last_scale;
    cast_with_scale(f, input8, inp, (size_t)N * in_dim, FP8_E4M3, FP8_INPUT, inp_scale);
    cast_with_scale(f, f->weight8, w->w, (size_t)out_dim * in_dim, FP8_E4M3, FP8_WEIGHT, w_scale);
    matmul_backward_fp8(dinp, g->w, g->b, dout, dout16, dout_scale, input8, inp_scale, f->weight8, w_scale, N, in_dim,
                        out_dim);
}

// each matmul's operands cast along its own reduction dimension
static void grouped_backward(Fp8Layers *f, float *dinp, Linear *g, const float *dout, half16 *dout16,
                             const float *inp, const Linear *w, int N, int in_dim, int out_dim) {
    if (dinp) {  // dinp = dout W: over out_dim, dout's rows and W's columns
        cast_grouped(f, dout16, dout, N, out_dim, 0, FP8_OUTPUT_GRAD);
        cast_grouped(f, f->weight8, w->w, out_dim, in_dim, 1, FP8_WEIGHT);
        matmul_backward_16(dinp, NULL, NULL, dout, dout16, NULL, f->weight8, N, in_dim, out_dim);
    }
    // dW = dout^T x: over the tokens, both by columns
    half16 *input8 = input8_buffer(f, (size_t)N * in_dim);
    cast_grouped(f, dout16, dout, N, out_dim, 1, FP8_OUTPUT_GRAD);
    cast_grouped(f, input8, inp, N, in_dim, 1, FP8_INPUT);
    matmul_backward_16(NULL, g->w, g->b, dout, dout16, input8, NULL, N, in_dim, out_dim);
}

static void fp8_linear_backward(LayerOps *ops, LinearKind k, float *dinp, Linear *g, const float *dout,
                                half16 *dout16, const float *inp, const half16 *inp16, const Linear *w, int N,
                                int in_dim, int out_dim) {
    Fp8Layers *f = (Fp8Layers *)ops;
    if (!runs_in_fp8(k, w)) {
        f->inner->linear_backward(f->inner, k, dinp, g, dout, dout16, inp, inp16, w, N, in_dim, out_dim);
        return;
    }
    const float *x = saved_input(f, inp16);  // inp is the forward's scratch, long since reused
    if (f->prec == PREC_FP8_TENSORWISE) tensorwise_backward(f, dinp, g, dout, dout16, x, w, N, in_dim, out_dim);
    else grouped_backward(f, dinp, g, dout, dout16, x, w, N, in_dim, out_dim);
}

void fp8_attach(Fp8Layers *f, const Config *cfg, Activations *acts, const ParamLayout *layout) {
    *f = (Fp8Layers){.prec = cfg->prec};
    if (!config_is_fp8(cfg)) return;
    f->inner = acts->ops;
    f->ops = *acts->ops;
    f->ops.linear_forward = fp8_linear_forward;
    f->ops.linear_backward = fp8_linear_backward;
    f->bytes = layout_block_numel(layout, layout->first_block) * sizeof(half16);
    f->weight8 = dev_malloc(f->bytes);
    f->clips = dev_malloc(FP8_OPERANDS * FP8_CLIPS * sizeof(unsigned long long));
    f->history_len = strcmp(cfg->fp8_scaling, "delayed") == 0 ? cfg->fp8_amax_history : 0;
    f->unscaled = strcmp(cfg->fp8_scaling, "none") == 0;
    f->max_histories = FP8_OPERANDS * LIN_HEAD * layout->n_blocks;  // the block's linears: the kinds before the head
    f->histories = calloc_or_die((size_t)f->max_histories, sizeof(AmaxHistory));
    if (f->history_len) keep_histories(f, cfg);
    f->max_inputs = LIN_HEAD * layout->n_blocks;
    f->inputs = calloc_or_die((size_t)f->max_inputs, sizeof(SavedInput));
    f->max_tokens = (size_t)acts->spec.B * acts->spec.T;
    acts->ops = &f->ops;
}

const Fp8StepStats *fp8_step_stats(Fp8Layers *f) {
    if (!f->clips) return NULL;
    unsigned long long clips[FP8_OPERANDS * FP8_CLIPS];
    copy_to_host(clips, f->clips, sizeof clips);
    dev_zero(f->clips, sizeof clips);
    for (int op = 0; op < FP8_OPERANDS; op++) {
        double n = f->values[op] > 0 ? f->values[op] : 1;
        f->stats.saturated[op] = (double)clips[op * FP8_CLIPS + FP8_SATURATED] / n;
        f->stats.underflow[op] = (double)clips[op * FP8_CLIPS + FP8_FLUSHED] / n;
        f->values[op] = 0;
    }
    return &f->stats;
}

void fp8_free(Fp8Layers *f) {
    if (f->history_len) checkpoint_keep_extra(NULL, 0, 0, NULL, NULL);
    for (int i = 0; i < f->n_histories; i++) free(f->histories[i].amax);
    free(f->histories);
    free(f->resumed);
    for (int i = 0; i < f->n_inputs; i++) dev_free(f->inputs[i].x);
    free(f->inputs);
    dev_free(f->clips);
    dev_free(f->input8);
    dev_free(f->weight8);
}
