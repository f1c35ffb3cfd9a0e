// tp_lora.c: see tp_lora.h.
#include "tp_lora.h"

#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "ops/ops.h"

// this rank's slice of one whole adapter, beside the site that runs it
typedef struct {
    int a_col0;                       // A's columns [a_col0, a_col0 + in_dim) of the whole A
    int n_rows, b_row0[3], b_rows[3]; // B's row ranges of the whole B, one after another here
    bool counts_a, counts_b;          // this rank's copy is the one of its replica that counts
} Slice;

struct TPLora {
    Lora whole;           // the whole adapters, described on the full model: names, shapes, files
    Slice *slices;        // [whole.n_sites], indexed as the sites
    const Lora *lo;       // the Lora that runs this rank's slices: its layout is the run's after tp_lora_attach
    TensorInfo *tensors;  // that layout's tensors (tp_lora_free frees them)
};

static int imax(int a, int b) { return a > b ? a : b; }
static int imin(int a, int b) { return a < b ? a : b; }

// the full model's fused weight that starts at `offset`
static int tensor_at(const ParamLayout *full, size_t offset) {
    for (int i = 0; i < full->num_tensors; i++)
        if (full->tensors[i].offset == offset && full->tensors[i].ndim == 2) return i;
    fatal("internal: no matrix of the full model starts at element %zu", offset);
}

// the site of this rank's slice of whole site w: the block's columns, and the rows of w that fall in
// the block's row ranges (a fused tensor's block is up to three ranges: q, k, v; gate, up)
static void slice_site(const TPModel *m, const LoraSite *w, LoraSite *s, Slice *sl) {
    const LocalTensor *lt = &m->local[tensor_at(&m->full, w->base_offset)];
    const TPLinear *l = tp_layer_of(m, w->kind);
    *s = *w;
    s->base_offset = lt->offset;
    s->in_dim = lt->cols;
    s->rows = 0;
    s->col0 = lt->col0;  // its dropout mask's columns: the whole input's
    *sl = (Slice){.a_col0 = lt->col0};
    for (int r = 0, at = 0; r < lt->nranges; at += lt->rows[r], r++) {
        int lo = imax(w->row0, lt->row0[r]), hi = imin(w->row0 + w->rows, lt->row0[r] + lt->rows[r]);
        if (lo >= hi) continue;
        if (!s->rows) s->row0 = at + lo - lt->row0[r];
        sl->b_row0[sl->n_rows] = lo - w->row0;
        sl->b_rows[sl->n_rows++] = hi - lo;
        s->rows += hi - lo;
    }
    if (!s->rows) fatal("internal: LoRA's %s has no rows on this rank", w->kind == LIN_QKV ? "qkv" : "linear");
    // A is the same on every rank of the out group, B on every rank of the in group, both on every z
    sl->counts_a = m->grid.z == 0 && comm_rank(l->out_group) == 0;
    sl->counts_b = m->grid.z == 0 && comm_rank(l->in_group) == 0;
}

static void add_tensor(ParamLayout *l, const TensorInfo *whole, int rows, int cols) {
    TensorInfo *t = &l->tensors[l->num_tensors++];
    *t = *whole;
    t->shape[0] = rows, t->shape[1] = cols;
    t->numel = (size_t)rows * cols;
    t->offset = l->num_params;
    l->num_params += t->numel;
}

// lo: this rank's slices of t->whole's adapters
static void describe_slices(Lora *lo, struct TPLora *t, const TPModel *m) {
    const Lora *w = &t->whole;
    *lo = (Lora){.rank = w->rank, .alpha = w->alpha, .scale = w->scale, .dropout = w->dropout, .seed = w->seed, .arch = w->arch,
                 .n_sites = w->n_sites};
    memcpy(lo->targets, w->targets, sizeof lo->targets);
    lo->layout = (ParamLayout){.cfg = w->layout.cfg, .arch = w->layout.arch, .first_block = w->layout.first_block,
                               .n_blocks = w->layout.n_blocks};
    lo->sites = calloc_or_die((size_t)w->n_sites, sizeof(LoraSite));
    t->slices = calloc_or_die((size_t)w->n_sites, sizeof(Slice));
    t->tensors = lo->layout.tensors = calloc_or_die((size_t)w->layout.num_tensors, sizeof(TensorInfo));
    for (int i = 0; i < w->n_sites; i++) {
        LoraSite *s = &lo->sites[i];
        slice_site(m, &w->sites[i], s, &t->slices[i]);
        s->a = lo->layout.num_tensors;
        add_tensor(&lo->layout, &w->layout.tensors[w->sites[i].a], lo->rank, s->in_dim);
        s->b = lo->layout.num_tensors;
        add_tensor(&lo->layout, &w->layout.tensors[w->sites[i].b], s->rows, lo->rank);
    }
}

// Copies between the whole adapters and this rank's slices (host buffers): to_slices, or back, from
// the copies that count only (every other element of `whole` is left alone)
static void move_slices(const struct TPLora *t, const Lora *lo, float *whole, float *slices, bool to_slices) {
    const Lora *w = &t->whole;
    int r = lo->rank;
    for (int i = 0; i < lo->n_sites; i++) {
        const LoraSite *s = &lo->sites[i], *ws = &w->sites[i];
        const Slice *sl = &t->slices[i];
        float *wa = whole + w->layout.tensors[ws->a].offset, *sa = slices + lo->layout.tensors[s->a].offset;
        float *wb = whole + w->layout.tensors[ws->b].offset, *sb = slices + lo->layout.tensors[s->b].offset;
        if (to_slices || sl->counts_a)
            for (int k = 0; k < r; k++) {
                float *from_whole = wa + (size_t)k * ws->in_dim + sl->a_col0, *here = sa + (size_t)k * s->in_dim;
                if (to_slices) memcpy(here, from_whole, (size_t)s->in_dim * sizeof(float));
                else memcpy(from_whole, here, (size_t)s->in_dim * sizeof(float));
            }
        if (to_slices || sl->counts_b)
            for (int q = 0, at = 0; q < sl->n_rows; at += sl->b_rows[q], q++) {
                float *from_whole = wb + (size_t)sl->b_row0[q] * r, *here = sb + (size_t)at * r;
                size_t bytes = (size_t)sl->b_rows[q] * r * sizeof(float);
                if (to_slices) memcpy(here, from_whole, bytes);
                else memcpy(from_whole, here, bytes);
            }
    }
}

// x A^T over the in group (each rank multiplied its columns of A), dy B over the out group
static void complete_over_group(void *ctx, LinearKind k, bool backward, float *h, size_t n) {
    const TPLinear *l = tp_layer_of(ctx, k);
    tp_all_reduce(backward ? l->out_group : l->in_group, h, n);
}

void tp_lora_attach(Lora *lo, const Config *cfg, TPModel *m, ParamLayout *layout, ModelBuffers *mb, TPActs *acts) {
    memset(lo, 0, sizeof *lo);
    if (!cfg->lora_rank) return;
    struct TPLora *t = calloc_or_die(1, sizeof *t);
    lora_describe_keys(&t->whole, cfg, &m->full);
    float *whole = lora_start(&t->whole, cfg, &m->full);  // the values every stage starts from
    describe_slices(lo, t, m);
    float *mine = malloc_or_die(lo->layout.num_params * sizeof(float));
    move_slices(t, lo, whole, mine, true);
    lora_plug(lo, mine, mb->params, &acts->acts);
    free(mine), free(whole);
    lo->complete = complete_over_group;
    lo->complete_ctx = m;
    lora_take_over(lo, layout, mb);
    lo->base_layout.tensors = NULL, lo->base_layout.block_first = NULL;  // the model's (tp_model_free frees them)
    t->lo = lo;
    m->lora = t;
}

void tp_lora_memory(const Lora *lo, MemoryItem items[TP_MEMORY_ITEMS]) {
    if (!lo->rank) return;
    items[0].bytes += lo->bytes;
    items[2].bytes = lo->bytes;
    items[3].bytes = 2 * lo->bytes;
    items[6].bytes += lo->acts_bytes;
}

double tp_lora_norm_squares(const TPModel *m, const float *grads) {
    const struct TPLora *t = m->lora;
    const Lora *lo = t->lo;
    double s = 0;
    for (int i = 0; i < lo->n_sites; i++) {
        const TensorInfo *a = &lo->layout.tensors[lo->sites[i].a], *b = &lo->layout.tensors[lo->sites[i].b];
        if (t->slices[i].counts_a) s += sum_squares(grads + a->offset, a->numel);
        if (t->slices[i].counts_b) s += sum_squares(grads + b->offset, b->numel);
    }
    return s;
}

void tp_lora_save(const Config *cfg, const TPModel *m, Comm *group, const float *params) {
    const struct TPLora *t = m->lora;
    const Lora *lo = t->lo;
    size_t n = t->whole.layout.num_params, bytes = n * sizeof(float);
    float *mine = malloc_or_die(lo->bytes), *whole = calloc_or_die(n, sizeof(float));
    copy_to_host(mine, params, lo->bytes);
    if (m->grid.d == 0) move_slices(t, lo, whole, mine, false);  // one replica's counting copies: each element once
    float *sum = dev_malloc(bytes);
    copy_to_device(sum, whole, bytes);
    comm_all_reduce(group, sum, n);
    copy_to_host(whole, sum, bytes);
    if (comm_rank(group) == 0) lora_save(cfg, &t->whole.layout, whole);
    dev_free(sum);
    free(mine), free(whole);
}

void tp_lora_free(TPModel *m) {
    struct TPLora *t = m->lora;
    if (!t) return;
    lora_free(&t->whole);
    free(t->slices);
    free(t->tensors);
    free(t);
    m->lora = NULL;
}
