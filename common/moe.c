// moe.c: see moe.h.
#include "moe.h"

#include <math.h>
#include <string.h>

#include "device.h"
#include "kernels.h"
#include "log.h"
#include "ops.h"

int moe_capacity(const ModelShape *s, int T) {
    if (s->capacity_factor <= 0) return 0;
    return (int)ceilf(s->capacity_factor * (float)T * (float)s->top_k / (float)s->n_experts);
}

int moe_receive_capacity(const ModelShape *s, int B, int T) {
    long every_row = (long)s->ep * B * T * s->top_k, cap = moe_capacity(s, T);
    long within_capacity = (long)s->n_local_experts * cap * B * s->ep;
    return (int)(cap && within_capacity < every_row ? within_capacity : every_row);
}

void moe_set_global_batch(Activations *a, const GPTConfig *cfg, int global_sequences) {
    int blocks = gpt_moe_blocks(cfg, 0, cfg->n_layer);
    a->aux_dloss = blocks ? cfg->aux_loss_coef / ((float)global_sequences * (float)blocks) : 0.0f;
}

void moe_stats_reset(Activations *a) {
    MoEStats *st = &a->moe_stats;
    st->aux_sum = 0;
    st->dropped = 0;
    if (st->load) memset(st->load, 0, (size_t)a->spec.n_layers * a->spec.shape.n_experts * sizeof(long));
}

MoEActs *moe_acts(const Activations *a, int l) { return a->blocks[l - a->spec.first_layer].moe; }

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
static long place_rows(MoEActs *m, const ModelShape *s, int B, int T, long *load) {
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
static void routed_shares(const MoEActs *m, int E, int k, int b, int T, float *f) {
    memset(f, 0, (size_t)E * sizeof(float));
    for (long n = (long)b * T; n < (long)(b + 1) * T; n++)
        for (int j = 0; j < k; j++) f[m->choice[n * k + j]] += 1.0f / (float)T;
}

// sum over the sequences of E * sum_e f_e * P_e
static double load_balancing_loss(const MoEActs *m, int E, int k, int B, int T) {
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
    const ModelShape *s = &a->spec.shape;
    MoEActs *m = moe_acts(a, l);
    int N = B * T, E = s->n_experts, k = s->top_k, C = s->C;
    const float *x = block_mlp_input(a, l);
    matmul_forward(m->logits, x, w->router.w, NULL, N, C, E);
    copy_to_host(m->probs, m->logits, (size_t)N * E * sizeof(float));
    for (int n = 0; n < N; n++) {
        softmax_row(m->probs + (size_t)n * E, E);
        top_k(m->probs + (size_t)n * E, E, k, m->choice + (size_t)n * k, m->weight + (size_t)n * k);
    }
    MoEStats *st = &a->moe_stats;
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
    const ModelShape *s = &a->spec.shape;
    MoEActs *m = moe_acts(a, l);
    size_t C = s->C, F = s->C_mlp;
    for (int i = 0; i < s->n_local_experts; i++) {
        int e = s->first_expert + i, r0 = m->expert_rows[i], rows = m->expert_rows[i + 1] - r0;
        if (!rows) continue;
        expert_linear_forward(m->fch + r0 * F, m->expert_in + r0 * C, &w->expert_fc[e], rows, (int)C, (int)F);
        gelu_forward(m->fch_gelu + r0 * F, m->fch + r0 * F, rows * F);
        expert_linear_forward(m->expert_out + r0 * C, m->fch_gelu + r0 * F, &w->expert_proj[e], rows, (int)F, (int)C);
    }
}

void moe_experts_backward(Activations *a, int l, const BlockWeights *w, BlockWeights *g, const float *dexpert_out,
                          float *dexpert_in) {
    const ModelShape *s = &a->spec.shape;
    MoEActs *m = moe_acts(a, l);
    MoEScratch *d = &a->moe;
    size_t C = s->C, F = s->C_mlp;
    for (int i = 0; i < s->n_local_experts; i++) {
        int e = s->first_expert + i, r0 = m->expert_rows[i], rows = m->expert_rows[i + 1] - r0;
        if (!rows) continue;
        float *dfch_gelu = d->dfch_gelu + r0 * F, *dfch = d->dfch + r0 * F, *din = dexpert_in + r0 * C;
        dev_zero(dfch_gelu, rows * F * sizeof(float));
        dev_zero(dfch, rows * F * sizeof(float));
        dev_zero(din, rows * C * sizeof(float));
        expert_linear_backward(dfch_gelu, &g->expert_proj[e], dexpert_out + r0 * C, m->fch_gelu + r0 * F,
                               &w->expert_proj[e], rows, (int)F, (int)C);
        gelu_backward(dfch, m->fch + r0 * F, dfch_gelu, rows * F);
        expert_linear_backward(din, &g->expert_fc[e], dfch, m->expert_in + r0 * C, &w->expert_fc[e], rows, (int)C,
                               (int)F);
    }
}

// ---- combining the outputs --------------------------------------------------------------------

void moe_combine_outputs(Activations *a, int l, int B, int T) {
    const ModelShape *s = &a->spec.shape;
    MoEActs *m = moe_acts(a, l);
    moe_combine(a->blocks[l - a->spec.first_layer].out, m->returned, m->slot_dev, m->weight_dev, B * T, s->top_k, s->C);
}

void moe_combine_outputs_backward(Activations *a, int l, const float *dout, float *dreturned, int B, int T) {
    const ModelShape *s = &a->spec.shape;
    MoEActs *m = moe_acts(a, l);
    size_t pairs = (size_t)B * T * s->top_k;
    moe_combine_backward(dreturned, a->moe.dweight_dev, dout, m->returned, m->slot_dev, m->weight_dev,
                         B * T, s->top_k, s->C);
    copy_to_host(a->moe.dweight, a->moe.dweight_dev, pairs * sizeof(float));
}

// The router's gradient, on the host. With w_j = p_j / S over the chosen experts (S their sum),
// dL/dp_i = (dL/dw_i - sum_j dL/dw_j w_j) / S for each chosen i; the load-balancing loss adds
// aux_dloss * E * f_e / T to every token's p_e. Then back through the softmax.
static void router_logits_grad(const Activations *a, const MoEActs *m, float *dprobs, int B, int T) {
    const ModelShape *s = &a->spec.shape;
    int E = s->n_experts, k = s->top_k;
    const float *dweight = a->moe.dweight;
    float f[MAX_EXPERTS];
    for (int b = 0; b < B; b++) {
        routed_shares(m, E, k, b, T, f);
        for (long n = (long)b * T; n < (long)(b + 1) * T; n++) {
            const float *p = m->probs + n * E, *wt = m->weight + n * k, *gw = dweight + n * k;
            const int *c = m->choice + n * k;
            float *dp = dprobs + n * E, S = 0.0f, gw_mean = 0.0f;
            for (int e = 0; e < E; e++) dp[e] = a->aux_dloss * (float)E * f[e] / (float)T;
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
    const ModelShape *s = &a->spec.shape;
    MoEActs *m = moe_acts(a, l);
    MoEScratch *d = &a->moe;
    int N = B * T, E = s->n_experts;
    moe_dispatch_backward(dinp, dpacked, m->slot_dev, N, s->top_k, s->C);
    router_logits_grad(a, m, d->dprobs, B, T);
    copy_to_device(d->dlogits, d->dprobs, (size_t)N * E * sizeof(float));
    matmul_backward(dinp, g->router.w, NULL, d->dlogits, block_mlp_input(a, l), w->router.w, N, s->C, E);
}

// ---- on one rank ------------------------------------------------------------------------------

// Every expert is here, so the packed rows are the experts' rows and their outputs come back as
// they are: expert_in is packed, returned is expert_out (gpt.c allocates them so).
void moe_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T) {
    (void)ops;
    MoEActs *m = moe_acts(a, l);
    moe_route(a, l, w, B, T);
    m->expert_rows[0] = 0;
    for (int e = 0; e < a->spec.shape.n_experts; e++) m->expert_rows[e + 1] = m->expert_rows[e] + m->routed[e];
    moe_experts_forward(a, l, w);
    moe_combine_outputs(a, l, B, T);
}

void moe_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w, BlockWeights *g,
                  const float *dout, int B, int T) {
    (void)ops;
    MoEScratch *d = &a->moe;
    moe_combine_outputs_backward(a, l, dout, d->dexpert_out, B, T);
    moe_experts_backward(a, l, w, g, d->dexpert_out, d->dexpert_in);
    moe_route_backward(a, l, dinp, w, g, d->dexpert_in, B, T);
}
