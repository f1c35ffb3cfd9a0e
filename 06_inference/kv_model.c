// kv_model.c: the GPT-2 forward pass with a KV cache (see kv_model.h), over the ops.h interface
// and stage 05's tensor-parallel pieces. The block is tp_model.c's block_forward with one change:
// attention reads keys and values from the cache (after writing the new rows' into it) instead of
// from this pass's qkv alone.
#include "kv_model.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

static float *alloc_floats(KVModel *m, size_t n) {
    m->bytes += n * sizeof(float);
    return dev_malloc(n * sizeof(float));
}

static void alloc_caches(KVModel *m) {
    size_t L = (size_t)m->cfg.n_layer, per_layer = (size_t)m->B * m->maxT * m->tp.Cx;
    m->k_cache = calloc_or_die(L, sizeof(float *));
    m->v_cache = calloc_or_die(L, sizeof(float *));
    for (size_t l = 0; l < L; l++) {
        m->k_cache[l] = alloc_floats(m, per_layer);
        m->v_cache[l] = alloc_floats(m, per_layer);
    }
}

static void alloc_scratch(KVModel *m, bool bf16_mode) {
    const TPModel *tp = &m->tp;
    size_t N = (size_t)m->B * m->T, B = (size_t)m->B, Cy = tp->Cy, Cx = tp->Cx, C4x = tp->C4x;
    m->x = alloc_floats(m, N * Cy);
    m->ln = alloc_floats(m, N * Cy);
    m->mean = alloc_floats(m, N);
    m->rstd = alloc_floats(m, N);
    m->stats = alloc_floats(m, N);
    m->qkv = alloc_floats(m, N * 3 * Cx);
    m->atty = alloc_floats(m, N * Cx);
    m->fch = alloc_floats(m, N * C4x);
    m->scores = alloc_floats(m, B * tp->NHx * m->T * m->maxT);
    m->last = alloc_floats(m, B * Cy);
    m->logits = alloc_floats(m, B * m->cfg.padded_vocab_size);
    if (tp->grid.X > 1) {  // with x = 1 the head writes the whole rows into logits directly
        m->shard = alloc_floats(m, B * tp->Vl);
        m->gathered = alloc_floats(m, B * m->cfg.padded_vocab_size);
    }
    if (bf16_mode) {  // the widest matmul input: the MLP projection's (C4x) or the hidden (Cy)
        size_t widest = C4x > Cy ? C4x : Cy;
        m->inp16 = dev_malloc(N * widest * sizeof(bf16));
        m->bytes += N * widest * sizeof(bf16);
    }
    m->tokens = dev_malloc(N * sizeof(int));
    m->start = dev_malloc(B * sizeof(int));
    m->bytes += (N + B) * sizeof(int);
}

void kv_model_alloc(KVModel *m, Comm *world, const GPTConfig *cfg, const int dims[3], int B, int T,
                    int maxT, bool bf16_mode) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->B = B;
    m->T = T;
    m->maxT = maxT;
    tp_model_init(&m->tp, world, cfg, dims, true);
    m->params = dev_malloc(m->tp.layout.num_params * sizeof(float));
    if (bf16_mode) m->params16 = dev_malloc(m->tp.layout.num_params * sizeof(bf16));
    tp_params_point(&m->w, &m->tp, m->params);
    tp_stream_init(&m->stream, &m->tp.grid, m->tp.max_block, false, bf16_mode);
    alloc_caches(m);
    alloc_scratch(m, bf16_mode);
}

void kv_model_load(KVModel *m, const float *full) {
    tp_extract(&m->tp, m->params, full);
    if (m->params16) cast_to_bf16(m->params16, m->params, m->tp.layout.num_params);
}

void kv_model_free(KVModel *m) {
    ops_graph_free(m->graph);
    for (int l = 0; l < m->cfg.n_layer; l++) {
        dev_free(m->k_cache[l]);
        dev_free(m->v_cache[l]);
    }
    free(m->k_cache);
    free(m->v_cache);
    void *bufs[] = {m->params, m->params16, m->x, m->ln, m->mean, m->rstd, m->stats, m->qkv, m->atty,
                    m->fch, m->scores, m->inp16, m->last, m->shard, m->gathered, m->logits,
                    m->tokens, m->start};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dev_free(bufs[i]);
    tp_stream_free(&m->stream);
    tp_params_free(&m->w);
    tp_model_free(&m->tp);
    memset(m, 0, sizeof *m);
}

// ---- the forward pass -------------------------------------------------------------------------

// One block over N = B * T rows of m->x, in place: x += attn(ln1(x)); x += mlp(ln2(x)). Each
// tp_linear_forward ends with its all-reduce (over y for qkv and fc, over x for the projections).
static void block_forward(KVModel *m, int l, int B, int T) {
    const TPModel *tp = &m->tp;
    const TPBlock *w = &m->w.h[l];
    int N = B * T;
    size_t NCy = (size_t)N * tp->Cy;
    tp_layernorm_forward(tp, m->stats, m->ln, m->mean, m->rstd, m->x, w->ln1w, w->ln1b, N);
    tp_linear_forward(&tp->qkv, m->qkv, m->ln, m->inp16, tp_stream_next(&m->stream), w->qkvb, N);
    // this rank's heads' new keys and values join its share of the cache, then its new queries
    // attend to all of it: heads are independent, so no rank needs another's cache
    kv_cache_write(m->k_cache[l], m->v_cache[l], m->qkv, m->start, B, T, tp->Cx, m->maxT);
    attention_cached_forward(m->atty, m->scores, m->qkv, m->k_cache[l], m->v_cache[l], m->start,
                             B, T, tp->Cx, tp->NHx, m->maxT);
    tp_linear_forward(&tp->proj, m->ln, m->atty, m->inp16, tp_stream_next(&m->stream), w->attprojb, N);
    add_inplace(m->x, m->ln, NCy);
    tp_layernorm_forward(tp, m->stats, m->ln, m->mean, m->rstd, m->x, w->ln2w, w->ln2b, N);
    tp_linear_forward(&tp->fc, m->fch, m->ln, m->inp16, tp_stream_next(&m->stream), w->fcb, N);
    gelu_forward(m->fch, m->fch, (size_t)N * tp->C4x);  // element-wise: in place is safe
    tp_linear_forward(&tp->fcproj, m->ln, m->fch, m->inp16, tp_stream_next(&m->stream), w->fcprojb, N);
    add_inplace(m->x, m->ln, NCy);
}

// Each x rank looks up the tokens of its vocabulary shard (0 for the others) and x rank 0 adds
// the positions; the sum over x completes every row (as tp_forward's embedding, at start[b] + t).
static void embed(KVModel *m, int B, int T) {
    const TPModel *tp = &m->tp;
    TPWeight wte = tp_stream_next(&m->stream);
    encoder_forward_at(m->x, m->tokens, m->start, wte.w, tp->grid.x == 0 ? m->w.wpe : NULL, tp->v_lo,
                       tp->Vl, B, T, tp->Cy);
    tp_all_reduce(tp->grid.gx, m->x, (size_t)B * T * tp->Cy);
}

// the final layernorm and the tied lm_head, for B rows of `rows` (B, Cy): the head is a normal
// layer (vocabulary over x), so each x rank computes its shard and an all-gather puts the rows
// together for the sampler
static void head_forward(KVModel *m, const float *rows, int B) {
    const TPModel *tp = &m->tp;
    tp_layernorm_forward(tp, m->stats, m->ln, m->mean, m->rstd, rows, m->w.lnfw, m->w.lnfb, B);
    float *out = tp->grid.X > 1 ? m->shard : m->logits;
    tp_linear_forward(&tp->head, out, m->ln, m->inp16, tp_stream_next(&m->stream), NULL, B);
    if (tp->grid.X > 1) tp_gather_vocab(tp, m->logits, m->gathered, m->shard, B);
}

// everything between the uploaded inputs and the logits: what a CUDA graph can record
static void forward_on_device(KVModel *m, int B, int T, const int *last_row) {
    tp_stream_forward(&m->tp, &m->stream, m->params, m->params16);  // wte, the blocks', wte
    embed(m, B, T);
    for (int l = 0; l < m->cfg.n_layer; l++) block_forward(m, l, B, T);
    if (T == 1) {  // decode: the rows are the sequences' last rows already
        head_forward(m, m->x, B);
        return;
    }
    // prefill: only each sequence's last prompt row predicts a token; the lm_head (the biggest
    // matmul at GPT-2's vocabulary) runs on those B rows, not on all B * T
    size_t Cy = (size_t)m->tp.Cy;
    for (int b = 0; b < B; b++) {
        int row = last_row ? last_row[b] : T - 1;
        dev_copy(m->last + b * Cy, m->x + ((size_t)b * T + row) * Cy, Cy * sizeof(float));
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
    float *params;   // the serial model's (taken over from the caller)
    bf16 *params16;
    Weights w;
    Activations acts;
};

NoCacheModel *nocache_alloc(const KVModel *m, float *full, int B, int T) {
    NoCacheModel *nc = calloc_or_die(1, sizeof *nc);
    const ParamLayout *layout = &m->tp.full;
    nc->params = full;
    weights_point(&nc->w, layout, full);
    if (m->params16) {
        nc->params16 = dev_malloc(layout->num_params * sizeof(bf16));
        cast_to_bf16(nc->params16, full, layout->num_params);
        weights_point_bf16(&nc->w, layout, nc->params16);
    }
    acts_alloc(&nc->acts, &m->cfg, B, T, m->params16 != NULL);
    return nc;
}

void nocache_forward(NoCacheModel *nc, const KVModel *m, const int *tokens, const int *len, int B,
                     int T, float *logits_host) {
    size_t Vp = (size_t)m->cfg.padded_vocab_size;
    gpt_forward(&nc->acts, &nc->w, &m->cfg, tokens, B, T);
    for (int b = 0; b < B; b++)
        copy_to_host(logits_host + b * Vp, nc->acts.logits + ((size_t)b * T + len[b] - 1) * Vp,
                     Vp * sizeof(float));
}

void nocache_free(NoCacheModel *nc) {
    if (!nc) return;
    acts_free(&nc->acts);
    weights_free(&nc->w);
    dev_free(nc->params);
    dev_free(nc->params16);
    free(nc);
}
