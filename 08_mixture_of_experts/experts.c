// experts.c: the grid, the expert-parallel MoE layer, the gradients and the checkpoints of stage
// 08 (experts.h).
#include "experts.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "moe.h"
#include "model/activations.h"
#include "ops/ops.h"
#include "run/run_checkpoint.h"
#include "run/run_stats.h"

// ---- the grid ---------------------------------------------------------------------------------

void expert_grid_init(ExpertGrid *g, Comm *world, const Config *cfg) {
    int rank = comm_rank(world), ranks = comm_size(world), ep = cfg->ep_size;
    if (ranks % ep != 0)
        fatal("key 'ep_size': expert groups of %d ranks do not divide the %d ranks", ep, ranks);
    if (ep > 1 && !cfg->num_experts)
        fatal("key 'ep_size' is %d but num_experts is 0: there are no experts to spread", ep);
    memset(g, 0, sizeof *g);
    g->ep = ep;
    g->dp = ranks / ep;
    g->ep_rank = rank % ep;
    g->replica = rank / ep;
    g->n_local = cfg->num_experts / ep;
    g->first_expert = g->ep_rank * g->n_local;
    g->world = world;
    g->ep_group = comm_split(world, g->replica, g->ep_rank, "experts");
    g->expert_dp = comm_split(world, g->ep_rank, g->replica, "expert-replicas");
}

ModelShape expert_shape(const ExpertGrid *g, const GPTConfig *mc) {
    ModelShape s = whole_model_shape(mc);
    s.first_repeat = g->first_expert;
    s.n_repeats = g->n_local;
    s.repeat_ranks = g->ep;
    return s;
}

void print_expert_plan(const ExpertGrid *g, const GPTConfig *mc) {
    const MoEConfig *moe = mc->moe;
    if (!moe) {
        printf("experts: none (num_experts 0): every block has its dense MLP; %d data-parallel ranks\n", g->dp);
        return;
    }
    printf("experts: %d per MoE block (%d of %d blocks), top-%d, capacity factor %g (%s), aux loss x %g\n",
           moe->n_experts, gpt_moe_blocks(mc, 0, mc->n_layer), mc->n_layer, moe->experts_per_token,
           moe->capacity_factor, moe->capacity_factor > 0 ? "rows per expert per sequence: ceil(factor T k / E)" : "no limit",
           moe->aux_loss_coef);
    printf("grid: %d expert ranks x %d data-parallel replicas (rank = replica * %d + expert rank); expert rank r "
           "holds experts [r * %d, (r + 1) * %d)\n", g->ep, g->dp, g->ep, g->n_local, g->n_local);
}

// ---- the expert-parallel MoE layer ------------------------------------------------------------

static ExpertLayers *layers_of(LayerOps *ops) { return (ExpertLayers *)ops; }

// Every rank of the replica learns how many rows each rank sends to each expert: what it will
// receive, and where those rows go.
static void exchange_counts(ExpertLayers *x, const MoEBlockActs *m, int *counts) {
    int E = x->E, ep = x->grid->ep;
    float *host = x->count_host;
    for (int e = 0; e < E; e++) host[e] = (float)m->routed[e];
    copy_to_device(x->count_buf, host, (size_t)E * sizeof(float));
    comm_all_gather(x->grid->ep_group, x->count_buf + E, x->count_buf, (size_t)E);
    copy_to_host(host, x->count_buf + E, (size_t)ep * E * sizeof(float));
    for (int i = 0; i < ep * E; i++) counts[i] = (int)host[i];
}

// rows rank `from` sends to the experts rank `to` holds
static int rows_between(const ExpertLayers *x, const int *counts, int from, int to) {
    int rows = 0, n = x->grid->n_local;
    for (int e = to * n; e < (to + 1) * n; e++) rows += counts[from * x->E + e];
    return rows;
}

// The all-to-all's counts and offsets (in floats): `packed` holds this rank's rows in expert
// order, so those for rank d's experts are one run; rows arrive grouped by sender, and the held
// experts run on them expert by expert (m->expert_rows), so x->order says where received row i
// goes. Returns the rows received.
static int plan_exchange(ExpertLayers *x, const int *counts, MoEBlockActs *m, int C) {
    const ExpertGrid *g = x->grid;
    int me = g->ep_rank, first = g->first_expert, sent = 0, got = 0;
    for (int d = 0; d < g->ep; d++) {
        int out = rows_between(x, counts, me, d), in = rows_between(x, counts, d, me);
        x->send_counts[d] = (size_t)out * C, x->send_offsets[d] = (size_t)sent * C;
        x->recv_counts[d] = (size_t)in * C, x->recv_offsets[d] = (size_t)got * C;
        sent += out, got += in;
    }
    if (got > m->R) fatal("internal: %d rows received, room for %d", got, m->R);
    m->expert_rows[0] = 0;
    for (int i = 0; i < g->n_local; i++) {
        int rows = 0;
        for (int d = 0; d < g->ep; d++) rows += counts[d * x->E + first + i];
        m->expert_rows[i + 1] = m->expert_rows[i] + rows;
    }
    for (int d = 0, r = 0; d < g->ep; d++)
        for (int i = 0; i < g->n_local; i++) {
            int start = m->expert_rows[i];
            for (int s = 0; s < d; s++) start += counts[s * x->E + first + i];
            for (int j = 0; j < counts[d * x->E + first + i]; j++) x->order[r++] = start + j;
        }
    copy_to_device(x->order_dev, x->order, (size_t)got * sizeof(int));
    return got;
}

// rows of this rank's tokens (home, in expert order) to the ranks of their experts, into the
// expert-major rows those run on
static void send_to_experts(ExpertLayers *x, const float *home, float *expert_rows, int got, int C) {
    comm_all_to_all_v(x->grid->ep_group, x->received, x->recv_counts, x->recv_offsets, home, x->send_counts,
                      x->send_offsets);
    moe_dispatch(expert_rows, x->received, x->order_dev, got, 1, C);
}

// and back: the experts' rows, regrouped by the rank they came from, return to it
static void send_home(ExpertLayers *x, const float *expert_rows, float *home, int got, int C) {
    dev_zero(x->received, (size_t)got * C * sizeof(float));
    moe_dispatch_backward(x->received, expert_rows, x->order_dev, got, 1, C);
    comm_all_to_all_v(x->grid->ep_group, home, x->send_counts, x->send_offsets, x->received, x->recv_counts,
                      x->recv_offsets);
}

// a dense block's MLP runs as on one rank
static void expert_parallel_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T) {
    if (!gpt_block_is_moe(&a->spec.model, l)) {
        serial_layer_ops()->mlp_forward(ops, a, l, w, B, T);
        return;
    }
    ExpertLayers *x = layers_of(ops);
    MoEBlockActs *m = moe_acts(a, l);
    int C = a->spec.shape.C, *counts = m->counts;
    moe_route(a, l, w, B, T);
    exchange_counts(x, m, counts);
    int got = plan_exchange(x, counts, m, C);
    send_to_experts(x, m->packed, m->expert_in, got, C);
    moe_experts_forward(a, l, w);
    send_home(x, m->expert_out, m->returned, got, C);
    moe_combine_outputs(a, l, B, T);
    for (int e = 0; e < x->E; e++) x->rows_to_experts += m->routed[e];
    x->rows_at_experts += got;
}

// the same trips in reverse order, with the gradients, on the forward's counts
static void expert_parallel_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w,
                                     BlockWeights *g, const float *dout, int B, int T) {
    if (!gpt_block_is_moe(&a->spec.model, l)) {
        serial_layer_ops()->mlp_backward(ops, a, l, dinp, w, g, dout, B, T);
        return;
    }
    ExpertLayers *x = layers_of(ops);
    MoEScratch *d = &a->moe->scratch;
    int C = a->spec.shape.C;
    MoEBlockActs *m = moe_acts(a, l);
    int got = plan_exchange(x, m->counts, m, C);
    moe_combine_outputs_backward(a, l, dout, d->dreturned, B, T);
    send_to_experts(x, d->dreturned, d->dexpert_out, got, C);
    moe_experts_backward(a, l, w, g, d->dexpert_out, d->dexpert_in);
    send_home(x, d->dexpert_in, d->dpacked, got, C);
    moe_route_backward(a, l, dinp, w, g, d->dpacked, B, T);
}

void expert_layers_init(ExpertLayers *x, const ExpertGrid *g, const GPTConfig *mc, int B, int T) {
    memset(x, 0, sizeof *x);
    x->base = *serial_layer_ops();
    x->grid = g;
    if (g->ep == 1) return;
    x->base.mlp_forward = expert_parallel_forward;
    x->base.mlp_backward = expert_parallel_backward;
    ModelShape shape = expert_shape(g, mc);
    MoEShape s = moe_shape(mc, &shape);
    int R = moe_receive_capacity(&s, B, T);
    x->E = gpt_experts(mc);
    x->order = calloc_or_die((size_t)R, sizeof(int));
    x->order_dev = dev_malloc((size_t)R * sizeof(int));
    x->received = dev_malloc((size_t)R * s.C * sizeof(float));
    x->count_buf = dev_malloc((size_t)(g->ep + 1) * x->E * sizeof(float));
    x->count_host = calloc_or_die((size_t)g->ep * x->E, sizeof(float));
    x->send_counts = calloc_or_die((size_t)g->ep * 4, sizeof(size_t));
    x->send_offsets = x->send_counts + g->ep;
    x->recv_counts = x->send_counts + 2 * g->ep;
    x->recv_offsets = x->send_counts + 3 * g->ep;
}

void expert_acts_alloc(Activations *a, ExpertLayers *x, const ExpertGrid *g, const GPTConfig *mc, int B, int T,
                       int global_sequences) {
    expert_layers_init(x, g, mc, B, T);
    ActsSpec spec = whole_model_acts(mc, B, T, false, false);  // stage 08 trains in fp32
    spec.shape = expert_shape(g, mc);
    spec.ops = &x->base;
    acts_alloc_spec(a, &spec);
    moe_set_global_batch(a, mc, global_sequences);
    int blocks = gpt_moe_blocks(mc, 0, mc->n_layer);
    x->step = (MoEStepStats){.load = calloc_or_die((size_t)blocks * gpt_experts(mc) + 1, sizeof(long)),
                             .blocks = blocks, .experts = gpt_experts(mc)};
}

void expert_layers_free(ExpertLayers *x) {
    free((long *)x->step.load);
    free(x->order);
    free(x->send_counts);
    dev_free(x->order_dev);
    dev_free(x->received);
    dev_free(x->count_buf);
    free(x->count_host);
}

// ---- gradients --------------------------------------------------------------------------------

// Runs of consecutive tensors that are all experts' or all not: f(first element, count, expert).
static void for_each_run(const ParamLayout *layout, void (*f)(size_t first, size_t n, bool expert, void *ctx),
                         void *ctx) {
    for (int i = 0; i < layout->num_tensors;) {
        bool expert = layout->tensors[i].repeat >= 0;
        int j = i;
        while (j < layout->num_tensors && (layout->tensors[j].repeat >= 0) == expert) j++;
        const TensorInfo *last = &layout->tensors[j - 1];
        f(layout->tensors[i].offset, last->offset + last->numel - layout->tensors[i].offset, expert, ctx);
        i = j;
    }
}

typedef struct {
    const ExpertGrid *g;
    float *grads;
    double squares[2];  // the replicated tensors', the experts'
} GradientRuns;

static void all_reduce_run(size_t first, size_t n, bool expert, void *ctx) {
    GradientRuns *r = ctx;
    Comm *group = expert ? r->g->expert_dp : r->g->world;
    if (comm_size(group) > 1) comm_all_reduce(group, r->grads + first, n);  // one rank: nothing to add
}

void all_reduce_gradients(const ExpertGrid *g, const ParamLayout *layout, float *grads) {
    GradientRuns r = {.g = g, .grads = grads};
    for_each_run(layout, all_reduce_run, &r);
}

static void add_squares(size_t first, size_t n, bool expert, void *ctx) {
    GradientRuns *r = ctx;
    r->squares[expert] += sum_squares(r->grads + first, n);
}

double expert_sum_squares(const ExpertGrid *g, const ParamLayout *layout, const float *grads) {
    GradientRuns r = {.g = g, .grads = (float *)grads};
    for_each_run(layout, add_squares, &r);
    // each rank of a replica holds other experts: their squares add up over the replica
    return r.squares[0] + comm_sum_double(g->ep_group, r.squares[1]);
}

typedef struct {
    long *runs;
    size_t *numel;
} RunCount;

static void count_run(size_t first, size_t n, bool expert, void *ctx) {
    (void)first;
    RunCount *c = ctx;
    c->runs[expert]++;
    c->numel[expert] += n;
}

void count_gradient_runs(const ParamLayout *layout, long runs[2], size_t numel[2]) {
    runs[0] = runs[1] = 0;
    numel[0] = numel[1] = 0;
    RunCount c = {runs, numel};
    for_each_run(layout, count_run, &c);
}

// ---- what the experts did ---------------------------------------------------------------------

void expert_run_stats(const ExpertLayers *x) {
    run_stats_number("rows_to_experts", (double)x->rows_to_experts);
    run_stats_number("rows_at_experts", (double)x->rows_at_experts);
}

const MoEStepStats *expert_step_stats(ExpertLayers *x, Activations *a, const GPTConfig *mc, int global_sequences) {
    if (!mc->moe) return NULL;
    int E = mc->moe->n_experts, blocks = x->step.blocks;
    long *load = (long *)x->step.load;
    const MoEStats *st = moe_stats(a);
    double *sums = calloc_or_die((size_t)blocks * E + 2, sizeof(double));
    sums[0] = st ? st->aux_sum : 0;
    sums[1] = st ? (double)st->dropped : 0;
    for (int l = 0, b = 0; l < mc->n_layer; l++)
        if (gpt_block_is_moe(mc, l)) {
            for (int e = 0; e < E; e++) sums[2 + b * E + e] = (double)st->load[l * E + e];
            b++;
        }
    comm_sum_doubles(x->grid->world, sums, blocks * E + 2);
    x->step.aux_loss = sums[0] / ((double)global_sequences * blocks);
    x->step.dropped = (long)sums[1];
    for (int i = 0; i < blocks * E; i++) load[i] = (long)sums[2 + i];
    free(sums);
    moe_stats_reset(a);
    return &x->step;
}

// ---- checkpoints ------------------------------------------------------------------------------

// a replica's rank 0 gives the tensors every rank holds; each rank gives its experts
static bool own_share(const TensorInfo *t, const void *grid) {
    return t->repeat >= 0 || ((const ExpertGrid *)grid)->ep_rank == 0;
}

static void sum_over_replica(float *buf, size_t n, void *ep_group) {
    if (comm_size(ep_group) > 1) comm_all_reduce(ep_group, buf, n);  // one rank holds it all
}

void expert_save_checkpoint(const Config *cfg, const ExpertGrid *g, const ParamLayout *local,
                            const ParamLayout *whole, const float *params, const float *m, const float *v,
                            long step) {
    if (g->replica != 0) return;  // the replicas are identical
    save_checkpoint_from_parts(cfg, local, whole, params, m, v, step, own_share, g, sum_over_replica, g->ep_group,
                               g->ep_rank == 0);
}
