// test_moe.c: the mixture-of-experts MLP (08_mixture_of_experts/moe.c, in common/model/gpt.c's block) against
// references written here, and our side of tests/test_moe_oracle.sh.
//
// Without arguments, on tiny GPT-2 MoE models (every block or every second block a MoE, k = 1 and
// k = 2, a capacity that drops pairs and none):
//  1. Finite differences: the objective CE + aux_loss_coef x mean aux, computed by the forward
//     alone, moved by +-eps on sampled elements of every tensor, against the analytic gradient.
//     Routing is piecewise constant: an element whose +-eps changes any choice or slot is skipped.
//  2. Routing against a reimplementation here: the router's softmax, the top-k and its weights,
//     which pairs fit (counted per sequence, token by token), the dropped count, the rows
//     each expert ran, the packing, the load-balancing loss.
//  3. With k = 1 the router's gradient comes from the load-balancing loss alone (coef 0: exactly 0).
//  4. Capacity is per sequence: it does not depend on how the experts are spread over ranks, and
//     the batch run whole routes, drops and outputs as its sequences run one by one; a micro-batch
//     smaller than the activations' allocation gives what activations of its exact size give;
//     two micro-batches accumulate the sum of their gradients.
//  5. Each rank's share of the experts (moe_layout_experts) has the whole model's names and initial
//     values, and the ranks' shares hold each expert once; acts_bytes is what the activations of
//     one rank (every expert, or its share) take.
//
// `test_moe --oracle DIR`: DIR holds a MoE GPT-2 checkpoint (config.json with num_local_experts,
// num_experts_per_tok, moe_every, and for the run capacity_factor and router_aux_loss_coef;
// model.safetensors) and tokens.bin (int32 B, T, then B*T inputs and B*T targets). Writes
//   DIR/logits.bin          our logits (B*T rows of vocab_size floats)
//   DIR/probs_L.bin         MoE block L's router probabilities (B*T rows of E floats)
//   DIR/choice_L.bin        its chosen experts, best first (B*T rows of k int32)
//   DIR/slot_L.bin          their packed rows, -1 where dropped (B*T rows of k int32)
//   DIR/result.json         {"loss": mean CE, "aux": mean aux, "dropped": pairs over capacity}
//   DIR/grads/              the gradient of CE + coef x aux, saved as a checkpoint (our names)
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/files.h"
#include "base/log.h"
#include "check.h"
#include "inputs.h"
#include "model/activations.h"
#include "model/checkpoint.h"
#include "model/gpt.h"
#include "moe.h"
#include "ops/ops.h"

static GPTConfig moe_config(int n_layer, int moe_every, int E, int k, float capacity_factor, float coef) {
    GPTConfig cfg = {.max_seq_len = 8, .vocab_size = 40, .n_layer = n_layer, .n_head = 2, .n_embd = 16,
                     .moe = moe_config_new(E, k, moe_every)};
    cfg.moe->capacity_factor = capacity_factor, cfg.moe->aux_loss_coef = coef, cfg.moe->mlp = &MOE_MLP;
    cfg.padded_vocab_size = gpt_padded_vocab(cfg.vocab_size);
    return cfg;
}

// the router: the one tensor of a MoE block's MLP that is not an expert's
static bool is_router(const TensorInfo *t) { return t->role == ROLE_MOE_MLP && t->repeat < 0; }

// a model, its gradients, a batch and its activations (parameters also kept on the host)
typedef struct {
    GPTConfig cfg;
    int B, T, blocks;  // blocks: the MoE blocks
    ParamLayout layout;
    float *params, *grads, *host;
    Weights w, g;
    Activations acts;
    int *x, *y;
} Model;

static void model_build(Model *m, const GPTConfig *cfg, int B, int T) {
    m->cfg = *cfg, m->B = B, m->T = T, m->blocks = gpt_moe_blocks(cfg, 0, cfg->n_layer);
    gpt_layout(&m->layout, cfg);
    size_t n = m->layout.num_params;
    m->params = dev_malloc(n * sizeof(float));
    m->grads = dev_malloc(n * sizeof(float));
    m->host = malloc_or_die(n * sizeof(float));
    gpt_init_range(m->params, &m->layout, 0, n, 5);
    copy_to_host(m->host, m->params, n * sizeof(float));
    // larger than GPT-2's init so that every path carries a gradient well above float noise; the
    // router larger still, so that the top-k is decided by margins an eps does not cross
    for (int i = 0; i < m->layout.num_tensors; i++) {
        const TensorInfo *t = &m->layout.tensors[i];
        float scale = is_router(t) ? 30.0f : 3.0f;
        for (size_t j = t->offset; j < t->offset + t->numel; j++)
            m->host[j] = m->host[j] * scale + (float)(0.1 * (uniform() - 0.5));
    }
    copy_to_device(m->params, m->host, n * sizeof(float));
    weights_point(&m->w, &m->layout, m->params);
    weights_point(&m->g, &m->layout, m->grads);
    acts_alloc(&m->acts, cfg, B, T, 0);
    m->x = malloc_or_die((size_t)B * T * sizeof(int));
    m->y = malloc_or_die((size_t)B * T * sizeof(int));
    for (int i = 0; i < B * T; i++) {
        m->x[i] = (int)(uniform() * cfg->vocab_size);
        m->y[i] = (i % 5 == 1) ? -1 : (int)(uniform() * cfg->vocab_size);  // some ignored targets
    }
}

static void model_free(Model *m) {
    acts_free(&m->acts);
    weights_free(&m->w), weights_free(&m->g);
    dev_free(m->params), dev_free(m->grads);
    gpt_layout_free(&m->layout);
    free(m->host), free(m->x), free(m->y);
}

static int count_targets(const int *targets, int n) {
    int c = 0;
    for (int i = 0; i < n; i++) c += targets[i] >= 0;
    return c;
}

// the load-balancing loss's mean over sequences and MoE blocks, from the last forward
static double mean_aux(const Model *m) { return moe_stats(&m->acts)->aux_sum / ((double)m->B * m->blocks); }

// CE_mean + coef x mean_aux by the forward alone
static double objective(Model *m) {
    moe_stats_reset(&m->acts);
    gpt_forward(&m->acts, &m->w, m->x, m->B, m->T);
    copy_to_device(m->acts.targets, m->y, (size_t)m->B * m->T * sizeof(int));
    double ce = gpt_loss_forward(&m->acts, &m->cfg, m->B, m->T) / count_targets(m->y, m->B * m->T);
    return ce + m->cfg.moe->aux_loss_coef * mean_aux(m);
}

// the same objective's gradient into m->grads (returns the mean CE)
static double forward_backward(Model *m) {
    dev_zero(m->grads, m->layout.num_params * sizeof(float));
    moe_set_global_batch(&m->acts, &m->cfg, m->B);
    moe_stats_reset(&m->acts);
    int count = count_targets(m->y, m->B * m->T);
    return gpt_forward_backward(&m->acts, &m->w, &m->g, &m->cfg, m->x, m->y, m->B, m->T, 1.0f / count) / count;
}

static MoEBlockActs *moe_of(const Model *m, int l) { return moe_acts(&m->acts, l); }

// every MoE block's choices and slots after the last forward, one after the other
static void routing_snapshot(const Model *m, int *out) {
    size_t pairs = (size_t)m->B * m->T * m->cfg.moe->experts_per_token, n = 0;
    for (int l = 0; l < m->cfg.n_layer; l++) {
        if (!moe_of(m, l)) continue;
        memcpy(out + n, moe_of(m, l)->choice, pairs * sizeof(int)), n += pairs;
        memcpy(out + n, moe_of(m, l)->slot, pairs * sizeof(int)), n += pairs;
    }
}

// ---- 1. finite differences ----------------------------------------------------------------------

// the objective with parameter i set to v, and whether the routing stayed `base`
static double objective_at(Model *m, size_t i, float v, const int *base, int *snap, size_t n_snap, bool *same) {
    copy_to_device(m->params + i, &v, sizeof(float));
    double f = objective(m);
    routing_snapshot(m, snap);
    *same &= memcmp(snap, base, n_snap * sizeof(int)) == 0;
    copy_to_device(m->params + i, &m->host[i], sizeof(float));
    return f;
}

// An element of tensor t: for wte a column of a token the batch uses (others have no gradient),
// for wpe a position it reaches, else any.
static size_t sample_element(const Model *m, const TensorInfo *t) {
    int C = m->cfg.n_embd;
    if (t->role == ROLE_WTE) return (size_t)m->x[(int)(uniform() * m->B * m->T)] * C + (size_t)(uniform() * C);
    if (t->role == ROLE_WPE) return (size_t)(uniform() * m->T) * C + (size_t)(uniform() * C);
    return (size_t)(uniform() * (double)t->numel);
}

static void test_finite_differences(const GPTConfig *cfg, const char *what) {
    enum { SAMPLES = 4 };
    Model m;
    model_build(&m, cfg, 2, 7);  // T below max_seq_len on purpose
    size_t n = m.layout.num_params, n_snap = (size_t)2 * m.blocks * m.B * m.T * cfg->moe->experts_per_token;
    forward_backward(&m);
    float *grad = malloc_or_die(n * sizeof(float));
    copy_to_host(grad, m.grads, n * sizeof(float));
    int *base = malloc_or_die(n_snap * sizeof(int)), *snap = malloc_or_die(n_snap * sizeof(int));
    objective(&m);
    routing_snapshot(&m, base);
    int checked = 0, skipped = 0;
    double router_grad = 0;
    for (int ti = 0; ti < m.layout.num_tensors; ti++) {
        const TensorInfo *t = &m.layout.tensors[ti];
        for (int s = 0; s < (is_router(t) ? 4 * SAMPLES : SAMPLES); s++) {
            size_t i = t->offset + sample_element(&m, t);
            // a step of eps both ways, as the float parameter holds it
            float h = m.host[i], up = h + 1e-3f, down = h - 1e-3f;
            bool same = true;
            double f_up = objective_at(&m, i, up, base, snap, n_snap, &same);
            double f_down = objective_at(&m, i, down, base, snap, n_snap, &same);
            if (!same) {
                skipped++;
                continue;
            }
            double numeric = (f_up - f_down) / ((double)up - (double)down);
            char name[160];
            snprintf(name, sizeof name, "%s: d objective / d %s[%zu]", what, t->name, i - t->offset);
            // float noise of the objective (~1e-7, / 2 eps) and the O(eps^2) truncation; a wrong
            // path gives errors of 10% and more of gradients of 1e-3 and up
            CHECK_CLOSE(grad[i], numeric, 2e-2, 2e-4, name);
            checked++;
            if (is_router(t)) router_grad += fabs(grad[i]);
        }
    }
    CHECK(skipped * 4 < checked, "%s: %d elements checked, %d skipped (the routing moved)", what, checked, skipped);
    CHECK(router_grad > 1e-3, "%s: the router's sampled gradients are all but zero (%g)", what, router_grad);
    free(grad), free(base), free(snap);
    model_free(&m);
}

// ---- 2. routing against a reimplementation -----------------------------------------------------

static int capacity_of(const GPTConfig *cfg, int T) {
    const MoEConfig *moe = cfg->moe;
    return moe->capacity_factor > 0 ? (int)ceil((double)moe->capacity_factor * T * moe->experts_per_token / moe->n_experts) : 0;
}

// a router's probabilities of one token, in double, from its MLP input x (C) and the router w (E, C)
static void router_probs(const Model *m, const float *x, const float *w, double *p) {
    int C = m->cfg.n_embd, E = m->cfg.moe->n_experts;
    double max = -INFINITY, sum = 0;
    for (int e = 0; e < E; e++) {
        p[e] = 0;
        for (int c = 0; c < C; c++) p[e] += (double)x[c] * w[(size_t)e * C + c];
        max = fmax(max, p[e]);
    }
    for (int e = 0; e < E; e++) sum += p[e] = exp(p[e] - max);
    for (int e = 0; e < E; e++) p[e] /= sum;
}

// token n's router: probabilities, the top-k (best first) and its renormalised weights
static void check_router(const Model *m, int l, int n, const float *x, const float *w, const char *what) {
    const MoEBlockActs *a = moe_of(m, l);
    int E = m->cfg.moe->n_experts, k = m->cfg.moe->experts_per_token;
    double p[MAX_EXPERTS], chosen = 0;
    router_probs(m, x, w, p);
    for (int e = 0; e < E; e++) CHECK_CLOSE(a->probs[(size_t)n * E + e], p[e], 1e-5, 1e-7, what);
    for (int j = 0; j < k; j++) chosen += p[a->choice[(size_t)n * k + j]];
    for (int j = 0; j < k; j++) {
        int e = a->choice[(size_t)n * k + j], better = 0;
        for (int o = 0; o < E; o++) better += p[o] > p[e];
        CHECK(better == j, "%s: token %d's choice %d is expert %d, which %d experts beat", what, n, j, e, better);
        CHECK_CLOSE(a->weight[(size_t)n * k + j], p[e] / chosen, 1e-5, 1e-7, what);
    }
}

// Whether pair (t, j) of sequence b fits: fewer than `cap` pairs of the sequence that chose the
// same expert come before it, a pair coming before when it is an earlier choice or the same
// choice of an earlier token.
static bool fits(const int *choice, int b, int t, int j, int T, int k, int cap) {
    int e = choice[((size_t)b * T + t) * k + j], before = 0;
    for (int tt = 0; tt < t; tt++)  // the earlier tokens' pairs (a token's own go to other experts)
        for (int jj = 0; jj < k; jj++) before += choice[((size_t)b * T + tt) * k + jj] == e;
    return !cap || before < cap;
}

// block l: which pairs were kept, the rows each expert ran (load, grouped rows), and its aux loss;
// returns the pairs dropped
static long check_block_routing(const Model *m, int l, const char *what, double *aux) {
    const MoEBlockActs *a = moe_of(m, l);
    int B = m->B, T = m->T, E = m->cfg.moe->n_experts, k = m->cfg.moe->experts_per_token, cap = capacity_of(&m->cfg, T);
    int N = B * T;
    long kept[MAX_EXPERTS] = {0}, dropped = 0, first_row[MAX_EXPERTS + 1] = {0};
    char router[64];
    snprintf(router, sizeof router, "transformer.h.%d.mlp.gate.weight", l);
    const float *w = m->host + layout_tensor(&m->layout, router)->offset;
    float *x = malloc_or_die((size_t)N * m->cfg.n_embd * sizeof(float));
    copy_to_host(x, block_mlp_input(&m->acts, l), (size_t)N * m->cfg.n_embd * sizeof(float));
    for (int n = 0; n < N; n++) check_router(m, l, n, x + (size_t)n * m->cfg.n_embd, w, what);
    free(x);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++) {
                size_t pair = ((size_t)b * T + t) * k + j;
                bool keep = fits(a->choice, b, t, j, T, k, cap);
                CHECK(keep == (a->slot[pair] >= 0), "%s: block %d sequence %d token %d choice %d: slot %d", what, l, b,
                      t, j, a->slot[pair]);
                kept[a->choice[pair]] += keep;
                dropped += !keep;
            }
    const long *load = moe_stats(&m->acts)->load + (size_t)l * E;
    for (int e = 0; e < E; e++) {
        CHECK(load[e] == kept[e], "%s: block %d expert %d ran %ld rows, expected %ld", what, l, e, load[e], kept[e]);
        first_row[e + 1] = first_row[e] + kept[e];
    }
    CHECK(first_row[E] + dropped == (long)N * k, "%s: block %d: %ld rows + %ld dropped of %d pairs", what, l,
          first_row[E], dropped, N * k);
    // the kept rows are distinct and each lies in its expert's group
    bool *used = calloc_or_die((size_t)N * k, sizeof(bool));
    for (size_t pair = 0; pair < (size_t)N * k; pair++) {
        int row = a->slot[pair], e = a->choice[pair];
        if (row < 0) continue;
        CHECK(row >= first_row[e] && row < first_row[e + 1] && !used[row],
              "%s: block %d pair %zu of expert %d has row %d (its rows [%ld, %ld))", what, l, pair, e, row,
              first_row[e], first_row[e + 1]);
        if (row >= 0 && row < N * k) used[row] = true;
    }
    free(used);
    // aux = E sum_e f_e P_e per sequence, f_e counting every choice (kept or not)
    for (int b = 0; b < B; b++)
        for (int e = 0; e < E; e++) {
            double f = 0, P = 0;
            for (int t = 0; t < T; t++) {
                size_t n = (size_t)b * T + t;
                for (int j = 0; j < k; j++) f += a->choice[n * k + j] == e;
                P += a->probs[n * E + e];
            }
            *aux += E * (f / T) * (P / T);
        }
    return dropped;
}

static void test_routing(const GPTConfig *cfg, const char *what, bool expect_drops) {
    Model m;
    model_build(&m, cfg, 3, 8);
    objective(&m);
    long dropped = 0, rows = 0;
    double aux = 0;
    for (int l = 0; l < cfg->n_layer; l++)
        if (moe_of(&m, l)) dropped += check_block_routing(&m, l, what, &aux);
    const MoEStats *st = moe_stats(&m.acts);
    CHECK(st->dropped == dropped, "%s: %ld pairs dropped, counted %ld", what, st->dropped, dropped);
    CHECK(expect_drops ? dropped > 0 : dropped == 0, "%s: %ld pairs dropped", what, dropped);
    for (size_t i = 0; i < (size_t)cfg->n_layer * cfg->moe->n_experts; i++) rows += st->load[i];
    CHECK(rows + dropped == (long)m.blocks * m.B * m.T * cfg->moe->experts_per_token, "%s: %ld rows + %ld dropped", what,
          rows, dropped);
    CHECK_CLOSE(st->aux_sum, aux, 1e-5, 0, "load-balancing loss");
    // the stats add up over micro-batches until reset
    objective(&m);
    gpt_forward(&m.acts, &m.w, m.x, m.B, m.T);
    CHECK(st->dropped == 2 * dropped, "%s: two forwards drop %ld, expected %ld", what, st->dropped, 2 * dropped);
    model_free(&m);
}

// ---- 3. k = 1: the router learns from the load-balancing loss only -----------------------------

static double router_grad_norm(Model *m) {
    forward_backward(m);
    double sum = 0;
    for (int i = 0; i < m->layout.num_tensors; i++) {
        const TensorInfo *t = &m->layout.tensors[i];
        if (is_router(t)) sum += sum_squares(m->grads + t->offset, t->numel);
    }
    return sqrt(sum);
}

static void test_top1_router_gradient(void) {
    for (int coef = 0; coef < 2; coef++) {
        GPTConfig cfg = moe_config(2, 1, 4, 1, 1.0f, coef ? 0.1f : 0.0f);
        Model m;
        model_build(&m, &cfg, 2, 7);
        double norm = router_grad_norm(&m);
        if (coef) CHECK(norm > 1e-4, "k=1 with the load-balancing loss: router gradient %g", norm);
        else CHECK(norm == 0, "k=1 without the load-balancing loss: router gradient %g, expected exactly 0", norm);
        model_free(&m);
    }
}

// ---- 4. capacity per sequence ------------------------------------------------------------------

static void test_capacity_per_sequence(const GPTConfig *cfg) {
    ModelShape shape = whole_model_shape(cfg);
    int T = 8, want = capacity_of(cfg, T);
    for (int ep = 1; ep <= 4; ep *= 2) {
        shape.repeat_ranks = ep, shape.n_repeats = cfg->moe->n_experts / ep, shape.first_repeat = 0;
        MoEShape s = moe_shape(cfg, &shape);
        CHECK(moe_capacity(&s, T) == want, "capacity with ep=%d: %d, expected %d", ep, moe_capacity(&s, T), want);
    }
    Model whole;
    model_build(&whole, cfg, 3, T);
    objective(&whole);
    Activations one;
    acts_alloc(&one, cfg, 1, T, 0);
    int V = cfg->vocab_size, Vp = cfg->padded_vocab_size, k = cfg->moe->experts_per_token;
    size_t row_bytes = (size_t)T * Vp * sizeof(float);
    float *batch_logits = malloc_or_die(whole.B * row_bytes), *alone_logits = malloc_or_die(row_bytes);
    copy_to_host(batch_logits, whole.acts.logits, whole.B * row_bytes);
    long dropped = 0;
    double aux = 0;
    for (int b = 0; b < whole.B; b++) {
        moe_stats_reset(&one);
        gpt_forward(&one, &whole.w, whole.x + b * T, 1, T);
        copy_to_host(alone_logits, one.logits, row_bytes);
        dropped += moe_stats(&one)->dropped, aux += moe_stats(&one)->aux_sum;
        double worst = 0;
        for (int t = 0; t < T; t++)
            for (int v = 0; v < V; v++)
                worst = fmax(worst, fabs(alone_logits[(size_t)t * Vp + v] - batch_logits[((size_t)b * T + t) * Vp + v]));
        CHECK(worst < 1e-5, "sequence %d alone: logits differ by %g from the batch's", b, worst);
        for (int l = 0; l < cfg->n_layer; l++) {
            if (!moe_of(&whole, l)) continue;
            const MoEBlockActs *alone = moe_acts(&one, l), *in_batch = moe_of(&whole, l);
            int same = 0;
            for (int i = 0; i < T * k; i++)
                same += alone->choice[i] == in_batch->choice[b * T * k + i] &&
                        (alone->slot[i] < 0) == (in_batch->slot[b * T * k + i] < 0);
            CHECK(same == T * k, "sequence %d alone, block %d: %d of %d pairs routed and dropped alike", b, l, same,
                  T * k);
        }
    }
    CHECK(dropped == moe_stats(&whole.acts)->dropped && dropped > 0, "sequences alone drop %ld, the batch %ld", dropped,
          moe_stats(&whole.acts)->dropped);
    CHECK_CLOSE(aux, moe_stats(&whole.acts)->aux_sum, 1e-5, 0, "load-balancing loss of the sequences alone");
    free(batch_logits), free(alone_logits);
    acts_free(&one);
    model_free(&whole);
}

// A micro-batch smaller than the activations were allocated for (fewer, shorter sequences: its
// capacity is its own T's) runs as in activations of its exact size: the same loss, aux and
// gradients.
static void test_smaller_than_allocated(const GPTConfig *cfg) {
    Model m;
    model_build(&m, cfg, 3, 8);
    m.B = 2, m.T = 5;
    double loss = forward_backward(&m), aux = mean_aux(&m), aux_here = 0;
    long dropped = moe_stats(&m.acts)->dropped, dropped_here = 0;
    for (int l = 0; l < cfg->n_layer; l++)  // routed with the capacity of T = 5, not 8
        if (moe_of(&m, l)) dropped_here += check_block_routing(&m, l, "B=2, T=5 in activations for 3 x 8", &aux_here);
    CHECK(dropped_here == dropped, "B=2, T=5 in activations for 3 x 8: dropped %ld, counted %ld", dropped, dropped_here);
    size_t n = m.layout.num_params;
    float *big = malloc_or_die(n * sizeof(float)), *exact = malloc_or_die(n * sizeof(float));
    copy_to_host(big, m.grads, n * sizeof(float));
    acts_free(&m.acts);
    acts_alloc(&m.acts, cfg, m.B, m.T, 0);
    CHECK_CLOSE(forward_backward(&m), loss, 1e-6, 0, "loss in activations of the exact size");
    CHECK_CLOSE(mean_aux(&m), aux, 1e-6, 0, "aux loss in activations of the exact size");
    CHECK(moe_stats(&m.acts)->dropped == dropped && dropped > 0, "dropped %ld in activations of the exact size, %ld",
          moe_stats(&m.acts)->dropped, dropped);
    copy_to_host(exact, m.grads, n * sizeof(float));
    double worst = 0, scale = 0;
    for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs(big[i] - exact[i])), scale = fmax(scale, fabs(exact[i]));
    CHECK(worst <= 1e-6 * scale, "gradients differ by %g (largest %g) from those in activations of the exact size",
          worst, scale);
    free(big), free(exact);
    model_free(&m);
}

// Gradient accumulation: backward adds into the gradients, so two micro-batches run one after the
// other give the sum of their gradients run apart (the MoE blocks' shared scratch carries nothing
// from one micro-batch or block to the next).
static void test_accumulation(const GPTConfig *cfg) {
    Model m;
    model_build(&m, cfg, 4, 7);
    size_t n = m.layout.num_params;
    float *apart = calloc_or_die(n, sizeof(float)), *one = malloc_or_die(n * sizeof(float));
    int *x = m.x, *y = m.y;
    m.B = 2;
    for (int half = 0; half < 2; half++) {  // each half alone, its gradients summed here
        m.x = x + half * m.B * m.T, m.y = y + half * m.B * m.T;
        forward_backward(&m);
        copy_to_host(one, m.grads, n * sizeof(float));
        for (size_t i = 0; i < n; i++) apart[i] += one[i];
    }
    dev_zero(m.grads, n * sizeof(float));
    for (int half = 0; half < 2; half++) {  // the same halves added up by backward itself
        m.x = x + half * m.B * m.T, m.y = y + half * m.B * m.T;
        int count = count_targets(m.y, m.B * m.T);
        moe_set_global_batch(&m.acts, &m.cfg, m.B);
        gpt_forward_backward(&m.acts, &m.w, &m.g, &m.cfg, m.x, m.y, m.B, m.T, 1.0f / count);
    }
    copy_to_host(one, m.grads, n * sizeof(float));
    double worst = 0, scale = 0;
    for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs(one[i] - apart[i])), scale = fmax(scale, fabs(apart[i]));
    CHECK(worst <= 1e-6 * scale, "two accumulated micro-batches: gradients differ by %g (largest %g) from their sum",
          worst, scale);
    m.x = x, m.y = y;
    free(apart), free(one);
    model_free(&m);
}

// ---- 5. the experts a rank holds ------------------------------------------------------------------

// moe_layout_experts (expert parallelism): each rank's share holds every tensor but the other
// ranks' experts, under the same names and with the same initial values as the whole model, and
// the shares of the ranks hold each expert once.
static void test_expert_layouts(const GPTConfig *cfg) {
    ParamLayout whole;
    gpt_layout(&whole, cfg);
    float *init = dev_malloc(whole.num_params * sizeof(float)), *all = malloc_or_die(whole.num_params * sizeof(float));
    gpt_init_range(init, &whole, 0, whole.num_params, 9);
    copy_to_host(all, init, whole.num_params * sizeof(float));
    int E = cfg->moe->n_experts, blocks = gpt_moe_blocks(cfg, 0, cfg->n_layer), per_expert = 4;
    for (int ep = 1; ep <= E; ep *= 2) {
        int expert_tensors = 0;
        for (int r = 0; r < ep; r++) {
            int first = r * E / ep, n = E / ep, elsewhere = 0, outside = 0;
            ParamLayout part;
            moe_layout_experts(&part, cfg, first, n);
            float *dev = dev_malloc(part.num_params * sizeof(float)), *mine = malloc_or_die(part.num_params * sizeof(float));
            gpt_init_range(dev, &part, 0, part.num_params, 9);
            copy_to_host(mine, dev, part.num_params * sizeof(float));
            for (int i = 0; i < part.num_tensors; i++) {
                const TensorInfo *t = &part.tensors[i], *same = layout_tensor(&whole, t->name);
                expert_tensors += t->repeat >= 0;
                outside += t->repeat >= 0 && (t->repeat < first || t->repeat >= first + n);
                if (!same || same->numel != t->numel ||
                    memcmp(mine + t->offset, all + same->offset, t->numel * sizeof(float)) != 0)
                    elsewhere++;
            }
            CHECK(elsewhere == 0 && outside == 0, "ep=%d rank %d: %d tensors differ from the whole model's, %d hold "
                  "another rank's experts", ep, r, elsewhere, outside);
            CHECK(part.num_tensors == whole.num_tensors - blocks * per_expert * (E - n),
                  "ep=%d rank %d: %d tensors, expected %d", ep, r, part.num_tensors,
                  whole.num_tensors - blocks * per_expert * (E - n));
            dev_free(dev), free(mine);
            gpt_layout_free(&part);
        }
        CHECK(expert_tensors == blocks * per_expert * E, "ep=%d: the ranks hold %d expert tensors, expected %d", ep,
              expert_tensors, blocks * per_expert * E);
    }
    dev_free(init), free(all);
    gpt_layout_free(&whole);
}

// What acts_bytes reports for a MoE model (one rank with every expert, or with its share) is what
// acts_alloc_spec allocates on the device.
static void test_activation_bytes(const GPTConfig *cfg) {
    for (int ep = 1; ep <= 2; ep++) {
        ActsSpec spec = whole_model_acts(cfg, 3, 8, false, false);
        spec.shape.repeat_ranks = ep, spec.shape.n_repeats = cfg->moe->n_experts / ep, spec.shape.first_repeat = 0;
        size_t before = dev_bytes_in_use(), reported = acts_bytes(&spec);
        Activations a;
        acts_alloc_spec(&a, &spec);
        CHECK(dev_bytes_in_use() - before == reported && a.bytes == reported,
              "ep=%d: activations take %zu device bytes, acts_bytes says %zu", ep, dev_bytes_in_use() - before, reported);
        acts_free(&a);
    }
}

// ---- the oracle run ------------------------------------------------------------------------------

// the run's routing settings, which config.json carries for the oracle (the checkpoint reader
// leaves them to the run's config)
static void read_routing(const char *dir, GPTConfig *cfg) {
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = read_file_or_die(path, NULL);
    cJSON *root = cJSON_Parse(text);
    const cJSON *cf = cJSON_GetObjectItem(root, "capacity_factor"), *coef = cJSON_GetObjectItem(root, "router_aux_loss_coef");
    if (!cJSON_IsNumber(cf) || !cJSON_IsNumber(coef))
        fatal("%s: expected numbers \"capacity_factor\" and \"router_aux_loss_coef\"", path);
    cfg->moe->capacity_factor = (float)cf->valuedouble;
    cfg->moe->aux_loss_coef = (float)coef->valuedouble;
    cJSON_Delete(root);
    free(text);
}

static void write_array(const char *dir, const char *name, int l, const void *data, size_t bytes) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s_%d.bin", dir, name, l);
    FILE *f = fopen_or_die(path, "wb");
    fwrite(data, 1, bytes, f);
    fclose(f);
}

static int run_oracle(const char *dir) {
    Model m = {0};
    checkpoint_read_config(dir, &m.cfg);
    moe_model(&m.cfg);
    read_routing(dir, &m.cfg);
    int *tokens = read_oracle_tokens(dir, &m.B, &m.T);
    m.x = tokens + 2, m.y = tokens + 2 + m.B * m.T;
    m.blocks = gpt_moe_blocks(&m.cfg, 0, m.cfg.n_layer);
    gpt_layout(&m.layout, &m.cfg);
    size_t P = m.layout.num_params;
    m.params = calloc_or_die(P, sizeof(float)), m.grads = calloc_or_die(P, sizeof(float));
    checkpoint_load_model(dir, &m.layout, m.params);
    weights_point(&m.w, &m.layout, m.params);  // the CPU backend: device pointers are host pointers
    weights_point(&m.g, &m.layout, m.grads);
    acts_alloc(&m.acts, &m.cfg, m.B, m.T, 0);
    double loss = forward_backward(&m), aux = mean_aux(&m);
    long dropped = moe_stats(&m.acts)->dropped;
    char path[1024];
    snprintf(path, sizeof path, "%s/grads", dir);
    checkpoint_save_model(path, &m.layout, m.grads, NULL);
    objective(&m);  // the logits again: backward overwrote them with their gradient
    int N = m.B * m.T, E = m.cfg.moe->n_experts, k = m.cfg.moe->experts_per_token, V = m.cfg.vocab_size;
    snprintf(path, sizeof path, "%s/logits.bin", dir);
    FILE *f = fopen_or_die(path, "wb");
    for (int n = 0; n < N; n++) fwrite(m.acts.logits + (size_t)n * m.cfg.padded_vocab_size, sizeof(float), (size_t)V, f);
    fclose(f);
    for (int l = 0; l < m.cfg.n_layer; l++) {
        const MoEBlockActs *a = moe_of(&m, l);
        if (!a) continue;
        write_array(dir, "probs", l, a->probs, (size_t)N * E * sizeof(float));
        write_array(dir, "choice", l, a->choice, (size_t)N * k * sizeof(int));
        write_array(dir, "slot", l, a->slot, (size_t)N * k * sizeof(int));
    }
    char json[256];
    snprintf(json, sizeof json, "{\"loss\": %.9g, \"aux\": %.9g, \"dropped\": %ld}", loss, aux, dropped);
    write_text_file(dir, "result.json", json);
    acts_free(&m.acts);
    weights_free(&m.w), weights_free(&m.g);
    gpt_layout_free(&m.layout);
    free(tokens), free(m.params), free(m.grads);
    return 0;
}

int main(int argc, char **argv) {
    ops_init();
    if (argc == 3 && strcmp(argv[1], "--oracle") == 0) return run_oracle(argv[2]);
    // (layers, moe_every, k, capacity_factor) with E = 4 and aux_loss_coef 0.5: with T = 7 and 8,
    // factor 1 gives 2 rows per expert for k = 1 and 4 for k = 2, which the routed tokens overflow;
    // k = E sends every token to every expert, half of whose rows fit
    static const struct {
        int L, every, k;
        float factor;
        const char *what;
    } cases[] = {
        {2, 1, 2, 1.0f, "every block, k=2, dropping"},
        {2, 1, 1, 1.0f, "every block, k=1, dropping"},
        {2, 2, 2, 0.0f, "every second block, k=2, no capacity"},
        {3, 2, 1, 0.0f, "every second block, k=1, no capacity"},
        {2, 1, 4, 0.5f, "every block, k=E=4, dropping half"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        GPTConfig cfg = moe_config(cases[i].L, cases[i].every, 4, cases[i].k, cases[i].factor, 0.5f);
        test_finite_differences(&cfg, cases[i].what);
        test_routing(&cfg, cases[i].what, cases[i].factor > 0);
    }
    test_top1_router_gradient();
    GPTConfig dropping = moe_config(2, 1, 4, 2, 1.0f, 0.5f);
    test_capacity_per_sequence(&dropping);
    test_smaller_than_allocated(&dropping);
    test_accumulation(&dropping);
    GPTConfig every_second = moe_config(3, 2, 4, 2, 1.0f, 0.5f);
    test_expert_layouts(&every_second);
    test_activation_bytes(&every_second);
    return test_summary("test_moe");
}
