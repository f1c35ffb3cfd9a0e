// tp_linear.c: see tp_linear.h. The 3D-parallel linear layer, its depth all-gathers and
// gradient reduce-scatters; the model that strings these layers together is tp_model.c.
#include "tp_linear.h"

#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "model/gpt.h"

// ---- the grid ---------------------------------------------------------------------------------

void tp_grid_init(TPGrid *g, Comm *world, const int dims[3]) {
    int rank = comm_rank(world);
    g->X = dims[0];
    g->Y = dims[1];
    g->Z = dims[2];
    int XYZ = g->X * g->Y * g->Z;
    g->D = comm_size(world) / XYZ;
    g->y = rank % g->Y;
    g->x = rank / g->Y % g->X;
    g->z = rank / (g->X * g->Y) % g->Z;
    g->d = rank / XYZ;
    // a group = the ranks that differ only in its own coordinate (color: the other three)
    int X = g->X, Y = g->Y, Z = g->Z;
    g->gx = comm_split(world, (g->d * Z + g->z) * Y + g->y, g->x, "x");
    g->gy = comm_split(world, (g->d * Z + g->z) * X + g->x, g->y, "y");
    g->gz = comm_split(world, (g->d * X + g->x) * Y + g->y, g->z, "z");
    g->gdata = comm_split(world, rank % XYZ, g->d, "data");
    g->tp = comm_split(world, g->d, rank % XYZ, "tp");
    g->row_ranks = Z * g->D;
    g->row_rank = g->d * Z + g->z;
    g->counts_rows = g->x == 0 && g->y == 0;
}

// A group of one rank has nothing to add up: skip the call, so that the counted communication
// of a grid is exactly what its formula says (and [1,1,1] communicates nothing).
void tp_all_reduce(Comm *c, float *buf, size_t count) {
    if (comm_size(c) > 1) comm_all_reduce(c, buf, count);
}

CommRequest *tp_all_reduce_start(Comm *c, float *buf, size_t count) {
    return comm_size(c) > 1 ? comm_all_reduce_start(c, buf, count) : NULL;
}

void tp_wait(CommRequest *r) {
    if (r) comm_wait(r);
}

// ---- one layer --------------------------------------------------------------------------------

TPLinear tp_linear_make(const TPGrid *g, int in, int out, bool transposed) {
    TPLinear l = {.in_group = transposed ? g->gx : g->gy, .out_group = transposed ? g->gy : g->gx,
                  .depth = g->gz, .in = in, .out = out};
    // sizes from the grid's, not the groups': a grid without groups (the planner's) sizes alike
    l.in_local = in / (transposed ? g->X : g->Y);
    l.out_local = out / (transposed ? g->Y : g->X);
    l.block = (size_t)l.in_local * l.out_local;
    l.shard = l.block / (size_t)g->Z;
    return l;
}

void tp_linear_forward(const TPLinear *l, float *out, const float *inp, half16 *inp16, Linear W, int N) {
    // every rank of the in group computes a partial sum; the bias must enter the total once, so
    // only the group's first rank adds it (before the all-reduce: no extra pass over out)
    if (comm_rank(l->in_group) != 0) W.b = NULL;
    linear_forward(out, inp, inp16, &W, N, l->in_local, l->out_local);  // f32, or stage 02's bf16 recipe
    if (!l->partial_sums) tp_all_reduce(l->in_group, out, (size_t)N * l->out_local);
}

void tp_linear_backward(const TPLinear *l, float *dinp, float *dw_block, float *dbias,
                        const float *dout, half16 *dout16, const float *inp, const half16 *inp16,
                        Linear W, int N, bool overlap) {
    int K = l->in_local, M = l->out_local;
    if (W.w16) cast_gradient_to_16(dout16, dout, (size_t)N * M);
    // dX first: its all-reduce over the out group can then travel while dW is computed
    if (W.w16) matmul_backward_16(dinp, NULL, NULL, dout, dout16, inp16, W.w16, N, K, M);
    else matmul_backward(dinp, NULL, NULL, dout, inp, W.w, N, K, M);
    CommRequest *r = NULL;
    bool complete_dinp = !l->partial_sums && dinp;  // a weight pass (zero bubble's W) has no dinp
    if (complete_dinp && overlap) r = tp_all_reduce_start(l->out_group, dinp, (size_t)N * K);
    else if (complete_dinp) tp_all_reduce(l->out_group, dinp, (size_t)N * K);
    // dbias: dout is the same on every rank of the in group, so each gets the whole bias gradient
    if (W.w16) matmul_backward_16(NULL, dw_block, dbias, dout, dout16, inp16, W.w16, N, K, M);
    else matmul_backward(NULL, dw_block, dbias, dout, inp, W.w, N, K, M);
    tp_wait(r);
}

// ---- depth ------------------------------------------------------------------------------------

void tp_stream_init(TPWeightStream *s, const TPGrid *g, size_t max_block, bool prefetch, bool half_mode) {
    memset(s, 0, sizeof *s);
    s->prefetch = prefetch;
    s->half = half_mode;
    if (g->Z == 1) return;  // every weight is whole on its rank: nothing to gather
    for (int i = 0; i < 2; i++) {
        s->buf[i] = dev_malloc(max_block * sizeof(float));
        if (half_mode) s->buf16[i] = dev_malloc(max_block * sizeof(half16));
    }
}

void tp_stream_free(TPWeightStream *s) {
    for (int i = 0; i < 2; i++) {
        tp_wait(s->req[i]);
        dev_free(s->buf[i]);
        dev_free(s->buf16[i]);
    }
    memset(s, 0, sizeof *s);
}

// A weight a matmul reads in 16 bits is gathered as the shards' 16-bit copies: half the bytes of
// gathering the fp32 shards and rounding after, and the same numbers. The embedding reads wte in
// fp32 (its use has no 16-bit copy): that one is gathered in fp32.
static bool gathers_16bit(const TPWeightStream *s, const TPWeightUse *u) { return s->half && u->shard16; }

static void stream_gather(TPWeightStream *s, int i, bool async) {
    const TPWeightUse *u = &s->uses[i];
    const TPLinear *l = u->layer;
    CommRequest *r = gathers_16bit(s, u) ? comm_all_gather16_start(l->depth, s->buf16[i % 2], u->shard16, l->shard)
                                         : comm_all_gather_start(l->depth, s->buf[i % 2], u->shard, l->shard);
    if (async) s->req[i % 2] = r;
    else comm_wait(r);
}

static bool stream_gathers(const TPWeightStream *s) { return s->n && comm_size(s->uses[0].layer->depth) > 1; }

void tp_stream_begin(TPWeightStream *s) {
    s->next = 0;
    if (s->prefetch && stream_gathers(s)) stream_gather(s, 0, true);
}

Linear tp_stream_next(TPWeightStream *s) {
    if (s->next >= s->n) fatal("internal: weight stream used more than its %d weights", s->n);
    int i = s->next++, slot = i % 2;
    const TPWeightUse *u = &s->uses[i];
    if (!stream_gathers(s)) return (Linear){u->shard, NULL, s->half ? u->shard16 : NULL};
    if (s->prefetch) {
        comm_wait(s->req[slot]);
        s->req[slot] = NULL;
        // the other buffer held weight i-1, whose layer is done: fetch weight i+1 into it now
        if (i + 1 < s->n) stream_gather(s, i + 1, true);
    } else {
        stream_gather(s, i, false);
    }
    if (gathers_16bit(s, u)) return (Linear){NULL, NULL, s->buf16[slot]};
    return (Linear){s->buf[slot], NULL, NULL};
}

void tp_grad_slot_alloc(TPGradSlot *s, size_t max_block) {
    memset(s, 0, sizeof *s);
    s->block = dev_malloc(max_block * sizeof(float));
    s->shard = dev_malloc(max_block * sizeof(float));
}

void tp_grad_slot_free(TPGradSlot *s) {
    tp_grad_slot_finish(s);
    dev_free(s->block);
    dev_free(s->shard);
    memset(s, 0, sizeof *s);
}

float *tp_grad_slot_open(TPGradSlot *s, const TPLinear *l, float *grad) {
    tp_grad_slot_finish(s);  // the slot's previous gradient must have left the block
    s->layer = l;
    s->grad = grad;
    dev_zero(s->block, l->block * sizeof(float));
    return s->block;
}

void tp_grad_slot_launch(TPGradSlot *s) {
    s->req = comm_reduce_scatter_start(s->layer->depth, s->shard, s->block, s->layer->shard);
}

void tp_grad_slot_finish(TPGradSlot *s) {
    if (!s->req) return;
    comm_wait(s->req);
    s->req = NULL;
    // reduce-scatter writes its result; the gradient accumulates over micro-batches: add it
    add_inplace(s->grad, s->shard, s->layer->shard);
}
