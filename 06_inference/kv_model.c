// kv_model.c: the GPT-2 forward pass with a KV cache (see kv_model.h), over the ops.h interface.
// The block is gpt_block_forward with one change: attention reads keys and values from the
// cache (after writing the new rows' into it) instead of from this pass's qkv alone.
#include "kv_model.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

static float *alloc_floats(KVModel *m, size_t n) {
    m->bytes += n * sizeof(float);
    return dev_malloc(n * sizeof(float));
}

void kv_model_alloc(KVModel *m, const GPTConfig *cfg, int B, int T, int maxT, bool bf16) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->B = B;
    m->T = T;
    m->maxT = maxT;
    gpt_layout(&m->layout, cfg);
    m->params = dev_malloc(m->layout.num_params * sizeof(float));
    weights_point(&m->w, &m->layout, m->params);
    if (bf16) {
        m->params16 = dev_malloc(m->layout.num_params * sizeof(bf16));
        weights_point_bf16(&m->w, &m->layout, m->params16);
    }
    size_t C = (size_t)cfg->n_embd, N = (size_t)B * T, L = (size_t)cfg->n_layer;
    m->k_cache = calloc_or_die(L, sizeof(float *));
    m->v_cache = calloc_or_die(L, sizeof(float *));
    for (size_t l = 0; l < L; l++) {
        m->k_cache[l] = alloc_floats(m, (size_t)B * maxT * C);
        m->v_cache[l] = alloc_floats(m, (size_t)B * maxT * C);
    }
    m->x = alloc_floats(m, N * C);
    m->ln = alloc_floats(m, N * C);
    m->mean = alloc_floats(m, N);
    m->rstd = alloc_floats(m, N);
    m->qkv = alloc_floats(m, N * 3 * C);
    m->atty = alloc_floats(m, N * C);
    m->fch = alloc_floats(m, N * 4 * C);
    m->scores = alloc_floats(m, (size_t)B * cfg->n_head * T * maxT);
    m->last = alloc_floats(m, (size_t)B * C);
    m->logits = alloc_floats(m, (size_t)B * cfg->padded_vocab_size);
    if (bf16) {
        m->inp16 = dev_malloc(N * 4 * C * sizeof(bf16));
        m->bytes += N * 4 * C * sizeof(bf16);
    }
    m->tokens = dev_malloc(N * sizeof(int));
    m->start = dev_malloc((size_t)B * sizeof(int));
    m->bytes += (N + B) * sizeof(int);
}

void kv_model_ready(KVModel *m) {
    if (m->params16) cast_to_bf16(m->params16, m->params, m->layout.num_params);
}

void kv_model_free(KVModel *m) {
    ops_graph_free(m->graph);
    for (int l = 0; l < m->cfg.n_layer; l++) {
        dev_free(m->k_cache[l]);
        dev_free(m->v_cache[l]);
    }
    free(m->k_cache);
    free(m->v_cache);
    void *bufs[] = {m->params, m->params16, m->x, m->ln, m->mean, m->rstd, m->qkv, m->atty, m->fch,
                    m->scores, m->inp16, m->last, m->logits, m->tokens, m->start};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dev_free(bufs[i]);
    weights_free(&m->w);
    gpt_layout_free(&m->layout);
    memset(m, 0, sizeof *m);
}

// ---- the forward pass -------------------------------------------------------------------------

// One block over N = B * T rows of m->x, in place: x += attn(ln1(x)); x += mlp(ln2(x)).
static void block_forward(KVModel *m, int l, int B, int T) {
    const BlockWeights *w = &m->w.h[l];
    int N = B * T, C = m->cfg.n_embd, NH = m->cfg.n_head;
    layernorm_forward(m->ln, m->mean, m->rstd, m->x, w->ln1w, w->ln1b, N, C);
    gpt_linear_forward(m->qkv, m->ln, m->inp16, w->qkvw, w->qkvw16, w->qkvb, N, C, 3 * C);
    // the new rows' keys and values join the cache, then the new queries attend to all of it
    kv_cache_write(m->k_cache[l], m->v_cache[l], m->qkv, m->start, B, T, C, m->maxT);
    attention_cached_forward(m->atty, m->scores, m->qkv, m->k_cache[l], m->v_cache[l], m->start,
                             B, T, C, NH, m->maxT);
    gpt_linear_forward(m->ln, m->atty, m->inp16, w->attprojw, w->attprojw16, w->attprojb, N, C, C);
    add_inplace(m->x, m->ln, (size_t)N * C);
    layernorm_forward(m->ln, m->mean, m->rstd, m->x, w->ln2w, w->ln2b, N, C);
    gpt_linear_forward(m->fch, m->ln, m->inp16, w->fcw, w->fcw16, w->fcb, N, C, 4 * C);
    gelu_forward(m->fch, m->fch, (size_t)N * 4 * C);  // element-wise: in place is safe
    gpt_linear_forward(m->ln, m->fch, m->inp16, w->fcprojw, w->fcprojw16, w->fcprojb, N, 4 * C, C);
    add_inplace(m->x, m->ln, (size_t)N * C);
}

// the final layernorm and the tied lm_head, for B rows of `rows` (B, C)
static void head_forward(KVModel *m, const float *rows, int B) {
    int C = m->cfg.n_embd;
    layernorm_forward(m->ln, m->mean, m->rstd, rows, m->w.lnfw, m->w.lnfb, B, C);
    gpt_linear_forward(m->logits, m->ln, m->inp16, m->w.wte, m->w.wte16, NULL, B, C,
                       m->cfg.padded_vocab_size);
}

// everything between the uploaded inputs and the logits: what a CUDA graph can record
static void forward_on_device(KVModel *m, int B, int T, const int *last_row) {
    encoder_forward_at(m->x, m->tokens, m->start, m->w.wte, m->w.wpe, B, T, m->cfg.n_embd);
    for (int l = 0; l < m->cfg.n_layer; l++) block_forward(m, l, B, T);
    if (T == 1) {  // decode: the rows are the sequences' last rows already
        head_forward(m, m->x, B);
        return;
    }
    // prefill: only each sequence's last prompt row predicts a token; the lm_head (the biggest
    // matmul at GPT-2's vocabulary) runs on those B rows, not on all B * T
    size_t C = (size_t)m->cfg.n_embd;
    for (int b = 0; b < B; b++) {
        int row = last_row ? last_row[b] : T - 1;
        dev_copy(m->last + b * C, m->x + ((size_t)b * T + row) * C, C * sizeof(float));
    }
    head_forward(m, m->last, B);
}

static void upload_inputs(KVModel *m, const int *tokens, const int *start, int B, int T) {
    if (B > m->B || T > m->T) fatal("internal: %d x %d new rows exceed the model's %d x %d", B, T, m->B, m->T);
    for (int b = 0; b < B; b++)
        if (start[b] + T > m->maxT)
            fatal("internal: sequence %d would reach position %d of a %d-position cache", b,
                  start[b] + T, m->maxT);
    copy_to_device(m->tokens, tokens, (size_t)B * T * sizeof(int));
    copy_to_device(m->start, start, (size_t)B * sizeof(int));
}

void kv_forward(KVModel *m, const int *tokens, const int *start, int B, int T, const int *last_row) {
    upload_inputs(m, tokens, start, B, T);
    forward_on_device(m, B, T, last_row);
}

void kv_decode(KVModel *m, const int *tokens, const int *start, int B, bool use_graph) {
    upload_inputs(m, tokens, start, B, 1);
    if (!use_graph) {
        forward_on_device(m, B, 1, NULL);
        return;
    }
    if (m->graph && m->graph_B == B) {
        ops_graph_replay(m->graph);
        return;
    }
    // First step at this batch size: run it for real (cuBLAS picks its kernels, the ops' lazy
    // set-up happens), then record the same step. Replaying a recording computes exactly what
    // this step computed, so the recording is not run now; later steps replay it.
    forward_on_device(m, B, 1, NULL);
    ops_graph_free(m->graph);
    ops_graph_begin();
    forward_on_device(m, B, 1, NULL);
    m->graph = ops_graph_end();
    m->graph_B = B;
}

// ---- without a cache: the training model's own forward ----------------------------------------

struct NoCacheModel {
    Activations acts;
};

NoCacheModel *nocache_alloc(const KVModel *m, int B, int T) {
    NoCacheModel *nc = calloc_or_die(1, sizeof *nc);
    acts_alloc(&nc->acts, &m->cfg, B, T, m->params16 != NULL);
    return nc;
}

void nocache_forward(NoCacheModel *nc, const KVModel *m, const int *tokens, const int *len, int B,
                     int T, float *logits_host) {
    size_t Vp = (size_t)m->cfg.padded_vocab_size;
    gpt_forward(&nc->acts, &m->w, &m->cfg, tokens, B, T);
    for (int b = 0; b < B; b++)
        copy_to_host(logits_host + b * Vp, nc->acts.logits + ((size_t)b * T + len[b] - 1) * Vp,
                     Vp * sizeof(float));
}

void nocache_free(NoCacheModel *nc) {
    if (!nc) return;
    acts_free(&nc->acts);
    free(nc);
}
