// test_lora.c: LoRA's own parts (common/run/lora.h), and our side of tests/test_lora_oracle.sh's peft oracle.
//
// Without arguments: the adapters a Llama's lora_targets describe sit in the right rows of the
// fused projections (q, k, v in qkv; gate and up in fc) with PEFT's shapes; a target naming no
// linear is refused by name (a child process); and the adapted model's logits equal those of the base with lora_merge's W + scale B A, on random
// adapters (B non-zero).
//
// `test_lora --oracle DIR`: DIR holds ckpt/ (a Hugging Face checkpoint), adapter/ (a PEFT adapter
// for it) and tokens.bin (int32 B, T, then B*T inputs and B*T targets). Writes
//   DIR/logits.bin          the adapted model's logits (B*T rows of vocab_size floats)
//   DIR/grads/              the adapters' gradients of one step's mean loss, as an adapter (PEFT's names)
//   DIR/stepped/            the adapters after one AdamW step (ORACLE_* of tests/oracle_step.h), our files
//   DIR/stepped_logits.bin  the adapted model's logits after that step
//   DIR/base_after/         the base's weights after the step (they must not have moved)
// `test_lora --oracle-dropout DIR P`: the same DIR, one training step's adapter gradients with
// lora_dropout P (step 0, the tokens as sequences 0.. of the batch) in DIR/grads/, and each
// adapter's mask, B*T rows of its input width (0 or 1 / (1 - P)), in DIR/mask.<module>.bin
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/device.h"
#include "base/numbers.h"
#include "check.h"
#include "ops/ops.h"
#include "oracle_step.h"
#include "run/lora.h"

static GPTConfig tiny_llama(void) {
    return (GPTConfig){.arch = &ARCH_LLAMA, .max_seq_len = 16, .vocab_size = 50, .padded_vocab_size = 128,
                       .n_layer = 2, .n_head = 4, .n_embd = 32, .n_kv_head = 2, .ffn_dim = 40,
                       .rope_theta = 10000.0f, .norm_eps = 1e-5f};
}

static const LoraSite *site_named(const Lora *lo, const char *module) {
    char name[80];
    snprintf(name, sizeof name, "%s.lora_A.weight", module);
    for (int i = 0; i < lo->n_sites; i++)
        if (strcmp(lo->trained.layout.tensors[lo->sites[i].a].name, name) == 0) return &lo->sites[i];
    return NULL;
}

static void test_sites(void) {
    GPTConfig cfg = tiny_llama();
    ParamLayout l;
    gpt_layout(&l, &cfg);
    Lora lo;
    lora_describe(&lo, &l, 4, 8, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "test");
    CHECK(lo.n_sites == 14 && lo.trained.layout.num_tensors == 28, "7 linears x 2 blocks: %d sites", lo.n_sites);
    struct { const char *module; LinearKind kind; int row0, rows, in, part; } want[] = {
        {"model.layers.1.self_attn.q_proj", LIN_QKV, 0, 32, 32, 0},
        {"model.layers.1.self_attn.k_proj", LIN_QKV, 32, 16, 32, 1},
        {"model.layers.1.self_attn.v_proj", LIN_QKV, 48, 16, 32, 2},
        {"model.layers.1.self_attn.o_proj", LIN_ATTN_PROJ, 0, 32, 32, 0},
        {"model.layers.1.mlp.gate_proj", LIN_FC, 0, 40, 32, 0},
        {"model.layers.1.mlp.up_proj", LIN_FC, 40, 40, 32, 1},
        {"model.layers.1.mlp.down_proj", LIN_FC_PROJ, 0, 32, 40, 0},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const LoraSite *s = site_named(&lo, want[i].module);
        CHECK(s && s->kind == want[i].kind && s->row0 == want[i].row0 && s->rows == want[i].rows &&
                  s->in_dim == want[i].in && s->layer == 1 && s->part == want[i].part && s->col0 == 0,
              "%s: kind, rows [row0, row0 + rows) of the fused output, input width, part", want[i].module);
        if (!s) continue;
        const TensorInfo *a = &lo.trained.layout.tensors[s->a], *b = &lo.trained.layout.tensors[s->b];
        CHECK(a->shape[0] == 4 && a->shape[1] == want[i].in && b->shape[0] == want[i].rows && b->shape[1] == 4,
              "%s: A (r, in) and B (out, r), PEFT's shapes", want[i].module);
    }
    lora_free(&lo);
    lora_describe(&lo, &l, 2, 2, "", "test");
    CHECK(lo.n_sites == 4 && site_named(&lo, "model.layers.0.self_attn.v_proj") &&
              !site_named(&lo, "model.layers.0.self_attn.k_proj"),
          "empty lora_targets: PEFT's default for Llama, q_proj and v_proj (%d sites)", lo.n_sites);
    lora_free(&lo);
    // a target naming no linear: refused by name, in a child (fatal exits)
    int pipefd[2];
    if (pipe(pipefd) != 0) return;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pipefd[1], 2);
        lora_describe(&lo, &l, 2, 2, "q_proj,c_attn", "command line");
        _exit(0);
    }
    close(pipefd[1]);
    char msg[1024] = {0};
    size_t used = 0;
    for (ssize_t got; used < sizeof msg - 1 && (got = read(pipefd[0], msg + used, sizeof msg - 1 - used)) > 0;)
        used += (size_t)got;  // fatal() may write its message in pieces: read to the end
    close(pipefd[0]);
    int status;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) != 0 && strstr(msg, "lora_targets") && strstr(msg, "\"c_attn\"") &&
              strstr(msg, "gate_proj"),
          "lora_targets c_attn on a Llama is refused naming it and the linears there are: %s", msg);
    gpt_layout_free(&l);
}

// PEFT's start: every lora_A drawn as torch's kaiming_uniform_(a=sqrt(5)), U(-1/sqrt(in), 1/sqrt(in)),
// every lora_B zero, so that the adapted model starts as the base and B's gradient moves first.
// Each A within its bound; their spread, pooled over the adapters in units of each one's bound,
// that of U(-1, 1) (standard deviation 1/sqrt(3)) within 10%.
static void test_init_as_peft(void) {
    GPTConfig cfg = tiny_llama();
    ParamLayout l;
    gpt_layout(&l, &cfg);
    Lora lo;
    lora_describe(&lo, &l, 3, 7, "q_proj,v_proj,o_proj,down_proj", "test");
    float *adapters = malloc_or_die(lo.trained.layout.num_params * sizeof(float));
    lora_init(&lo, adapters, 3);
    double sum2 = 0;
    size_t count = 0;
    for (int i = 0; i < lo.n_sites; i++) {
        const TensorInfo *a = &lo.trained.layout.tensors[lo.sites[i].a], *b = &lo.trained.layout.tensors[lo.sites[i].b];
        double bound = 1.0 / sqrt((double)a->shape[1]), largest = 0;
        size_t nonzero_b = 0;
        for (size_t j = 0; j < a->numel; j++) {
            double x = adapters[a->offset + j] / bound;
            sum2 += x * x, count++;
            largest = fmax(largest, fabs(x));
        }
        for (size_t j = 0; j < b->numel; j++) nonzero_b += adapters[b->offset + j] != 0.0f;
        CHECK(largest <= 1 && nonzero_b == 0, "%s: A within its bound 1/sqrt(in) %.3g (largest %.3g of it), B zero "
              "(%zu elements not)", a->name, bound, largest, nonzero_b);
    }
    double sd = sqrt(sum2 / (double)count), want = 1 / sqrt(3.0);
    CHECK(fabs(sd - want) < 0.1 * want, "A's %zu elements spread as U(-bound, bound): standard deviation %.3g of the "
          "bound, want %.3g", count, sd, want);
    lora_free(&lo);
    gpt_layout_free(&l);
    free(adapters);
}

// the tiny Llama's layout and random weights, and adapters of rank r and lora_alpha alpha on
// `targets`: lora_init's A and a non-zero B (lora_init's zero B would hide every adapter's effect)
static float *adapted_tiny_llama(ParamLayout *l, float **params, Lora *lo, const char *targets, int r, double alpha) {
    GPTConfig cfg = tiny_llama();
    gpt_layout(l, &cfg);
    *params = malloc_or_die(l->num_params * sizeof(float));
    gpt_init_range(*params, l, 0, l->num_params, 7);
    lora_describe(lo, l, r, alpha, targets, "test");
    float *adapters = malloc_or_die(lo->trained.layout.num_params * sizeof(float));
    lora_init(lo, adapters, 3);
    for (size_t i = 0; i < lo->trained.layout.num_params; i++)
        if (adapters[i] == 0) adapters[i] = 0.05f * (float)((i * 7919) % 13) - 0.3f;
    return adapters;
}

// every pointer of a block's weights NULL: what the frozen base's gradients name
static bool names_nothing(const Weights *g) {
    static const BlockWeights none;
    bool empty = !g->wte && !g->wpe && !g->lnf.w && !g->lnf.b && !g->head.w && !g->head.b;
    for (int i = 0; i < g->n_layer; i++) empty = empty && memcmp(&g->h[i], &none, sizeof none) == 0;
    return empty;
}

// trainable_take_base: the loop's layout and buffers become the trained set's, the base keeps its
// parameters (which forward reads through mb.w) and nothing else: no gradient is named
static void test_take_base(void) {
    ParamLayout l;
    float *params;
    Lora lo;
    float *adapters = adapted_tiny_llama(&l, &params, &lo, "q_proj,down_proj", 3, 6);
    GPTConfig cfg = l.cfg;
    size_t base_n = l.num_params;
    ModelBuffers mb;
    model_buffers_alloc(&mb, &l, false);
    copy_to_device(mb.params, params, base_n * sizeof(float));
    float *base = mb.params, *wte = mb.w.wte;
    Activations a;
    acts_alloc(&a, &cfg, 2, 8, 0);
    lora_plug(&lo, adapters, mb.params, &a);
    trainable_take_base(&lo.trained, &l, &mb);
    const Trainable *t = &lo.trained;
    CHECK(l.num_params == t->layout.num_params && l.tensors == t->layout.tensors && mb.n == t->layout.num_params &&
          mb.bytes == t->bytes && mb.params == t->params && mb.grads == t->grads && mb.adam_m == t->m &&
          mb.adam_v == t->v, "after trainable_take_base the loop's layout and buffers are not the trained set's");
    CHECK(t->base_params == base && t->base_layout.num_params == base_n && t->base_bytes == base_n * sizeof(float) &&
          mb.w.wte == wte, "the frozen base's parameters moved (forward reads them through mb.w)");
    CHECK(mb.g.n_layer == cfg.n_layer && names_nothing(&mb.g), "mb.g still names a gradient of the frozen base");
    MemoryItem items[MODEL_MEMORY_ITEMS] = {{"p", 0}, {"p16", 0}, {"g", 0}, {"m", 0}, {"a", 0}};
    trainable_add_memory(t, items);
    CHECK(items[0].bytes == base_n * sizeof(float) && items[1].bytes == 0 && items[4].bytes == t->acts_bytes,
          "trainable_add_memory: %zu bytes of the base, %zu of activations", items[0].bytes, items[4].bytes);
    acts_free(&a);
    model_buffers_free(&mb);
    gpt_layout_free(&l);
    lora_free(&lo);
    free(adapters);
    free(params);
}

// the adapted model's logits against the merged base's, on random adapters
static void test_merge_equals_adapted(void) {
    ParamLayout l;
    float *params;
    Lora lo;
    float *adapters = adapted_tiny_llama(&l, &params, &lo, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", 4, 8);
    GPTConfig cfg = l.cfg;
    int B = 2, T = 8, N = B * T, tokens[16];
    for (int i = 0; i < N; i++) tokens[i] = (i * 17 + 3) % cfg.vocab_size;
    Weights w;
    weights_point(&w, &l, params);
    Activations a;
    acts_alloc(&a, &cfg, B, T, 0);
    lora_plug(&lo, adapters, params, &a);
    gpt_forward(&a, &w, tokens, B, T);
    float *adapted = malloc_or_die((size_t)N * cfg.padded_vocab_size * sizeof(float));
    memcpy(adapted, a.logits, (size_t)N * cfg.padded_vocab_size * sizeof(float));
    acts_free(&a);
    lora_merge(&lo, adapters, params);
    acts_alloc(&a, &cfg, B, T, 0);
    gpt_forward(&a, &w, tokens, B, T);
    double worst = 0, largest = 0;
    for (int n = 0; n < N; n++)
        for (int v = 0; v < cfg.vocab_size; v++) {
            size_t i = (size_t)n * cfg.padded_vocab_size + v;
            worst = fmax(worst, fabs(adapted[i] - a.logits[i]));
            largest = fmax(largest, fabs(a.logits[i]));
        }
    CHECK(worst <= 1e-5 * largest + 1e-6, "adapted logits equal the merged model's (max |diff| %.3g of %.3g)", worst,
          largest);
    acts_free(&a);
    lora_free(&lo);
    weights_free(&w);
    gpt_layout_free(&l);
    free(params), free(adapters), free(adapted);
}

// ---- dropout ---------------------------------------------------------------------------------------

// the mask's factor of element (sequence, position, column), as ops.h's DropoutMask defines it,
// computed here from the hash alone: 0 or 1 / (1 - p)
static double mask_factor(uint64_t seed, uint64_t stream, float p, int seq, int pos, int col) {
    uint64_t h = rng_hash(seed, stream, (uint64_t)seq << 40 | (uint64_t)pos << 20 | (uint64_t)col);
    return (double)(h >> 40) / 16777216.0 < p ? 0.0 : 1.0 / (1.0 - p);
}

// dropout_apply on ones: the factors, their rate, and the same global mask for every cut of the
// rows and columns (a slice of sequences, a column shard, context parallelism's two chunks)
static void test_dropout_mask(void) {
    const float p = 0.3f;
    int N = 512, W = 1024;
    float *ones = malloc_or_die((size_t)N * W * sizeof(float)), *out = malloc_or_die((size_t)N * W * sizeof(float));
    for (size_t i = 0; i < (size_t)N * W; i++) ones[i] = 1.0f;
    DropoutMask m = {.seed = 5, .stream = 9, .p = p, .first_seq = 0, .T = 64, .n_chunks = 1};
    dropout_apply(out, ones, N, W, &m, 0);
    size_t dropped = 0, wrong = 0;
    for (size_t i = 0; i < (size_t)N * W; i++) {
        dropped += out[i] == 0.0f;
        wrong += out[i] != 0.0f && out[i] != 1.0f / (1.0f - p);
    }
    double rate = (double)dropped / ((double)N * W), sigma = sqrt(p * (1 - p) / ((double)N * W));
    CHECK(fabs(rate - p) < 5 * sigma, "dropped %.5f of the elements, want %.2f within 5 sigma (%.5f)", rate, p, sigma);
    CHECK(wrong == 0, "%zu kept elements are not 1 / (1 - p)", wrong);
    float *twice = malloc_or_die((size_t)N * W * sizeof(float));
    memcpy(twice, out, (size_t)N * W * sizeof(float));
    dropout_apply(twice, ones, N, W, &m, 1);
    size_t not_doubled = 0;
    for (size_t i = 0; i < (size_t)N * W; i++) not_doubled += twice[i] != 2 * out[i];
    CHECK(not_doubled == 0, "add: out += mask(inp), %zu elements not twice the mask", not_doubled);
    free(twice);

    // the whole: 4 sequences of 8 tokens, 40 columns, from sequence 3 of the batch
    int S = 4, T = 8, C = 40;
    m = (DropoutMask){.seed = 5, .stream = 9, .p = 0.5f, .first_seq = 3, .T = T, .n_chunks = 1};
    float whole[4 * 8 * 40], part[4 * 8 * 40];
    dropout_apply(whole, ones, S * T, C, &m, 0);
    size_t off = 0;
    for (int s = 0; s < S; s++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++)
                off += whole[(s * T + t) * C + c] != (float)mask_factor(5, 9, 0.5f, 3 + s, t, c);
    CHECK(off == 0, "%zu elements differ from the hash of (sequence << 40 | position << 20 | column)", off);
    // sequences 2 and 3 of the whole, as a data-parallel rank holds them
    DropoutMask slice = m;
    slice.first_seq = 5;
    dropout_apply(part, ones, 2 * T, C, &slice, 0);
    CHECK(memcmp(part, whole + 2 * T * C, (size_t)2 * T * C * sizeof(float)) == 0, "a slice of sequences: the whole's rows");
    // columns 24.. of the whole, as a row-parallel linear's rank holds them
    DropoutMask shard = m;
    shard.col0 = 24;
    dropout_apply(part, ones, S * T, C - 24, &shard, 0);
    off = 0;
    for (int n = 0; n < S * T; n++)
        for (int c = 24; c < C; c++) off += part[n * (C - 24) + c - 24] != whole[n * C + c];
    CHECK(off == 0, "a column shard (col0 24): %zu elements differ from the whole's columns", off);
    // context parallelism: chunk 1 (positions 4..7) of every sequence first, then chunk 0
    DropoutMask chunks = m;
    chunks.T = 4, chunks.n_chunks = 2, chunks.pos0[0] = 4, chunks.pos0[1] = 0;
    dropout_apply(part, ones, S * T, C, &chunks, 0);
    off = 0;
    for (int g = 0; g < 2; g++)
        for (int s = 0; s < S; s++)
            for (int t = 0; t < 4; t++)
                for (int c = 0; c < C; c++)
                    off += part[((g * S + s) * 4 + t) * C + c] != whole[(s * T + chunks.pos0[g] + t) * C + c];
    CHECK(off == 0, "two chunks of every sequence: %zu elements differ from the whole's", off);
    free(ones), free(out);
}

static double max_abs(const double *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

// the largest |got - want| over the largest |want| (0 when both are zero)
static double gap(const float *got, const double *want, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs(got[i] - want[i]));
    double m = max_abs(want, n);
    return m > 0 ? worst / m : worst;
}

// The adapted qkv projection (q and v adapted, each with its own mask) in training with dropout:
// its output, input gradient and the adapters' gradients against a double-precision reference
// with the masks written out; after lora_training_done, the output without dropout. Rank 3 and
// alpha 7: PEFT's scale alpha / r is 7/3, which a scale rounded to an integer (2) misses.
static void test_dropout_adapter(void) {
    enum { R = 3 };  // the adapters' rank
    ParamLayout l;
    float *params;
    Lora lo;
    const double scale = 7.0 / R;
    float *adapters = adapted_tiny_llama(&l, &params, &lo, "q_proj,v_proj", R, 7);
    GPTConfig cfg = l.cfg;
    lo.dropout = 0.25f, lo.seed = 11;
    int B = 2, T = 8, N = B * T, C = cfg.n_embd;
    Weights w;
    weights_point(&w, &l, params);
    Activations a;
    acts_alloc(&a, &cfg, B, T, 0);
    lora_plug(&lo, adapters, params, &a);
    const Linear *qkv = &w.h[1].qkv;
    int out_dim = 64;  // q 32, k 16, v 16
    float *x = malloc_or_die((size_t)N * C * sizeof(float)), *dout = malloc_or_die((size_t)N * out_dim * sizeof(float));
    for (int i = 0; i < N * C; i++) x[i] = rng_normal(1, 2, (uint64_t)i);
    for (int i = 0; i < N * out_dim; i++) dout[i] = rng_normal(1, 3, (uint64_t)i);
    float *out = calloc_or_die((size_t)N * out_dim, sizeof(float)), *dinp = calloc_or_die((size_t)N * C, sizeof(float));
    long step = 5;
    int first_seq = 6;
    lora_training(&lo, step, first_seq, T);
    lo.ops.linear_forward(&lo.ops, LIN_QKV, out, x, NULL, qkv, N, C, out_dim);
    Linear none = {0};
    lo.ops.linear_backward(&lo.ops, LIN_QKV, dinp, &none, dout, NULL, x, NULL, qkv, N, C, out_dim);

    // the reference: y = x W^T + scale (mask_s(x) A^T) B^T over the sites s of block 1's qkv
    double *want = calloc_or_die((size_t)N * out_dim, sizeof(double)), *dx = calloc_or_die((size_t)N * C, sizeof(double));
    double *dparams = calloc_or_die(lo.trained.layout.num_params, sizeof(double));
    float *grads = malloc_or_die(lo.trained.bytes);
    copy_to_host(grads, lo.trained.grads, lo.trained.bytes);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < out_dim; o++)
            for (int c = 0; c < C; c++) {
                want[n * out_dim + o] += (double)x[n * C + c] * qkv->w[o * C + c];
                dx[n * C + c] += (double)dout[n * out_dim + o] * qkv->w[o * C + c];
            }
    double *xd = malloc_or_die((size_t)N * C * sizeof(double)), h[16 * R], dh[16 * R];
    int sites = 0;
    for (int i = 0; i < lo.n_sites; i++) {
        const LoraSite *s = &lo.sites[i];
        if (s->layer != 1) continue;
        sites++;
        const float *A = adapters + lo.trained.layout.tensors[s->a].offset, *Bm = adapters + lo.trained.layout.tensors[s->b].offset;
        double *dA = dparams + lo.trained.layout.tensors[s->a].offset, *dB = dparams + lo.trained.layout.tensors[s->b].offset;
        uint64_t stream = 1ULL << 62 | (uint64_t)step << 15 | 1u << 5 | (uint64_t)LIN_QKV << 2 | (uint64_t)s->part;
        for (int n = 0; n < N; n++)
            for (int c = 0; c < C; c++)
                xd[n * C + c] = x[n * C + c] * mask_factor(11, stream, 0.25f, first_seq + n / T, n % T, c);
        for (int n = 0; n < N; n++)
            for (int k = 0; k < R; k++) {
                h[n * R + k] = 0, dh[n * R + k] = 0;
                for (int c = 0; c < C; c++) h[n * R + k] += xd[n * C + c] * A[k * C + c];
                for (int j = 0; j < s->rows; j++) dh[n * R + k] += scale * dout[n * out_dim + s->row0 + j] * Bm[j * R + k];
            }
        for (int n = 0; n < N; n++)
            for (int j = 0; j < s->rows; j++)
                for (int k = 0; k < R; k++) {
                    want[n * out_dim + s->row0 + j] += scale * h[n * R + k] * Bm[j * R + k];
                    dB[j * R + k] += scale * dout[n * out_dim + s->row0 + j] * h[n * R + k];
                }
        for (int n = 0; n < N; n++)
            for (int c = 0; c < C; c++) {
                double f = x[n * C + c] ? xd[n * C + c] / x[n * C + c] : 0;  // the mask's factor
                for (int k = 0; k < R; k++) {
                    dx[n * C + c] += f * dh[n * R + k] * A[k * C + c];
                    dA[k * C + c] += dh[n * R + k] * xd[n * C + c];
                }
            }
    }
    CHECK(sites == 2, "block 1 has q's and v's adapters (%d)", sites);
    double e_out = gap(out, want, (size_t)N * out_dim), e_dx = gap(dinp, dx, (size_t)N * C);
    double e_grads = gap(grads, dparams, lo.trained.layout.num_params);
    CHECK(e_out < 1e-5, "with dropout, the output against the masked reference: relative gap %.3g", e_out);
    CHECK(e_dx < 1e-5, "with dropout, the input gradient against the masked reference: relative gap %.3g", e_dx);
    CHECK(e_grads < 1e-5, "with dropout, A's and B's gradients against the masked reference: relative gap %.3g", e_grads);

    // evaluation: no mask, out = x W^T + scale (x A^T) B^T
    lora_training_done(&lo);
    memset(out, 0, (size_t)N * out_dim * sizeof(float));
    lo.ops.linear_forward(&lo.ops, LIN_QKV, out, x, NULL, qkv, N, C, out_dim);
    memset(want, 0, (size_t)N * out_dim * sizeof(double));
    for (int n = 0; n < N; n++)
        for (int o = 0; o < out_dim; o++)
            for (int c = 0; c < C; c++) want[n * out_dim + o] += (double)x[n * C + c] * qkv->w[o * C + c];
    for (int i = 0; i < lo.n_sites; i++) {
        const LoraSite *s = &lo.sites[i];
        if (s->layer != 1) continue;
        const float *A = adapters + lo.trained.layout.tensors[s->a].offset, *Bm = adapters + lo.trained.layout.tensors[s->b].offset;
        for (int n = 0; n < N; n++)
            for (int k = 0; k < R; k++) {
                double hk = 0;
                for (int c = 0; c < C; c++) hk += (double)x[n * C + c] * A[k * C + c];
                for (int j = 0; j < s->rows; j++) want[n * out_dim + s->row0 + j] += scale * hk * Bm[j * R + k];
            }
    }
    e_out = gap(out, want, (size_t)N * out_dim);
    CHECK(e_out < 1e-5, "after lora_training_done, the output has no dropout: relative gap %.3g", e_out);
    acts_free(&a);
    lora_free(&lo);
    weights_free(&w);
    gpt_layout_free(&l);
    free(params), free(adapters), free(x), free(dout), free(out), free(dinp), free(want), free(dx), free(dparams);
    free(grads), free(xd);
}

// ---- the oracle run -------------------------------------------------------------------------------

// what both oracle runs start from: DIR's base and adapter, plugged into activations for its tokens
typedef struct {
    GPTConfig cfg;
    ParamLayout l;
    float *params, *adapters;
    Lora lo;
    int B, T, *tokens;
    Weights w, g;
    Activations a;
} OracleRun;

static void oracle_open(OracleRun *o, const char *dir, float dropout) {
    char path[1024], adapter_dir[1024];
    snprintf(path, sizeof path, "%s/ckpt", dir);
    snprintf(adapter_dir, sizeof adapter_dir, "%s/adapter", dir);
    checkpoint_read_config(path, &o->cfg);
    gpt_layout(&o->l, &o->cfg);
    o->params = calloc_or_die(o->l.num_params, sizeof(float));
    checkpoint_load_model(path, &o->l, o->params);
    int rank;
    double alpha;
    char targets[256];
    lora_read_adapter_config(adapter_dir, &rank, &alpha, targets, sizeof targets);
    lora_describe(&o->lo, &o->l, rank, alpha, targets, adapter_dir);
    o->lo.dropout = dropout, o->lo.seed = 1;
    o->adapters = calloc_or_die(o->lo.trained.layout.num_params, sizeof(float));
    lora_read_adapter(&o->lo, adapter_dir, o->adapters);
    o->tokens = read_oracle_tokens(dir, &o->B, &o->T);
    weights_point(&o->w, &o->l, o->params);
    o->g = (Weights){.n_layer = o->cfg.n_layer, .h = calloc_or_die((size_t)o->cfg.n_layer, sizeof(BlockWeights))};
    acts_alloc(&o->a, &o->cfg, o->B, o->T, 0);
    lora_plug(&o->lo, o->adapters, o->params, &o->a);
}

static void oracle_close(OracleRun *o) {
    acts_free(&o->a);
    lora_free(&o->lo);
    weights_free(&o->w), weights_free(&o->g);
    gpt_layout_free(&o->l);
    free(o->tokens), free(o->params), free(o->adapters);
}

static int run_lora_oracle_dropout(const char *dir, float p) {
    OracleRun o;
    oracle_open(&o, dir, p);
    int N = o.B * o.T;
    const int *x = o.tokens + 2, *y = o.tokens + 2 + N;
    lora_training(&o.lo, 0, 0, o.T);
    gpt_forward_backward(&o.a, &o.w, &o.g, &o.cfg, x, y, o.B, o.T, 1.0f / (float)N);
    float *host = malloc_or_die(o.lo.trained.bytes);
    copy_to_host(host, o.lo.trained.grads, o.lo.trained.bytes);
    char path[1200];
    snprintf(path, sizeof path, "%s/grads", dir);
    lora_write_adapter(&o.lo, path, host, "ckpt");
    free(host);
    for (int i = 0; i < o.lo.n_sites; i++) {
        const LoraSite *s = &o.lo.sites[i];
        size_t n = (size_t)N * s->in_dim;
        float *ones = malloc_or_die(n * sizeof(float)), *mask = malloc_or_die(n * sizeof(float));
        for (size_t k = 0; k < n; k++) ones[k] = 1.0f;
        DropoutMask m;
        lora_site_mask(&o.lo, s, &m);
        dropout_apply(mask, ones, N, s->in_dim, &m, 0);
        char module[80];  // <module>.lora_A.weight
        snprintf(module, sizeof module, "%s", o.lo.trained.layout.tensors[s->a].name);
        *strstr(module, ".lora_A.weight") = '\0';
        snprintf(path, sizeof path, "%s/mask.%s.bin", dir, module);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(mask, sizeof(float), n, f) != n || fclose(f) != 0) fatal("cannot write %s", path);
        free(ones), free(mask);
    }
    oracle_close(&o);
    return 0;
}

static int run_lora_oracle(const char *dir) {
    OracleRun o;
    oracle_open(&o, dir, 0);
    Lora *lo = &o.lo;
    const GPTConfig *cfg = &o.cfg;
    int N = o.B * o.T;
    const int *x = o.tokens + 2, *y = o.tokens + 2 + N;
    float *host = calloc_or_die(lo->trained.layout.num_params, sizeof(float));
    char path[1200];
    gpt_forward(&o.a, &o.w, x, o.B, o.T);
    snprintf(path, sizeof path, "%s/logits.bin", dir);
    write_rows(path, o.a.logits, N, cfg->padded_vocab_size, cfg->vocab_size);
    double loss = gpt_forward_backward(&o.a, &o.w, &o.g, cfg, x, y, o.B, o.T, 1.0f / (float)N) / N;
    printf("loss %.9g\n", loss);
    copy_to_host(host, lo->trained.grads, lo->trained.bytes);
    snprintf(path, sizeof path, "%s/grads", dir);
    lora_write_adapter(lo, path, host, "ckpt");
    for (int i = 0; i < lo->trained.layout.num_tensors; i++) {
        const TensorInfo *t = &lo->trained.layout.tensors[i];
        adamw_update(lo->trained.params + t->offset, lo->trained.grads + t->offset, 1.0f, lo->trained.m + t->offset, lo->trained.v + t->offset,
                     t->numel, ORACLE_LR, ORACLE_BETA1, ORACLE_BETA2, ORACLE_EPS, ORACLE_WD, 1);
    }
    copy_to_host(host, lo->trained.params, lo->trained.bytes);
    snprintf(path, sizeof path, "%s/stepped", dir);
    lora_write_adapter(lo, path, host, "ckpt");
    gpt_forward(&o.a, &o.w, x, o.B, o.T);
    snprintf(path, sizeof path, "%s/stepped_logits.bin", dir);
    write_rows(path, o.a.logits, N, cfg->padded_vocab_size, cfg->vocab_size);
    snprintf(path, sizeof path, "%s/base_after", dir);
    checkpoint_save_model(path, &o.l, o.params, NULL);
    free(host);
    oracle_close(&o);
    return 0;
}

int main(int argc, char **argv) {
    ops_init();
    if (argc == 3 && strcmp(argv[1], "--oracle") == 0) return run_lora_oracle(argv[2]);
    if (argc == 4 && strcmp(argv[1], "--oracle-dropout") == 0) return run_lora_oracle_dropout(argv[2], (float)atof(argv[3]));
    test_sites();
    test_init_as_peft();
    test_merge_equals_adapted();
    test_take_base();
    test_dropout_mask();
    test_dropout_adapter();
    return test_summary("test_lora");
}
