// tp_model.c: see tp_model.h.
#include "tp_model.h"

#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "run/evaluate.h"
#include "run/run_checkpoint.h"
#include "run/run_stats.h"

// ---- the grid must fit ------------------------------------------------------------------------

// false, with why = the constraint broken (and the numbers that break it), unless ok
static bool require(bool ok, const char *constraint, const int d[3], char *why, size_t why_size, const char *fmt,
                    int a, int b) {
    if (ok) return true;
    char detail[160];
    snprintf(detail, sizeof detail, fmt, a, b);
    snprintf(why, why_size, "key 'tp_dimensions' [%d, %d, %d] does not fit: %s (%s)", d[0], d[1], d[2], constraint,
             detail);
    return false;
}

bool tp_grid_fits(const GPTConfig *mc, const int d[3], int world, int global_batch, int acc, char *why,
                  size_t why_size) {
    int X = d[0], Y = d[1], Z = d[2], C = mc->n_embd, Vp = mc->padded_vocab_size;
    ModelShape whole = whole_model_shape(mc);
    int F = whole.C_mlp, F_fc = whole.gated_mlp ? 2 * F : F, Ckv = whole.C_kv;
    if (!require(world % (X * Y * Z) == 0, "x*y*z must divide the number of ranks (the rest is data parallelism)",
                 d, why, why_size, "%d ranks, x*y*z = %d", world, X * Y * Z) ||
        !require(mc->n_head % X == 0, "attention heads must divide by x (heads are split over x)", d, why, why_size,
                 "n_head %d, x %d", mc->n_head, X) ||
        !require(whole.n_kv_head % X == 0,
                 "key/value heads must divide by x (each x rank holds those of its query heads)", d, why, why_size,
                 "n_kv_head %d, x %d", whole.n_kv_head, X) ||
        !require(C % Y == 0, "the hidden size must divide by y (it is split over y)", d, why, why_size,
                 "n_embd %d, y %d", C, Y) ||
        !require(F % X == 0, "the MLP width must divide by x", d, why, why_size, "MLP width %d, x %d", F, X) ||
        !require(Vp % X == 0, "the padded vocabulary must divide by x (it is split over x)", d, why, why_size,
                 "padded vocabulary %d, x %d", Vp, X))
        return false;
    size_t blocks[] = {(size_t)Vp / X * (C / Y), (size_t)(C + 2 * Ckv) / X * (C / Y), (size_t)C / Y * (C / X),
                       (size_t)F_fc / X * (C / Y)};
    for (int i = 0; i < 4; i++)
        if (!require(blocks[i] % Z == 0, "every weight block must divide by z (depth shards are equal)", d, why,
                     why_size, "block of %d elements, z %d", (int)blocks[i], Z))
            return false;
    int rows = world / (X * Y) * acc;  // z * data ranks, each taking acc micro-batches
    return require(global_batch % rows == 0,
                   "global_batch_size must divide by z * data * gradient_acc_steps (rows are split over z and data)",
                   d, why, why_size, "global_batch_size %d, z*data*acc %d", global_batch, rows);
}

void tp_check_grid(const GPTConfig *mc, const int d[3], int world, int global_batch, int acc) {
    char why[320];
    if (!tp_grid_fits(mc, d, world, global_batch, acc, why, sizeof why)) fatal("%s", why);
}

// ---- this rank's tensors ----------------------------------------------------------------------

static LocalTensor vector_part(TPKind kind, int row0, int rows) {
    return (LocalTensor){.kind = kind, .nranges = 1, .row0 = {row0}, .rows = {rows}, .cols = 1};
}

static LocalTensor matrix_part(int row0, int rows, int col0, int cols) {
    return (LocalTensor){.kind = TP_WEIGHT, .nranges = 1, .row0 = {row0}, .rows = {rows}, .col0 = col0, .cols = cols};
}

// q, k and v of this rank's heads: three row ranges of the fused (C + 2 C_kv, ...) tensor (the
// key/value heads of its query heads: with grouped-query attention, fewer rows of k and v)
static LocalTensor heads_part(TPKind kind, const TPModel *m, int col0, int cols) {
    int C = m->cfg.n_embd, x0 = m->grid.x * m->Cx, Ckvx = m->shape.C_kv, kv0 = m->grid.x * Ckvx;
    int Ckv = Ckvx * m->grid.X;
    return (LocalTensor){.kind = kind, .nranges = 3, .row0 = {x0, C + kv0, C + Ckv + kv0}, .rows = {m->Cx, Ckvx, Ckvx},
                         .col0 = col0, .cols = cols};
}

// SwiGLU's gate and up of this rank's MLP columns: two row ranges of the fused (2F, ...) tensor
static LocalTensor gate_up_part(const TPModel *m, int col0, int cols) {
    int x4 = m->grid.x * m->C4x, F = m->C4x * m->grid.X;
    return (LocalTensor){.kind = TP_WEIGHT, .nranges = 2, .row0 = {x4, F + x4}, .rows = {m->C4x, m->C4x},
                         .col0 = col0, .cols = cols};
}

static LocalTensor describe(const TPModel *m, TensorRole role) {
    const TPGrid *g = &m->grid;
    int y0 = g->y * m->Cy, Cy = m->Cy, x4 = g->x * m->C4x;
    switch (role) {
    case ROLE_WTE: return matrix_part(m->v_lo, m->Vl, y0, Cy);
    case ROLE_WPE: {  // every position, hidden over y
        LocalTensor t = matrix_part(0, m->cfg.max_seq_len, y0, Cy);
        t.kind = TP_SPLIT_Y;
        return t;
    }
    case ROLE_HEAD_W: return matrix_part(m->v_lo, m->Vl, y0, Cy);  // an untied lm_head (phi): as wte
    case ROLE_HEAD_B: return vector_part(TP_SPLIT_X, m->v_lo, m->Vl);
    case ROLE_QKV_W: return heads_part(TP_WEIGHT, m, y0, Cy);
    case ROLE_QKV_B: return heads_part(TP_SPLIT_X, m, 0, 1);
    case ROLE_ATTN_PROJ_W: return matrix_part(y0, Cy, g->x * m->Cx, m->Cx);  // transposed: out over y, in over x
    case ROLE_FC_W: return m->shape.gated_mlp ? gate_up_part(m, y0, Cy) : matrix_part(x4, m->C4x, y0, Cy);
    case ROLE_FC_B: return vector_part(TP_SPLIT_X, x4, m->C4x);
    case ROLE_FC_PROJ_W: return matrix_part(y0, Cy, x4, m->C4x);
    default: return vector_part(TP_SPLIT_Y, y0, Cy);  // LayerNorms, the projections' biases
    }
}

// phi's and Llama's k and v follow q in the full buffer, so q's part above (three row ranges of a
// (C + 2 C_kv)-row tensor) reaches them, as gate's reaches Llama's up: they hold nothing of their
// own here
static LocalTensor describe_tensor(const TPModel *m, const TensorInfo *t) {
    if (t->role == ROLE_MOE_MLP) {  // the router and the experts, whole (moe_shape)
        LocalTensor whole = matrix_part(0, t->shape[0], 0, t->ndim == 2 ? t->shape[1] : 1);
        whole.kind = TP_COPY;
        return whole;
    }
    if (t->role != ROLE_QKV_PART && t->role != ROLE_FC_PART) return describe(m, t->role);
    return (LocalTensor){.kind = t->ndim == 2 ? TP_WEIGHT : TP_SPLIT_X, .nranges = 1, .rows = {0}, .cols = 1};
}

static void build_local_layout(TPModel *m) {
    const ParamLayout *f = &m->full;
    m->local = calloc_or_die((size_t)f->num_tensors, sizeof(LocalTensor));
    m->layout = *f;  // the same tensors and names: only their offsets and sizes are this rank's
    m->layout.num_params = 0;
    m->layout.num_tensors = 0;
    m->layout.tensors = calloc_or_die((size_t)f->num_tensors, sizeof(TensorInfo));
    // two passes: the small replicated tensors first, so that their gradients (summed over z and
    // data) are one contiguous range, then the weight shards (summed over data only)
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < f->num_tensors; i++) {
            LocalTensor t = describe_tensor(m, &f->tensors[i]);
            if ((t.kind == TP_WEIGHT) != (pass == 1)) continue;
            t.block = 0;
            for (int r = 0; r < t.nranges; r++) t.block += (size_t)t.rows[r] * t.cols;
            t.numel = t.kind == TP_WEIGHT ? t.block / (size_t)m->grid.Z : t.block;
            t.first = t.kind == TP_WEIGHT ? (size_t)m->grid.z * t.numel : 0;
            t.offset = m->layout.num_params;
            m->local[i] = t;
            TensorInfo *ti = &m->layout.tensors[m->layout.num_tensors++];
            *ti = f->tensors[i];
            ti->offset = t.offset;
            ti->numel = t.numel;
            m->layout.num_params += t.numel;
            if (pass == 0) m->small_numel = m->layout.num_params;
            else m->full_weight_numel += f->tensors[i].numel;
        }
    m->weight_numel = m->layout.num_params - m->small_numel;
}

void tp_model_init(TPModel *m, Comm *world, const GPTConfig *mc, const int dims[3], bool vocab_parallel_loss) {
    TPGrid grid;
    tp_grid_init(&grid, world, dims);
    tp_model_layout(m, mc, &grid, vocab_parallel_loss);
}

void tp_model_layout(TPModel *m, const GPTConfig *mc, const TPGrid *grid, bool vocab_parallel_loss) {
    ParamLayout whole;
    gpt_layout(&whole, mc);
    tp_model_layout_part(m, mc, grid, vocab_parallel_loss, whole);
}

void tp_model_layout_part(TPModel *m, const GPTConfig *mc, const TPGrid *grid, bool vocab_parallel_loss,
                          ParamLayout part) {
    memset(m, 0, sizeof *m);
    m->full = part;
    m->cfg = *mc;
    m->vocab_parallel_loss = vocab_parallel_loss;
    m->grid = *grid;
    const TPGrid *g = &m->grid;
    int C = mc->n_embd;
    m->Cy = C / g->Y;
    m->Cx = C / g->X;
    ModelShape whole = whole_model_shape(mc);
    m->C4x = whole.C_mlp / g->X;
    m->NHx = mc->n_head / g->X;
    m->Vl = mc->padded_vocab_size / g->X;
    m->v_lo = g->x * m->Vl;
    int real = mc->vocab_size - m->v_lo;  // the real (unpadded) tokens of this shard
    m->v_count = real < 0 ? 0 : real > m->Vl ? m->Vl : real;
    m->shape = whole;                  // the architecture's block and position encoding, then our share:
    m->shape.C = m->Cy;                // rotary turns each local head as a whole one
    m->shape.n_head = m->NHx;
    m->shape.C_attn = m->Cx;
    m->shape.n_kv_head /= g->X;        // and the key/value heads of ours
    m->shape.C_kv /= g->X;
    m->shape.C_mlp = m->C4x;
    m->shape.v_rows = m->Vl;
    build_local_layout(m);  // reads the shape
    m->qkv = tp_linear_make(g, C, C + 2 * whole.C_kv, false);
    m->proj = tp_linear_make(g, C, C, true);
    m->fc = tp_linear_make(g, C, whole.gated_mlp ? 2 * whole.C_mlp : whole.C_mlp, false);
    m->fcproj = tp_linear_make(g, whole.C_mlp, C, true);
    m->head = tp_linear_make(g, C, mc->padded_vocab_size, false);
    const TPLinear *all[] = {&m->qkv, &m->proj, &m->fc, &m->fcproj, &m->head};
    for (int i = 0; i < 5; i++)
        if (all[i]->block > m->max_block) m->max_block = all[i]->block;
}

void tp_model_free(TPModel *m) {
    if (m->trained.free) m->trained.free(m->trained.owner);
    free(m->local);
    free(m->layout.tensors);
    gpt_layout_free(&m->full);
    memset(m, 0, sizeof *m);
}

// ---- moving between the full model and this rank's share -------------------------------------

typedef void (*SegmentFn)(size_t full_offset, size_t local_offset, size_t count, void *ctx);

// Calls fn for every run of this rank's elements of tensor i that is contiguous both in the full
// buffer and in the local one (a row of a block, or a whole column vector).
static void for_each_run(const TPModel *m, int i, SegmentFn fn, void *ctx) {
    const LocalTensor *t = &m->local[i];
    const TensorInfo *f = &m->full.tensors[i];
    size_t full_cols = f->ndim == 2 ? (size_t)f->shape[1] : 1;
    size_t run_full = 0, run_local = 0, run_n = 0;
    for (size_t k = t->first, end = t->first + t->numel; k < end;) {
        size_t r = 0, in_range = k;  // the range element k falls in, and its place there
        while (in_range >= (size_t)t->rows[r] * t->cols) in_range -= (size_t)t->rows[r++] * t->cols;
        size_t row = in_range / t->cols, col = in_range % t->cols;
        size_t n = (size_t)t->cols - col < end - k ? (size_t)t->cols - col : end - k;
        size_t full = f->offset + ((size_t)t->row0[r] + row) * full_cols + t->col0 + col;
        size_t local = t->offset + (k - t->first);
        if (run_n && run_full + run_n == full && run_local + run_n == local) {
            run_n += n;  // continues the run
        } else {
            if (run_n) fn(run_full, run_local, run_n, ctx);
            run_full = full, run_local = local, run_n = n;
        }
        k += n;
    }
    if (run_n) fn(run_full, run_local, run_n, ctx);
}

typedef struct {
    const TPModel *m;
    float *dst;
    const float *src;
    uint64_t seed;
} RunCtx;

static void init_run(size_t full, size_t local, size_t n, void *ctx) {
    RunCtx *c = ctx;
    gpt_init_range(c->dst + local, &c->m->full, full, n, c->seed);
}

void tp_init_params(const TPModel *m, float *local, uint64_t seed) {
    RunCtx c = {.m = m, .dst = local, .seed = seed};
    for (int i = 0; i < m->full.num_tensors; i++) for_each_run(m, i, init_run, &c);
}

static void extract_run(size_t full, size_t local, size_t n, void *ctx) {
    RunCtx *c = ctx;
    dev_copy(c->dst + local, c->src + full, n * sizeof(float));
}

void tp_extract(const TPModel *m, float *local, const float *full) {
    RunCtx c = {.m = m, .dst = local, .src = full};
    for (int i = 0; i < m->full.num_tensors; i++) for_each_run(m, i, extract_run, &c);
}

// the one rank of a replica that counts (norm) or contributes (assembly) a tensor's copy
static bool is_owner(const TPModel *m, const LocalTensor *t) {
    const TPGrid *g = &m->grid;
    if (t->kind == TP_WEIGHT) return true;  // every shard is unique in the replica
    if (t->kind == TP_SPLIT_Y) return g->x == 0 && g->z == 0;
    if (t->kind == TP_COPY) return g->x == 0 && g->y == 0 && g->z == 0;
    return g->y == 0 && g->z == 0;
}

static void assemble_run(size_t full, size_t local, size_t n, void *ctx) {
    RunCtx *c = ctx;
    dev_copy(c->dst + full, c->src + local, n * sizeof(float));
}

void tp_assemble(const TPModel *m, float *full, const float *local, Comm *group) {
    dev_zero(full, m->full.num_params * sizeof(float));
    RunCtx c = {.m = m, .dst = full, .src = local};
    if (m->grid.d == 0)
        for (int i = 0; i < m->full.num_tensors; i++)
            if (is_owner(m, &m->local[i])) for_each_run(m, i, assemble_run, &c);
    // each element is non-zero on exactly one rank: the sum puts the model together
    comm_all_reduce(group, full, m->full.num_params);
}

double tp_norm_squares(const TPModel *m, const float *grads) { return tp_norm_squares_of(m, grads, NULL, NULL); }

double tp_norm_squares_of(const TPModel *m, const float *grads, TensorFilter take, const void *ctx) {
    // a frozen base has no gradients: the trained set's are the norm's (take filters the base's tensors)
    if (m->trained.norm_squares) return m->trained.norm_squares(m->trained.owner, grads);
    return tp_norm_squares_in(m, grads, take, ctx, 0, m->layout.num_params);
}

double tp_norm_squares_in(const TPModel *m, const float *grads, TensorFilter take, const void *ctx, size_t first,
                          size_t count) {
    double s = 0;
    for (int i = 0; i < m->full.num_tensors; i++) {
        const LocalTensor *t = &m->local[i];
        size_t lo = t->offset > first ? t->offset : first;
        size_t hi = t->offset + t->numel < first + count ? t->offset + t->numel : first + count;
        if (lo < hi && is_owner(m, t) && (!take || take(&m->full.tensors[i], ctx)))
            s += sum_squares(grads + lo, hi - lo);
    }
    return s;
}

// ---- weight streams ---------------------------------------------------------------------------

static void add_use(TPWeightStream *s, const TPLinear *l, const Linear *w) {
    if (s->n == TP_STREAM_MAX) fatal("internal: more than %d weight uses in one pass", TP_STREAM_MAX);
    s->uses[s->n++] = (TPWeightUse){l, w->w, w->w16};
}

// a MoE block's MLP runs its experts' own matmuls (moe.c): nothing of it is streamed
static void add_block_forward(const TPModel *m, TPWeightStream *s, const BlockWeights *b) {
    add_use(s, &m->qkv, &b->qkv);
    add_use(s, &m->proj, &b->attn_proj);
    if (b->moe_mlp) return;
    add_use(s, &m->fc, &b->fc);
    add_use(s, &m->fcproj, &b->fc_proj);
}

// a pass through blocks [first, first + n), with or without the embedding and the head
static void stream_forward_over(const TPModel *m, TPWeightStream *s, const Weights *w, int first, int n, bool embed,
                                bool head) {
    s->n = 0;
    Linear wte = {.w = w->wte};  // the embedding reads wte's block in fp32 (no 16-bit copy)
    if (embed) add_use(s, &m->head, &wte);
    for (int b = first; b < first + n; b++) add_block_forward(m, s, &w->h[b]);
    if (head) add_use(s, &m->head, &w->head);  // the lm_head
    tp_stream_begin(s);
}

// the layers m holds: every block, the embedding and the head, or a pipeline stage's part
void tp_stream_forward(const TPModel *m, TPWeightStream *s, const Weights *w) {
    const ParamLayout *f = &m->full;
    stream_forward_over(m, s, w, f->first_block, f->n_blocks, f->has_embed, f->has_head);
}

void tp_stream_backward(const TPModel *m, TPWeightStream *s, const Weights *w, const ActsSpec *pass) {
    s->n = 0;
    if (pass->head) add_use(s, &m->head, &w->head);
    for (int b = pass->first_layer + pass->n_layers - 1; b >= pass->first_layer; b--) {
        if (pass->recompute) add_block_forward(m, s, &w->h[b]);
        if (!w->h[b].moe_mlp) {
            add_use(s, &m->fcproj, &w->h[b].fc_proj);
            add_use(s, &m->fc, &w->h[b].fc);
        }
        add_use(s, &m->proj, &w->h[b].attn_proj);
        add_use(s, &m->qkv, &w->h[b].qkv);
    }
    tp_stream_begin(s);
}

// ---- LayerNorm over the hidden dimension split over y -----------------------------------------
// Each y rank holds C/Y columns of every row: the row's mean, variance and the two sums of the
// backward are partial sums here, completed by an all-reduce over y (2 of N floats forward, one
// of 2N backward). With y = 1 the all-reduces vanish and this is the serial LayerNorm.

void tp_layernorm_forward(const TPModel *m, float *stats, float *out, float *mean, float *rstd,
                          const float *inp, const float *w, const float *b, int N) {
    Comm *gy = m->grid.gy;
    layernorm_row_sums(mean, inp, NULL, N, m->Cy);
    tp_all_reduce(gy, mean, (size_t)N);
    scale_inplace(mean, 1.0f / (float)m->cfg.n_embd, (size_t)N);
    layernorm_row_sums(stats, inp, mean, N, m->Cy);  // two passes: see kernels.h
    tp_all_reduce(gy, stats, (size_t)N);
    layernorm_forward_stats(out, rstd, inp, w, b, mean, stats, N, m->Cy, m->cfg.n_embd);
}

// Llama's RMSNorm the same way: one sum per row, of squares forward, of dnorm * norm backward
static void tp_rmsnorm_forward(const TPModel *m, float *stats, float *out, float *rstd, const float *inp,
                               const float *w, float eps, int N) {
    rmsnorm_row_sums(stats, inp, N, m->Cy);
    tp_all_reduce(m->grid.gy, stats, (size_t)N);
    rmsnorm_forward_stats(out, rstd, inp, w, stats, N, m->Cy, m->cfg.n_embd, eps);
}

static void tp_rmsnorm_backward(const TPModel *m, float *stats, float *dinp, float *dw, const float *dout,
                                const float *inp, const float *w, const float *rstd, int N) {
    rmsnorm_backward_row_sums(stats, dout, inp, w, rstd, N, m->Cy);
    tp_all_reduce(m->grid.gy, stats, (size_t)N);
    rmsnorm_backward_stats(dinp, dw, dout, inp, w, rstd, stats, N, m->Cy, m->cfg.n_embd);
}

static void tp_norm_forward(LayerOps *ops, float *out, float *mean, float *rstd, const float *inp,
                            const Norm *w, const ModelShape *s, int N) {
    TPLayers *t = (TPLayers *)ops;
    if (s->rms_norm) {
        tp_rmsnorm_forward(t->m, t->stats, out, rstd, inp, w->w, s->norm_eps, N);
        return;
    }
    tp_layernorm_forward(t->m, t->stats, out, mean, rstd, inp, w->w, w->b, N);
}

static void tp_norm_backward(LayerOps *ops, float *dinp, Norm *g, const float *dout, const float *inp,
                             const Norm *w, const float *mean, const float *rstd, const ModelShape *s, int N) {
    TPLayers *t = (TPLayers *)ops;
    if (s->rms_norm) {
        tp_rmsnorm_backward(t->m, t->stats, dinp, g->w, dout, inp, w->w, rstd, N);
        return;
    }
    const TPModel *m = t->m;
    layernorm_backward_row_sums(t->stats, dout, inp, w->w, mean, rstd, N, m->Cy);
    tp_all_reduce(m->grid.gy, t->stats, 2 * (size_t)N);
    layernorm_backward_stats(dinp, g->w, g->b, dout, inp, w->w, mean, rstd, t->stats, N, m->Cy, m->cfg.n_embd);
}

// ---- the linear layers ------------------------------------------------------------------------

const TPLinear *tp_layer_of(const TPModel *m, LinearKind k) {
    switch (k) {
    case LIN_QKV: return &m->qkv;
    case LIN_ATTN_PROJ: return &m->proj;
    case LIN_FC: return &m->fc;
    case LIN_FC_PROJ: return &m->fcproj;
    case LIN_HEAD: break;
    }
    return &m->head;
}

// forward: the gathered weight from the stream, this rank's bias; the all-reduce over the layer's
// in group completes the output (tp_linear.h)
static void tp_layer_forward(LayerOps *ops, LinearKind k, float *out, const float *inp, half16 *inp16,
                             const Linear *w, int N, int in_dim, int out_dim) {
    (void)in_dim, (void)out_dim;
    TPLayers *t = (TPLayers *)ops;
    Linear W = tp_stream_next(t->stream);
    W.b = w->b;
    tp_linear_forward(tp_layer_of(t->m, k), out, inp, inp16, W, N);
}

// Where layer l's weight gradient goes: straight into the gradient shard when z = 1, else into a
// slot's block that is reduce-scattered over z when the layer is done (grad_done).
static float *grad_target(const TPModel *m, TPGradSlot *slot, const TPLinear *l, float *grad) {
    return m->grid.Z == 1 ? grad : tp_grad_slot_open(slot, l, grad);
}

static void grad_done(const TPModel *m, TPGradSlot *slot, bool overlap) {
    if (m->grid.Z == 1) return;
    tp_grad_slot_launch(slot);
    if (!overlap) tp_grad_slot_finish(slot);  // else it travels during the next layers' backward
}

// backward with the weight gradient's reduce-scatter; the lm_head's (wte's) stays open until the
// embedding has added its part
static void tp_layer_backward(LayerOps *ops, LinearKind k, float *dinp, Linear *g, const float *dout,
                              half16 *dout16, const float *inp, const half16 *inp16, const Linear *w, int N,
                              int in_dim, int out_dim) {
    (void)w, (void)in_dim, (void)out_dim;
    TPLayers *t = (TPLayers *)ops;
    const TPModel *m = t->m;
    const TPLinear *l = tp_layer_of(m, k);
    if (!g->w) {  // a frozen weight: the input gradient only
        tp_linear_backward(l, dinp, NULL, NULL, dout, dout16, inp, inp16, tp_stream_next(t->stream), N, t->overlap);
        return;
    }
    bool tied_head = k == LIN_HEAD && m->full.arch->tied_head;  // wte's gradient: the embedding adds to it
    TPGradSlot *slot = tied_head ? &t->slots->wte : &t->slots->mat[t->slots->next++ % 2];
    float *target = grad_target(m, slot, l, g->w);
    tp_linear_backward(l, dinp, target, g->b, dout, dout16, inp, inp16, tp_stream_next(t->stream), N, t->overlap);
    if (tied_head) t->dwte = target;
    else grad_done(m, slot, t->overlap);
}

// ---- the embedding over the vocabulary split over x -------------------------------------------

// Each x rank looks up the tokens of its vocabulary shard (0 for the others) and x rank 0 adds
// the positions; the sum over x completes every row.
static void tp_embed_forward(LayerOps *ops, float *out, const int *tokens, const int *start,
                             const Weights *w, const ModelShape *s, int B, int T) {
    TPLayers *t = (TPLayers *)ops;
    const TPModel *m = t->m;
    Linear wte = tp_stream_next(t->stream);
    float *sum = m->seq_shards > 1 ? t->seq_full : out;  // sequence parallel: reduce-scattered into out
    embedding_forward(sum, tokens, start, wte.w, m->grid.x == 0 ? w->wpe : NULL, m->v_lo, s->v_rows, B, T, s->C);
    if (m->seq_shards > 1) ops->seq_reduce_scatter(ops, out, sum, B * T);
    else tp_all_reduce(m->grid.gx, out, (size_t)B * T * s->C);
}

// the gradient of the rows of this rank's vocabulary, into where the head put wte's; wpe's on
// every x rank (dout is the same there, as wpe is a copy on each)
static void tp_embed_backward(LayerOps *ops, Weights *g, const float *dout, const int *tokens,
                              const ModelShape *s, int B, int T) {
    TPLayers *t = (TPLayers *)ops;
    // (a part without the head, a first pipeline stage, collects its tied wte's gradient alone)
    const ParamLayout *f = &t->m->full;
    if (!f->arch->tied_head || !f->has_head) t->dwte = grad_target(t->m, &t->slots->wte, &t->m->head, g->wte);
    if (t->m->seq_shards > 1) {  // sequence parallel: dout is this rank's rows
        ops->seq_gather(ops, t->seq_full, dout, B * T);
        dout = t->seq_full;
    }
    embedding_backward(t->dwte, g->wpe, dout, tokens, t->m->v_lo, s->v_rows, B, T, s->C);
    grad_done(t->m, &t->slots->wte, t->overlap);
}

void tp_layers_init(TPLayers *t, const TPModel *m, TPWeightStream *stream, TPGradSlots *slots, bool overlap,
                    float *stats) {
    *t = (TPLayers){.base = *serial_layer_ops(), .m = m, .stream = stream, .slots = slots, .overlap = overlap,
                    .stats = stats};
    t->base.embed_forward = tp_embed_forward;
    t->base.embed_backward = tp_embed_backward;
    t->base.linear_forward = tp_layer_forward;
    t->base.linear_backward = tp_layer_backward;
    t->base.norm_forward = tp_norm_forward;
    t->base.norm_backward = tp_norm_backward;
    if (m->seq_shards > 1) {
        t->base.seq_gather = m->seq_gather;
        t->base.seq_reduce_scatter = m->seq_reduce_scatter;
    }
}

// ---- activations ------------------------------------------------------------------------------

static float *alloc_floats(TPActs *a, size_t n) {
    a->bytes += n * sizeof(float);
    return dev_malloc(n * sizeof(float));
}

// the block's activations at this rank's sizes, for the layers m holds
static ActsSpec tp_acts_spec(const TPModel *m, int B, int T, int flags) {
    ActsSpec spec = whole_model_acts(&m->cfg, B, T, flags & ACTS_16BIT, flags & ACTS_RECOMPUTE);
    spec.shape = m->shape;
    spec.first_layer = m->full.first_block, spec.n_layers = m->full.n_blocks;
    spec.embed = m->full.has_embed, spec.head = m->full.has_head;
    spec.seq_shards = m->seq_shards;
    return spec;
}

void tp_acts_alloc(TPActs *a, const TPModel *m, int B, int T, int flags, bool overlap) {
    tp_scratch_alloc(a, m, B, T, flags, overlap);
    ActsSpec spec = tp_acts_spec(m, B, T, flags);
    spec.ops = &a->layers.base;
    acts_alloc_spec(&a->acts, &spec);
    a->bytes += a->acts.bytes;
}

void tp_scratch_alloc(TPActs *a, const TPModel *m, int B, int T, int flags, bool overlap) {
    size_t N = (size_t)B * T, X = m->grid.X;
    memset(a, 0, sizeof *a);
    tp_stream_init(&a->stream, &m->grid, m->max_block, overlap, flags & ACTS_16BIT);
    if (m->grid.Z > 1) {  // counted apart: tp_memory_items' weight-gradient blocks
        tp_grad_slot_alloc(&a->slots.wte, m->head.block);
        for (int i = 0; i < 2; i++) tp_grad_slot_alloc(&a->slots.mat[i], m->max_block);
    }
    a->stats = alloc_floats(a, 2 * N);
    tp_layers_init(&a->layers, m, &a->stream, &a->slots, overlap, a->stats);
    if (m->seq_shards > 1) a->seq_full = a->layers.seq_full = alloc_floats(a, N * m->shape.C);
    a->ce_max = alloc_floats(a, N), a->ce_maxes = alloc_floats(a, X * N), a->ce_sums = alloc_floats(a, 2 * N);
    if (!m->vocab_parallel_loss) {
        a->gathered = alloc_floats(a, X * N * m->Vl);
        a->full_logits = alloc_floats(a, N * (size_t)m->cfg.padded_vocab_size);
    }
}

// what tp_acts_alloc allocates, buffer for buffer (test_plan.sh checks the two agree)
size_t tp_acts_bytes(const TPModel *m, int B, int T, int flags) {
    size_t N = (size_t)B * T, X = m->grid.X;
    ActsSpec spec = tp_acts_spec(m, B, T, flags);
    size_t floats = 2 * N + N + X * N + 2 * N;  // stats, ce_max, ce_maxes, ce_sums
    if (m->seq_shards > 1) floats += N * m->shape.C;  // seq_full
    if (!m->vocab_parallel_loss) floats += X * N * m->Vl + N * (size_t)m->cfg.padded_vocab_size;
    return acts_bytes(&spec) + floats * sizeof(float);
}

void tp_memory_items(const TPModel *m, const Config *cfg, size_t acts_bytes, MemoryItem items[TP_MEMORY_ITEMS]) {
    bool half_mode = config_is_half(cfg);
    size_t n = m->layout.num_params, bytes = n * sizeof(float);
    // with z > 1: two gathered blocks (this one and the prefetched next) with their 16-bit copies,
    // and the weight-gradient slots (wte's and two alternating ones), each a block and its shard
    size_t gather_bytes = m->grid.Z > 1 ? 2 * m->max_block * (sizeof(float) + (half_mode ? sizeof(half16) : 0)) : 0;
    size_t slot_bytes = m->grid.Z > 1 ? 2 * sizeof(float) * (m->head.block + 2 * m->max_block) : 0;
    MemoryItem all[TP_MEMORY_ITEMS] = {
        {parameters_label(cfg), bytes}, {copy_label(cfg), half_mode ? n * sizeof(half16) : 0},
        {"gradients (fp32)", bytes}, {"AdamW m and v (fp32)", 2 * bytes},
        {"gathered weight blocks", gather_bytes}, {"weight-gradient blocks", slot_bytes},
        {"activations", acts_bytes}};
    memcpy(items, all, sizeof all);
}

void tp_acts_free(TPActs *a) {
    if (a->layers.m->grid.Z > 1) {
        tp_grad_slot_free(&a->slots.wte);
        for (int i = 0; i < 2; i++) tp_grad_slot_free(&a->slots.mat[i]);
    }
    acts_free(&a->acts);
    tp_stream_free(&a->stream);
    void *all[] = {a->stats, a->ce_max, a->ce_maxes, a->ce_sums, a->gathered, a->full_logits, a->seq_full};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dev_free(all[i]);
    memset(a, 0, sizeof *a);
}

// ---- the passes -------------------------------------------------------------------------------

void tp_forward(const TPModel *m, TPActs *a, const Weights *w, const int *inputs, int B, int T) {
    tp_forward_on(m, a, &a->acts, w, inputs, B, T);
}

// Sequence parallelism's shards hold equal rows: without padding (which would change the bytes moved and the work
// done), a batch whose tokens x does not divide is refused rather than split unevenly.
static void refuse_unsplit_batch(const TPModel *m, int B, int T) {
    if (m->seq_shards > 1 && (long)B * T % m->seq_shards)
        fatal("%s: key 'sequence_parallel': a micro-batch of %d rows x sequence length T = %d is %ld tokens, "
              "which the x = %d tensor ranks do not divide (each keeps an equal share of the residual "
              "stream); choose max_seq_len, global_batch_size or tp_dimensions so that x divides rows x T",
              config_source("sequence_parallel"), B, T, (long)B * T, m->seq_shards);
}

void tp_forward_on(const TPModel *m, TPActs *a, Activations *k, const Weights *w, const int *inputs, int B, int T) {
    refuse_unsplit_batch(m, B, T);
    // k's blocks: the layers m holds, or one chunk of them (a stage's under an interleaved pipeline)
    stream_forward_over(m, a->layers.stream, w, k->spec.first_layer, k->spec.n_layers, k->spec.embed, k->spec.head);
    gpt_forward(k, w, inputs, B, T);
}

// Vocab-parallel (the default): softmax over a vocabulary split over x needs only each row's max
// (an all-gather of N floats) and its sum of exponentials and target logit (an all-reduce of 2N):
// the (N, V) logits never exist on one rank.
static void loss_vocab_parallel(const TPModel *m, TPActs *a, const Activations *k, int N, float dloss,
                                bool backward) {
    int X = m->grid.X;
    cross_entropy_shard_max(a->ce_max, k->logits, N, m->v_count, m->Vl);
    const float *maxes = a->ce_max;
    if (X > 1) {
        comm_all_gather(m->grid.gx, a->ce_maxes, a->ce_max, (size_t)N);
        maxes = a->ce_maxes;
    }
    cross_entropy_shard_sums(a->ce_sums, k->logits, maxes, X, k->targets, m->v_lo, m->v_count, N, m->Vl);
    tp_all_reduce(m->grid.gx, a->ce_sums, 2 * (size_t)N);
    cross_entropy_shard_finish(k->losses, backward ? k->logits : NULL, k->logits, maxes, X, a->ce_sums,
                               k->targets, dloss, m->v_lo, m->v_count, N, m->Vl);
}

// see tp_model.h: the loss below, and stage 06 (the whole row it samples from), use it
void tp_gather_vocab(const TPModel *m, float *full, float *gathered, const float *local, int N) {
    int X = m->grid.X, Vl = m->Vl, Vp = m->cfg.padded_vocab_size;
    size_t row = (size_t)Vl * sizeof(float);
    if (X > 1) comm_all_gather(m->grid.gx, gathered, local, (size_t)N * Vl);
    else dev_copy(gathered, local, (size_t)N * row);
    for (int r = 0; r < X; r++)  // (X, N, Vl) blocks -> (N, Vp) rows
        for (int n = 0; n < N; n++)
            dev_copy(full + (size_t)n * Vp + (size_t)r * Vl, gathered + ((size_t)r * N + n) * Vl, row);
}

// Gathered (the lesson's first version, AxoNN's and the tutorial's): all-gather the logits over
// x into full (N, Vp) rows on every x rank, run the serial loss, keep this rank's columns of the
// gradient. Simple, but it moves and holds N x Vp floats: for GPT-2 that is the largest
// activation of the model.
static void loss_gathered(const TPModel *m, TPActs *a, const Activations *k, int N, float dloss, bool backward) {
    int Vl = m->Vl, Vp = m->cfg.padded_vocab_size;
    size_t row = (size_t)Vl * sizeof(float);
    tp_gather_vocab(m, a->full_logits, a->gathered, k->logits, N);
    if (!backward) {
        cross_entropy_forward(k->losses, a->full_logits, k->targets, N, m->cfg.vocab_size, Vp);
        return;
    }
    cross_entropy_forward_backward(a->full_logits, NULL, k->losses, k->targets, dloss, N, m->cfg.vocab_size, Vp);
    for (int n = 0; n < N; n++) dev_copy(k->logits + (size_t)n * Vl, a->full_logits + (size_t)n * Vp + m->v_lo, row);
}

double tp_loss(const TPModel *m, TPActs *a, const int *targets, int B, int T, float dloss, bool backward) {
    return tp_loss_on(m, a, &a->acts, targets, B, T, dloss, backward);
}

double tp_loss_on(const TPModel *m, TPActs *a, Activations *k, const int *targets, int B, int T, float dloss,
                  bool backward) {
    int N = B * T;
    copy_to_device(k->targets, targets, (size_t)N * sizeof(int));
    if (m->vocab_parallel_loss) loss_vocab_parallel(m, a, k, N, dloss, backward);
    else loss_gathered(m, a, k, N, dloss, backward);
    return sum_values(k->losses, (size_t)N);
}

void tp_backward(const TPModel *m, TPActs *a, const Weights *w, Weights *g, int B, int T) {
    tp_backward_on(m, a, &a->acts, w, g, B, T);
}

// with z > 1: every weight gradient of the pass has arrived
static void finish_grad_slots(const TPModel *m, TPActs *a) {
    if (m->grid.Z == 1) return;
    TPGradSlots *slots = a->layers.slots;
    for (int i = 0; i < 2; i++) tp_grad_slot_finish(&slots->mat[i]);
    tp_grad_slot_finish(&slots->wte);
}

void tp_backward_on(const TPModel *m, TPActs *a, Activations *k, const Weights *w, Weights *g, int B, int T) {
    tp_stream_backward(m, a->layers.stream, w, &k->spec);
    gpt_backward(k, w, g, B, T, NULL, NULL);
    finish_grad_slots(m, a);
}

void tp_weight_pass_on(const TPModel *m, TPActs *a, Activations *k, const Weights *w, void (*run)(void *notes),
                       void *notes) {
    tp_stream_backward(m, a->layers.stream, w, &k->spec);
    run(notes);
    finish_grad_slots(m, a);
}

// ---- checkpoints: the full model, whatever the grid (tp_model.h) -------------------------------
typedef struct {
    float *params, *m, *v;  // device buffers in the full layout
} FullState;

static void full_alloc(FullState *f, const TPModel *m) {
    size_t bytes = m->full.num_params * sizeof(float);
    f->params = dev_malloc(bytes), f->m = dev_malloc(bytes), f->v = dev_malloc(bytes);
}

static void full_free(FullState *f) {
    dev_free(f->params), dev_free(f->m), dev_free(f->v);
}

void tp_save_checkpoint(const Config *cfg, const TPModel *m, Comm *group, const float *params,
                      const float *adam_m, const float *adam_v, long step) {
    if (m->trained.save) {
        m->trained.save(m->trained.owner, cfg, group, params);
        return;
    }
    FullState f;
    full_alloc(&f, m);
    tp_assemble(m, f.params, params, group);
    tp_assemble(m, f.m, adam_m, group);
    tp_assemble(m, f.v, adam_v, group);
    if (comm_rank(group) == 0) save_checkpoint(cfg, &m->full, f.params, f.m, f.v, step);
    full_free(&f);
}

long tp_load_checkpoint(const Config *cfg, const TPModel *m, float *params, float *adam_m, float *adam_v) {
    FullState f;
    full_alloc(&f, m);
    long step = 0;
    if (cfg->resume) step = resume_checkpoint(cfg, &m->full, f.params, f.m, f.v);
    else load_initial_weights(cfg, &m->full, f.params);
    tp_extract(m, params, f.params);
    tp_extract(m, adam_m, f.m);
    tp_extract(m, adam_v, f.v);
    full_free(&f);
    return step;
}

// ---- evaluation: the forward of the training's layout, no backward ----------------------------
typedef struct {
    const TPModel *m;
    TPActs *a;
    const Weights *w;
} TPEval;

static double tp_batch_loss(void *ctx, const Batch *batch) {  // a BatchLossFn of evaluate.h
    TPEval *e = ctx;
    tp_forward(e->m, e->a, e->w, batch->inputs, batch->rows, batch->T);
    return tp_loss(e->m, e->a, batch->targets, batch->rows, batch->T, 0.0f, false);
}

void tp_evaluate(const TPModel *m, TPActs *a, const Weights *w, const Dataset *data, const Config *cfg,
                        int row_rank, int row_ranks, bool counts, double sums[2]) {
    TPEval e = {m, a, w};
    evaluate_batches(tp_batch_loss, &e, data, cfg, row_rank, row_ranks, sums);
    // every x, y rank of a row group computed the same rows: one of them counts them
    if (!counts) sums[0] = sums[1] = 0;
}

void tp_print_grid(const TPModel *m, int P, bool overlap) {
    const TPGrid *g = &m->grid;
    printf("grid [x=%d, y=%d, z=%d] x data %d = %d ranks (rank = ((data*z_size + z)*x_size + x)*y_size + y)\n",
           g->X, g->Y, g->Z, g->D, P);
    printf("  x: %d head%s, %d MLP columns, %d vocabulary rows per rank | y: %d of %d hidden columns | "
           "z, data: rows of the batch\n", m->NHx, m->NHx == 1 ? "" : "s", m->C4x, m->Vl, m->Cy, m->cfg.n_embd);
    printf("loss: %s\n", m->vocab_parallel_loss ? "vocab-parallel (max and sum-exp all-reduced over x)"
                                                : "on logits all-gathered over x");
    printf("overlap_communication: %s\n", overlap ? "on (depth all-gathers prefetched, backward collectives "
                                                    "started before the weight-gradient matmul)" : "off");
    size_t full = m->full_weight_numel;
    printf("parallel weights on this rank: %zu of %zu elements (1/%zu); replicated small tensors: %zu\n",
           m->weight_numel, full, full / (m->weight_numel ? m->weight_numel : 1), m->small_numel);
    run_stats_number("parallel_weight_elements", (double)full);
    run_stats_number("parallel_weight_elements_per_rank", (double)m->weight_numel);
    run_stats_number("small_elements_per_rank", (double)m->small_numel);
}
