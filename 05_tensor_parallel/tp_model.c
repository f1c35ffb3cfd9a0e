// tp_model.c: see tp_model.h.
#include "tp_model.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

// block tensor i of BlockWeights' twelve (the full layout's order)
enum { LN1W, LN1B, QKVW, QKVB, PROJW, PROJB, LN2W, LN2B, FCW, FCB, FCPROJW, FCPROJB };

// ---- the grid must fit ------------------------------------------------------------------------

static void require(bool ok, const char *constraint, const int d[3], const char *fmt, int a, int b) {
    if (ok) return;
    char detail[160];
    snprintf(detail, sizeof detail, fmt, a, b);
    fatal("key 'tp_dimensions' [%d, %d, %d] does not fit: %s (%s)", d[0], d[1], d[2], constraint, detail);
}

void tp_check_grid(const GPTConfig *mc, const int d[3], int world, int global_batch, int acc) {
    int X = d[0], Y = d[1], Z = d[2], C = mc->n_embd, Vp = mc->padded_vocab_size;
    require(world % (X * Y * Z) == 0, "x*y*z must divide the number of ranks (the rest is data parallelism)", d,
            "%d ranks, x*y*z = %d", world, X * Y * Z);
    require(mc->n_head % X == 0, "attention heads must divide by x (heads are split over x)", d,
            "n_head %d, x %d", mc->n_head, X);
    require(C % Y == 0, "the hidden size must divide by y (it is split over y)", d, "n_embd %d, y %d", C, Y);
    require(4 * C % X == 0, "the MLP width 4*n_embd must divide by x", d, "4*n_embd %d, x %d", 4 * C, X);
    require(Vp % X == 0, "the padded vocabulary must divide by x (it is split over x)", d,
            "padded vocabulary %d, x %d", Vp, X);
    size_t blocks[] = {(size_t)Vp / X * (C / Y), (size_t)3 * C / X * (C / Y), (size_t)C / Y * (C / X),
                       (size_t)4 * C / X * (C / Y)};
    for (int i = 0; i < 4; i++)
        require(blocks[i] % Z == 0, "every weight block must divide by z (depth shards are equal)", d,
                "block of %d elements, z %d", (int)blocks[i], Z);
    int rows = world / (X * Y) * acc;  // z * data ranks, each taking acc micro-batches
    require(global_batch % rows == 0,
            "global_batch_size must divide by z * data * gradient_acc_steps (rows are split over z and data)",
            d, "global_batch_size %d, z*data*acc %d", global_batch, rows);
}

// ---- this rank's tensors ----------------------------------------------------------------------

static LocalTensor vector_part(TPKind kind, int row0, int rows) {
    return (LocalTensor){.kind = kind, .nranges = 1, .row0 = {row0}, .rows = rows, .cols = 1};
}

static LocalTensor matrix_part(int row0, int rows, int col0, int cols) {
    return (LocalTensor){.kind = TP_WEIGHT, .nranges = 1, .row0 = {row0}, .rows = rows, .col0 = col0, .cols = cols};
}

// q, k and v of this rank's heads: three row ranges of the fused (3C, ...) tensor
static LocalTensor heads_part(TPKind kind, const TPModel *m, int col0, int cols) {
    int C = m->cfg.n_embd, x0 = m->grid.x * m->Cx;
    return (LocalTensor){.kind = kind, .nranges = 3, .row0 = {x0, C + x0, 2 * C + x0}, .rows = m->Cx,
                         .col0 = col0, .cols = cols};
}

static LocalTensor describe(const TPModel *m, int i) {
    const TPGrid *g = &m->grid;
    int y0 = g->y * m->Cy, Cy = m->Cy;
    if (i == 0) return matrix_part(m->v_lo, m->Vl, y0, Cy);  // wte
    if (i == 1) {                                              // wpe: every position, hidden over y
        LocalTensor t = matrix_part(0, m->cfg.max_seq_len, y0, Cy);
        t.kind = TP_SPLIT_Y;
        return t;
    }
    if (i < ROOT_TENSORS) return vector_part(TP_SPLIT_Y, y0, Cy);  // ln_f
    int x4 = g->x * m->C4x;
    switch ((i - ROOT_TENSORS) % BLOCK_TENSORS) {
    case QKVW: return heads_part(TP_WEIGHT, m, y0, Cy);
    case QKVB: return heads_part(TP_SPLIT_X, m, 0, 1);
    case PROJW: return matrix_part(y0, Cy, g->x * m->Cx, m->Cx);  // transposed: out over y, in over x
    case FCW: return matrix_part(x4, m->C4x, y0, Cy);
    case FCB: return vector_part(TP_SPLIT_X, x4, m->C4x);
    case FCPROJW: return matrix_part(y0, Cy, x4, m->C4x);
    default: return vector_part(TP_SPLIT_Y, y0, Cy);  // LayerNorms, the projections' biases
    }
}

static void build_local_layout(TPModel *m) {
    const ParamLayout *f = &m->full;
    m->local = calloc_or_die((size_t)f->num_tensors, sizeof(LocalTensor));
    m->layout.cfg = m->cfg;
    m->layout.tensors = calloc_or_die((size_t)f->num_tensors, sizeof(TensorInfo));
    // two passes: the small replicated tensors first, so that their gradients (summed over z and
    // data) are one contiguous range, then the weight shards (summed over data only)
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < f->num_tensors; i++) {
            LocalTensor t = describe(m, i);
            if ((t.kind == TP_WEIGHT) != (pass == 1)) continue;
            t.block = (size_t)t.nranges * t.rows * t.cols;
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
    memset(m, 0, sizeof *m);
    m->cfg = *mc;
    m->vocab_parallel_loss = vocab_parallel_loss;
    tp_grid_init(&m->grid, world, dims);
    const TPGrid *g = &m->grid;
    int C = mc->n_embd;
    m->Cy = C / g->Y;
    m->Cx = C / g->X;
    m->C4x = 4 * C / g->X;
    m->NHx = mc->n_head / g->X;
    m->Vl = mc->padded_vocab_size / g->X;
    m->v_lo = g->x * m->Vl;
    int real = mc->vocab_size - m->v_lo;  // the real (unpadded) tokens of this shard
    m->v_count = real < 0 ? 0 : real > m->Vl ? m->Vl : real;
    gpt_layout(&m->full, mc);
    build_local_layout(m);
    m->qkv = tp_linear_make(g, C, 3 * C, false);
    m->proj = tp_linear_make(g, C, C, true);
    m->fc = tp_linear_make(g, C, 4 * C, false);
    m->fcproj = tp_linear_make(g, 4 * C, C, true);
    m->head = tp_linear_make(g, C, mc->padded_vocab_size, false);
    const TPLinear *all[] = {&m->qkv, &m->proj, &m->fc, &m->fcproj, &m->head};
    for (int i = 0; i < 5; i++)
        if (all[i]->block > m->max_block) m->max_block = all[i]->block;
}

void tp_model_free(TPModel *m) {
    free(m->local);
    free(m->layout.tensors);
    gpt_layout_free(&m->full);
    memset(m, 0, sizeof *m);
}

void tp_params_point(TPParams *p, const TPModel *m, float *flat) {
    const LocalTensor *t = m->local;
    p->wte = flat + t[0].offset;
    p->wpe = flat + t[1].offset;
    p->lnfw = flat + t[2].offset;
    p->lnfb = flat + t[3].offset;
    p->h = calloc_or_die((size_t)m->cfg.n_layer, sizeof(TPBlock));
    for (int b = 0; b < m->cfg.n_layer; b++) {
        float **slots = (float **)&p->h[b];  // TPBlock is twelve float pointers in layout order
        for (int i = 0; i < BLOCK_TENSORS; i++) slots[i] = flat + t[ROOT_TENSORS + b * BLOCK_TENSORS + i].offset;
    }
}

void tp_params_free(TPParams *p) {
    free(p->h);
    p->h = NULL;
}

// ---- moving between the full model and this rank's share -------------------------------------

typedef void (*SegmentFn)(size_t full_offset, size_t local_offset, size_t count, void *ctx);

// Calls fn for every run of this rank's elements of tensor i that is contiguous both in the full
// buffer and in the local one (a row of a block, or a whole column vector).
static void for_each_run(const TPModel *m, int i, SegmentFn fn, void *ctx) {
    const LocalTensor *t = &m->local[i];
    const TensorInfo *f = &m->full.tensors[i];
    size_t full_cols = f->ndim == 2 ? (size_t)f->shape[1] : 1, per_range = (size_t)t->rows * t->cols;
    size_t run_full = 0, run_local = 0, run_n = 0;
    for (size_t k = t->first, end = t->first + t->numel; k < end;) {
        size_t r = k / per_range, row = k % per_range / t->cols, col = k % t->cols;
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

double tp_norm_squares(const TPModel *m, const float *grads) {
    double s = 0;
    for (int i = 0; i < m->full.num_tensors; i++)
        if (is_owner(m, &m->local[i])) s += sum_squares(grads + m->local[i].offset, m->local[i].numel);
    return s;
}

// ---- activations ------------------------------------------------------------------------------

static float *act(TPActs *a, size_t n) {
    a->bytes += n * sizeof(float);
    return dev_malloc(n * sizeof(float));
}

static bf16 *act16(TPActs *a, size_t n, bool on) {  // (a parameter named bf16 would hide the type)
    if (!on) return NULL;
    a->bytes += n * sizeof(bf16);
    return dev_malloc(n * sizeof(bf16));
}

void tp_acts_alloc(TPActs *a, const TPModel *m, int B, int T, bool bf16_mode) {
    size_t N = (size_t)B * T, Cy = m->Cy, Cx = m->Cx, C4x = m->C4x, Vl = m->Vl, X = m->grid.X;
    size_t att = (size_t)B * m->NHx * T * T, widest = C4x > 3 * Cx ? C4x : 3 * Cx;
    if (Cy > widest) widest = Cy;
    memset(a, 0, sizeof *a);
    a->B = B, a->T = T, a->L = m->cfg.n_layer;
    a->encoded = act(a, N * Cy);
    a->blocks = calloc_or_die((size_t)a->L, sizeof(TPBlockActs));
    for (int l = 0; l < a->L; l++) {
        TPBlockActs *k = &a->blocks[l];
        k->ln1 = act(a, N * Cy), k->ln1_mean = act(a, N), k->ln1_rstd = act(a, N);
        k->qkv = act(a, N * 3 * Cx), k->att = act(a, att), k->atty = act(a, N * Cx);
        k->res2 = act(a, N * Cy), k->ln2 = act(a, N * Cy), k->ln2_mean = act(a, N), k->ln2_rstd = act(a, N);
        k->fch = act(a, N * C4x), k->fch_gelu = act(a, N * C4x), k->out = act(a, N * Cy);
        k->ln1_16 = act16(a, N * Cy, bf16_mode), k->atty16 = act16(a, N * Cx, bf16_mode);
        k->ln2_16 = act16(a, N * Cy, bf16_mode), k->fch_gelu16 = act16(a, N * C4x, bf16_mode);
    }
    a->lnf = act(a, N * Cy), a->lnf_mean = act(a, N), a->lnf_rstd = act(a, N);
    a->lnf16 = act16(a, N * Cy, bf16_mode);
    a->dout16 = act16(a, N * (Vl > widest ? Vl : widest), bf16_mode);
    a->logits = act(a, N * Vl), a->losses = act(a, N);
    a->inputs = dev_malloc(N * sizeof(int)), a->targets = dev_malloc(N * sizeof(int));
    a->bytes += 2 * N * sizeof(int);
    a->dres = act(a, N * Cy), a->dbig = act(a, N * widest), a->dbig2 = act(a, N * widest);
    a->dsmall = act(a, N * widest), a->datt = act(a, att), a->stats = act(a, 2 * N);
    a->ce_max = act(a, N), a->ce_maxes = act(a, X * N), a->ce_sums = act(a, 2 * N);
    if (!m->vocab_parallel_loss) {
        a->gathered = act(a, X * N * Vl);
        a->full_logits = act(a, N * (size_t)m->cfg.padded_vocab_size);
    }
}

void tp_acts_free(TPActs *a) {
    for (int l = 0; a->blocks && l < a->L; l++) {
        TPBlockActs *k = &a->blocks[l];
        void *all[] = {k->ln1, k->ln1_mean, k->ln1_rstd, k->qkv, k->att, k->atty, k->res2, k->ln2,
                       k->ln2_mean, k->ln2_rstd, k->fch, k->fch_gelu, k->out, k->ln1_16, k->atty16,
                       k->ln2_16, k->fch_gelu16};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dev_free(all[i]);
    }
    void *all[] = {a->encoded, a->lnf, a->lnf_mean, a->lnf_rstd, a->lnf16, a->dout16, a->logits,
                   a->losses, a->inputs, a->targets, a->dres, a->dbig, a->dbig2, a->dsmall, a->datt,
                   a->stats, a->ce_max, a->ce_maxes, a->ce_sums, a->gathered, a->full_logits};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dev_free(all[i]);
    free(a->blocks);
    memset(a, 0, sizeof *a);
}

// ---- weight streams ---------------------------------------------------------------------------

static void add_use(TPWeightStream *s, const TPModel *m, const TPLinear *l, int tensor, const float *flat,
                    const bf16 *flat16) {
    if (s->n == TP_STREAM_MAX) fatal("internal: more than %d weight uses in one pass", TP_STREAM_MAX);
    size_t off = m->local[tensor].offset;
    s->uses[s->n++] = (TPWeightUse){l, flat + off, flat16 ? flat16 + off : NULL};
}

static int block_tensor(int b, int i) { return ROOT_TENSORS + b * BLOCK_TENSORS + i; }

void tp_stream_forward(const TPModel *m, TPWeightStream *s, const float *flat, const bf16 *flat16) {
    s->n = 0;
    add_use(s, m, &m->head, 0, flat, flat16);  // the embedding reads wte's block
    for (int b = 0; b < m->cfg.n_layer; b++) {
        add_use(s, m, &m->qkv, block_tensor(b, QKVW), flat, flat16);
        add_use(s, m, &m->proj, block_tensor(b, PROJW), flat, flat16);
        add_use(s, m, &m->fc, block_tensor(b, FCW), flat, flat16);
        add_use(s, m, &m->fcproj, block_tensor(b, FCPROJW), flat, flat16);
    }
    add_use(s, m, &m->head, 0, flat, flat16);  // the lm_head
    tp_stream_begin(s);
}

void tp_stream_backward(const TPModel *m, TPWeightStream *s, const float *flat, const bf16 *flat16) {
    s->n = 0;
    add_use(s, m, &m->head, 0, flat, flat16);
    for (int b = m->cfg.n_layer - 1; b >= 0; b--) {
        add_use(s, m, &m->fcproj, block_tensor(b, FCPROJW), flat, flat16);
        add_use(s, m, &m->fc, block_tensor(b, FCW), flat, flat16);
        add_use(s, m, &m->proj, block_tensor(b, PROJW), flat, flat16);
        add_use(s, m, &m->qkv, block_tensor(b, QKVW), flat, flat16);
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

static void tp_layernorm_backward(const TPModel *m, TPActs *a, float *dinp, float *dw, float *db,
                                  const float *dout, const float *inp, const float *w,
                                  const float *mean, const float *rstd, int N) {
    layernorm_backward_row_sums(a->stats, dout, inp, w, mean, rstd, N, m->Cy);
    tp_all_reduce(m->grid.gy, a->stats, 2 * (size_t)N);
    layernorm_backward_stats(dinp, dw, db, dout, inp, w, mean, rstd, a->stats, N, m->Cy, m->cfg.n_embd);
}

// ---- forward ----------------------------------------------------------------------------------

static void block_forward(const TPModel *m, TPActs *a, TPBlockActs *k, const float *x, const TPBlock *w,
                          TPWeightStream *s, int B, int T) {
    int N = B * T;
    size_t NCy = (size_t)N * m->Cy;
    // attention: ln1 -> qkv of this rank's heads (all-reduce over y) -> attention on those heads
    // -> projection back to the hidden dim (all-reduce over x) -> residual
    tp_layernorm_forward(m, a->stats, k->ln1, k->ln1_mean, k->ln1_rstd, x, w->ln1w, w->ln1b, N);
    tp_linear_forward(&m->qkv, k->qkv, k->ln1, k->ln1_16, tp_stream_next(s), w->qkvb, N);
    attention_forward(k->atty, k->att, k->qkv, B, T, m->Cx, m->NHx);
    tp_linear_forward(&m->proj, k->res2, k->atty, k->atty16, tp_stream_next(s), w->attprojb, N);
    add_inplace(k->res2, x, NCy);
    // MLP: ln2 -> fc (columns over x) -> gelu -> proj (all-reduce over x) -> residual
    tp_layernorm_forward(m, a->stats, k->ln2, k->ln2_mean, k->ln2_rstd, k->res2, w->ln2w, w->ln2b, N);
    tp_linear_forward(&m->fc, k->fch, k->ln2, k->ln2_16, tp_stream_next(s), w->fcb, N);
    gelu_forward(k->fch_gelu, k->fch, (size_t)N * m->C4x);
    tp_linear_forward(&m->fcproj, k->out, k->fch_gelu, k->fch_gelu16, tp_stream_next(s), w->fcprojb, N);
    add_inplace(k->out, k->res2, NCy);
}

static const float *block_input(const TPActs *a, int l) { return l == 0 ? a->encoded : a->blocks[l - 1].out; }

void tp_forward(const TPModel *m, TPActs *a, const TPParams *w, TPWeightStream *s, const int *inputs, int B, int T) {
    if (B > a->B || T > a->T) fatal("internal: batch %dx%d exceeds the activations' %dx%d", B, T, a->B, a->T);
    int N = B * T;
    copy_to_device(a->inputs, inputs, (size_t)N * sizeof(int));
    // embedding: each x rank looks up the tokens of its vocabulary shard (0 for the others) and
    // the sum over x completes every row; the position embedding is added by x rank 0 only
    TPWeight wte = tp_stream_next(s);
    encoder_forward_shard(a->encoded, a->inputs, wte.w, m->grid.x == 0 ? w->wpe : NULL, m->v_lo, m->Vl, B, T, m->Cy);
    tp_all_reduce(m->grid.gx, a->encoded, (size_t)N * m->Cy);
    for (int l = 0; l < m->cfg.n_layer; l++) block_forward(m, a, &a->blocks[l], block_input(a, l), &w->h[l], s, B, T);
    // head: final LayerNorm, then the tied lm_head, a normal layer: logits of this rank's vocabulary
    tp_layernorm_forward(m, a->stats, a->lnf, a->lnf_mean, a->lnf_rstd, block_input(a, m->cfg.n_layer), w->lnfw, w->lnfb, N);
    tp_linear_forward(&m->head, a->logits, a->lnf, a->lnf16, tp_stream_next(s), NULL, N);
}

// ---- the loss ---------------------------------------------------------------------------------

// Vocab-parallel (the default): softmax over a vocabulary split over x needs only each row's max
// (an all-gather of N floats) and its sum of exponentials and target logit (an all-reduce of 2N):
// the (N, V) logits never exist on one rank.
static void loss_vocab_parallel(const TPModel *m, TPActs *a, int N, float dloss, bool backward) {
    int X = m->grid.X;
    cross_entropy_shard_max(a->ce_max, a->logits, N, m->v_count, m->Vl);
    const float *maxes = a->ce_max;
    if (X > 1) {
        comm_all_gather(m->grid.gx, a->ce_maxes, a->ce_max, (size_t)N);
        maxes = a->ce_maxes;
    }
    cross_entropy_shard_sums(a->ce_sums, a->logits, maxes, X, a->targets, m->v_lo, m->v_count, N, m->Vl);
    tp_all_reduce(m->grid.gx, a->ce_sums, 2 * (size_t)N);
    cross_entropy_shard_finish(a->losses, backward ? a->logits : NULL, a->logits, maxes, X, a->ce_sums,
                               a->targets, dloss, m->v_lo, m->v_count, N, m->Vl);
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
static void loss_gathered(const TPModel *m, TPActs *a, int N, float dloss, bool backward) {
    int Vl = m->Vl, Vp = m->cfg.padded_vocab_size;
    size_t row = (size_t)Vl * sizeof(float);
    tp_gather_vocab(m, a->full_logits, a->gathered, a->logits, N);
    if (!backward) {
        cross_entropy_forward(a->losses, a->full_logits, a->targets, N, m->cfg.vocab_size, Vp);
        return;
    }
    cross_entropy_forward_backward(a->full_logits, a->losses, a->targets, dloss, N, m->cfg.vocab_size, Vp);
    for (int n = 0; n < N; n++) dev_copy(a->logits + (size_t)n * Vl, a->full_logits + (size_t)n * Vp + m->v_lo, row);
}

double tp_loss(const TPModel *m, TPActs *a, const int *targets, int B, int T, float dloss, bool backward) {
    int N = B * T;
    copy_to_device(a->targets, targets, (size_t)N * sizeof(int));
    if (m->vocab_parallel_loss) loss_vocab_parallel(m, a, N, dloss, backward);
    else loss_gathered(m, a, N, dloss, backward);
    return sum_values(a->losses, (size_t)N);
}

// ---- backward ---------------------------------------------------------------------------------

// where layer l's weight gradient goes: straight into the gradient shard when z = 1, else into a
// slot's block that is reduce-scattered over z when the layer is done (grad_done)
static float *grad_target(const TPModel *m, TPGradSlot *slot, const TPLinear *l, float *grad) {
    return m->grid.Z == 1 ? grad : tp_grad_slot_open(slot, l, grad);
}

static void grad_done(const TPModel *m, TPGradSlot *slot, bool overlap) {
    if (m->grid.Z == 1) return;
    tp_grad_slot_launch(slot);
    if (!overlap) tp_grad_slot_finish(slot);  // else it travels during the next layers' backward
}

static TPGradSlot *next_slot(TPGradSlots *s) { return &s->mat[s->next++ % 2]; }

// one linear layer's backward with its gradient's reduce-scatter
static void linear_backward(const TPModel *m, TPActs *a, const TPLinear *l, TPGradSlots *slots, float *dinp,
                            float *dw, float *db, const float *dout, const float *inp, const bf16 *inp16,
                            TPWeightStream *s, int N, bool overlap) {
    TPGradSlot *slot = next_slot(slots);
    float *target = grad_target(m, slot, l, dw);
    tp_linear_backward(l, dinp, target, db, dout, a->dout16, inp, inp16, tp_stream_next(s), N, overlap);
    grad_done(m, slot, overlap);
}

static void block_backward(const TPModel *m, TPActs *a, TPBlockActs *k, const float *x, const TPBlock *w,
                           TPBlock *g, TPWeightStream *s, TPGradSlots *slots, int B, int T, bool overlap) {
    int N = B * T;
    size_t NCy = (size_t)N * m->Cy, NC4x = (size_t)N * m->C4x, NCx = (size_t)N * m->Cx;
    float *dres = a->dres;  // dL/d(out); the residual passes it on unchanged
    // MLP, backwards: the projection's dX is summed over y, fc's over x
    float *dfch_gelu = a->dbig, *dfch = a->dbig2, *dln2 = a->dsmall;
    dev_zero(dfch_gelu, NC4x * sizeof(float));
    dev_zero(dfch, NC4x * sizeof(float));
    dev_zero(dln2, NCy * sizeof(float));
    linear_backward(m, a, &m->fcproj, slots, dfch_gelu, g->fcprojw, g->fcprojb, dres, k->fch_gelu, k->fch_gelu16,
                    s, N, overlap);
    gelu_backward(dfch, k->fch, dfch_gelu, NC4x);
    linear_backward(m, a, &m->fc, slots, dln2, g->fcw, g->fcb, dfch, k->ln2, k->ln2_16, s, N, overlap);
    tp_layernorm_backward(m, a, dres, g->ln2w, g->ln2b, dln2, k->res2, w->ln2w, k->ln2_mean, k->ln2_rstd, N);
    // attention, backwards
    float *datty = a->dbig, *dqkv = a->dbig2, *dln1 = a->dsmall;
    dev_zero(datty, NCx * sizeof(float));
    dev_zero(dqkv, 3 * NCx * sizeof(float));
    dev_zero(dln1, NCy * sizeof(float));
    linear_backward(m, a, &m->proj, slots, datty, g->attprojw, g->attprojb, dres, k->atty, k->atty16, s, N, overlap);
    attention_backward(dqkv, a->datt, datty, k->qkv, k->att, B, T, m->Cx, m->NHx);
    linear_backward(m, a, &m->qkv, slots, dln1, g->qkvw, g->qkvb, dqkv, k->ln1, k->ln1_16, s, N, overlap);
    tp_layernorm_backward(m, a, dres, g->ln1w, g->ln1b, dln1, x, w->ln1w, k->ln1_mean, k->ln1_rstd, N);
}

void tp_backward(const TPModel *m, TPActs *a, const TPParams *w, TPParams *g, TPWeightStream *s,
                 TPGradSlots *slots, int B, int T, bool overlap) {
    int N = B * T, L = m->cfg.n_layer;
    size_t NCy = (size_t)N * m->Cy;
    // head: the lm_head's dX is summed over x; wte's gradient stays open until the embedding
    // has added its part
    float *dlnf = a->dbig;
    dev_zero(dlnf, NCy * sizeof(float));
    dev_zero(a->dres, NCy * sizeof(float));
    float *dwte = grad_target(m, &slots->wte, &m->head, g->wte);
    tp_linear_backward(&m->head, dlnf, dwte, NULL, a->logits, a->dout16, a->lnf, a->lnf16, tp_stream_next(s), N,
                       overlap);
    tp_layernorm_backward(m, a, a->dres, g->lnfw, g->lnfb, dlnf, block_input(a, L), w->lnfw, a->lnf_mean,
                          a->lnf_rstd, N);
    for (int l = L - 1; l >= 0; l--)
        block_backward(m, a, &a->blocks[l], block_input(a, l), &w->h[l], &g->h[l], s, slots, B, T, overlap);
    // embedding: the gradient of the rows of this rank's vocabulary; wpe's on every x rank (dres
    // is the same there, as wpe is a copy on each)
    encoder_backward_shard(dwte, g->wpe, a->dres, a->inputs, m->v_lo, m->Vl, B, T, m->Cy);
    grad_done(m, &slots->wte, overlap);
    if (m->grid.Z > 1) {  // every weight gradient of this micro-batch has arrived
        for (int i = 0; i < 2; i++) tp_grad_slot_finish(&slots->mat[i]);
        tp_grad_slot_finish(&slots->wte);
    }
}
