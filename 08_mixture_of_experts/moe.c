// moe.c: see moe.h.
#include "moe.h"

#include <math.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "model/activations.h"
#include "model/moe_mlp.h"
#include "ops/kernels.h"
#include "ops/ops.h"

// ---- the MLP the core sees ----------------------------------------------------------------------

// Named as Mixtral names its sparse block's parts (block_sparse_moe.gate, .experts.N), with
// GPT-2's names inside an expert. The order is moe_weights' too.
static const TensorSpec MOE_TENSORS[] = {
    {"transformer.h.%d.mlp.gate.weight", ROLE_MOE_MLP, DIM_REPEATS, DIM_C, INIT_NORMAL, true, false, false},
    {"transformer.h.%d.mlp.experts.%d.c_fc.weight", ROLE_MOE_MLP, DIM_4C, DIM_C, INIT_NORMAL, true, true, true},
    {"transformer.h.%d.mlp.experts.%d.c_fc.bias", ROLE_MOE_MLP, DIM_4C, DIM_NONE, INIT_ZEROS, false, false, true},
    {"transformer.h.%d.mlp.experts.%d.c_proj.weight", ROLE_MOE_MLP, DIM_C, DIM_4C, INIT_RESIDUAL, true, true, true},
    {"transformer.h.%d.mlp.experts.%d.c_proj.bias", ROLE_MOE_MLP, DIM_C, DIM_NONE, INIT_ZEROS, false, false, true},
};

static void alloc_moe_acts(Activations *a, ActsAllocator *al);

const MoEMLP MOE_MLP = {MOE_TENSORS, 5, alloc_moe_acts, moe_forward, moe_backward};

void moe_model(GPTConfig *cfg) {
    if (cfg->moe) cfg->moe->mlp = &MOE_MLP;
}

void moe_layout_experts(ParamLayout *layout, const GPTConfig *cfg, int first_expert, int n) {
    gpt_layout_repeats(layout, cfg, first_expert, n);
}

// a dense model's (stage 08 without experts): nothing is routed
static const MoEConfig NO_EXPERTS;

// An expert is whole on each rank that holds it, whatever share of the dense MLP the shape holds
// (stage 10's tensor-parallel ranks each run their experts whole: Megatron's expert tensor
// parallelism 1)
MoEShape moe_shape(const GPTConfig *cfg, const ModelShape *s) {
    const MoEConfig *m = cfg->moe ? cfg->moe : &NO_EXPERTS;
    return (MoEShape){.C = s->C, .C_mlp = whole_model_shape(cfg).C_mlp, .n_experts = m->n_experts,
                      .top_k = m->experts_per_token, .capacity_factor = m->capacity_factor,
                      .aux_loss_coef = m->aux_loss_coef, .first_expert = s->first_repeat,
                      .n_local = s->n_repeats, .ep = s->repeat_ranks};
}

int moe_capacity(const MoEShape *s, int T) {
    if (s->capacity_factor <= 0) return 0;
    return (int)ceilf(s->capacity_factor * (float)T * (float)s->top_k / (float)s->n_experts);
}

int moe_receive_capacity(const MoEShape *s, int B, int T) {
    long every_row = (long)s->ep * B * T * s->top_k, cap = moe_capacity(s, T);
    long within_capacity = (long)s->n_local * cap * B * s->ep;
    return (int)(cap && within_capacity < every_row ? within_capacity : every_row);
}

// the router, then each held expert's c_fc weight and bias, c_proj weight and bias (MOE_TENSORS'
// order, which BlockWeights.moe_mlp keeps)
void moe_weights(MoEWeights *mw, const BlockWeights *w, const MoEShape *s) {
    float *const *t = w->moe_mlp;
    mw->router = (Linear){.w = t[0]};
    for (int i = 0; i < s->n_local; i++, t += 4) {
        mw->fc[i] = (Linear){.w = t[1], .b = t[2]};
        mw->proj[i] = (Linear){.w = t[3], .b = t[4]};
    }
}

// ---- activations ------------------------------------------------------------------------------

// A MoE block's routing and expert rows. The held experts receive at most R rows: every token of
// the group's ranks routed here, or with a capacity, the held experts' capacity per sequence.
static MoEBlockActs *alloc_block(ActsAllocator *al, const ActsSpec *sp, const MoEShape *s) {
    size_t N = (size_t)sp->B * sp->T, C = s->C, F = s->C_mlp, E = s->n_experts, k = s->top_k;
    MoEBlockActs *m = acts_alloc_host(al, sizeof(MoEBlockActs));
    MoEBlockActs shape = {.N = (int)N, .R = moe_receive_capacity(s, sp->B, sp->T)};
    if (!m) m = &shape;  // counting only: the sizes, nothing kept
    *m = shape;
    size_t R = (size_t)m->R;
    m->logits = acts_alloc_device(al, N * E * sizeof(float));
    m->probs = acts_alloc_host(al, N * E * sizeof(float));
    m->choice = acts_alloc_host(al, N * k * sizeof(int));
    m->weight = acts_alloc_host(al, N * k * sizeof(float));
    m->slot = acts_alloc_host(al, N * k * sizeof(int));
    m->routed = acts_alloc_host(al, E * sizeof(int));
    m->expert_rows = acts_alloc_host(al, ((size_t)s->n_local + 1) * sizeof(int));
    if (s->ep > 1) m->counts = acts_alloc_host(al, (size_t)s->ep * E * sizeof(int));
    m->slot_dev = acts_alloc_device(al, N * k * sizeof(int));
    m->weight_dev = acts_alloc_device(al, N * k * sizeof(float));
    m->packed = acts_alloc_device(al, N * k * C * sizeof(float));
    m->expert_in = s->ep > 1 ? acts_alloc_device(al, R * C * sizeof(float)) : m->packed;
    m->fch = acts_alloc_device(al, R * F * sizeof(float));
    m->fch_gelu = acts_alloc_device(al, R * F * sizeof(float));
    m->expert_out = acts_alloc_device(al, R * C * sizeof(float));
    m->returned = s->ep > 1 ? acts_alloc_device(al, N * k * C * sizeof(float)) : m->expert_out;
    return m == &shape ? NULL : m;
}

static void alloc_scratch(ActsAllocator *al, const ActsSpec *sp, const MoEShape *s, MoEScratch *d) {
    size_t N = (size_t)sp->B * sp->T, C = s->C, F = s->C_mlp, E = s->n_experts, k = s->top_k;
    size_t R = (size_t)moe_receive_capacity(s, sp->B, sp->T), f = sizeof(float);
    if (s->ep > 1) {  // the rows' gradients before and after their trip to the experts' ranks
        d->dreturned = acts_alloc_device(al, N * k * C * f);
        d->dpacked = acts_alloc_device(al, N * k * C * f);
    }
    d->dexpert_out = acts_alloc_device(al, R * C * f);
    d->dexpert_in = acts_alloc_device(al, R * C * f);
    d->dfch = acts_alloc_device(al, R * F * f);
    d->dfch_gelu = acts_alloc_device(al, R * F * f);
    d->dlogits = acts_alloc_device(al, N * E * f);
    d->dprobs = acts_alloc_host(al, N * E * f);
    d->dweight = acts_alloc_host(al, N * k * f);
    d->dweight_dev = acts_alloc_device(al, N * k * f);
}

// The scratch, then each MoE block's routing and rows; when recomputing, one set serves every
// MoE block. Counting only, the sizes alone.
static void alloc_moe_acts(Activations *a, ActsAllocator *al) {
    const ActsSpec *sp = &a->spec;
    MoEActs counted, *moe = acts_alloc_host(al, sizeof(MoEActs));
    if (!moe) moe = &counted;
    memset(moe, 0, sizeof *moe);
    moe->shape = moe_shape(&sp->model, &sp->shape);
    alloc_scratch(al, sp, &moe->shape, &moe->scratch);
    moe->stats.load = acts_alloc_host(al, (size_t)sp->n_layers * moe->shape.n_experts * sizeof(long));
    moe->blocks = acts_alloc_host(al, (size_t)sp->n_layers * sizeof(MoEBlockActs *));
    MoEBlockActs *shared = NULL;
    for (int i = 0; i < sp->n_layers; i++) {
        if (!gpt_block_is_moe(&sp->model, sp->first_layer + i)) continue;
        MoEBlockActs *m = sp->recompute && shared ? shared : alloc_block(al, sp, &moe->shape);
        if (sp->recompute && !shared) shared = m;
        if (moe->blocks) moe->blocks[i] = m;
    }
    if (moe != &counted) a->moe = moe;
}

void moe_set_global_batch(Activations *a, const GPTConfig *cfg, int global_sequences) {
    int blocks = gpt_moe_blocks(cfg, 0, cfg->n_layer);
    if (a->moe) a->moe->aux_dloss = blocks ? cfg->moe->aux_loss_coef / ((float)global_sequences * (float)blocks) : 0.0f;
}

void moe_stats_reset(Activations *a) {
    if (!a->moe) return;
    MoEStats *st = &a->moe->stats;
    st->aux_sum = 0;
    st->dropped = 0;
    memset(st->load, 0, (size_t)a->spec.n_layers * a->moe->shape.n_experts * sizeof(long));
}

const MoEStats *moe_stats(const Activations *a) { return a->moe ? &a->moe->stats : NULL; }

MoEBlockActs *moe_acts(const Activations *a, int l) { return a->moe->blocks[l - a->spec.first_layer]; }

// ---- routing, on the host ---------------------------------------------------------------------

// the router's softmax, with the loss's row math (kernels.h), one worker per row
static void softmax_row(float *p, int E) {
    float max = row_partial_max(p, E, 0, 1), sum = row_partial_sumexp(p, max, E, 0, 1);
    for (int e = 0; e < E; e++) p[e] = softmax_exp(p[e], max) / sum;
}

// the k most probable experts, best first (ties: the lower index), and their renormalised weights
static void top_k(const float *p, int E, int k, int *choice, float *weight) {
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int i = 0; i < j; i++) taken |= choice[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        choice[j] = best;
        sum += p[best];
    }
    for (int j = 0; j < k; j++) weight[j] = p[choice[j]] / sum;
}

// Which token-expert pairs fit: per sequence, token by token in position order, at most
// `capacity` rows per expert (a token's own pairs go to distinct experts, so the order of its
// choices never matters). Kept pairs get packed rows grouped by expert, in the same order;
// m->routed counts them. Returns the pairs dropped.
static long place_rows(MoEBlockActs *m, const MoEShape *s, int B, int T, long *load) {
    int E = s->n_experts, k = s->top_k, cap = moe_capacity(s, T);
    int used[MAX_EXPERTS], next[MAX_EXPERTS];
    long dropped = 0, pairs = (long)B * T * k;
    memset(m->routed, 0, (size_t)E * sizeof(int));
    for (long pair = 0; pair < pairs; pair++) {
        if (pair % ((long)T * k) == 0) memset(used, 0, sizeof used);  // a new sequence
        int e = m->choice[pair];
        bool fits = !cap || used[e] < cap;
        used[e] += fits;
        m->routed[e] += fits;
        m->slot[pair] = fits ? e : -1;
        dropped += !fits;
    }
    for (int e = 0, row = 0; e < E; row += m->routed[e], e++) {
        next[e] = row;
        load[e] += m->routed[e];
    }
    for (long pair = 0; pair < pairs; pair++)
        if (m->slot[pair] >= 0) m->slot[pair] = next[m->slot[pair]]++;
    return dropped;
}

// f_e of sequence b: the share of its tokens that chose expert e (before dropping)
static void routed_shares(const MoEBlockActs *m, int E, int k, int b, int T, float *f) {
    memset(f, 0, (size_t)E * sizeof(float));
    for (long n = (long)b * T; n < (long)(b + 1) * T; n++)
        for (int j = 0; j < k; j++) f[m->choice[n * k + j]] += 1.0f / (float)T;
}

// sum over the sequences of E * sum_e f_e * P_e
static double load_balancing_loss(const MoEBlockActs *m, int E, int k, int B, int T) {
    float f[MAX_EXPERTS];
    double sum = 0;
    for (int b = 0; b < B; b++) {
        routed_shares(m, E, k, b, T, f);
        for (int e = 0; e < E; e++) {
            double P = 0;
            for (long n = (long)b * T; n < (long)(b + 1) * T; n++) P += m->probs[n * E + e];
            sum += (double)E * f[e] * P / T;
        }
    }
    return sum;
}

void moe_route(Activations *a, int l, const BlockWeights *w, int B, int T) {
    const MoEShape *s = &a->moe->shape;
    MoEBlockActs *m = moe_acts(a, l);
    int N = B * T, E = s->n_experts, k = s->top_k, C = s->C;
    const float *x = block_mlp_input(a, l);
    MoEWeights mw;
    moe_weights(&mw, w, s);
    matmul_forward(m->logits, x, mw.router.w, NULL, N, C, E);
    copy_to_host(m->probs, m->logits, (size_t)N * E * sizeof(float));
    for (int n = 0; n < N; n++) {
        softmax_row(m->probs + (size_t)n * E, E);
        top_k(m->probs + (size_t)n * E, E, k, m->choice + (size_t)n * k, m->weight + (size_t)n * k);
    }
    MoEStats *st = &a->moe->stats;
    st->dropped += place_rows(m, s, B, T, st->load + (size_t)(l - a->spec.first_layer) * E);
    st->aux_sum += load_balancing_loss(m, E, k, B, T);
    copy_to_device(m->slot_dev, m->slot, (size_t)N * k * sizeof(int));
    copy_to_device(m->weight_dev, m->weight, (size_t)N * k * sizeof(float));
    moe_dispatch(m->packed, x, m->slot_dev, N, k, C);
}

// ---- the experts ------------------------------------------------------------------------------

// An expert's row count changes every step. The matmuls run on power-of-two chunks of the rows,
// so that a backend which prepares one kernel per shape (oneDNN on the CPU) sees a few shapes
// (log2 of the rows) instead of a new one at every step; the rows are independent, and the
// weights' gradients add up over the chunks.
static int chunk_rows(int rows) {
    int c = 1;
    while (c * 2 <= rows) c *= 2;
    return c;
}

static void expert_linear_forward(float *out, const float *inp, const Linear *w, int rows, int C, int OC) {
    for (int r = 0, n; r < rows; r += n) {
        n = chunk_rows(rows - r);
        matmul_forward(out + (size_t)r * OC, inp + (size_t)r * C, w->w, w->b, n, C, OC);
    }
}

static void expert_linear_backward(float *dinp, Linear *g, const float *dout, const float *inp, const Linear *w,
                                   int rows, int C, int OC) {
    for (int r = 0, n; r < rows; r += n) {
        n = chunk_rows(rows - r);
        matmul_backward(dinp + (size_t)r * C, g->w, g->b, dout + (size_t)r * OC, inp + (size_t)r * C, w->w, n, C, OC);
    }
}

void moe_experts_forward(Activations *a, int l, const BlockWeights *w) {
    const MoEShape *s = &a->moe->shape;
    MoEBlockActs *m = moe_acts(a, l);
    size_t C = s->C, F = s->C_mlp;
    MoEWeights mw;
    moe_weights(&mw, w, s);
    for (int i = 0; i < s->n_local; i++) {
        int r0 = m->expert_rows[i], rows = m->expert_rows[i + 1] - r0;
        if (!rows) continue;
        expert_linear_forward(m->fch + r0 * F, m->expert_in + r0 * C, &mw.fc[i], rows, (int)C, (int)F);
        gelu_forward(m->fch_gelu + r0 * F, m->fch + r0 * F, rows * F);
        expert_linear_forward(m->expert_out + r0 * C, m->fch_gelu + r0 * F, &mw.proj[i], rows, (int)F, (int)C);
    }
}

void moe_experts_backward(Activations *a, int l, const BlockWeights *w, BlockWeights *g, const float *dexpert_out,
                          float *dexpert_in) {
    const MoEShape *s = &a->moe->shape;
    MoEBlockActs *m = moe_acts(a, l);
    MoEScratch *d = &a->moe->scratch;
    size_t C = s->C, F = s->C_mlp;
    MoEWeights mw, mg;
    moe_weights(&mw, w, s);
    moe_weights(&mg, g, s);
    for (int i = 0; i < s->n_local; i++) {
        int r0 = m->expert_rows[i], rows = m->expert_rows[i + 1] - r0;
        if (!rows) continue;
        float *dfch_gelu = d->dfch_gelu + r0 * F, *dfch = d->dfch + r0 * F, *din = dexpert_in + r0 * C;
        dev_zero(dfch_gelu, rows * F * sizeof(float));
        dev_zero(din, rows * C * sizeof(float));
        expert_linear_backward(dfch_gelu, &mg.proj[i], dexpert_out + r0 * C, m->fch_gelu + r0 * F, &mw.proj[i],
                               rows, (int)F, (int)C);
        gelu_backward(dfch, m->fch + r0 * F, dfch_gelu, rows * F);
        expert_linear_backward(din, &mg.fc[i], dfch, m->expert_in + r0 * C, &mw.fc[i], rows, (int)C, (int)F);
    }
}

// ---- combining the outputs --------------------------------------------------------------------

void moe_combine_outputs(Activations *a, int l, int B, int T) {
    const MoEShape *s = &a->moe->shape;
    MoEBlockActs *m = moe_acts(a, l);
    moe_combine(a->blocks[l - a->spec.first_layer].mlp_out, m->returned, m->slot_dev, m->weight_dev, B * T, s->top_k, s->C);
}

void moe_combine_outputs_backward(Activations *a, int l, const float *dout, float *dreturned, int B, int T) {
    const MoEShape *s = &a->moe->shape;
    MoEBlockActs *m = moe_acts(a, l);
    size_t pairs = (size_t)B * T * s->top_k;
    moe_combine_backward(dreturned, a->moe->scratch.dweight_dev, dout, m->returned, m->slot_dev, m->weight_dev,
                         B * T, s->top_k, s->C);
    copy_to_host(a->moe->scratch.dweight, a->moe->scratch.dweight_dev, pairs * sizeof(float));
}

// The router's gradient, on the host. With w_j = p_j / S over the chosen experts (S their sum),
// dL/dp_i = (dL/dw_i - sum_j dL/dw_j w_j) / S for each chosen i; the load-balancing loss adds
// aux_dloss * E * f_e / T to every token's p_e. Then back through the softmax.
static void router_logits_grad(const Activations *a, const MoEBlockActs *m, float *dprobs, int B, int T) {
    const MoEShape *s = &a->moe->shape;
    int E = s->n_experts, k = s->top_k;
    const float *dweight = a->moe->scratch.dweight;
    float f[MAX_EXPERTS];
    for (int b = 0; b < B; b++) {
        routed_shares(m, E, k, b, T, f);
        for (long n = (long)b * T; n < (long)(b + 1) * T; n++) {
            const float *p = m->probs + n * E, *wt = m->weight + n * k, *gw = dweight + n * k;
            const int *c = m->choice + n * k;
            float *dp = dprobs + n * E, S = 0.0f, gw_mean = 0.0f;
            for (int e = 0; e < E; e++) dp[e] = a->moe->aux_dloss * (float)E * f[e] / (float)T;
            for (int j = 0; j < k; j++) S += p[c[j]], gw_mean += gw[j] * wt[j];
            for (int j = 0; j < k; j++) dp[c[j]] += (gw[j] - gw_mean) / S;
            float dot = 0.0f;
            for (int e = 0; e < E; e++) dot += p[e] * dp[e];
            for (int e = 0; e < E; e++) dp[e] = p[e] * (dp[e] - dot);
        }
    }
}

void moe_route_backward(Activations *a, int l, float *dinp, const BlockWeights *w, BlockWeights *g,
                        const float *dpacked, int B, int T) {
    const MoEShape *s = &a->moe->shape;
    MoEBlockActs *m = moe_acts(a, l);
    MoEScratch *d = &a->moe->scratch;
    int N = B * T, E = s->n_experts;
    moe_dispatch_backward(dinp, dpacked, m->slot_dev, N, s->top_k, s->C);
    router_logits_grad(a, m, d->dprobs, B, T);
    copy_to_device(d->dlogits, d->dprobs, (size_t)N * E * sizeof(float));
    MoEWeights mw, mg;
    moe_weights(&mw, w, s);
    moe_weights(&mg, g, s);
    matmul_backward(dinp, mg.router.w, NULL, d->dlogits, block_mlp_input(a, l), mw.router.w, N, s->C, E);
}

// ---- on one rank ------------------------------------------------------------------------------

// Every expert is here, so the packed rows are the experts' rows and their outputs come back as
// they are: expert_in is packed, returned is expert_out (alloc_block allocates them so).
void moe_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T) {
    (void)ops;
    MoEBlockActs *m = moe_acts(a, l);
    moe_route(a, l, w, B, T);
    m->expert_rows[0] = 0;
    for (int e = 0; e < a->moe->shape.n_experts; e++) m->expert_rows[e + 1] = m->expert_rows[e] + m->routed[e];
    moe_experts_forward(a, l, w);
    moe_combine_outputs(a, l, B, T);
}

void moe_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w, BlockWeights *g,
                  const float *dout, int B, int T) {
    (void)ops;
    MoEScratch *d = &a->moe->scratch;
    moe_combine_outputs_backward(a, l, dout, d->dexpert_out, B, T);
    moe_experts_backward(a, l, w, g, d->dexpert_out, d->dexpert_in);
    moe_route_backward(a, l, dinp, w, g, d->dexpert_in, B, T);
}
