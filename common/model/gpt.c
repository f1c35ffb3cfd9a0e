// gpt.c: the layer steps of GPT-2 (pre-LayerNorm blocks, causal multi-head attention, GELU-tanh
// MLP, tied lm_head), phi-1_5 (the same block with one LayerNorm feeding attention and MLP in
// parallel, rotary positions, an untied lm_head with a bias) and Llama (RMSNorm, rotary positions,
// grouped-query attention, a SwiGLU MLP, no biases), over a LayerOps table: first the
// block, then the embedding and the head, the passes over the layers a rank holds, and last the
// layers on one rank (serial_layer_ops) that the stages plug their own versions into.
// Backward mirrors forward line for line. The parameters' layout is layout.c's, the activations'
// activations.c's.
#include "activations.h"
#include "gpt.h"
#include "moe_mlp.h"

#include <stdio.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "ops/ops.h"

// one span on the trace's compute track (trace.h); layer < 0 for the embedding and the head
static void trace_layer(const char *what, int layer, int m0) {
    if (m0 < 0) return;
    char name[48];
    if (layer >= 0) snprintf(name, sizeof name, "block %d %s", layer, what);
    else snprintf(name, sizeof name, "%s", what);
    trace_span(name, TRACK_COMPUTE, m0, trace_mark(), NULL);
}

static void zero_floats(float *x, size_t n) { dev_zero(x, n * sizeof(float)); }

// How the serial layers (serial_layer_ops) put their weight gradients: GRAD_WRITE during the
// backward pass gpt_gradients_begin asked to write, GRAD_ADD otherwise. A stage's own layers are
// never asked to write: gpt_gradients_begin zeroes their gradients instead.
static GradMode g_serial_grads = GRAD_ADD;
// During the backward of a serial linear layer whose output gradient's producer also wrote its
// 16-bit copy into dout16 as it made the gradient (the loss the head's, gpt_loss_forward_backward;
// the MLP's activation fc's, dense_mlp_backward): the layer skips its own cast over it. A
// stage's own layers cast as before.
static bool g_dout16_made;
static BlockActs *block_acts(const Activations *a, int l) { return &a->blocks[l - a->spec.first_layer]; }
// the layers run on one rank, none a stage's own
static bool serial_layers(const Activations *a) { return a->ops == serial_layer_ops(); }

// ---- sequence parallelism's edges of a tensor-parallel region (ActsSpec.seq_shards) --------------
// Without it these are the plain norm and nothing else. With it the norms and the residual run on
// this rank's rows; a region (the linears, attention, the MLP) runs on all N rows: its input is
// gathered before it, and its output, a partial sum, reduce-scattered after it (Megatron's g and
// g-bar; backward swaps them).

static bool seq_parallel(const Activations *a) { return a->spec.seq_shards > 1; }

// out (N, C) = norm(inp), inp being this rank's rows: normalised there, then gathered
static void norm_into_region(Activations *a, float *out, float *mean, float *rstd, const float *inp,
                             const Norm *w, int N) {
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    if (!seq_parallel(a)) {
        ops->norm_forward(ops, out, mean, rstd, inp, w, s, N);
        return;
    }
    ops->norm_forward(ops, a->seq_shard, mean, rstd, inp, w, s, residual_rows(&a->spec, N));
    ops->seq_gather(ops, out, a->seq_shard, N);
}

// where a region's last linear writes its output for `out`: out itself, or the partial sum that
// region_done reduce-scatters into out
static float *region_output(Activations *a, float *out) { return seq_parallel(a) ? a->seq_full : out; }

static void region_done(Activations *a, float *out, int N) {
    if (seq_parallel(a)) a->ops->seq_reduce_scatter(a->ops, out, a->seq_full, N);
}

// backward: the residual gradient (this rank's rows) as a region reads it, all N rows
static const float *region_gradient(Activations *a, const float *dres, int N) {
    if (!seq_parallel(a)) return dres;
    a->ops->seq_gather(a->ops, a->seq_full, dres, N);
    return a->seq_full;
}

// backward: dinp += the norm's backward from dout, a region's input gradient (with sequence
// parallelism each rank's is a partial sum over all N rows: reduce-scattered to this rank's first)
static void norm_backward_from_region(Activations *a, float *dinp, Norm *g, const float *dout, const float *inp,
                                      const Norm *w, const float *mean, const float *rstd, int N) {
    LayerOps *ops = a->ops;
    if (seq_parallel(a)) {
        ops->seq_reduce_scatter(ops, a->seq_shard, dout, N);
        dout = a->seq_shard;
    }
    ops->norm_backward(ops, dinp, g, dout, inp, w, mean, rstd, &a->spec.shape, residual_rows(&a->spec, N));
}

// ---- the block --------------------------------------------------------------------------------

void gpt_block_forward(Activations *a, int l, const BlockWeights *w, int B, int T) {
    int m0 = trace_mark();
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    BlockActs *k = block_acts(a, l);
    const float *x = block_input(a, l);
    int N = B * T, C = s->C, Ca = s->C_attn, R = residual_rows(&a->spec, N);
    // attention sub-block: res2 = x + proj(attention(rotary(qkv(ln1(x)))))
    norm_into_region(a, k->ln1, k->ln1_mean, k->ln1_rstd, x, &w->ln1, N);
    // grouped-query attention projects fewer keys and values (into scratch that forward leaves
    // unused) and repeats each for the query heads of its group
    bool gqa = s->C_kv < Ca;
    float *proj = gqa ? a->dsmall : k->qkv;
    ops->linear_forward(ops, LIN_QKV, proj, k->ln1, k->ln1_16, &w->qkv, N, C, Ca + 2 * s->C_kv);
    if (gqa) gqa_expand(k->qkv, proj, N, Ca, s->n_head, s->n_kv_head);
    if (s->rotary_dim) rotary_forward(k->qkv, a->start, B, T, Ca, s->n_head, s->rotary_dim, s->rope);
    ops->attention_forward(ops, l, k->atty, k->att, k->qkv, s, B, T);
    ops->linear_forward(ops, LIN_ATTN_PROJ, region_output(a, k->res2), k->atty, k->atty16, &w->attn_proj, N, Ca, C);
    region_done(a, k->res2, N);
    add_inplace(k->res2, x, (size_t)R * C);
    // MLP sub-block: out = res2 + mlp(ln2(res2)), or in a parallel block out = res2 + mlp(ln1(x))
    if (!s->parallel_block) norm_into_region(a, k->ln2, k->ln2_mean, k->ln2_rstd, k->res2, &w->ln2, N);
    ops->mlp_forward(ops, a, l, w, B, T);  // into k->mlp_out: region_output(a, k->out)
    region_done(a, k->out, N);
    add_inplace(k->out, k->res2, (size_t)R * C);
    trace_layer("forward", l, m0);
}

void gpt_block_backward(Activations *a, int l, const BlockWeights *w, BlockWeights *g, int B, int T) {
    int m0 = trace_mark();
    if (a->spec.recompute) gpt_block_forward(a, l, w, B, T);  // the activations it did not keep
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    BlockActs *k = block_acts(a, l);
    const float *x = block_input(a, l);
    int N = B * T, C = s->C, Ca = s->C_attn;
    float *dres = a->dres;  // dL/d(out) now; the residual connection passes it on unchanged
    // MLP sub-block, backwards: out = res2 + mlp(ln2(res2)). In a parallel block the MLP's input
    // is ln1(x): its gradient waits in dln for attention's (dsmall is attention's dqkv).
    float *dln2 = s->parallel_block ? a->dln : a->dsmall;
    zero_floats(dln2, (size_t)N * C);
    const float *dout = region_gradient(a, dres, N);
    ops->mlp_backward(ops, a, l, dln2, w, g, dout, B, T);
    if (!s->parallel_block)
        norm_backward_from_region(a, dres, &g->ln2, dln2, k->res2, &w->ln2, k->ln2_mean, k->ln2_rstd, N);
    // dres is now dL/d(res2). Attention sub-block, backwards: res2 = x + proj(attention(ln1(x)))
    float *datty = a->dbig, *dqkv = a->dsmall, *dln1 = a->dbig2;
    zero_floats(datty, (size_t)N * Ca);
    zero_floats(dqkv, (size_t)N * 3 * Ca);
    zero_floats(dln1, (size_t)N * C);
    // (a parallel block's dres is the MLP's: gathered already)
    if (!s->parallel_block) dout = region_gradient(a, dres, N);
    ops->linear_backward(ops, LIN_ATTN_PROJ, datty, &g->attn_proj, dout, a->dout16, k->atty, k->atty16,
                         &w->attn_proj, N, Ca, C);
    ops->attention_backward(ops, l, dqkv, a->datt, datty, k->qkv, k->atty, k->att, s, B, T);
    if (s->rotary_dim) rotary_backward(dqkv, a->start, B, T, Ca, s->n_head, s->rotary_dim, s->rope);
    // grouped-query attention: each key and value head's gradient is its group's sum (into
    // datty's scratch, read by now)
    bool gqa = s->C_kv < Ca;
    float *dproj = gqa ? a->dbig : dqkv;
    if (gqa) gqa_reduce(dproj, dqkv, N, Ca, s->n_head, s->n_kv_head);
    ops->linear_backward(ops, LIN_QKV, dln1, &g->qkv, dproj, a->dout16, k->ln1, k->ln1_16, &w->qkv, N, C,
                         Ca + 2 * s->C_kv);
    // ln1(x) fed attention and the MLP: its gradient is the sum. (Each linear layer's backward
    // completes its own dinp, a tensor-parallel one with an all-reduce: the two must not share one.)
    if (s->parallel_block) add_inplace(dln1, a->dln, (size_t)N * C);
    norm_backward_from_region(a, dres, &g->ln1, dln1, x, &w->ln1, k->ln1_mean, k->ln1_rstd, N);
    trace_layer("backward", l, m0);
}

// ---- the embedding, the head and the loss ------------------------------------------------------

void gpt_embed_forward(Activations *a, const Weights *w, int B, int T) {
    int m0 = trace_mark();
    a->ops->embed_forward(a->ops, a->encoded, a->inputs, NULL, w, &a->spec.shape, B, T);
    trace_layer("embedding forward", -1, m0);
}

void gpt_embed_backward(Activations *a, Weights *g, int B, int T) {
    int m0 = trace_mark();
    a->ops->embed_backward(a->ops, g, a->dres, a->inputs, &a->spec.shape, B, T);
    trace_layer("embedding backward", -1, m0);
}

void gpt_head_forward(Activations *a, const float *x, const Weights *w, int N) {
    int m0 = trace_mark();
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    norm_into_region(a, a->lnf, a->lnf_mean, a->lnf_rstd, x, &w->lnf, N);
    ops->linear_forward(ops, LIN_HEAD, a->logits, a->lnf, a->lnf16, &w->head, N, s->C, s->v_rows);
    trace_layer("head forward", -1, m0);
}

double gpt_loss_forward_backward(Activations *a, const GPTConfig *cfg, int B, int T, float dloss) {
    int m0 = trace_mark();
    int N = B * T;
    // in 16 bits the head's backward multiplies the logits' gradient's 16-bit copy: made here
    cross_entropy_forward_backward(a->logits, a->dout16, a->losses, a->targets, dloss, N, cfg->vocab_size,
                                   cfg->padded_vocab_size);
    a->dlogits16_made = a->dout16 != NULL;
    double sum = sum_values(a->losses, (size_t)N);
    trace_layer("loss", -1, m0);
    return sum;
}

double gpt_loss_forward(Activations *a, const GPTConfig *cfg, int B, int T) {
    int N = B * T;
    cross_entropy_forward(a->losses, a->logits, a->targets, N, cfg->vocab_size, cfg->padded_vocab_size);
    return sum_values(a->losses, (size_t)N);
}

void gpt_head_backward(Activations *a, const Weights *w, Weights *g, int B, int T) {
    int m0 = trace_mark();
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    int N = B * T;
    float *dlnf = a->dbig;  // (N, C) scratch
    zero_floats(dlnf, (size_t)N * s->C);
    zero_floats(a->dres, (size_t)residual_rows(&a->spec, N) * s->C);
    g_dout16_made = a->dlogits16_made;
    ops->linear_backward(ops, LIN_HEAD, dlnf, &g->head, a->logits, a->dout16, a->lnf, a->lnf16, &w->head,
                         N, s->C, s->v_rows);
    g_dout16_made = a->dlogits16_made = false;  // later layers' casts overwrite dout16
    norm_backward_from_region(a, a->dres, &g->lnf, dlnf, head_input(a), &w->lnf, a->lnf_mean, a->lnf_rstd, N);
    trace_layer("head backward", -1, m0);
}

// ---- the passes -------------------------------------------------------------------------------

static void upload_tokens(int *dst, const int *src, int B, int T) {
    if (src) copy_to_device(dst, src, (size_t)B * T * sizeof(int));
}

void gpt_forward(Activations *a, const Weights *w, const int *inputs, int B, int T) {
    const ActsSpec *sp = &a->spec;
    if (B > sp->B || T > sp->T) fatal("internal: batch %dx%d exceeds the activations' %dx%d", B, T, sp->B, sp->T);
    if (sp->embed) {
        upload_tokens(a->inputs, inputs, B, T);
        gpt_embed_forward(a, w, B, T);
    }
    for (int l = sp->first_layer; l < sp->first_layer + sp->n_layers; l++) gpt_block_forward(a, l, &w->h[l], B, T);
    if (sp->head) gpt_head_forward(a, head_input(a), w, B * T);
}

void gpt_backward(Activations *a, const Weights *w, Weights *g, int B, int T, GradReadyHook hook, void *ctx) {
    const ActsSpec *sp = &a->spec;
    g_serial_grads = a->write_grads ? GRAD_WRITE : GRAD_ADD;  // the step's first pass writes
    a->write_grads = false;
    if (sp->head) gpt_head_backward(a, w, g, B, T);
    for (int l = sp->first_layer + sp->n_layers - 1; l >= sp->first_layer; l--) {
        gpt_block_backward(a, l, &w->h[l], &g->h[l], B, T);
        if (hook) hook(l, ctx);
    }
    if (sp->embed) gpt_embed_backward(a, g, B, T);
    g_serial_grads = GRAD_ADD;
    if (hook) hook(-1, ctx);
}

// The serial layers' backward writes every weight gradient of a dense whole model but the
// embedding's, which add: a token's rows from each of its places, GPT-2's wte onto what its tied
// lm_head wrote. So a step that starts here zeroes only those the head did not write.
static bool serial_writes_gradients(const Activations *a) {
    const ActsSpec *sp = &a->spec;
    return serial_layers(a) && sp->embed && sp->head && sp->first_layer == 0 &&
           sp->n_layers == sp->model.n_layer && gpt_experts(&sp->model) == 0;
}

void gpt_gradients_begin(Activations *a, Weights *g, float *grads, size_t bytes) {
    if (!serial_writes_gradients(a)) {
        dev_zero(grads, bytes);
        return;
    }
    const GPTConfig *cfg = &a->spec.model;
    if (g->wpe) zero_floats(g->wpe, (size_t)cfg->max_seq_len * cfg->n_embd);
    if (g->wte != g->head.w) zero_floats(g->wte, (size_t)cfg->padded_vocab_size * cfg->n_embd);
    a->write_grads = true;
}

double gpt_forward_backward_hooked(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                                   const int *inputs, const int *targets, int B, int T, float dloss,
                                   GradReadyHook hook, void *ctx) {
    gpt_forward(a, w, inputs, B, T);
    upload_tokens(a->targets, targets, B, T);
    double loss_sum = gpt_loss_forward_backward(a, cfg, B, T, dloss);
    gpt_backward(a, w, g, B, T, hook, ctx);
    return loss_sum;
}

double gpt_forward_backward(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                            const int *inputs, const int *targets, int B, int T, float dloss) {
    return gpt_forward_backward_hooked(a, w, g, cfg, inputs, targets, B, T, dloss, NULL, NULL);
}

// ---- the layers on one rank -------------------------------------------------------------------

// how cfg's rotary embeddings turn
static Rope model_rope(const GPTConfig *cfg) {
    return (Rope){.theta = cfg->rope_theta, .factor = cfg->rope_factor, .low_freq_factor = cfg->rope_low_freq_factor,
                  .high_freq_factor = cfg->rope_high_freq_factor,
                  .original_max_positions = (float)cfg->rope_original_max_positions};
}

ModelShape whole_model_shape(const GPTConfig *cfg) {
    int C = cfg->n_embd, n_kv_head = cfg->n_kv_head ? cfg->n_kv_head : cfg->n_head;
    const Arch *arch = gpt_arch(cfg);
    return (ModelShape){.C = C, .n_head = cfg->n_head, .C_attn = C,
                        .C_mlp = cfg->ffn_dim ? cfg->ffn_dim : 4 * C,
                        .v_rows = cfg->padded_vocab_size,
                        .parallel_block = arch->parallel_block,
                        .rotary_dim = arch->rotary ? cfg->rotary_dim : 0, .rope = model_rope(cfg),
                        .n_kv_head = n_kv_head, .C_kv = n_kv_head * (C / cfg->n_head),
                        .rms_norm = arch->rms_norm, .norm_eps = cfg->norm_eps, .gated_mlp = arch->gated_mlp,
                        .first_repeat = 0, .n_repeats = gpt_experts(cfg), .repeat_ranks = 1};
}

// out (N, OC) = inp (N, C) @ w^T + b. With bf16 weights (w16 set) the input is rounded to bf16
// into inp16, which is also what backward will read, and the matmul accumulates in f32.
void linear_forward(float *out, const float *inp, half16 *inp16, const Linear *w, int N, int C, int OC) {
    // bf16 activations keep no f32 matmul input for backward: an f32 layer there would read scratch
    if (inp16 && !w->w16) fatal("internal: activations allocated for bf16, weights without a bf16 copy");
    if (!w->w16) {
        matmul_forward(out, inp, w->w, w->b, N, C, OC);
        return;
    }
    if (!inp16) fatal("internal: bf16 weights need activations allocated for bf16");
    cast_to_16(inp16, inp, (size_t)N * C);
    matmul_forward_16(out, inp16, w->w16, w->b, N, C, OC);
}

// one rank holds the whole vocabulary: rows [0, v_rows)
static void serial_embed_forward(LayerOps *ops, float *out, const int *tokens, const int *start,
                                 const Weights *w, const ModelShape *s, int B, int T) {
    (void)ops;
    embedding_forward(out, tokens, start, w->wte, w->wpe, 0, s->v_rows, B, T, s->C);
}

static void serial_embed_backward(LayerOps *ops, Weights *g, const float *dout, const int *tokens,
                                  const ModelShape *s, int B, int T) {
    (void)ops;
    embedding_backward(g->wte, g->wpe, dout, tokens, 0, s->v_rows, B, T, s->C);
}

static void serial_linear_forward(LayerOps *ops, LinearKind k, float *out, const float *inp, half16 *inp16,
                                  const Linear *w, int N, int in_dim, int out_dim) {
    (void)ops, (void)k;
    linear_forward(out, inp, inp16, w, N, in_dim, out_dim);
}

// the matching backward: in bf16 the output gradient is rounded too (into dout16, unless the loss
// already made the head's); the gradients come out in f32 and the bias gradient is summed from the f32 dout
static void serial_linear_backward(LayerOps *ops, LinearKind k, float *dinp, Linear *g, const float *dout,
                                   half16 *dout16, const float *inp, const half16 *inp16, const Linear *w,
                                   int N, int in_dim, int out_dim) {
    (void)ops, (void)k;
    if (!w->w16) {
        matmul_backward_mode(dinp, g->w, g->b, dout, inp, w->w, N, in_dim, out_dim, g_serial_grads);
        return;
    }
    if (!g_dout16_made) cast_gradient_to_16(dout16, dout, (size_t)N * out_dim);
    matmul_backward_16_mode(dinp, g->w, g->b, dout, dout16, inp16, w->w16, N, in_dim, out_dim, g_serial_grads);
}

static void serial_norm_forward(LayerOps *ops, float *out, float *mean, float *rstd, const float *inp,
                                const Norm *w, const ModelShape *s, int N) {
    (void)ops;
    if (s->rms_norm) rmsnorm_forward(out, rstd, inp, w->w, N, s->C, s->norm_eps);
    else layernorm_forward(out, mean, rstd, inp, w->w, w->b, N, s->C);
}

static void serial_norm_backward(LayerOps *ops, float *dinp, Norm *g, const float *dout, const float *inp,
                                 const Norm *w, const float *mean, const float *rstd, const ModelShape *s,
                                 int N) {
    (void)ops;
    if (s->rms_norm) rmsnorm_backward_mode(dinp, g->w, dout, inp, w->w, rstd, N, s->C, g_serial_grads);
    else layernorm_backward_mode(dinp, g->w, g->b, dout, inp, w->w, mean, rstd, N, s->C, g_serial_grads);
}

static void serial_attention_forward(LayerOps *ops, int layer, float *out, float *att, const float *qkv,
                                     const ModelShape *s, int B, int T) {
    (void)ops, (void)layer;
    (s->half ? attention_forward_16 : attention_forward)(out, att, qkv, B, T, s->C_attn, s->n_head);
}

static void serial_attention_backward(LayerOps *ops, int layer, float *dqkv, float *datt, const float *dout,
                                      const float *qkv, const float *out, const float *att, const ModelShape *s,
                                      int B, int T) {
    (void)ops, (void)layer, (void)out;
    (s->half ? attention_backward_16 : attention_backward)(dqkv, datt, dout, qkv, att, B, T, s->C_attn, s->n_head);
}

static half16 *mlp_input16(const BlockActs *k, const ModelShape *s) { return s->parallel_block ? k->ln1_16 : k->ln2_16; }

// dfch (written) from dh through the activation. Serial layers in 16 bits: its 16-bit copy too,
// made into dout16 with it, which fc's backward then multiplies as it is (g_dout16_made). (A
// stage's own layers cast for themselves: a copy made here would be cast and counted twice.)
static void mlp_activation_backward(Activations *a, float *dfch, const float *fch, const float *dh, int N, int F) {
    bool gated = a->spec.shape.gated_mlp;
    g_dout16_made = a->dout16 && serial_layers(a);
    if (!g_dout16_made && gated) swiglu_backward(dfch, fch, dh, N, F);
    else if (!g_dout16_made) gelu_backward(dfch, fch, dh, (size_t)N * F);
    else if (gated) swiglu_backward_16(dfch, a->dout16, fch, dh, N, F);
    else gelu_backward_16(dfch, a->dout16, fch, dh, (size_t)N * F);
}

// the dense MLP: out = fc_proj(gelu(fc(inp))), or with SwiGLU out = down(silu(gate(inp)) * up(inp)),
// where fc is gate and up side by side
static void dense_mlp_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T) {
    const ModelShape *s = &a->spec.shape;
    BlockActs *k = block_acts(a, l);
    int N = B * T, C = s->C, F = s->C_mlp, F_fc = s->gated_mlp ? 2 * F : F;
    ops->linear_forward(ops, LIN_FC, k->fch, block_mlp_input(a, l), mlp_input16(k, s), &w->fc, N, C, F_fc);
    if (s->gated_mlp) swiglu_forward(k->fch_gelu, k->fch, N, F);
    else gelu_forward(k->fch_gelu, k->fch, (size_t)N * F);
    ops->linear_forward(ops, LIN_FC_PROJ, k->mlp_out, k->fch_gelu, k->fch_gelu16, &w->fc_proj, N, F, C);
}

static void dense_mlp_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w,
                               BlockWeights *g, const float *dout, int B, int T) {
    const ModelShape *s = &a->spec.shape;
    BlockActs *k = block_acts(a, l);
    int N = B * T, C = s->C, F = s->C_mlp, F_fc = s->gated_mlp ? 2 * F : F;
    float *dfch_gelu = a->dbig, *dfch = a->dbig2;
    zero_floats(dfch_gelu, (size_t)N * F);
    ops->linear_backward(ops, LIN_FC_PROJ, dfch_gelu, &g->fc_proj, dout, a->dout16, k->fch_gelu,
                         k->fch_gelu16, &w->fc_proj, N, F, C);
    mlp_activation_backward(a, dfch, k->fch, dfch_gelu, N, F);
    ops->linear_backward(ops, LIN_FC, dinp, &g->fc, dfch, a->dout16, block_mlp_input(a, l), mlp_input16(k, s),
                         &w->fc, N, C, F_fc);
    g_dout16_made = false;
}

// a MoE block's MLP is MoEConfig.mlp's (08_mixture_of_experts/moe.c), on one rank
static void serial_mlp_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T) {
    if (gpt_block_is_moe(&a->spec.model, l)) a->spec.model.moe->mlp->forward(ops, a, l, w, B, T);
    else dense_mlp_forward(ops, a, l, w, B, T);
}

static void serial_mlp_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w,
                                BlockWeights *g, const float *dout, int B, int T) {
    if (gpt_block_is_moe(&a->spec.model, l)) a->spec.model.moe->mlp->backward(ops, a, l, dinp, w, g, dout, B, T);
    else dense_mlp_backward(ops, a, l, dinp, w, g, dout, B, T);
}

LayerOps *serial_layer_ops(void) {
    static LayerOps serial = {serial_embed_forward, serial_embed_backward, serial_linear_forward,
                              serial_linear_backward, serial_norm_forward, serial_norm_backward,
                              serial_attention_forward, serial_attention_backward, serial_mlp_forward,
                              serial_mlp_backward, NULL, NULL};  // one rank holds every row
    return &serial;
}
