// gpt.c: GPT-2 (pre-LayerNorm blocks, causal multi-head attention, GELU-tanh MLP, tied lm_head)
// written as layer steps over the ops.h interface. Backward mirrors forward line for line.
#include "gpt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "ops.h"

int gpt_padded_vocab(int vocab_size) { return (vocab_size + 127) / 128 * 128; }

// ---- the parameter table ----------------------------------------------------------------------

static TensorInfo *add_tensor(ParamLayout *l, const char *name, int rows, int cols, int block) {
    TensorInfo *t = &l->tensors[l->num_tensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->offset = l->num_params;
    t->ndim = cols ? 2 : 1;
    t->shape[0] = rows;
    t->shape[1] = cols;
    t->numel = (size_t)rows * (size_t)(cols ? cols : 1);
    t->hf_rows = rows;
    t->block = block;
    t->init_std = 0.02f;
    l->num_params += t->numel;
    return t;
}

static void add_layernorm(ParamLayout *l, const char *prefix, int C, int block) {
    char name[64];
    snprintf(name, sizeof name, "%s.weight", prefix);
    add_tensor(l, name, C, 0, block)->init_value = 1.0f;
    snprintf(name, sizeof name, "%s.bias", prefix);
    add_tensor(l, name, C, 0, block);
    l->tensors[l->num_tensors - 1].init_std = 0;
    l->tensors[l->num_tensors - 2].init_std = 0;
}

// A Conv1D linear layer: weight stored (in, out) by Hugging Face, (out, in) here.
static void add_linear(ParamLayout *l, const char *prefix, int out, int in, int block, float std) {
    char name[64];
    snprintf(name, sizeof name, "%s.weight", prefix);
    TensorInfo *w = add_tensor(l, name, out, in, block);
    w->hf_transposed = 1;
    w->decay = 1;
    w->init_std = std;
    snprintf(name, sizeof name, "%s.bias", prefix);
    add_tensor(l, name, out, 0, block)->init_std = 0;
}

void gpt_layout(ParamLayout *l, const GPTConfig *cfg) {
    int C = cfg->n_embd, L = cfg->n_layer;
    memset(l, 0, sizeof *l);
    l->cfg = *cfg;
    l->tensors = calloc_or_die((size_t)(ROOT_TENSORS + BLOCK_TENSORS * L), sizeof(TensorInfo));
    TensorInfo *wte = add_tensor(l, "transformer.wte.weight", cfg->padded_vocab_size, C, -1);
    wte->hf_rows = cfg->vocab_size;
    wte->decay = 1;
    add_tensor(l, "transformer.wpe.weight", cfg->max_seq_len, C, -1)->decay = 1;
    add_layernorm(l, "transformer.ln_f", C, -1);
    l->root_numel = l->num_params;
    // the projections into the residual stream are scaled down so that the stream's variance
    // does not grow with depth (GPT-2 paper, section 2.3)
    float residual_std = 0.02f / sqrtf(2.0f * (float)L);
    for (int b = 0; b < L; b++) {
        char p[48];
        size_t start = l->num_params;
        snprintf(p, sizeof p, "transformer.h.%d.ln_1", b);
        add_layernorm(l, p, C, b);
        snprintf(p, sizeof p, "transformer.h.%d.attn.c_attn", b);
        add_linear(l, p, 3 * C, C, b, 0.02f);
        snprintf(p, sizeof p, "transformer.h.%d.attn.c_proj", b);
        add_linear(l, p, C, C, b, residual_std);
        snprintf(p, sizeof p, "transformer.h.%d.ln_2", b);
        add_layernorm(l, p, C, b);
        snprintf(p, sizeof p, "transformer.h.%d.mlp.c_fc", b);
        add_linear(l, p, 4 * C, C, b, 0.02f);
        snprintf(p, sizeof p, "transformer.h.%d.mlp.c_proj", b);
        add_linear(l, p, C, 4 * C, b, residual_std);
        if (b == 0) l->block_offset[0] = start;
        l->block_offset[1] = l->num_params - start;
    }
}

void gpt_layout_free(ParamLayout *l) {
    free(l->tensors);
    l->tensors = NULL;
}

void weights_point(Weights *w, const ParamLayout *l, float *flat) {
    const TensorInfo *t = l->tensors;
    w->wte = flat + t[0].offset;
    w->wpe = flat + t[1].offset;
    w->lnfw = flat + t[2].offset;
    w->lnfb = flat + t[3].offset;
    w->wte16 = NULL;
    w->h = calloc_or_die((size_t)l->cfg.n_layer, sizeof(BlockWeights));
    for (int b = 0; b < l->cfg.n_layer; b++)
        block_weights_point(&w->h[b], l, b, flat + t[ROOT_TENSORS + b * BLOCK_TENSORS].offset);
}

void block_weights_point(BlockWeights *bw, const ParamLayout *l, int block, float *unit) {
    const TensorInfo *t = &l->tensors[ROOT_TENSORS + block * BLOCK_TENSORS];
    memset(bw, 0, sizeof *bw);
    // BlockWeights starts with its twelve float pointers in buffer order: fill them as an array
    float **slots = (float **)bw;
    for (int i = 0; i < BLOCK_TENSORS; i++) slots[i] = unit + (t[i].offset - t[0].offset);
}

void weights_point_bf16(Weights *w, const ParamLayout *l, bf16 *flat16) {
    const TensorInfo *t = l->tensors;
    w->wte16 = flat16 + t[0].offset;
    for (int b = 0; b < l->cfg.n_layer; b++)
        block_weights_point_bf16(&w->h[b], l, b, flat16 + t[ROOT_TENSORS + b * BLOCK_TENSORS].offset);
}

void block_weights_point_bf16(BlockWeights *bw, const ParamLayout *l, int block, bf16 *unit16) {
    const TensorInfo *t = &l->tensors[ROOT_TENSORS + block * BLOCK_TENSORS];  // this block's twelve
    bw->qkvw16 = unit16 + (t[2].offset - t[0].offset);
    bw->attprojw16 = unit16 + (t[4].offset - t[0].offset);
    bw->fcw16 = unit16 + (t[8].offset - t[0].offset);
    bw->fcprojw16 = unit16 + (t[10].offset - t[0].offset);
}

void weights_free(Weights *w) {
    free(w->h);
    w->h = NULL;
}

// Initialises the part of tensor t that falls in the flat range [first, first + n).
static void init_tensor_part(float *slice, const TensorInfo *t, int tensor_index, size_t first,
                             size_t n, uint64_t seed) {
    size_t lo = t->offset > first ? t->offset : first;
    size_t hi = t->offset + t->numel < first + n ? t->offset + t->numel : first + n;
    if (lo >= hi) return;
    float *out = slice + (lo - first);
    size_t count = hi - lo, start = lo - t->offset;
    if (t->init_std == 0) {
        fill_constant(out, count, t->init_value);
        return;
    }
    // the rows past the real vocabulary never see a token: keep them zero
    size_t real = (size_t)t->hf_rows * (size_t)(t->ndim == 2 ? t->shape[1] : 1);
    size_t random = start < real ? (real - start < count ? real - start : count) : 0;
    init_normal(out, random, seed, (uint64_t)tensor_index, start, t->init_std);
    if (random < count) fill_constant(out + random, count - random, 0.0f);
}

void gpt_init_range(float *slice, const ParamLayout *l, size_t first, size_t n, uint64_t seed) {
    for (int i = 0; i < l->num_tensors; i++) init_tensor_part(slice, &l->tensors[i], i, first, n, seed);
}

// ---- activations ------------------------------------------------------------------------------

static float *alloc_floats(Activations *a, size_t n) {
    a->bytes += n * sizeof(float);
    return dev_malloc(n * sizeof(float));
}

static bf16 *alloc_bf16(Activations *a, size_t n) {
    a->bytes += n * sizeof(bf16);
    return dev_malloc(n * sizeof(bf16));
}

// In bf16 mode a matmul input is needed in f32 only until it is rounded, so one scratch buffer
// serves every block; in f32 mode each block keeps its own for backward.
static float *matmul_input(Activations *a, float **shared, size_t n) {
    if (!a->bf16) return alloc_floats(a, n);
    if (!*shared) *shared = alloc_floats(a, n);
    return *shared;
}

void acts_alloc(Activations *a, const GPTConfig *cfg, int B, int T, int bf16) {
    size_t N = (size_t)B * T, C = (size_t)cfg->n_embd, NH = (size_t)cfg->n_head;
    size_t att = (size_t)B * NH * T * T, Vp = (size_t)cfg->padded_vocab_size;
    memset(a, 0, sizeof *a);
    a->B = B;
    a->T = T;
    a->n_layer = cfg->n_layer;
    a->bf16 = bf16;
    float *shared_ln1 = NULL, *shared_atty = NULL, *shared_ln2 = NULL, *shared_fch_gelu = NULL;
    a->encoded = alloc_floats(a, N * C);
    a->blocks = calloc_or_die((size_t)cfg->n_layer, sizeof(BlockActs));
    for (int l = 0; l < cfg->n_layer; l++) {
        BlockActs *k = &a->blocks[l];
        k->ln1 = matmul_input(a, &shared_ln1, N * C);
        k->ln1_mean = alloc_floats(a, N);
        k->ln1_rstd = alloc_floats(a, N);
        k->qkv = alloc_floats(a, N * 3 * C);
        k->att = alloc_floats(a, att);
        k->atty = matmul_input(a, &shared_atty, N * C);
        k->res2 = alloc_floats(a, N * C);
        k->ln2 = matmul_input(a, &shared_ln2, N * C);
        k->ln2_mean = alloc_floats(a, N);
        k->ln2_rstd = alloc_floats(a, N);
        k->fch = alloc_floats(a, N * 4 * C);
        k->fch_gelu = matmul_input(a, &shared_fch_gelu, N * 4 * C);
        k->out = alloc_floats(a, N * C);
        if (bf16) {
            k->ln1_16 = alloc_bf16(a, N * C);
            k->atty16 = alloc_bf16(a, N * C);
            k->ln2_16 = alloc_bf16(a, N * C);
            k->fch_gelu16 = alloc_bf16(a, N * 4 * C);
        }
    }
    if (bf16) {
        a->lnf16 = alloc_bf16(a, N * C);
        a->dout16 = alloc_bf16(a, N * (Vp > 4 * C ? Vp : 4 * C));
    }
    a->lnf = alloc_floats(a, N * C);
    a->lnf_mean = alloc_floats(a, N);
    a->lnf_rstd = alloc_floats(a, N);
    a->logits = alloc_floats(a, N * (size_t)cfg->padded_vocab_size);
    a->losses = alloc_floats(a, N);
    a->inputs = dev_malloc(N * sizeof(int));
    a->targets = dev_malloc(N * sizeof(int));
    a->bytes += 2 * N * sizeof(int);
    a->dres = alloc_floats(a, N * C);
    a->dbig = alloc_floats(a, N * 4 * C);
    a->dbig2 = alloc_floats(a, N * 4 * C);
    a->dsmall = alloc_floats(a, N * 3 * C);
    a->datt = alloc_floats(a, att);
}

void acts_free(Activations *a) {
    float **all[] = {&a->encoded, &a->lnf, &a->lnf_mean, &a->lnf_rstd, &a->logits, &a->losses,
                     &a->dres, &a->dbig, &a->dbig2, &a->dsmall, &a->datt};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dev_free(*all[i]);
    dev_free(a->inputs);
    dev_free(a->targets);
    for (int l = 0; a->blocks && l < a->n_layer; l++) {
        BlockActs *k = &a->blocks[l];
        void *own[] = {k->ln1_mean, k->ln1_rstd, k->qkv, k->att, k->res2, k->ln2_mean,
                       k->ln2_rstd, k->fch, k->out, k->ln1_16, k->atty16, k->ln2_16, k->fch_gelu16};
        for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) dev_free(own[i]);
        // the f32 matmul inputs are shared scratch in bf16 mode: free those once
        if (!a->bf16 || l == 0) {
            dev_free(k->ln1);
            dev_free(k->atty);
            dev_free(k->ln2);
            dev_free(k->fch_gelu);
        }
    }
    dev_free(a->lnf16);
    dev_free(a->dout16);
    free(a->blocks);
    memset(a, 0, sizeof *a);
}

// ---- a linear layer in f32 or bf16 ------------------------------------------------------------

// out (N, OC) = inp (N, C) @ w^T + b. With bf16 weights (w16 set) the input is rounded to bf16
// into inp16, which is also what backward will read, and the matmul accumulates in f32.
void gpt_linear_forward(float *out, const float *inp, bf16 *inp16, const float *w,
                        const bf16 *w16, const float *b, int N, int C, int OC) {
    if (!w16) {
        matmul_forward(out, inp, w, b, N, C, OC);
        return;
    }
    if (!inp16) fatal("internal: bf16 weights need activations allocated for bf16");
    cast_to_bf16(inp16, inp, (size_t)N * C);
    matmul_forward_bf16(out, inp16, w16, b, N, C, OC);
}

// the matching backward: the output gradient is rounded to bf16 too (into a->dout16); the
// gradients come out in f32 and the bias gradient is summed from the f32 dout
static void linear_backward(Activations *a, float *dinp, float *dw, float *db, const float *dout,
                            const float *inp, const bf16 *inp16, const float *w, const bf16 *w16,
                            int N, int C, int OC) {
    if (!w16) {
        matmul_backward(dinp, dw, db, dout, inp, w, N, C, OC);
        return;
    }
    cast_to_bf16(a->dout16, dout, (size_t)N * OC);
    matmul_backward_bf16(dinp, dw, db, dout, a->dout16, inp16, w16, N, C, OC);
}

// ---- forward ----------------------------------------------------------------------------------

void gpt_embed_forward(Activations *a, const Weights *w, const GPTConfig *cfg, int B, int T) {
    encoder_forward(a->encoded, a->inputs, w->wte, w->wpe, B, T, cfg->n_embd);
}

void gpt_block_forward(BlockActs *k, const float *x, const BlockWeights *w, const GPTConfig *cfg,
                       int B, int T) {
    int N = B * T, C = cfg->n_embd, NH = cfg->n_head;
    // attention sub-block: res2 = x + proj(attention(ln1(x)))
    layernorm_forward(k->ln1, k->ln1_mean, k->ln1_rstd, x, w->ln1w, w->ln1b, N, C);
    gpt_linear_forward(k->qkv, k->ln1, k->ln1_16, w->qkvw, w->qkvw16, w->qkvb, N, C, 3 * C);
    attention_forward(k->atty, k->att, k->qkv, B, T, C, NH);
    gpt_linear_forward(k->res2, k->atty, k->atty16, w->attprojw, w->attprojw16, w->attprojb, N, C, C);
    add_inplace(k->res2, x, (size_t)N * C);
    // MLP sub-block: out = res2 + proj(gelu(fc(ln2(res2))))
    layernorm_forward(k->ln2, k->ln2_mean, k->ln2_rstd, k->res2, w->ln2w, w->ln2b, N, C);
    gpt_linear_forward(k->fch, k->ln2, k->ln2_16, w->fcw, w->fcw16, w->fcb, N, C, 4 * C);
    gelu_forward(k->fch_gelu, k->fch, (size_t)N * 4 * C);
    gpt_linear_forward(k->out, k->fch_gelu, k->fch_gelu16, w->fcprojw, w->fcprojw16, w->fcprojb, N, 4 * C, C);
    add_inplace(k->out, k->res2, (size_t)N * C);
}

void gpt_head_forward(Activations *a, const float *x, const Weights *w, const GPTConfig *cfg, int B, int T) {
    int N = B * T, C = cfg->n_embd;
    layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, x, w->lnfw, w->lnfb, N, C);
    // the lm_head is the token embedding itself (weight tying): logits = lnf @ wte^T
    gpt_linear_forward(a->logits, a->lnf, a->lnf16, w->wte, w->wte16, NULL, N, C, cfg->padded_vocab_size);
}

double gpt_loss_forward_backward(Activations *a, const GPTConfig *cfg, int B, int T, float dloss) {
    int N = B * T;
    cross_entropy_forward_backward(a->logits, a->losses, a->targets, dloss, N, cfg->vocab_size,
                                   cfg->padded_vocab_size);
    return sum_values(a->losses, (size_t)N);
}

double gpt_loss_forward(Activations *a, const GPTConfig *cfg, int B, int T) {
    int N = B * T;
    cross_entropy_forward(a->losses, a->logits, a->targets, N, cfg->vocab_size, cfg->padded_vocab_size);
    return sum_values(a->losses, (size_t)N);
}

// ---- backward: each step undoes its forward, in reverse order ---------------------------------

void gpt_head_backward(Activations *a, const float *x, const Weights *w, Weights *g,
                       const GPTConfig *cfg, int B, int T) {
    int N = B * T, C = cfg->n_embd;
    float *dlnf = a->dbig;  // (N, C) scratch
    dev_zero(dlnf, (size_t)N * C * sizeof(float));
    dev_zero(a->dres, (size_t)N * C * sizeof(float));
    linear_backward(a, dlnf, g->wte, NULL, a->logits, a->lnf, a->lnf16, w->wte, w->wte16, N, C,
                    cfg->padded_vocab_size);
    layernorm_backward(a->dres, g->lnfw, g->lnfb, dlnf, x, w->lnfw, a->lnf_mean, a->lnf_rstd, N, C);
}

void gpt_block_backward(Activations *a, BlockActs *k, const float *x, const BlockWeights *w,
                        BlockWeights *g, const GPTConfig *cfg, int B, int T) {
    int N = B * T, C = cfg->n_embd, NH = cfg->n_head;
    size_t NC = (size_t)N * C;
    float *dres = a->dres;  // dL/d(out) now; the residual connection passes it on unchanged
    // MLP sub-block, backwards: out = res2 + proj(gelu(fc(ln2(res2))))
    float *dfch_gelu = a->dbig, *dfch = a->dbig2, *dln2 = a->dsmall;
    dev_zero(dfch_gelu, 4 * NC * sizeof(float));
    dev_zero(dfch, 4 * NC * sizeof(float));
    dev_zero(dln2, NC * sizeof(float));
    linear_backward(a, dfch_gelu, g->fcprojw, g->fcprojb, dres, k->fch_gelu, k->fch_gelu16,
                    w->fcprojw, w->fcprojw16, N, 4 * C, C);
    gelu_backward(dfch, k->fch, dfch_gelu, 4 * NC);
    linear_backward(a, dln2, g->fcw, g->fcb, dfch, k->ln2, k->ln2_16, w->fcw, w->fcw16, N, C, 4 * C);
    layernorm_backward(dres, g->ln2w, g->ln2b, dln2, k->res2, w->ln2w, k->ln2_mean, k->ln2_rstd, N, C);
    // dres is now dL/d(res2). Attention sub-block, backwards: res2 = x + proj(attention(ln1(x)))
    float *datty = a->dbig, *dqkv = a->dsmall, *dln1 = a->dbig2;
    dev_zero(datty, NC * sizeof(float));
    dev_zero(dqkv, 3 * NC * sizeof(float));
    dev_zero(dln1, NC * sizeof(float));
    linear_backward(a, datty, g->attprojw, g->attprojb, dres, k->atty, k->atty16, w->attprojw,
                    w->attprojw16, N, C, C);
    attention_backward(dqkv, a->datt, datty, k->qkv, k->att, B, T, C, NH);
    linear_backward(a, dln1, g->qkvw, g->qkvb, dqkv, k->ln1, k->ln1_16, w->qkvw, w->qkvw16, N, C, 3 * C);
    layernorm_backward(dres, g->ln1w, g->ln1b, dln1, x, w->ln1w, k->ln1_mean, k->ln1_rstd, N, C);
}

void gpt_embed_backward(Activations *a, Weights *g, const GPTConfig *cfg, int B, int T) {
    encoder_backward(g->wte, g->wpe, a->dres, a->inputs, B, T, cfg->n_embd);
}

// ---- the whole model --------------------------------------------------------------------------

static void upload_tokens(int *dst, const int *src, int B, int T) {
    if (src) copy_to_device(dst, src, (size_t)B * T * sizeof(int));
}

static const float *block_input(const Activations *a, int l) {
    return l == 0 ? a->encoded : a->blocks[l - 1].out;
}

void gpt_forward(Activations *a, const Weights *w, const GPTConfig *cfg, const int *inputs, int B, int T) {
    if (B > a->B || T > a->T) fatal("internal: batch %dx%d exceeds the activations' %dx%d", B, T, a->B, a->T);
    upload_tokens(a->inputs, inputs, B, T);
    gpt_embed_forward(a, w, cfg, B, T);
    for (int l = 0; l < cfg->n_layer; l++)
        gpt_block_forward(&a->blocks[l], block_input(a, l), &w->h[l], cfg, B, T);
    gpt_head_forward(a, block_input(a, cfg->n_layer), w, cfg, B, T);
}

double gpt_forward_backward_hooked(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                                   const int *inputs, const int *targets, int B, int T, float dloss,
                                   GradReadyHook hook, void *ctx) {
    gpt_forward(a, w, cfg, inputs, B, T);
    upload_tokens(a->targets, targets, B, T);
    double loss_sum = gpt_loss_forward_backward(a, cfg, B, T, dloss);
    gpt_head_backward(a, block_input(a, cfg->n_layer), w, g, cfg, B, T);
    for (int l = cfg->n_layer - 1; l >= 0; l--) {
        gpt_block_backward(a, &a->blocks[l], block_input(a, l), &w->h[l], &g->h[l], cfg, B, T);
        if (hook) hook(l, ctx);
    }
    gpt_embed_backward(a, g, cfg, B, T);
    if (hook) hook(-1, ctx);
    return loss_sum;
}

double gpt_forward_backward(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                            const int *inputs, const int *targets, int B, int T, float dloss) {
    return gpt_forward_backward_hooked(a, w, g, cfg, inputs, targets, B, T, dloss, NULL, NULL);
}
