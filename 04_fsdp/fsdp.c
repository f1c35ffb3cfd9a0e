// fsdp.c: see fsdp.h. Read it with fsdp_forward_backward: the gathers, the frees and the
// reduce-scatters sit between the same layer steps that gpt_forward_backward strings together.
#include "fsdp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "model/activations.h"
#include "ops/ops.h"
#include "run/optimizer.h"
#include "run/run_checkpoint.h"
#include "run/run_stats.h"

// ---- units and shards -------------------------------------------------------------------------

static size_t padded(const Fsdp *f, const FsdpUnit *u) { return u->shard * (size_t)f->P; }

// elements of this rank's shard that are real parameters: the last ranks' shards end in padding
// (zeros that no tensor owns), possibly all of it
static size_t real_in_shard(const Fsdp *f, const FsdpUnit *u) {
    size_t start = (size_t)f->rank * u->shard;
    if (start >= u->numel) return 0;
    return u->numel - start < u->shard ? u->numel - start : u->shard;
}

// where this rank's shard starts in the flat layout
static size_t shard_first(const Fsdp *f, const FsdpUnit *u) { return u->first + (size_t)f->rank * u->shard; }

// Below ZeRO-3 the parameters are whole on every rank; below ZeRO-2 the gradients too. A rank's
// shard of a whole buffer is its slice of each unit.
static bool params_whole(const Fsdp *f) { return f->zero_stage < 3; }
static bool grads_whole(const Fsdp *f) { return f->zero_stage < 2; }

static float *slice_of(const Fsdp *f, float *buf, bool whole, const FsdpUnit *u) {
    return whole ? buf + u->whole_at + (size_t)f->rank * u->shard : buf + u->local;
}
static float *param_shard(const Fsdp *f, const FsdpUnit *u) { return slice_of(f, f->params, params_whole(f), u); }
static float *grad_shard(const Fsdp *f, const FsdpUnit *u) { return slice_of(f, f->grads, grads_whole(f), u); }

// Block l's tensors that no matmul reads in 16 bits stay fp32. Walks their elements in shard r
// (relative to the unit: [r x shard, (r + 1) x shard)) in layout order, and copies them between
// `packed` and `unit`, where unit[x - base] is the unit's element x: into packed (to_packed) or
// back out of it. NULL buffers: only counts. Returns the number of elements.
static size_t move_fp32_part(const Fsdp *f, int l, int r, float *unit, size_t base, float *packed, bool to_packed) {
    const FsdpUnit *u = &f->units[1 + l];
    size_t lo = (size_t)r * u->shard, hi = lo + u->shard, n = 0;
    for (int i = 0; i < f->layout->num_tensors; i++) {
        const TensorInfo *t = &f->layout->tensors[i];
        if (t->block != l || block_role_read_in_16_bits(t->role)) continue;
        size_t a = t->offset - u->first, b = a + t->numel;
        if (a < lo) a = lo;
        if (b > hi) b = hi;
        if (a >= b) continue;
        if (unit && packed) {
            size_t bytes = (b - a) * sizeof(float);
            if (to_packed) dev_copy(packed + n, unit + (a - base), bytes);
            else dev_copy(unit + (a - base), packed + n, bytes);
        }
        n += b - a;
    }
    return n;
}

bool fsdp_replicas_fit(int replicas, int P, char *why, size_t why_size) {
    if (replicas >= 1 && P % replicas == 0) return true;
    snprintf(why, why_size, "key 'hsdp_replicas': expected a divisor of the %d ranks (replica groups of equal size), "
             "found %d", P, replicas);
    return false;
}

void fsdp_plan(Fsdp *f, const ParamLayout *layout, int rank, int P, bool prefetch, bool use_16bit, int zero_stage,
               int replicas) {
    memset(f, 0, sizeof *f);
    f->zero_stage = zero_stage;
    f->n_replicas = replicas;
    f->P = P / replicas;
    f->rank = rank % f->P;
    P = f->P;
    f->layout = layout;
    f->prefetch = prefetch;
    f->use_16bit = use_16bit;
    int L = layout->cfg.n_layer;
    f->n_units = 1 + L;
    f->units = calloc_or_die((size_t)f->n_units, sizeof(FsdpUnit));
    for (int i = 0; i < f->n_units; i++) {
        FsdpUnit *u = &f->units[i];
        u->first = i == 0 ? 0 : layout_block_start(layout, i - 1);
        u->numel = i == 0 ? layout->root_numel : layout_block_numel(layout, i - 1);
        u->shard = (u->numel + (size_t)f->P - 1) / (size_t)f->P;
        u->local = f->shard_numel;
        f->shard_numel += u->shard;
        u->whole_at = f->whole_numel;
        f->whole_numel += padded(f, u);
        if (i > 0 && padded(f, u) > f->max_block) f->max_block = padded(f, u);
    }
    for (int l = 0; use_16bit && l < L; l++)
        for (int r = 0; r < P; r++) {
            size_t n = move_fp32_part(f, l, r, NULL, 0, NULL, true);
            if (n > f->fp32_pack) f->fp32_pack = n;
        }
    f->params_numel = params_whole(f) ? f->whole_numel : f->shard_numel;
    f->grads_numel = grads_whole(f) ? f->whole_numel : f->shard_numel;
    size_t root = padded(f, &f->units[0]), slots = prefetch ? 2 : 1;
    // what the rungs hold beyond their shards: ZeRO-3 the gathered units and their gradients (and
    // bf16's packs), ZeRO-2 the gradients in flight, ZeRO-1 nothing; bf16 copies of the units
    if (zero_stage == 3)
        f->gathered_bytes = (2 * root + 2 * slots * f->max_block + slots * (1 + (size_t)P) * f->fp32_pack) * sizeof(float);
    if (zero_stage == 2) f->gathered_bytes = (root + slots * f->max_block) * sizeof(float);
    size_t shard16 = zero_stage == 3 ? f->max_block / (size_t)P : 0, slots16 = zero_stage == 3 ? slots : 1;
    if (use_16bit) f->gathered16_bytes = (root + slots16 * (f->max_block + shard16)) * sizeof(half16);
}

// ---- Muon's owners ------------------------------------------------------------------------------

typedef struct { double cost; int tensor; } MatrixCost;

// largest first; equal costs in layout order, so every rank draws the same owners
static int by_cost_descending(const void *a, const void *b) {
    const MatrixCost *x = a, *y = b;
    if (x->cost != y->cost) return x->cost < y->cost ? 1 : -1;
    return x->tensor - y->tensor;
}

void fsdp_plan_muon(Fsdp *f, bool redundant, int ns_steps) {
    const ParamLayout *layout = f->layout;
    f->muon_on = true;
    f->muon_redundant = redundant;
    f->muon_owner = malloc_or_die((size_t)layout->num_tensors * sizeof(int));
    MatrixCost *order = calloc_or_die((size_t)layout->num_tensors, sizeof(MatrixCost));
    int n = 0;
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *ti = &layout->tensors[i];
        f->muon_owner[i] = -1;
        if (muon_updates(ti)) order[n++] = (MatrixCost){muon_flops(ti->shape[0], ti->shape[1], ns_steps), i};
    }
    qsort(order, (size_t)n, sizeof *order, by_cost_descending);
    double *load = calloc_or_die((size_t)f->P, sizeof(double));
    for (int j = 0; j < n; j++) {
        int least = 0;
        for (int r = 1; r < f->P; r++)
            if (load[r] < load[least]) least = r;
        f->muon_owner[order[j].tensor] = least;
        load[least] += order[j].cost;
    }
    double total = 0;
    f->muon_flops_max = f->muon_flops_min = load[0];
    for (int r = 0; r < f->P; r++) {
        total += load[r];
        if (load[r] > f->muon_flops_max) f->muon_flops_max = load[r];
        if (load[r] < f->muon_flops_min) f->muon_flops_min = load[r];
    }
    if (redundant) f->muon_flops_max = f->muon_flops_min = total;  // every rank does every matrix
    free(load);
    free(order);
    f->muon_bytes = muon_scratch_bytes(layout) + (redundant ? 1 : 2) * f->max_block * sizeof(float);
}

void fsdp_init(Fsdp *f, Comm *world, const ParamLayout *layout, const Config *cfg, bool use_16bit) {
    char why[160];
    if (!fsdp_replicas_fit(cfg->hsdp_replicas, comm_size(world), why, sizeof why)) fatal("%s", why);
    bool prefetch = cfg->overlap_communication;
    fsdp_plan(f, layout, comm_rank(world), comm_size(world), prefetch, use_16bit, cfg->zero_stage, cfg->hsdp_replicas);
    f->world = world;
    // HSDP: a group is P / R consecutive ranks (on a cluster, a node's GPUs); replicas stride by it
    int replica = comm_rank(world) / f->P;
    f->group = f->n_replicas > 1 ? comm_split(world, replica, f->rank, "shard") : world;
    if (f->n_replicas > 1) f->replicas = comm_split(world, f->rank, replica, "replicas");
    // checkpoints travel on their own group, so that the training groups' statistics are training's alone
    f->io = comm_split(world, replica, f->rank, "ckpt");
    if (cfg->muon) {
        fsdp_plan_muon(f, cfg->muon_redundant, cfg->muon_ns_steps);
        f->muon = muon_create(cfg, layout);
        f->muon_unit = dev_malloc(f->max_block * sizeof(float));
        if (!f->muon_redundant) f->muon_mine = dev_malloc(f->max_block * sizeof(float));
    }
    size_t shard_bytes = f->shard_numel * sizeof(float), root = padded(f, &f->units[0]), max_block = f->max_block;
    f->params = dev_malloc(f->params_numel * sizeof(float));
    f->grads = dev_malloc(f->grads_numel * sizeof(float));
    f->adam_m = dev_malloc(shard_bytes);
    f->adam_v = dev_malloc(shard_bytes);
    size_t max_shard = f->units[0].shard > max_block / (size_t)f->P ? f->units[0].shard : max_block / (size_t)f->P;
    // the buffers of fsdp_plan's gathered_bytes: ZeRO-3 gathers units, ZeRO-2 their gradients
    if (!params_whole(f)) f->root = dev_malloc(root * sizeof(float));
    if (!grads_whole(f)) f->root_grad = dev_malloc(root * sizeof(float));
    int slots = prefetch ? 2 : 1;
    for (int s = 0; s < slots; s++) {
        if (!params_whole(f)) f->block[s] = dev_malloc(max_block * sizeof(float));
        if (!grads_whole(f)) f->block_grad[s] = dev_malloc(max_block * sizeof(float));
        f->shard_scratch[s] = dev_malloc(max_shard * sizeof(float));
    }
    if (use_16bit) {
        f->root16 = dev_malloc(root * sizeof(half16));
        // ZeRO-1, 2 cast their whole blocks in turn into one slot; ZeRO-3 gathers bf16 shards
        for (int s = 0; s < (params_whole(f) ? 1 : slots); s++) f->block16[s] = dev_malloc(max_block * sizeof(half16));
        for (int s = 0; !params_whole(f) && s < slots; s++) {
            f->shard16[s] = dev_malloc(max_block / (size_t)f->P * sizeof(half16));
            f->pack_send[s] = dev_malloc(f->fp32_pack * sizeof(float));
            f->pack_recv[s] = dev_malloc((size_t)f->P * f->fp32_pack * sizeof(float));
        }
    }
}

void fsdp_freeze_base(Fsdp *f, Trainable *t) {
    if (!t) return;
    dev_free(f->grads), dev_free(f->adam_m), dev_free(f->adam_v), dev_free(f->root_grad);
    f->adam_m = f->adam_v = f->root_grad = NULL;
    for (int s = 0; s < 2; s++) dev_free(f->block_grad[s]), f->block_grad[s] = NULL;
    // ZeRO-2, 3 held the root's gradient and a block's (two, prefetching) beside their weights
    if (!grads_whole(f))
        f->gathered_bytes -= (padded(f, &f->units[0]) + (f->prefetch ? 2 : 1) * f->max_block) * sizeof(float);
    f->trained = t;
    f->grads = t->grads;
    f->grads_numel = t->layout.num_params;
}

void fsdp_free(Fsdp *f) {
    if (f->trained) f->grads = NULL;  // the trained set's (its owner frees them)
    void *all[] = {f->params, f->grads, f->adam_m, f->adam_v, f->root, f->root_grad, f->block[0],
                   f->block[1], f->block_grad[0], f->block_grad[1], f->shard_scratch[0],
                   f->shard_scratch[1], f->root16, f->block16[0], f->block16[1], f->shard16[0],
                   f->shard16[1], f->pack_send[0], f->pack_send[1], f->pack_recv[0], f->pack_recv[1],
                   f->muon_unit, f->muon_mine};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dev_free(all[i]);
    muon_free(&f->muon);
    free(f->muon_owner);
    free(f->units);
    memset(f, 0, sizeof *f);
}

size_t fsdp_state_bytes(const Fsdp *f) {
    if (f->trained) return f->params_numel * sizeof(float) + 4 * f->trained->bytes;  // the base; the trained set's 4 buffers
    return (f->params_numel + f->grads_numel + 2 * f->shard_numel) * sizeof(float);
}

void fsdp_print_sharding(const Fsdp *f) {
    static const char *const sharded[] = {"", "AdamW's m and v", "AdamW's m and v and the gradients",
                                          "parameters, gradients and AdamW's m and v"};
    printf("sharding: ZeRO-%d (%s) | %d units (root + %d blocks) in %d shards", f->zero_stage,
           sharded[f->zero_stage], f->n_units, f->n_units - 1, f->P);
    if (f->n_replicas > 1) printf(" | HSDP: %d replica groups of %d ranks", f->n_replicas, f->P);
    if (f->zero_stage == 3)
        printf(" | all-gather %s", f->prefetch ? "of the next block prefetched during this one's compute"
                                                : "of each unit when it is needed");
    if (f->zero_stage == 2)
        printf(" | reduce-scatter %s", f->prefetch ? "of each block's gradient during the next one's backward"
                                                    : "of each block's gradient after its backward");
    if (f->muon_on) {
        printf("\nMuon: each block's updates all-gathered, %s; orthogonalization %.3g to %.3g GFLOP a step per rank",
               f->muon_redundant ? "every matrix orthogonalized on every rank"
                                 : "each matrix orthogonalized by one owner rank and reduce-scattered back",
               f->muon_flops_min / 1e9, f->muon_flops_max / 1e9);
        run_stats_number("muon_flops_per_rank_max", f->muon_flops_max);
        run_stats_number("muon_flops_per_rank_min", f->muon_flops_min);
    }
    printf("\n");
}

// ---- initialisation and checkpoints -----------------------------------------------------------

void fsdp_init_shards(Fsdp *f, uint64_t seed) {
    for (int i = 0; i < f->n_units; i++) {
        const FsdpUnit *u = &f->units[i];
        // whole parameters: every rank initialises all of them, as DDP's replicas do
        if (params_whole(f)) gpt_init_range(f->params + u->whole_at, f->layout, u->first, u->numel, seed);
        else gpt_init_range(param_shard(f, u), f->layout, shard_first(f, u), real_in_shard(f, u), seed);
    }
}

// the whole buffer a checkpoint's unit passes through (big enough for any unit of its kind):
// ZeRO-3's gathered parameters, ZeRO-2's gradients in flight, ZeRO-1's whole gradient; each is
// free between steps, when checkpoints move
static float *unit_buffer(Fsdp *f, int i) {
    if (f->zero_stage == 1) return f->grads + f->units[i].whole_at;
    if (f->zero_stage == 2) return i == 0 ? f->root_grad : f->block_grad[0];
    return i == 0 ? f->root : f->block[0];
}

// (with HSDP, the first rank of every group reads the file: the groups load alike)
static void scatter_full(Fsdp *f, const float *params, const float *m, const float *v, bool with_moments) {
    const float *full[3] = {params, m, v};
    for (int k = 0; k < (with_moments ? 3 : 1); k++)
        for (int i = 0; i < f->n_units; i++) {
            const FsdpUnit *u = &f->units[i];
            // whole parameters are broadcast straight into place; the rest keep their shard
            bool whole = k == 0 && params_whole(f);
            float *buf = whole ? f->params + u->whole_at : unit_buffer(f, i);
            float *shard = k == 0 ? param_shard(f, u) : (k == 1 ? f->adam_m : f->adam_v) + u->local;
            if (f->rank == 0) dev_copy(buf, full[k] + u->first, u->numel * sizeof(float));
            comm_broadcast(f->io, buf, u->numel, 0);
            if (!whole) dev_copy(shard, buf + (size_t)f->rank * u->shard, real_in_shard(f, u) * sizeof(float));
        }
}

// into full[] on the world's rank 0 (writer), which alone writes
static void gather_full(Fsdp *f, float *params, float *m, float *v, bool writer) {
    float *full[3] = {params, m, v};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < f->n_units; i++) {
            const FsdpUnit *u = &f->units[i];
            float *buf = unit_buffer(f, i);
            const float *shard = k == 0 ? param_shard(f, u) : (k == 1 ? f->adam_m : f->adam_v) + u->local;
            comm_all_gather(f->io, buf, shard, u->shard);
            if (writer) dev_copy(full[k] + u->first, buf, u->numel * sizeof(float));
        }
}

long fsdp_load_checkpoint(Fsdp *f, const Config *cfg) {
    size_t bytes = f->layout->num_params * sizeof(float);
    float *params = NULL, *m = NULL, *v = NULL;
    long step = 0;
    if (f->rank == 0) {
        params = dev_malloc(bytes);
        if (cfg->resume) {
            m = dev_malloc(bytes);
            v = dev_malloc(bytes);
            step = resume_checkpoint(cfg, f->layout, params, m, v);
        } else {
            load_initial_weights(cfg, f->layout, params);
        }
    }
    scatter_full(f, params, m, v, cfg->resume);
    dev_free(params);
    dev_free(m);
    dev_free(v);
    return comm_sum_long(f->io, step);  // only the group's rank 0 read it
}

void fsdp_save_checkpoint(Fsdp *f, const Config *cfg, long step) {
    bool writer = comm_rank(f->world) == 0;  // HSDP: the other groups hold the same shards
    if (f->trained) {
        const Trainable *t = f->trained;
        if (writer) save_checkpoint(cfg, &t->layout, t->params, t->m, t->v, step);
        return;
    }
    size_t bytes = f->layout->num_params * sizeof(float);
    float *params = NULL, *m = NULL, *v = NULL;
    if (writer) {
        params = dev_malloc(bytes);
        m = dev_malloc(bytes);
        v = dev_malloc(bytes);
    }
    gather_full(f, params, m, v, writer);
    if (writer) save_checkpoint(cfg, f->layout, params, m, v, step);
    dev_free(params);
    dev_free(m);
    dev_free(v);
}

// ---- gathering a unit -------------------------------------------------------------------------

// The root's tensors are the flat layout's first ones, so the gathered root is laid out as the
// start of a whole flat buffer: point the root fields of a Weights there (its blocks stay NULL).
// Whole parameters (ZeRO-1, 2) are in place already.
static void gather_root(Fsdp *f, Weights *w) {
    const FsdpUnit *u = &f->units[0];
    float *root = params_whole(f) ? f->params + u->whole_at : f->root;
    if (!params_whole(f)) comm_all_gather(f->group, f->root, param_shard(f, u), u->shard);
    if (f->use_16bit) cast_to_16(f->root16, root, u->numel);  // the lm_head matmul reads bf16
    root_weights_point(w, f->layout, root, f->root16);
}

// A pass over the blocks uses them in a known order (forward 0..L-1, backward L-1..0). Use k of
// a pass goes into slot k % 2 when prefetching, so that use k + 1 can be gathered into the other
// slot while use k computes; without prefetching everything goes through slot 0.
typedef struct {
    CommRequest *weights;    // the block: fp32, or its bf16 copy
    CommRequest *fp32_part;  // bf16 precisions: the tensors that stay fp32 (NULL: none)
    int block, slot;
} BlockGather;

typedef struct {
    Fsdp *f;
    int uses;                // blocks used so far in this micro-batch
    BlockGather pending;     // the prefetched gather, into slot uses % 2 (weights NULL: none)
} Gathers;

static BlockGather gather_block_start(Fsdp *f, int l, int slot) {
    const FsdpUnit *u = &f->units[1 + l];
    float *shard = param_shard(f, u);
    if (!f->use_16bit)
        return (BlockGather){comm_all_gather_start(f->group, f->block[slot], shard, u->shard), NULL, l, slot};
    cast_to_16(f->shard16[slot], shard, u->shard);
    move_fp32_part(f, l, f->rank, shard, (size_t)f->rank * u->shard, f->pack_send[slot], true);
    return (BlockGather){comm_all_gather16_start(f->group, f->block16[slot], f->shard16[slot], u->shard),
                         comm_all_gather_start(f->group, f->pack_recv[slot], f->pack_send[slot], f->fp32_pack),
                         l, slot};
}

// waits for a block's gather; in bf16 precisions, unpacks every rank's fp32 part into the slot
static void gather_block_finish(Fsdp *f, BlockGather g) {
    comm_wait(g.weights);
    if (!g.fp32_part) return;
    comm_wait(g.fp32_part);
    for (int r = 0; r < f->P; r++)
        move_fp32_part(f, g.block, r, f->block[g.slot], 0, f->pack_recv[g.slot] + (size_t)r * f->fp32_pack, false);
}

// Returns block l's gathered weights (bf16 copies included); `next` (-1: none) is the block the
// pass uses after this one: prefetching starts its gather now, before block l computes.
static BlockWeights use_block(Gathers *g, int l, int next) {
    Fsdp *f = g->f;
    int slot = f->prefetch ? g->uses % 2 : 0;
    gather_block_finish(f, g->pending.weights ? g->pending : gather_block_start(f, l, slot));
    g->pending = f->prefetch && next >= 0 ? gather_block_start(f, next, (g->uses + 1) % 2) : (BlockGather){0};
    g->uses++;
    // bf16 precisions: the slot's fp32 matrices are stale; the linears read the bf16 copies
    BlockWeights bw;
    block_weights_point(&bw, f->layout, l, f->block[slot]);
    if (f->use_16bit) block_weights_point_16(&bw, f->layout, l, f->block16[slot]);
    return bw;
}

// Block l's weights for this use on any rung: ZeRO-1 and 2 hold them whole (bf16 precisions cast
// them for the matmuls into one bf16 slot: nothing to prefetch); ZeRO-3 gathers them (use_block).
static BlockWeights block_for_use(Gathers *g, int l, int next) {
    Fsdp *f = g->f;
    if (!params_whole(f)) return use_block(g, l, next);
    const FsdpUnit *u = &f->units[1 + l];
    BlockWeights bw;
    block_weights_point(&bw, f->layout, l, f->params + u->whole_at);
    if (f->use_16bit) {
        cast_to_16(f->block16[0], f->params + u->whole_at, u->numel);
        block_weights_point_16(&bw, f->layout, l, f->block16[0]);
    }
    return bw;
}

// A unit's gradient on its way to the shards: its full gradient is reduce-scattered into a
// scratch shard, which is then added into this rank's gradient shard (the shards accumulate over
// micro-batches as DDP's gradients do).
typedef struct {
    CommRequest *req;  // NULL: nothing in flight
    int unit;
    float *shard;
} GradScatter;

static void reduce_scatter_start(Fsdp *f, GradScatter *s, int i, const float *full_grad, float *shard) {
    *s = (GradScatter){comm_reduce_scatter_start(f->group, shard, full_grad, f->units[i].shard), i, shard};
}

static void reduce_scatter_finish(Fsdp *f, GradScatter *s) {
    if (!s->req) return;
    comm_wait(s->req);
    const FsdpUnit *u = &f->units[s->unit];
    add_inplace(grad_shard(f, u), s->shard, u->shard);
    s->req = NULL;
}

// ---- forward and backward ---------------------------------------------------------------------

// the forward; leaves the root gathered in *root for the head's backward
static void forward(Fsdp *f, Gathers *g, Weights *root, Activations *a, const GPTConfig *cfg,
                    const int *inputs, int B, int T, bool then_backward) {
    int L = cfg->n_layer;
    if (B > a->spec.B || T > a->spec.T)
        fatal("internal: batch %dx%d exceeds the activations' %dx%d", B, T, a->spec.B, a->spec.T);
    copy_to_device(a->inputs, inputs, (size_t)B * T * sizeof(int));
    if (f->prefetch && L > 0 && !params_whole(f)) g->pending = gather_block_start(f, 0, 0);  // block 0 behind the root
    gather_root(f, root);
    gpt_embed_forward(a, root, B, T);
    for (int l = 0; l < L; l++) {
        int next = l + 1 < L ? l + 1 : (then_backward ? L - 1 : -1);
        BlockWeights bw = block_for_use(g, l, next);
        trainable_run_block(f->trained, l);
        gpt_block_forward(a, l, &bw, B, T);
        // the block's full weights are now free: the next use overwrites them
    }
    gpt_head_forward(a, head_input(a), root, B * T);
}

void fsdp_forward(void *fsdp, Activations *a, const int *inputs, int B, int T) {
    Fsdp *f = fsdp;
    Gathers g = {.f = f};
    Weights root;
    forward(f, &g, &root, a, &f->layout->cfg, inputs, B, T, false);
}

// A frozen base's backward computes input gradients only (the trained set's gradients add up in
// its own): the blocks are gathered again, and no gradient is reduce-scattered. The embedding,
// frozen, has nothing to compute.
static void backward_frozen(Fsdp *f, Gathers *g, const Weights *root, Activations *a, int B, int T) {
    Weights none = {0};  // the base's gradients: every pointer NULL
    gpt_head_backward(a, root, &none, B, T);
    for (int l = f->layout->cfg.n_layer - 1; l >= 0; l--) {
        BlockWeights bw = block_for_use(g, l, l - 1), bg = {0};
        trainable_run_block(f->trained, l);
        gpt_block_backward(a, l, &bw, &bg, B, T);
    }
}

double fsdp_forward_backward(Fsdp *f, Activations *a, const GPTConfig *cfg, const int *inputs,
                             const int *targets, int B, int T, float dloss) {
    int L = cfg->n_layer;
    Gathers g = {.f = f};
    Weights root, root_grad;
    forward(f, &g, &root, a, cfg, inputs, B, T, true);
    copy_to_device(a->targets, targets, (size_t)B * T * sizeof(int));
    double loss_sum = gpt_loss_forward_backward(a, cfg, B, T, dloss);
    if (f->trained) {
        backward_frozen(f, &g, &root, a, B, T);
        return loss_sum;
    }

    // the root's gradient collects the head's and (at the very end) the embedding's parts; ZeRO-1
    // adds every gradient into the whole buffer over the step's micro-batches, as DDP does
    float *root_grad_buf = grads_whole(f) ? f->grads + f->units[0].whole_at : f->root_grad;
    if (!grads_whole(f)) dev_zero(f->root_grad, padded(f, &f->units[0]) * sizeof(float));
    root_weights_point(&root_grad, f->layout, root_grad_buf, NULL);
    gpt_head_backward(a, &root, &root_grad, B, T);
    // with overlap, block l's gradient is reduce-scattered while block l - 1's backward computes
    // into the other slot; a slot is reused two blocks later, after its reduce-scatter finished
    GradScatter scatters[2] = {{0}};
    for (int l = L - 1; l >= 0; l--) {
        int slot = f->prefetch ? l % 2 : 0;
        BlockWeights bw = block_for_use(&g, l, l - 1), bg;  // gathered again: forward freed it
        if (grads_whole(f)) {
            block_weights_point(&bg, f->layout, l, f->grads + f->units[1 + l].whole_at);
            gpt_block_backward(a, l, &bw, &bg, B, T);
            continue;
        }
        reduce_scatter_finish(f, &scatters[slot]);
        // the padding past the unit must stay zero: it is reduce-scattered with the rest
        dev_zero(f->block_grad[slot], padded(f, &f->units[1 + l]) * sizeof(float));
        block_weights_point(&bg, f->layout, l, f->block_grad[slot]);
        gpt_block_backward(a, l, &bw, &bg, B, T);
        reduce_scatter_start(f, &scatters[slot], 1 + l, f->block_grad[slot], f->shard_scratch[slot]);
        if (!f->prefetch) reduce_scatter_finish(f, &scatters[slot]);
    }
    gpt_embed_backward(a, &root_grad, B, T);
    if (grads_whole(f)) return loss_sum;  // reduce-scattered once per step: fsdp_reduce_gradients
    for (int s = 0; s < 2; s++) reduce_scatter_finish(f, &scatters[s]);
    reduce_scatter_start(f, &scatters[0], 0, f->root_grad, f->shard_scratch[0]);
    reduce_scatter_finish(f, &scatters[0]);
    return loss_sum;
}

// ---- the optimizer step on shards -------------------------------------------------------------

void fsdp_reduce_gradients(Fsdp *f) {
    if (f->trained) {  // whole on every rank: all-reduced as DDP's (the base has no gradient)
        comm_all_reduce(f->world, f->grads, f->grads_numel);
        return;
    }
    // ZeRO-1: each unit's whole gradient, summed over the group into this rank's slice of it
    for (int i = 0; grads_whole(f) && i < f->n_units; i++) {
        const FsdpUnit *u = &f->units[i];
        comm_reduce_scatter(f->group, f->shard_scratch[0], f->grads + u->whole_at, u->shard);
        dev_copy(grad_shard(f, u), f->shard_scratch[0], u->shard * sizeof(float));
    }
    if (!f->replicas) return;
    // HSDP: the groups saw different rows; the ranks holding the same shard add theirs
    if (!grads_whole(f)) comm_all_reduce(f->replicas, f->grads, f->shard_numel);
    for (int i = 0; grads_whole(f) && i < f->n_units; i++)
        comm_all_reduce(f->replicas, grad_shard(f, &f->units[i]), f->units[i].shard);
}

double fsdp_grad_norm(Fsdp *f) {
    if (f->trained) return sqrt(sum_squares(f->grads, f->grads_numel));  // whole on every rank, summed
    double squares = 0;
    if (!grads_whole(f)) squares = sum_squares(f->grads, f->shard_numel);
    for (int i = 0; grads_whole(f) && i < f->n_units; i++) squares += sum_squares(grad_shard(f, &f->units[i]), f->units[i].shard);
    return sqrt(comm_sum_double(f->group, squares));
}

// ZeRO-1, 2: every rank's updated shard of each unit, gathered into the whole parameters (the
// shard goes through scratch: a collective's input may not lie inside its output)
static void gather_updated_params(Fsdp *f) {
    for (int i = 0; i < f->n_units; i++) {
        const FsdpUnit *u = &f->units[i];
        dev_copy(f->shard_scratch[0], param_shard(f, u), u->shard * sizeof(float));
        comm_all_gather(f->group, f->params + u->whole_at, f->shard_scratch[0], u->shard);
    }
}

// Block unit u's updates (this rank's shard of them in `updates`) orthogonalized: all-gathered
// whole, each matrix orthogonalized by its owner, and this rank's shard of the result written
// back to `updates` (AdamW's elements there become 0: muon_apply reads only Muon's)
static void orthogonalize_block(Fsdp *f, const FsdpUnit *u, float *updates, int steps) {
    size_t whole = padded(f, u);
    comm_all_gather(f->group, f->muon_unit, updates, u->shard);
    float *mine = f->muon_redundant ? f->muon_unit : f->muon_mine;
    if (!f->muon_redundant) dev_zero(mine, whole * sizeof(float));
    for (int i = 0; i < f->layout->num_tensors; i++) {
        const TensorInfo *ti = &f->layout->tensors[i];
        if (f->muon_owner[i] < 0 || ti->offset < u->first || ti->offset >= u->first + u->numel) continue;
        if (!f->muon_redundant && f->muon_owner[i] != f->rank) continue;
        float *x = mine + (ti->offset - u->first);
        if (!f->muon_redundant) dev_copy(x, f->muon_unit + (ti->offset - u->first), ti->numel * sizeof(float));
        muon_orthogonalize(&f->muon, x, ti->shape[0], ti->shape[1], steps);
    }
    if (f->muon_redundant) dev_copy(updates, mine + (size_t)f->rank * u->shard, u->shard * sizeof(float));
    else comm_reduce_scatter(f->group, updates, mine, u->shard);
}

// Muon's step on the shards: AdamW and the momentum per element, each block's matrices
// orthogonalized whole (fsdp.h's muon fields), the Muon tensors' shards stepped; then as AdamW's
static void fsdp_muon_step(Fsdp *f, const Config *cfg, double lr, long t, float clip) {
    for (int i = 0; i < f->n_units; i++) {
        const FsdpUnit *u = &f->units[i];
        float *params = param_shard(f, u), *grads = grad_shard(f, u);
        size_t first = shard_first(f, u), n = real_in_shard(f, u);
        muon_momentum_step(f->layout, params, grads, f->adam_m + u->local, f->adam_v + u->local, first, n, cfg, lr, t,
                           clip);
        if (i > 0) orthogonalize_block(f, u, grads, cfg->muon_ns_steps);  // the root holds no Muon matrix
        muon_apply(f->layout, params, grads, first, n, cfg, lr);
    }
    if (params_whole(f)) gather_updated_params(f);
}

void fsdp_optimizer_step(Fsdp *f, const Config *cfg, double lr, long t, float clip) {
    if (cfg->muon) {
        fsdp_muon_step(f, cfg, lr, t, clip);
        return;
    }
    if (f->trained) {
        const Trainable *x = f->trained;
        adamw_step(&x->layout, x->params, x->grads, x->m, x->v, 0, f->grads_numel, cfg, lr, t, clip);
        return;
    }
    for (int i = 0; i < f->n_units; i++) {
        const FsdpUnit *u = &f->units[i];
        adamw_step(f->layout, param_shard(f, u), grad_shard(f, u), f->adam_m + u->local, f->adam_v + u->local,
                   shard_first(f, u), real_in_shard(f, u), cfg, lr, t, clip);
    }
    if (params_whole(f)) gather_updated_params(f);
}

void fsdp_round_to_bf16(Fsdp *f) {
    for (int i = 0; i < f->n_units; i++) {
        const FsdpUnit *u = &f->units[i];
        half16 *scratch = i == 0 ? f->root16 : f->block16[0];  // holds a whole unit: a shard fits
        // whole parameters: every rank rounds all of them, the same numbers as rounding the shards
        float *params = params_whole(f) ? f->params + u->whole_at : param_shard(f, u);
        size_t n = params_whole(f) ? padded(f, u) : u->shard;
        cast_to_16(scratch, params, n);
        cast_to_float(params, scratch, n);
    }
}

// ---- the memory report ------------------------------------------------------------------------

void fsdp_print_peak_memory(const Fsdp *f) {
    double rss = (double)peak_resident_bytes();
    printf("peak resident memory per rank in training: max %.1f MiB, min %.1f MiB\n",
           comm_max_double(f->world, rss) / 1048576.0, -comm_max_double(f->world, -rss) / 1048576.0);
}

// the rows with a frozen base, FSDP's and DDP's: the trained set's parameters beside the base's,
// its gradients and moments only, and what it keeps for backward
static void frozen_memory_items(const Trainable *t, MemoryItem fsdp[], MemoryItem ddp[]) {
    for (MemoryItem *items = fsdp; items; items = items == fsdp ? ddp : NULL) {
        items[0].bytes += t->bytes;
        items[1].bytes = t->bytes;
        items[2].bytes = 2 * t->bytes;
        items[5].bytes += t->acts_bytes;
    }
}

int fsdp_memory_items(const Fsdp *f, const char *params_label, size_t acts_bytes,
                      MemoryItem fsdp[FSDP_MEMORY_ITEMS], MemoryItem ddp[FSDP_MEMORY_ITEMS]) {
    size_t n = f->layout->num_params, s = f->shard_numel, fl = sizeof(float);
    const char *copies = ops_half_format() == HALF_FP16 ? "fp16 weight copies" : "bf16 weight copies";
    struct { const char *what; size_t fsdp, ddp; } rows[FSDP_MEMORY_ITEMS] = {
        {params_label, f->params_numel * fl, n * fl},
        {"gradients (fp32)", f->grads_numel * fl, n * fl},
        {"AdamW m and v (fp32)", 2 * s * fl, 2 * n * fl},
        {"gathered units (fp32 w + grad)", f->gathered_bytes, 0},
        {copies, f->gathered16_bytes, f->use_16bit ? n * sizeof(half16) : 0},
        {"activations", acts_bytes, acts_bytes},
        // DDP holds every matrix whole: only the orthogonalization's scratch
        {"Muon: gathered block + scratch", f->muon_bytes, f->muon_on ? muon_scratch_bytes(f->layout) : 0},
    };
    for (int i = 0; i < FSDP_MEMORY_ITEMS; i++) {
        fsdp[i] = (MemoryItem){rows[i].what, rows[i].fsdp};
        if (ddp) ddp[i] = (MemoryItem){rows[i].what, rows[i].ddp};
    }
    if (f->trained) frozen_memory_items(f->trained, fsdp, ddp);
    return f->muon_on ? FSDP_MEMORY_ITEMS : FSDP_MEMORY_ITEMS - 1;
}

void fsdp_print_memory(const Fsdp *f, const char *params_label, size_t acts_bytes) {
    MemoryItem fsdp[FSDP_MEMORY_ITEMS], ddp[FSDP_MEMORY_ITEMS];
    int rows = fsdp_memory_items(f, params_label, acts_bytes, fsdp, ddp);
    size_t n = f->layout->num_params, total_fsdp = 0, total_ddp = 0;
    printf("memory per rank:                  ZeRO-%d (%d-rank shards)  DDP\n", f->zero_stage, f->P);
    for (int i = 0; i < rows; i++) {
        printf("  %-30s %10.2f MiB %10.2f MiB\n", fsdp[i].what, fsdp[i].bytes / 1048576.0, ddp[i].bytes / 1048576.0);
        total_fsdp += fsdp[i].bytes;
        run_stats_memory(fsdp[i].what, fsdp[i].bytes);  // this rank's memory (the FSDP column)
        total_ddp += ddp[i].bytes;
    }
    printf("  %-30s %10.2f MiB %10.2f MiB\n", "total", total_fsdp / 1048576.0, total_ddp / 1048576.0);
    if (f->zero_stage == 3)
        printf("  the gathered units: the root (%zu elements, held for a micro-batch) and %d block slot%s%s "
               "(%zu elements each)\n", f->units[0].numel, f->prefetch ? 2 : 1, f->prefetch ? "s" : "",
               f->trained ? "" : (f->prefetch ? " and gradients" : " and gradient"), f->n_units > 1 ? f->units[1].numel : 0);
    if (f->zero_stage == 2)
        printf("  the gradients held whole: the root's (through a micro-batch) and %d block's at a time (%zu "
               "elements each), reduce-scattered as they finish\n", f->prefetch ? 2 : 1,
               f->n_units > 1 ? f->units[1].numel : 0);
    if (f->trained)
        printf("  state (parameters + gradients + AdamW) per rank: %zu bytes = 4 x (%zu + 4 x %zu) elements: "
               "the base's parameters, the trained set's parameters, gradients and m, v\n", fsdp_state_bytes(f),
               f->params_numel, f->grads_numel);
    else
        printf("  state (parameters + gradients + AdamW) per rank: %zu bytes = 4 x (%zu + %zu + 2 x %zu) elements "
               "(DDP: 16 x %zu)\n", fsdp_state_bytes(f), f->params_numel, f->grads_numel, f->shard_numel, n);
    run_stats_number("state_bytes", (double)fsdp_state_bytes(f));
    run_stats_number("zero_stage", f->zero_stage);
    run_stats_number("hsdp_replicas", f->n_replicas);
}
