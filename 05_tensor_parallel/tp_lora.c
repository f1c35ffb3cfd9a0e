// tp_lora.c: see tp_lora.h.
#include "tp_lora.h"

#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "ops/ops.h"

// this rank's slice of one whole adapter, beside the site that runs it
typedef struct {
    int site;                         // the whole adapter's site in TPLora.whole
    int a_col0;                       // A's columns [a_col0, a_col0 + in_dim) of the whole A
    int n_rows, b_row0[3], b_rows[3]; // B's row ranges of the whole B, one after another here
    bool counts_a, counts_b;          // this rank's copy is the one of its replica that counts
} Slice;

struct TPLora {
    Lora whole;           // the whole adapters, described on the full model: names, shapes, files
    Slice *slices;        // [lo->n_sites], indexed as the sites of the adapters m's part holds
    const Lora *lo;       // the Lora that runs this rank's slices: its layout is the run's after tp_lora_attach
    const TPModel *m;
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

// the site of this rank's slice of whole site w (described on `model`): the block's columns, and the
// rows of w that fall in the block's row ranges (a fused tensor's block is up to three ranges: q, k,
// v; gate, up). false: w adapts a linear that m's part (a pipeline stage's blocks) does not hold.
static bool slice_site(const TPModel *m, const ParamLayout *model, const Lora *whole, int site, LoraSite *s,
                       Slice *sl) {
    const LoraSite *w = &whole->sites[site];
    const TensorInfo *linear = layout_tensor(&m->full, model->tensors[tensor_at(model, w->base_offset)].name);
    if (!linear) return false;
    const LocalTensor *lt = &m->local[linear - m->full.tensors];
    const TPLinear *l = tp_layer_of(m, w->kind);
    *s = *w;
    s->base_offset = lt->offset;
    s->in_dim = lt->cols;
    s->rows = 0;
    s->col0 = lt->col0;  // its dropout mask's columns: the whole input's
    *sl = (Slice){.site = site, .a_col0 = lt->col0};
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
    return true;
}

static void add_tensor(ParamLayout *l, const TensorInfo *whole, int rows, int cols) {
    TensorInfo *t = &l->tensors[l->num_tensors++];
    *t = *whole;
    t->shape[0] = rows, t->shape[1] = cols;
    t->numel = (size_t)rows * cols;
    t->offset = l->num_params;
    l->num_params += t->numel;
}

// lo: this rank's slices of t->whole's adapters (described on `model`) on the linears m holds
static void describe_slices(Lora *lo, struct TPLora *t, const TPModel *m, const ParamLayout *model) {
    const Lora *w = &t->whole;
    *lo = (Lora){.rank = w->rank, .alpha = w->alpha, .scale = w->scale, .dropout = w->dropout, .seed = w->seed, .arch = w->arch};
    memcpy(lo->targets, w->targets, sizeof lo->targets);
    lo->trained.layout = (ParamLayout){.cfg = w->trained.layout.cfg, .arch = w->trained.layout.arch, .first_block = m->full.first_block,
                               .n_blocks = m->full.n_blocks};
    lo->sites = calloc_or_die((size_t)w->n_sites, sizeof(LoraSite));
    t->slices = calloc_or_die((size_t)w->n_sites, sizeof(Slice));
    t->tensors = lo->trained.layout.tensors = calloc_or_die((size_t)w->trained.layout.num_tensors, sizeof(TensorInfo));
    for (int i = 0; i < w->n_sites; i++) {
        LoraSite *s = &lo->sites[lo->n_sites];
        if (!slice_site(m, model, w, i, s, &t->slices[lo->n_sites])) continue;
        lo->n_sites++;
        s->a = lo->trained.layout.num_tensors;
        add_tensor(&lo->trained.layout, &w->trained.layout.tensors[w->sites[i].a], lo->rank, s->in_dim);
        s->b = lo->trained.layout.num_tensors;
        add_tensor(&lo->trained.layout, &w->trained.layout.tensors[w->sites[i].b], s->rows, lo->rank);
    }
}

// Copies between the whole adapters and this rank's slices (host buffers): to_slices, or back, from
// the copies that count only (every other element of `whole` is left alone)
static void move_slices(const struct TPLora *t, const Lora *lo, float *whole, float *slices, bool to_slices) {
    const Lora *w = &t->whole;
    int r = lo->rank;
    for (int i = 0; i < lo->n_sites; i++) {
        const Slice *sl = &t->slices[i];
        const LoraSite *s = &lo->sites[i], *ws = &w->sites[sl->site];
        float *wa = whole + w->trained.layout.tensors[ws->a].offset, *sa = slices + lo->trained.layout.tensors[s->a].offset;
        float *wb = whole + w->trained.layout.tensors[ws->b].offset, *sb = slices + lo->trained.layout.tensors[s->b].offset;
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

// tp_norm_squares with LoRA: the slices' gradients, each element counted on one rank of the replica
static double norm_squares(const void *owner, const float *grads) {
    const struct TPLora *t = owner;
    const Lora *lo = t->lo;
    double s = 0;
    for (int i = 0; i < lo->n_sites; i++) {
        const TensorInfo *a = &lo->trained.layout.tensors[lo->sites[i].a], *b = &lo->trained.layout.tensors[lo->sites[i].b];
        if (t->slices[i].counts_a) s += sum_squares(grads + a->offset, a->numel);
        if (t->slices[i].counts_b) s += sum_squares(grads + b->offset, b->numel);
    }
    return s;
}

// the whole adapters, put together from every rank's slices over `group`, saved by its rank 0 as
// PEFT's files (what tp_save_checkpoint writes with LoRA)
static void save_whole(const void *owner, const Config *cfg, Comm *group, const float *params) {
    const struct TPLora *t = owner;
    const TPModel *m = t->m;
    const Lora *lo = t->lo;
    size_t n = t->whole.trained.layout.num_params, bytes = n * sizeof(float);
    float *mine = malloc_or_die(lo->trained.bytes), *whole = calloc_or_die(n, sizeof(float));
    copy_to_host(mine, params, lo->trained.bytes);
    if (m->grid.d == 0) move_slices(t, lo, whole, mine, false);  // one replica's counting copies: each element once
    float *sum = dev_malloc(bytes);
    copy_to_device(sum, whole, bytes);
    comm_all_reduce(group, sum, n);
    copy_to_host(whole, sum, bytes);
    if (comm_rank(group) == 0) lora_save(cfg, &t->whole.trained.layout, whole);
    dev_free(sum);
    free(mine), free(whole);
}

static void free_slices(void *owner) {
    struct TPLora *t = owner;
    lora_free(&t->whole);
    free(t->slices);
    free(t->tensors);
    free(t);
}

void tp_lora_attach(Lora *lo, const Config *cfg, TPModel *m, ParamLayout *layout, ModelBuffers *mb, TPActs *acts) {
    tp_lora_attach_part(lo, cfg, m, &m->full, layout, mb, &acts->acts, 1);
}

void tp_lora_attach_part(Lora *lo, const Config *cfg, TPModel *m, const ParamLayout *model, ParamLayout *layout,
                         ModelBuffers *mb, Activations *slots, int n_slots) {
    memset(lo, 0, sizeof *lo);
    if (!cfg->lora_rank) return;
    struct TPLora *t = calloc_or_die(1, sizeof *t);
    lora_describe_keys(&t->whole, cfg, model);
    float *whole = lora_start(&t->whole, cfg, model);  // the values every stage starts from
    describe_slices(lo, t, m, model);
    float *mine = malloc_or_die(lo->trained.layout.num_params * sizeof(float));
    move_slices(t, lo, whole, mine, true);
    lora_plug_slots(lo, mine, mb->params, slots, n_slots);
    free(mine), free(whole);
    lo->complete = complete_over_group;
    lo->complete_ctx = m;
    lora_print_summary(lo, layout->num_params);
    trainable_take_base(&lo->trained, layout, mb);
    lo->trained.base_layout.tensors = NULL, lo->trained.base_layout.block_first = NULL;  // the model's (tp_model_free frees them)
    t->lo = lo;
    t->m = m;
    m->trained = (TPTrained){.owner = t, .norm_squares = norm_squares, .save = save_whole, .free = free_slices};
}

void tp_lora_memory(const Lora *lo, MemoryItem items[TP_MEMORY_ITEMS]) {
    if (!lo->rank) return;
    items[0].bytes += lo->trained.bytes;
    items[2].bytes = lo->trained.bytes;
    items[3].bytes = 2 * lo->trained.bytes;
    items[6].bytes += lo->trained.acts_bytes;
}
