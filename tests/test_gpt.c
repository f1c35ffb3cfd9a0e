// test_gpt: the whole model against independent references.
//  1. The PyTorch GPT-2 fixture (../shared/fixtures/reference/tiny_gpt2_*): loss, global and
//     per-tensor gradient norms, and the loss after one AdamW step, to 1e-5 relative.
//  2. Finite differences: for every tensor, the directional derivative of the loss along a random
//     direction equals the analytic gradient's dot product with it (central differences).
//  3. Slice-invariant initialisation: initialising the flat buffer in pieces gives the same bits
//     as initialising it whole (what lets a rank initialise only its shard).
//  4. Layer ranges: the model cut into two ranges (blocks [0, 2) with the embedding, [2, 3) with
//     the head), the activation handed from one to the other, gives the whole model's logits and
//     gradients (what a pipeline stage holds); also with mixture-of-experts blocks on both sides,
//     whose load-balancing loss each range adds to its gradients, and whose stats (dropped pairs,
//     load-balancing loss, rows per expert) add up to the whole model's.
//  5. Activation recomputation: the same loss and gradients, bit for bit, with less memory.
//  6. Written gradients: a step begun with gpt_gradients_begin over a buffer of stale values (the
//     first backward writing, the next ones adding) gives the bits of a step over a zeroed buffer,
//     for GPT-2 (tied head, positions), phi (untied head with a bias, parallel block) and Llama
//     (RMSNorm, grouped-query attention, no biases), f32 and bf16, with 1 and 3 micro-batches.
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "check.h"
#include "inputs.h"
#include "model/activations.h"
#include "model/checkpoint.h"
#include "model/gpt.h"
#include "moe.h"  // 08_mixture_of_experts: the MoE blocks of test_layer_ranges
#include "ops/ops.h"

#define FIXTURES "../shared/fixtures/reference/"
// bf16 against PyTorch running the same recipe: both round the same f32 values to bf16, so
// results differ only where the f32 accumulation order of the two matmul libraries moves a
// value across a bf16 rounding boundary (one bf16 ulp, 0.4%, on rare elements). 1e-4 leaves
// room for a few such flips, and is 5x smaller than bf16's own effect on the gradient norm
// (5e-4 against fp32), so a recipe that skipped a rounding would fail. Per-tensor norms of the
// smallest tensors (LayerNorm parameters, ~3e-4) move by up to 4e-4 relative from one flipped
// value, so they get 1e-3 (still below bf16's own 3e-3 effect on them).
#define BF16_RTOL 1e-4
#define BF16_TENSOR_RTOL 1e-3

typedef struct {
    ParamLayout layout;
    float *params, *grads;
    half16 *params16;  // bf16 mode: the working copy the matmuls read
    Weights w, g;
    Activations acts;
} Model;

static void model_build(Model *m, const GPTConfig *cfg, int B, int T, int bf16) {
    gpt_layout(&m->layout, cfg);
    size_t n = m->layout.num_params;
    m->params = dev_malloc(n * sizeof(float));
    m->grads = dev_malloc(n * sizeof(float));
    m->params16 = bf16 ? dev_malloc(n * sizeof(half16)) : NULL;
    weights_point(&m->w, &m->layout, m->params);
    weights_point(&m->g, &m->layout, m->grads);
    if (bf16) weights_point_16(&m->w, &m->layout, m->params16);
    acts_alloc(&m->acts, cfg, B, T, bf16);
}

static void model_free(Model *m) {
    dev_free(m->params16);
    acts_free(&m->acts);
    weights_free(&m->w);
    weights_free(&m->g);
    dev_free(m->params);
    dev_free(m->grads);
    gpt_layout_free(&m->layout);
}

static int count_targets(const int *targets, int n) {
    int c = 0;
    for (int i = 0; i < n; i++) c += targets[i] >= 0;
    return c;
}

// mean loss and (optionally) gradients of one batch
static double loss_and_grads(Model *m, const GPTConfig *cfg, const int *x, const int *y, int B, int T) {
    int count = count_targets(y, B * T);
    dev_zero(m->grads, m->layout.num_params * sizeof(float));
    return gpt_forward_backward(&m->acts, &m->w, &m->g, cfg, x, y, B, T, 1.0f / count) / count;
}

static double loss_only(Model *m, const GPTConfig *cfg, const int *x, const int *y, int B, int T) {
    gpt_forward(&m->acts, &m->w, x, B, T);
    copy_to_device(m->acts.targets, y, (size_t)B * T * sizeof(int));
    return gpt_loss_forward(&m->acts, cfg, B, T) / count_targets(y, B * T);
}

// ---- 1. the PyTorch fixture --------------------------------------------------------------------

static void read_int_matrix(const cJSON *rows, int *out, int B, int T) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) out[b * T + t] = cJSON_GetArrayItem(cJSON_GetArrayItem(rows, b), t)->valueint;
}

// the fixture names tensors "h.0.attn_proj.weight"; ours are Hugging Face's
static void fixture_name(char *out, size_t size, const char *hf) {
    static const char *map[][2] = {{"attn.c_attn", "c_attn"}, {"attn.c_proj", "attn_proj"},
                                   {"mlp.c_fc", "c_fc"}, {"mlp.c_proj", "mlp_proj"}};
    const char *name = strncmp(hf, "transformer.", 12) == 0 ? hf + 12 : hf;
    snprintf(out, size, "%s", name);
    for (int i = 0; i < 4; i++) {
        char *at = strstr(out, map[i][0]);
        if (!at) continue;
        char rest[64];
        snprintf(rest, sizeof rest, "%s", at + strlen(map[i][0]));
        snprintf(at, size - (size_t)(at - out), "%s%s", map[i][1], rest);
    }
}

static double tensor_norm(const float *flat, const TensorInfo *t) {
    return sqrt(sum_squares(flat + t->offset, t->numel));
}

// Runs the fixture's two sequences through the model and one AdamW step, and compares with the
// values in `expected` (same keys as tiny_gpt2_train_step.json). With bf16, the matmuls follow
// stage 02's recipe on bf16 copies of the weights, made again after the step.
static void test_pytorch_fixture(const char *expected, int bf16, double rtol) {
    char *text = read_file_or_die(FIXTURES "tiny_gpt2_train_step.json", NULL);
    char *exp_text = read_file_or_die(expected, NULL);
    cJSON *ref = cJSON_Parse(text), *want = cJSON_Parse(exp_text);
    if (!ref || !want) fatal("%s or %s is not JSON", FIXTURES "tiny_gpt2_train_step.json", expected);
    const cJSON *c = cJSON_GetObjectItem(ref, "config");
    GPTConfig cfg = {.max_seq_len = cJSON_GetObjectItem(c, "n_positions")->valueint,
                     .vocab_size = cJSON_GetObjectItem(c, "vocab_size")->valueint,
                     .n_layer = cJSON_GetObjectItem(c, "n_layer")->valueint,
                     .n_head = cJSON_GetObjectItem(c, "n_head")->valueint,
                     .n_embd = cJSON_GetObjectItem(c, "n_embd")->valueint};
    cfg.padded_vocab_size = gpt_padded_vocab(cfg.vocab_size);
    const cJSON *xs = cJSON_GetObjectItem(ref, "x"), *ys = cJSON_GetObjectItem(ref, "y");
    int B = cJSON_GetArraySize(xs), T = cJSON_GetArraySize(cJSON_GetArrayItem(xs, 0));
    int *x = malloc_or_die(sizeof(int) * B * T), *y = malloc_or_die(sizeof(int) * B * T);
    read_int_matrix(xs, x, B, T);
    read_int_matrix(ys, y, B, T);

    Model m;
    model_build(&m, &cfg, B, T, bf16);
    size_t n = m.layout.num_params;
    float *host = malloc_or_die(n * sizeof(float));
    checkpoint_load_model(FIXTURES "tiny_gpt2_C8_L2_H2.safetensors", &m.layout, host);
    copy_to_device(m.params, host, n * sizeof(float));
    if (bf16) cast_to_16(m.params16, m.params, n);

    double loss = loss_and_grads(&m, &cfg, x, y, B, T);
    CHECK_CLOSE(loss, cJSON_GetObjectItem(want, "loss_before")->valuedouble, rtol, 0, "loss before");
    double norm = sqrt(sum_squares(m.grads, n));
    CHECK_CLOSE(norm, cJSON_GetObjectItem(want, "grad_global_norm")->valuedouble, rtol, 0, "global gradient norm");
    // and the rounding is real: the bf16 gradient is measurably not the fp32 one
    double fp32_norm = cJSON_GetObjectItem(ref, "grad_global_norm")->valuedouble;
    if (bf16) CHECK(fabs(norm - fp32_norm) > 2e-4 * fp32_norm, "bf16 norm %.9g equals fp32's %.9g", norm, fp32_norm);
    const cJSON *norms = cJSON_GetObjectItem(want, "grad_norms");
    int compared = 0;
    for (int i = 0; i < m.layout.num_tensors; i++) {
        char name[64];
        fixture_name(name, sizeof name, m.layout.tensors[i].name);
        const cJSON *w = cJSON_GetObjectItem(norms, name);
        CHECK(w != NULL, "no reference gradient norm for %s", name);
        if (!w) continue;
        // tiny norms (LayerNorm weights, ~2e-4) are sums of cancelling terms: allow 1e-9 absolute
        CHECK_CLOSE(tensor_norm(m.grads, &m.layout.tensors[i]), w->valuedouble,
                    bf16 ? BF16_TENSOR_RTOL : rtol, 1e-9, name);
        compared++;
    }
    CHECK(compared == cJSON_GetArraySize(norms), "compared %d of %d tensors", compared, cJSON_GetArraySize(norms));

    // one torch.optim.AdamW step; torch decays every parameter, so this test does too
    const cJSON *opt = cJSON_GetObjectItem(ref, "adamw");
    float *mom = dev_malloc(n * sizeof(float)), *var = dev_malloc(n * sizeof(float));
    adamw_update(m.params, m.grads, 1.0f, mom, var, n, (float)cJSON_GetObjectItem(opt, "lr")->valuedouble,
                 (float)cJSON_GetObjectItem(opt, "beta1")->valuedouble,
                 (float)cJSON_GetObjectItem(opt, "beta2")->valuedouble,
                 (float)cJSON_GetObjectItem(opt, "eps")->valuedouble,
                 (float)cJSON_GetObjectItem(opt, "weight_decay")->valuedouble, 1);
    if (bf16) cast_to_16(m.params16, m.params, n);
    CHECK_CLOSE(loss_only(&m, &cfg, x, y, B, T), cJSON_GetObjectItem(want, "loss_after_1_step")->valuedouble,
                rtol, 0, "loss after one AdamW step");
    dev_free(mom);
    dev_free(var);
    model_free(&m);
    free(host);
    free(x);
    free(y);
    cJSON_Delete(ref);
    cJSON_Delete(want);
    free(text);
    free(exp_text);
}

// ---- 2. finite differences ---------------------------------------------------------------------

static void test_finite_differences(void) {
    GPTConfig cfg = {.max_seq_len = 8, .vocab_size = 40, .n_layer = 2, .n_head = 2, .n_embd = 16};
    cfg.padded_vocab_size = gpt_padded_vocab(cfg.vocab_size);
    int B = 2, T = 7;  // T below max_seq_len on purpose
    Model m;
    model_build(&m, &cfg, B, T, 0);
    size_t n = m.layout.num_params;
    gpt_init_range(m.params, &m.layout, 0, n, 7);
    // larger than GPT-2's 0.02 so that every path carries a gradient well above float noise, but
    // not so large that softmax and GELU saturate and central differences lose their accuracy
    float *host = malloc_or_die(n * sizeof(float));
    copy_to_host(host, m.params, n * sizeof(float));
    for (size_t i = 0; i < n; i++) host[i] = host[i] * 3 + (float)(0.1 * (uniform() - 0.5));
    copy_to_device(m.params, host, n * sizeof(float));
    int x[14], y[14];
    for (int i = 0; i < B * T; i++) {
        x[i] = (int)(uniform() * cfg.vocab_size);
        y[i] = (i % 5 == 1) ? -1 : (int)(uniform() * cfg.vocab_size);  // some ignored targets
    }
    loss_and_grads(&m, &cfg, x, y, B, T);
    float *grad = malloc_or_die(n * sizeof(float));
    copy_to_host(grad, m.grads, n * sizeof(float));

    float *dir = malloc_or_die(n * sizeof(float)), *shifted = malloc_or_die(n * sizeof(float));
    for (int i = 0; i < m.layout.num_tensors; i++) {
        const TensorInfo *t = &m.layout.tensors[i];
        // a random direction within this tensor (real vocab rows only for wte)
        size_t live = t->block < 0 && i == 0 ? (size_t)cfg.vocab_size * cfg.n_embd : t->numel;
        double analytic = 0, eps = 1e-3;
        for (size_t j = 0; j < live; j++) {
            dir[j] = (float)(uniform() - 0.5);
            analytic += (double)grad[t->offset + j] * dir[j];
        }
        double side[2];
        for (int s = 0; s < 2; s++) {
            memcpy(shifted, host, n * sizeof(float));
            for (size_t j = 0; j < live; j++) shifted[t->offset + j] += (float)((s ? -eps : eps) * dir[j]);
            copy_to_device(m.params, shifted, n * sizeof(float));
            side[s] = loss_only(&m, &cfg, x, y, B, T);
        }
        double numeric = (side[0] - side[1]) / (2 * eps);
        // float loss noise (~1e-7 relative, / 2 eps) plus the O(eps^2) truncation of central
        // differences; real gradient bugs give errors of 10% and more
        CHECK_CLOSE(analytic, numeric, 2e-2, 2e-4, t->name);
    }
    copy_to_device(m.params, host, n * sizeof(float));
    free(dir);
    free(shifted);
    free(grad);
    free(host);
    model_free(&m);
}

// ---- 3. initialisation -------------------------------------------------------------------------

static void test_init_slices(void) {
    GPTConfig cfg = {.max_seq_len = 16, .vocab_size = 257, .n_layer = 3, .n_head = 2, .n_embd = 32};
    cfg.padded_vocab_size = gpt_padded_vocab(cfg.vocab_size);
    ParamLayout l;
    gpt_layout(&l, &cfg);
    size_t n = l.num_params;
    float *whole = dev_malloc(n * sizeof(float)), *pieces = dev_malloc(n * sizeof(float));
    gpt_init_range(whole, &l, 0, n, 42);
    size_t cut[] = {0, 1000, 1001, n / 3, n / 2 + 7, n};
    for (int i = 0; i + 1 < 6; i++) gpt_init_range(pieces + cut[i], &l, cut[i], cut[i + 1] - cut[i], 42);
    float *a = malloc_or_die(n * sizeof(float)), *b = malloc_or_die(n * sizeof(float));
    copy_to_host(a, whole, n * sizeof(float));
    copy_to_host(b, pieces, n * sizeof(float));
    CHECK(memcmp(a, b, n * sizeof(float)) == 0, "sliced initialisation differs from the whole");
    // GPT-2's scheme: std 0.02 for wte, 0.02/sqrt(2L) for the residual projections, LN weight 1
    const TensorInfo *wte = &l.tensors[0];
    double var = sum_squares(whole + wte->offset, (size_t)cfg.vocab_size * cfg.n_embd) / (cfg.vocab_size * cfg.n_embd);
    CHECK_CLOSE(sqrt(var), 0.02, 0.05, 0, "wte std");
    CHECK(sum_squares(whole + wte->offset + (size_t)cfg.vocab_size * cfg.n_embd,
                      (size_t)(cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd) == 0,
          "padded vocab rows are not zero");
    for (int i = 0; i < l.num_tensors; i++) {
        const TensorInfo *t = &l.tensors[i];
        if (strstr(t->name, "c_proj.weight")) {
            double s = sqrt(sum_squares(whole + t->offset, t->numel) / t->numel);
            CHECK_CLOSE(s, 0.02 / sqrt(2.0 * cfg.n_layer), 0.1, 0, t->name);
        }
        if (strstr(t->name, "ln_1.weight"))
            CHECK(sum_values(whole + t->offset, t->numel) == t->numel, "%s is not all ones", t->name);
    }
    free(a);
    free(b);
    dev_free(whole);
    dev_free(pieces);
    gpt_layout_free(&l);
}

// ---- 4. layer ranges ---------------------------------------------------------------------------

static GPTConfig small_config(void) {
    GPTConfig cfg = {.max_seq_len = 8, .vocab_size = 40, .n_layer = 3, .n_head = 2, .n_embd = 16};
    cfg.padded_vocab_size = gpt_padded_vocab(cfg.vocab_size);
    return cfg;
}

static void random_tokens(int *x, int *y, int n, int vocab) {
    for (int i = 0; i < n; i++) {
        x[i] = (int)(uniform() * vocab);
        y[i] = (i % 5 == 1) ? -1 : (int)(uniform() * vocab);
    }
}

// one range of the model: its layout, parameters, gradients and activations
typedef struct {
    ParamLayout layout;
    float *params, *grads;
    Weights w, g;
    Activations acts;
} Range;

static void range_build(Range *r, const GPTConfig *cfg, int first, int n, bool embed, bool head, int B, int T) {
    gpt_layout_range(&r->layout, cfg, first, n, embed, head);
    size_t count = r->layout.num_params;
    r->params = dev_malloc(count * sizeof(float));
    r->grads = dev_malloc(count * sizeof(float));
    gpt_init_range(r->params, &r->layout, 0, count, 11);
    weights_point(&r->w, &r->layout, r->params);
    weights_point(&r->g, &r->layout, r->grads);
    ActsSpec spec = whole_model_acts(cfg, B, T, false, false);
    spec.first_layer = first, spec.n_layers = n, spec.embed = embed, spec.head = head;
    acts_alloc_spec(&r->acts, &spec);
    moe_set_global_batch(&r->acts, cfg, B);
}

static void range_free(Range *r) {
    acts_free(&r->acts);
    weights_free(&r->w);
    weights_free(&r->g);
    dev_free(r->params);
    dev_free(r->grads);
    gpt_layout_free(&r->layout);
}

// host copy of tensor `name` of a range's flat buffer (NULL when the range does not hold it)
static float *tensor_of(const Range *r, const float *flat, const char *name, size_t *numel) {
    const TensorInfo *t = layout_tensor(&r->layout, name);
    if (!t) return NULL;
    float *host = malloc_or_die(t->numel * sizeof(float));
    copy_to_host(host, flat + t->offset, t->numel * sizeof(float));
    *numel = t->numel;
    return host;
}

// the MoE blocks' stats of two ranges, cut before block `cut`, are the whole model's (a dense
// model has none)
static void check_range_moe_stats(const GPTConfig *cfg, const MoEStats *whole, const MoEStats *first,
                                  const MoEStats *last, int cut) {
    if (!cfg->moe) {
        CHECK(!whole && !first && !last, "a dense model's activations keep MoE stats");
        return;
    }
    CHECK(whole->dropped == first->dropped + last->dropped, "the ranges drop %ld + %ld pairs, the whole model %ld",
          first->dropped, last->dropped, whole->dropped);
    CHECK(whole->aux_sum == first->aux_sum + last->aux_sum, "the ranges' load-balancing losses %.9g + %.9g, the "
          "whole model's %.9g", first->aux_sum, last->aux_sum, whole->aux_sum);
    size_t E = (size_t)cfg->moe->n_experts, before = (size_t)cut * E, after = (size_t)(cfg->n_layer - cut) * E;
    CHECK(memcmp(whole->load, first->load, before * sizeof(long)) == 0 &&
              memcmp(whole->load + before, last->load, after * sizeof(long)) == 0,
          "the rows each expert ran differ between the ranges and the whole model");
}

static void test_layer_ranges(const GPTConfig *config) {
    GPTConfig cfg = *config;
    int B = 2, T = 7, N = B * T, x[14], y[14];
    random_tokens(x, y, N, cfg.vocab_size);
    float dloss = 1.0f / (float)count_targets(y, N);
    Range whole, first, last;
    range_build(&whole, &cfg, 0, 3, true, true, B, T);
    range_build(&first, &cfg, 0, 2, true, false, B, T);
    range_build(&last, &cfg, 2, 1, false, true, B, T);
    CHECK(first.layout.num_params + last.layout.num_params ==
              whole.layout.num_params + (size_t)cfg.padded_vocab_size * cfg.n_embd,
          "the two ranges hold the whole model plus the tied wte twice");

    float *want = malloc_or_die((size_t)N * cfg.padded_vocab_size * sizeof(float));
    float *got = malloc_or_die((size_t)N * cfg.padded_vocab_size * sizeof(float));
    gpt_forward(&whole.acts, &whole.w, x, B, T);
    copy_to_host(want, whole.acts.logits, (size_t)N * cfg.padded_vocab_size * sizeof(float));
    dev_zero(whole.grads, whole.layout.num_params * sizeof(float));
    moe_stats_reset(&whole.acts);
    gpt_forward_backward(&whole.acts, &whole.w, &whole.g, &cfg, x, y, B, T, dloss);
    // the pipeline: first range forward, its output is the last range's input; backward returns
    // the gradient of that activation to the first range
    size_t act_bytes = (size_t)N * cfg.n_embd * sizeof(float);
    dev_zero(first.grads, first.layout.num_params * sizeof(float));
    dev_zero(last.grads, last.layout.num_params * sizeof(float));
    gpt_forward(&first.acts, &first.w, x, B, T);
    dev_copy(last.acts.encoded, head_input(&first.acts), act_bytes);
    gpt_forward(&last.acts, &last.w, NULL, B, T);
    copy_to_host(got, last.acts.logits, (size_t)N * cfg.padded_vocab_size * sizeof(float));
    double logit_err = 0;
    for (size_t j = 0; j < (size_t)N * cfg.padded_vocab_size; j++) logit_err = fmax(logit_err, fabs(want[j] - got[j]));
    CHECK(logit_err == 0, "logits of two ranges differ from the whole model's by up to %g", logit_err);
    check_range_moe_stats(&cfg, moe_stats(&whole.acts), moe_stats(&first.acts), moe_stats(&last.acts), 2);
    copy_to_device(last.acts.targets, y, (size_t)N * sizeof(int));
    gpt_loss_forward_backward(&last.acts, &cfg, B, T, dloss);
    gpt_backward(&last.acts, &last.w, &last.g, B, T, NULL, NULL);
    dev_copy(first.acts.dres, last.acts.dres, act_bytes);
    gpt_backward(&first.acts, &first.w, &first.g, B, T, NULL, NULL);

    // every gradient as the whole model's: bit for bit, but wte's, whose two parts (embedding on
    // the first range, lm_head on the last) are added in another order
    for (int i = 0; i < whole.layout.num_tensors; i++) {
        const TensorInfo *t = &whole.layout.tensors[i];
        size_t n = 0, n1 = 0, n2 = 0;
        float *w = tensor_of(&whole, whole.grads, t->name, &n);
        float *g1 = tensor_of(&first, first.grads, t->name, &n1), *g2 = tensor_of(&last, last.grads, t->name, &n2);
        CHECK(g1 || g2, "no range holds %s", t->name);
        double err = 0, scale = 0;
        for (size_t j = 0; j < n; j++) {
            double sum = (g1 ? g1[j] : 0.0) + (g2 ? g2[j] : 0.0);
            err = fmax(err, fabs(sum - w[j]));
            scale = fmax(scale, fabs(w[j]));
        }
        if (g1 && g2) CHECK(err <= 1e-6 * scale, "%s: the ranges' parts differ by %g (scale %g)", t->name, err, scale);
        else CHECK(err == 0, "%s: the range's gradient differs by %g from the whole model's", t->name, err);
        free(w), free(g1), free(g2);
    }
    free(want), free(got);
    range_free(&whole), range_free(&first), range_free(&last);
}

// ---- 5. activation recomputation ---------------------------------------------------------------

static void test_recompute(int bf16) {
    GPTConfig cfg = small_config();
    int B = 2, T = 7, N = B * T, x[14], y[14];
    random_tokens(x, y, N, cfg.vocab_size);
    float dloss = 1.0f / (float)count_targets(y, N);
    float *grads[2];
    double loss[2];
    size_t bytes[2];
    for (int r = 0; r < 2; r++) {
        Model m;
        model_build(&m, &cfg, B, T, bf16);
        acts_free(&m.acts);
        acts_alloc(&m.acts, &cfg, B, T, (bf16 ? ACTS_16BIT : 0) | (r ? ACTS_RECOMPUTE : 0));
        size_t n = m.layout.num_params;
        gpt_init_range(m.params, &m.layout, 0, n, 5);
        if (bf16) cast_to_16(m.params16, m.params, n);
        dev_zero(m.grads, n * sizeof(float));
        loss[r] = gpt_forward_backward(&m.acts, &m.w, &m.g, &cfg, x, y, B, T, dloss);
        grads[r] = malloc_or_die(n * sizeof(float));
        copy_to_host(grads[r], m.grads, n * sizeof(float));
        bytes[r] = m.acts.bytes;
        if (r) CHECK(memcmp(grads[0], grads[1], n * sizeof(float)) == 0,
                     "recomputed activations give other gradients (bf16 %d)", bf16);
        model_free(&m);
    }
    CHECK(loss[0] == loss[1], "recomputation changed the loss: %.9g vs %.9g", loss[0], loss[1]);
    CHECK(bytes[1] < bytes[0], "recomputation saves no memory: %zu vs %zu bytes", bytes[1], bytes[0]);
    free(grads[0]), free(grads[1]);
}

// ---- 6. written gradients ----------------------------------------------------------------------

// the gradients of `micro` micro-batches (B x T rows each, from x, y) added up, starting from
// zeroed gradients (written 0) or from stale ones through gpt_gradients_begin (written 1)
static float *step_gradients(const GPTConfig *cfg, int bf16, int micro, int written, const int *x, const int *y,
                             int B, int T) {
    Model m;
    model_build(&m, cfg, B, T, bf16);
    size_t n = m.layout.num_params, bytes = n * sizeof(float);
    gpt_init_range(m.params, &m.layout, 0, n, 3);
    if (bf16) cast_to_16(m.params16, m.params, n);
    if (written) {
        fill_constant(m.grads, n, 0.25f);  // a previous step's gradients
        gpt_gradients_begin(&m.acts, &m.g, m.grads, bytes);
        CHECK(m.acts.write_grads, "%s: the serial dense model zeroes its gradients instead of writing them",
              gpt_arch(cfg)->name);
    } else {
        dev_zero(m.grads, bytes);
    }
    int N = B * T, count = count_targets(y, micro * N);
    for (int i = 0; i < micro; i++)
        gpt_forward_backward(&m.acts, &m.w, &m.g, cfg, x + i * N, y + i * N, B, T, 1.0f / (float)count);
    float *g = malloc_or_die(bytes);
    copy_to_host(g, m.grads, bytes);
    model_free(&m);
    return g;
}

static void test_written_gradients(const GPTConfig *cfg) {
    enum { B = 2, T = 7, MICRO = 3 };  // T below max_seq_len: wpe's last rows get no gradient
    int x[MICRO * B * T], y[MICRO * B * T];
    random_tokens(x, y, MICRO * B * T, cfg->vocab_size);
    ParamLayout layout;
    gpt_layout(&layout, cfg);
    size_t bytes = layout.num_params * sizeof(float);
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (int micro = 1; micro <= MICRO; micro += MICRO - 1) {
            float *want = step_gradients(cfg, bf16, micro, 0, x, y, B, T);
            float *got = step_gradients(cfg, bf16, micro, 1, x, y, B, T);
            CHECK(memcmp(want, got, bytes) == 0, "%s bf16 %d, %d micro-batches: gradients begun over stale ones "
                  "differ from those over zeros", gpt_arch(cfg)->name, bf16, micro);
            free(want), free(got);
        }
    gpt_layout_free(&layout);
}

static void test_written_gradients_families(void) {
    GPTConfig gpt2 = small_config(), phi = gpt2, llama = gpt2;
    phi.arch = &ARCH_PHI, phi.rotary_dim = 4, phi.rope_theta = 10000.0f;
    llama.arch = &ARCH_LLAMA, llama.n_head = 4, llama.n_kv_head = 2, llama.ffn_dim = 40;
    llama.rotary_dim = llama.n_embd / llama.n_head, llama.rope_theta = 10000.0f, llama.norm_eps = 1e-5f;
    test_written_gradients(&gpt2);
    test_written_gradients(&phi);
    test_written_gradients(&llama);
}

int main(int argc, char **argv) {
    ops_init();
    // test_bf16_oracle.sh: compare stage 02's recipe with the PyTorch one written to FILE
    if (argc == 3 && strcmp(argv[1], "--bf16-reference") == 0) {
        test_pytorch_fixture(argv[2], 1, BF16_RTOL);
        return test_summary("test_gpt_bf16");
    }
    test_pytorch_fixture(FIXTURES "tiny_gpt2_train_step.json", 0, 1e-5);
    test_finite_differences();
    test_init_slices();
    GPTConfig dense = small_config(), moe = dense;  // moe: every block a mixture of experts, dropping
    moe.moe = moe_config_new(4, 2, 1);
    moe.moe->capacity_factor = 1.0f, moe.moe->aux_loss_coef = 0.5f;
    moe_model(&moe);  // stage 08's MoE MLP (08_mixture_of_experts/moe.c)
    test_layer_ranges(&dense);
    test_layer_ranges(&moe);
    test_recompute(0);
    test_recompute(1);
    test_written_gradients_families();
    return test_summary("test_gpt");
}
