// context.c: see context.h.
#include "context.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "model/activations.h"
#include "ops/ops.h"
#include "ring_blocks.h"
#include "run/evaluate.h"
#include "run/run_stats.h"

// ---- the grid ---------------------------------------------------------------------------------

void cp_grid_init(CPGrid *g, Comm *world, const Config *cfg, const GPTConfig *mc) {
    int P = comm_size(world), rank = comm_rank(world), cp = cfg->cp_size;
    if (P % cp != 0)
        fatal("%s: key 'cp_size': expected a divisor of the %d ranks (each sequence split over cp_size of "
              "them), found %d", config_source("cp_size"), P, cp);
    if (cfg->max_seq_len < 2 * cp)
        fatal("%s: keys 'max_seq_len' and 'cp_size': a sequence is cut into 2 x cp_size chunks of at least "
              "one token, so max_seq_len must be at least %d, found %d", config_source("max_seq_len"), 2 * cp,
              cfg->max_seq_len);
    bool ulysses = strcmp(cfg->cp_impl, "ulysses") == 0;
    if (ulysses && mc->n_head % cp != 0)
        fatal("%s: keys 'cp_impl' and 'cp_size': ulysses gives each of the cp_size ranks n_head / cp_size "
              "heads, so n_head %d must divide by cp_size, found %d", config_source("cp_size"), mc->n_head, cp);
    *g = (CPGrid){.cp = cp, .dp = P / cp, .cp_rank = rank % cp, .replica = rank / cp, .ulysses = ulysses,
                  .overlap = cfg->overlap_communication, .world = world};
    g->cp_group = comm_split(world, g->replica, g->cp_rank, "cp");
}

static void print_attention_balance(const CPGrid *g, const ModelShape *s, int c);  // with the attention below

void print_context_plan(const CPGrid *g, const Config *cfg, const ModelShape *s, int c) {
    printf("context parallelism: %d x %d (cp x dp), cp_impl %s; rank %d holds chunks %d and %d of %d of "
           "each sequence%s\n", g->cp, g->dp, cfg->cp_impl, g->cp_rank, g->cp_rank, 2 * g->cp - 1 - g->cp_rank,
           2 * g->cp, g->ulysses ? "" : g->overlap ? "; the next block travels during this one" : "");
    print_attention_balance(g, s, c);
}

// ---- the batch --------------------------------------------------------------------------------

int cp_chunk_len(const CPGrid *g, int T) { return (T + 2 * g->cp - 1) / (2 * g->cp); }

// the global chunk index of this rank's half 0 (early) or 1 (late)
static int chunk_of(const CPGrid *g, int cp_rank, int half) { return half ? 2 * g->cp - 1 - cp_rank : cp_rank; }

int cp_chunk_start(const CPGrid *g, int half, int T) { return chunk_of(g, g->cp_rank, half) * cp_chunk_len(g, T); }

void cp_local_batch(const CPGrid *g, const Batch *full, Batch *local) {
    int c = cp_chunk_len(g, full->T), rows = full->rows;
    size_t n = (size_t)2 * rows * c;
    if (local->capacity < n) {
        batch_free(local);
        local->inputs = malloc(n * sizeof(int));
        local->targets = malloc(n * sizeof(int));
        if (!local->inputs || !local->targets) fatal("out of host memory for a batch of %zu tokens", n);
        local->capacity = n;
    }
    local->rows = 2 * rows, local->T = c;
    local->n_targets_local = full->n_targets_local, local->n_targets_global = full->n_targets_global;
    for (int half = 0; half < 2; half++)
        for (int b = 0; b < rows; b++)
            for (int t = 0; t < c; t++) {
                int pos = chunk_of(g, g->cp_rank, half) * c + t;
                size_t at = ((size_t)half * rows + b) * c + t;
                bool pad = pos >= full->T;  // past the end: a token that nothing sees, without a target
                local->inputs[at] = pad ? 0 : full->inputs[(size_t)b * full->T + pos];
                local->targets[at] = pad ? -1 : full->targets[(size_t)b * full->T + pos];
            }
}

// ---- the embedding at the chunks' positions ----------------------------------------------------

// Each half's rows are chunks at the same position: the position table from that position on is
// an ordinary table for them. A padded last chunk may run past the table's end: its rows then
// take only the positions the table has (the pads' embeddings stay 0, their gradients are 0).
// Every rank holds the whole vocabulary (rows from 0).
static void embed_half(const CPLayers *x, float *out, float *dwpe, const int *tokens, const float *wte,
                       float *wte_grad, const float *wpe, const ModelShape *s, int B, int c, int pos, bool fwd) {
    int C = s->C, valid = x->max_positions - pos < c ? x->max_positions - pos : c;
    const float *wpe_at = wpe ? wpe + (size_t)pos * C : NULL;
    float *dwpe_at = dwpe ? dwpe + (size_t)pos * C : NULL;
    if (valid == c || !wpe) {
        if (fwd) embedding_forward(out, tokens, NULL, wte, wpe_at, 0, s->v_rows, B, c, C);
        else embedding_backward(wte_grad, dwpe_at, out, tokens, 0, s->v_rows, B, c, C);
        return;
    }
    for (int b = 0; b < B; b++) {
        float *o = out + (size_t)b * c * C;
        if (fwd) {
            dev_zero(o, (size_t)c * C * sizeof(float));
            embedding_forward(o, tokens + (size_t)b * c, NULL, wte, wpe_at, 0, s->v_rows, 1, valid, C);
        } else {
            embedding_backward(wte_grad, dwpe_at, o, tokens + (size_t)b * c, 0, s->v_rows, 1, valid, C);
        }
    }
}

void cp_layers_set_positions(CPLayers *x, int B, int T) {
    for (int b = 0; b < B; b++) x->start_host[b] = chunk_of(x->grid, x->grid->cp_rank, b / (B / 2)) * T;
    copy_to_device(x->start, x->start_host, (size_t)B * sizeof(int));
}

static void cp_embed_forward(LayerOps *ops, float *out, const int *tokens, const int *start, const Weights *w,
                             const ModelShape *s, int B, int T) {
    (void)start;
    CPLayers *x = (CPLayers *)ops;
    int half_rows = B / 2;
    cp_layers_set_positions(x, B, T);
    for (int half = 0; half < 2; half++) {
        size_t at = (size_t)half * half_rows * T;
        embed_half(x, out + at * s->C, NULL, tokens + at, w->wte, NULL, w->wpe, s, half_rows, T,
                   chunk_of(x->grid, x->grid->cp_rank, half) * T, true);
    }
}

static void cp_embed_backward(LayerOps *ops, Weights *g, const float *dout, const int *tokens, const ModelShape *s,
                              int B, int T) {
    CPLayers *x = (CPLayers *)ops;
    int half_rows = B / 2;
    for (int half = 0; half < 2; half++) {
        size_t at = (size_t)half * half_rows * T;
        embed_half(x, (float *)dout + at * s->C, g->wpe, tokens + at, NULL, g->wte, g->wpe, s, half_rows, T,
                   chunk_of(x->grid, x->grid->cp_rank, half) * T, false);
    }
}

// ---- ring attention ----------------------------------------------------------------------------

// this rank's chunks as queries, and the block that started on rank `src` as keys and values
static RingBlock ring_block(const CPGrid *g, const ModelShape *s, int B, int T, int src) {
    return (RingBlock){.B = B / 2, .c = T, .C = s->C_attn, .NH = s->n_head,
                       .chunk = {chunk_of(g, g->cp_rank, 0), chunk_of(g, g->cp_rank, 1)},
                       .kv_chunk = {chunk_of(g, src, 0), chunk_of(g, src, 1)}};
}

// Passes `count` floats on to the next rank of the ring and takes the previous rank's. With
// overlap the transfer is started here and finished by ring_pass_finish after the compute;
// without, it runs whole in ring_pass_finish, after the compute.
static CommRequest *ring_pass_start(const CPGrid *g, const float *send, float *recv, size_t count) {
    if (!g->overlap) return NULL;
    int next = (g->cp_rank + 1) % g->cp, prev = (g->cp_rank + g->cp - 1) % g->cp;
    return comm_send_recv_start(g->cp_group, send, count, next, recv, count, prev);
}

static void ring_pass_finish(const CPGrid *g, CommRequest *started, const float *send, float *recv, size_t count) {
    if (started) {
        comm_wait(started);
        return;
    }
    int next = (g->cp_rank + 1) % g->cp, prev = (g->cp_rank + g->cp - 1) % g->cp;
    comm_send_recv(g->cp_group, send, count, next, recv, count, prev);
}

// one span on the trace's compute track: block `layer`'s attention at a step of the ring
static void trace_attention_step(const char *what, int layer, int step, int m0) {
    char name[64];
    snprintf(name, sizeof name, "block %d %s %d", layer, what, step);
    trace_span(name, TRACK_COMPUTE, m0, trace_mark(), NULL);
}

// Forward: cp steps. At step s this rank holds the keys and values that started on rank
// cp_rank - s; it adds them to its queries' online softmax while that block moves on to the next
// rank and the previous rank's arrives. After the last step every query has seen every key
// before it, and out = o / sum; att keeps each (row, head)'s log-sum-exp for backward.
static void ring_attention_forward(LayerOps *ops, int layer, float *out, float *att, const float *qkv,
                                   const ModelShape *s, int B, int T) {
    CPLayers *x = (CPLayers *)ops;
    const CPGrid *g = x->grid;
    int N = B * T, C = s->C_attn, NH = s->n_head;
    size_t count = (size_t)N * 2 * C;
    ring_pack_kv(x->kv[0], qkv, N, C);
    ring_forward_start(x->o, x->run_max, x->run_sum, N, C, NH);
    for (int step = 0, cur = 0; step < g->cp; step++, cur = 1 - cur) {
        bool pass = step < g->cp - 1;
        CommRequest *moving = pass ? ring_pass_start(g, x->kv[cur], x->kv[1 - cur], count) : NULL;
        int m0 = trace_mark();
        RingBlock r = ring_block(g, s, B, T, (g->cp_rank - step + g->cp) % g->cp);
        ring_forward_block(&r, x->o, x->run_max, x->run_sum, x->scratch, qkv, x->kv[cur]);
        trace_attention_step("ring forward", layer, step, m0);
        if (pass) ring_pass_finish(g, moving, x->kv[cur], x->kv[1 - cur], count);
    }
    ring_forward_finish(out, att, x->o, x->run_max, x->run_sum, N, C, NH);
    if (x->kept_out) dev_copy(x->kept_out[layer], out, (size_t)N * C * sizeof(float));
}

// Backward: the blocks go around again, each with its gradient. At step s this rank holds the
// block of rank cp_rank - s and the gradient its keys and values gathered on the ranks before:
// it adds its queries' share (and its own dq), then passes both on. The keys and values can
// travel during the compute; their gradient only after it. After the last step each gradient takes
// one more hop, home, where it is added into dqkv.
static void ring_attention_backward(LayerOps *ops, int layer, float *dqkv, float *datt, const float *dout,
                                    const float *qkv, const float *out, const float *att, const ModelShape *s,
                                    int B, int T) {
    (void)datt;
    CPLayers *x = (CPLayers *)ops;
    const CPGrid *g = x->grid;
    int N = B * T, C = s->C_attn, NH = s->n_head;
    size_t count = (size_t)N * 2 * C;
    ring_pack_kv(x->kv[0], qkv, N, C);
    dev_zero(x->dkv[0], count * sizeof(float));
    ring_backward_delta(x->delta, dout, x->kept_out ? x->kept_out[layer] : out, N, C, NH);
    int cur = 0;
    for (int step = 0; step < g->cp; step++, cur = 1 - cur) {
        bool pass = step < g->cp - 1;
        CommRequest *moving = pass ? ring_pass_start(g, x->kv[cur], x->kv[1 - cur], count) : NULL;
        int m0 = trace_mark();
        RingBlock r = ring_block(g, s, B, T, (g->cp_rank - step + g->cp) % g->cp);
        ring_backward_block(&r, dqkv, x->dkv[cur], x->scratch, qkv, dout, att, x->delta, x->kv[cur]);
        trace_attention_step("ring backward", layer, step, m0);
        if (g->cp > 1) comm_send_recv(g->cp_group, x->dkv[cur], count, (g->cp_rank + 1) % g->cp, x->dkv[1 - cur],
                                      count, (g->cp_rank + g->cp - 1) % g->cp);
        else cur = 1 - cur;  // one rank: the gradient is home already
        if (pass) ring_pass_finish(g, moving, x->kv[cur], x->kv[1 - cur], count);
    }
    ring_add_dkv(dqkv, x->dkv[cur], N, C);
}

// ---- Ulysses: all-to-all between the sequence and the heads -----------------------------------

// After the first all-to-all this rank holds, for its n_head / cp heads, cp blocks of rows: block
// j is rank j's rows (its two chunks of every sequence, in the ring's row layout), q | k | v of
// C / cp columns each. The whole sequences' causal attention is then the ring's block math over
// every (query block i, key block j) pair, without the ring: all the keys are here already.
static RingBlock ulysses_block(const CPGrid *g, const ModelShape *s, int B, int T, int i, int j) {
    return (RingBlock){.B = B / 2, .c = T, .C = s->C_attn / g->cp, .NH = s->n_head / g->cp,
                       .chunk = {chunk_of(g, i, 0), chunk_of(g, i, 1)},
                       .kv_chunk = {chunk_of(g, j, 0), chunk_of(g, j, 1)}};
}

// ---- the work each rank's attention does -------------------------------------------------------

// the query-key scores one block pairing computes: every key a query sees, for every sequence and head
static double block_scores(const RingBlock *r) {
    double n = 0;
    for (int q_half = 0; q_half < 2; q_half++)
        for (int t = 0; t < r->c; t++)
            for (int half = 0; half < 2; half++) n += ring_keys_seen(r, q_half, t, half);
    return n * r->B * r->NH;
}

// the scores this rank computes for one sequence of 2 cp chunks of c tokens: the ring's blocks
// from every rank, or Ulysses' every pairing of its heads
static double rank_attention_scores(const CPGrid *g, const ModelShape *s, int c) {
    double n = 0;
    for (int j = 0; j < g->cp; j++)
        for (int i = 0; i < (g->ulysses ? g->cp : 1); i++) {
            RingBlock r = g->ulysses ? ulysses_block(g, s, 2, c, i, j) : ring_block(g, s, 2, c, j);
            n += block_scores(&r);
        }
    return n;
}

// the most and the fewest scores of any rank, printed and in stats.json (a reduction: every rank
// calls it)
static void print_attention_balance(const CPGrid *g, const ModelShape *s, int c) {
    double mine = rank_attention_scores(g, s, c), most = comm_max_double(g->world, mine);
    double fewest = -comm_max_double(g->world, -mine);
    printf("  attention under the causal mask: %.0f to %.0f query-key scores a rank for a sequence of %d tokens\n",
           fewest, most, 2 * g->cp * c);
    run_stats_number("attention_scores_per_rank_max", most);
    run_stats_number("attention_scores_per_rank_min", fewest);
}

// Ulysses' all-to-all buffers, send and recv (N x 3C floats each), also hold its attention's
// temporaries while no transfer needs them: during the local attention recv is [the heads' dout |
// the online softmax's unnormalised output | the heads' output], N x C floats each; in backward
// send then gathers the heads' dq | dk | dv.
//
// The attention of the heads' hqkv: returns its output (cp N rows, C / cp columns, in recv), lse
// (cp N x n_head / cp) its log-sum-exp per row and head; the online softmax over the key blocks,
// one at a time.
static float *ulysses_local_forward(CPLayers *x, float *lse, const float *hqkv, const ModelShape *s, int B, int T) {
    const CPGrid *g = x->grid;
    int N = B * T, cp = g->cp, C = s->C_attn, Ch = C / cp, NHh = s->n_head / cp;
    float *o = x->recv + (size_t)N * C, *heads_out = x->recv + (size_t)2 * N * C;
    ring_forward_start(o, x->run_max, x->run_sum, cp * N, Ch, NHh);
    for (int j = 0; j < cp; j++) {
        ring_pack_kv(x->kv[0], hqkv + (size_t)j * N * 3 * Ch, N, Ch);
        for (int i = 0; i < cp; i++) {
            RingBlock r = ulysses_block(g, s, B, T, i, j);
            size_t rows = (size_t)i * N;
            ring_forward_block(&r, o + rows * Ch, x->run_max + rows * NHh, x->run_sum + rows * NHh, x->scratch,
                               hqkv + rows * 3 * Ch, x->kv[0]);
        }
    }
    ring_forward_finish(heads_out, lse, o, x->run_max, x->run_sum, cp * N, Ch, NHh);
    return heads_out;
}

// Forward: every rank sends rank j its rows' q, k and v of head group j (C / cp columns of each);
// rank j then holds its heads for every position of its replica's sequences, runs causal
// attention on them keeping one log-sum-exp per row and head (in the block's att), and the second
// all-to-all sends each rank its rows' output of every head. The block keeps qkv for attention's
// backward alone, and Ulysses' backward reads the heads' q, k, v: they replace the rows' in the
// block's buffer (a second copy would cost N x 3C floats a layer).
static void ulysses_attention_forward(LayerOps *ops, int layer, float *out, float *att, const float *qkv,
                                      const ModelShape *s, int B, int T) {
    CPLayers *x = (CPLayers *)ops;
    const CPGrid *g = x->grid;
    int N = B * T, C = s->C_attn, cp = g->cp, Ch = C / cp;
    float *hq = (float *)qkv;
    for (int j = 0; j < cp; j++)
        for (int p = 0; p < 3; p++)
            cp_copy_rows(x->send + (size_t)j * N * 3 * Ch, 3 * Ch, p * Ch, qkv, 3 * C, p * C + j * Ch, N, Ch, false);
    comm_all_to_all(g->cp_group, hq, x->send, (size_t)N * 3 * Ch);
    int m0 = trace_mark();
    float *heads_out = ulysses_local_forward(x, att, hq, s, B, T);
    trace_attention_step("ulysses attention forward", layer, 0, m0);
    comm_all_to_all(g->cp_group, x->send, heads_out, (size_t)N * Ch);
    for (int j = 0; j < cp; j++)
        cp_copy_rows(out, C, j * Ch, x->send + (size_t)j * N * Ch, Ch, 0, N, Ch, false);
}

// Backward: the same two all-to-alls the other way round: the output's gradient to the heads,
// attention's backward there, and the q, k, v gradients back to the rows' ranks. The output in
// the heads' layout, which delta = dout . out needs, is not kept from the forward (N x C floats a
// layer) but recomputed from the kept q, k, v (one more attention forward).
static void ulysses_attention_backward(LayerOps *ops, int layer, float *dqkv, float *datt, const float *dout,
                                       const float *qkv, const float *out, const float *att, const ModelShape *s,
                                       int B, int T) {
    (void)datt, (void)out;
    CPLayers *x = (CPLayers *)ops;
    const CPGrid *g = x->grid;
    int N = B * T, C = s->C_attn, cp = g->cp, Ch = C / cp, NHh = s->n_head / cp;
    const float *hq = qkv;  // the heads' q, k, v, as the forward left them
    float *heads_dout = x->recv, *heads_dqkv = x->send;
    for (int j = 0; j < cp; j++)
        cp_copy_rows(x->send + (size_t)j * N * Ch, Ch, 0, dout, C, j * Ch, N, Ch, false);
    comm_all_to_all(g->cp_group, heads_dout, x->send, (size_t)N * Ch);
    int m0 = trace_mark();
    // (its log-sum-exp, the one att keeps, goes into delta's place, which delta then takes)
    float *heads_out = ulysses_local_forward(x, x->delta, hq, s, B, T);
    ring_backward_delta(x->delta, heads_dout, heads_out, cp * N, Ch, NHh);
    dev_zero(heads_dqkv, (size_t)N * 3 * C * sizeof(float));
    for (int j = 0; j < cp; j++) {
        ring_pack_kv(x->kv[0], hq + (size_t)j * N * 3 * Ch, N, Ch);
        dev_zero(x->dkv[0], (size_t)N * 2 * Ch * sizeof(float));
        for (int i = 0; i < cp; i++) {
            RingBlock r = ulysses_block(g, s, B, T, i, j);
            size_t rows = (size_t)i * N;
            ring_backward_block(&r, heads_dqkv + rows * 3 * Ch, x->dkv[0], x->scratch, hq + rows * 3 * Ch,
                                heads_dout + rows * Ch, att + rows * NHh, x->delta + rows * NHh, x->kv[0]);
        }
        ring_add_dkv(heads_dqkv + (size_t)j * N * 3 * Ch, x->dkv[0], N, Ch);
    }
    trace_attention_step("ulysses attention backward", layer, 0, m0);
    comm_all_to_all(g->cp_group, x->recv, heads_dqkv, (size_t)N * 3 * Ch);
    for (int j = 0; j < cp; j++)
        for (int p = 0; p < 3; p++)
            cp_copy_rows(dqkv, 3 * C, p * C + j * Ch, x->recv + (size_t)j * N * 3 * Ch, 3 * Ch, p * Ch, N, Ch,
                         true);
}

// the device buffers of the layers: allocated, or only counted (cp_layers_bytes)
static void *cp_alloc(CPLayers *x, size_t bytes) {
    x->bytes += bytes;
    return x->counting ? NULL : dev_malloc(bytes);
}

static float **per_layer(CPLayers *x, int L, size_t floats) {
    float **bufs = calloc((size_t)L, sizeof(float *));
    if (!bufs) fatal("out of host memory");
    for (int l = 0; l < L; l++) bufs[l] = cp_alloc(x, floats * sizeof(float));
    return bufs;
}

static void free_per_layer(float **bufs, int L) {
    for (int l = 0; bufs && l < L; l++) dev_free(bufs[l]);
    free(bufs);
}

// ---- the layers -------------------------------------------------------------------------------

// Ulysses: the online softmax's running max and sum and backward's delta, one key/value block and
// its gradient at a time, and the all-to-alls' buffers (which hold its other temporaries). What it
// keeps lives in the block's buffers: the heads' q, k, v in qkv, the log-sum-exp in att (N x
// n_head floats, as the ring's).
static void ulysses_alloc(CPLayers *x, const GPTConfig *mc, int B, int c) {
    int cp = x->grid->cp;
    size_t N = (size_t)2 * B * c, C = (size_t)mc->n_embd, NH = (size_t)mc->n_head;
    x->run_max = cp_alloc(x, N * NH * sizeof(float));
    x->run_sum = cp_alloc(x, N * NH * sizeof(float));
    x->delta = cp_alloc(x, N * NH * sizeof(float));
    x->kv[0] = cp_alloc(x, N * 2 * C / cp * sizeof(float));
    x->dkv[0] = cp_alloc(x, N * 2 * C / cp * sizeof(float));
    x->scratch = cp_alloc(x, N * NH / cp * c * sizeof(float));
    x->send = cp_alloc(x, N * 3 * C * sizeof(float));
    x->recv = cp_alloc(x, N * 3 * C * sizeof(float));
}

static void layers_setup(CPLayers *x, const CPGrid *g, const GPTConfig *mc, int B, int c, bool half, bool counting) {
    memset(x, 0, sizeof *x);
    x->counting = counting;
    x->base = *serial_layer_ops();
    x->grid = g;
    x->max_positions = mc->max_seq_len;
    x->base.embed_forward = cp_embed_forward;
    x->base.embed_backward = cp_embed_backward;
    x->base.attention_forward = g->ulysses ? ulysses_attention_forward : ring_attention_forward;
    x->base.attention_backward = g->ulysses ? ulysses_attention_backward : ring_attention_backward;
    x->n_layers = mc->n_layer;
    x->start = cp_alloc(x, (size_t)2 * B * sizeof(int));
    x->start_host = malloc((size_t)2 * B * sizeof(int));
    if (!x->start_host) fatal("out of host memory");
    if (g->ulysses) {
        ulysses_alloc(x, mc, B, c);
        return;
    }
    size_t N = (size_t)2 * B * c, C = (size_t)mc->n_embd, NH = (size_t)mc->n_head;
    for (int i = 0; i < 2; i++) {
        x->kv[i] = cp_alloc(x, N * 2 * C * sizeof(float));
        x->dkv[i] = cp_alloc(x, N * 2 * C * sizeof(float));
    }
    x->o = cp_alloc(x, N * C * sizeof(float));
    x->run_max = cp_alloc(x, N * NH * sizeof(float));
    x->run_sum = cp_alloc(x, N * NH * sizeof(float));
    x->delta = cp_alloc(x, N * NH * sizeof(float));
    x->scratch = cp_alloc(x, N * NH * (size_t)c * sizeof(float));
    if (half) x->kept_out = per_layer(x, mc->n_layer, N * C);
}

void cp_layers_init(CPLayers *x, const CPGrid *g, const GPTConfig *mc, int B, int c, bool half) {
    layers_setup(x, g, mc, B, c, half, false);
}

size_t cp_layers_bytes(const CPGrid *g, const GPTConfig *mc, int B, int c, bool half) {
    CPLayers x;
    layers_setup(&x, g, mc, B, c, half, true);
    cp_layers_free(&x);
    return x.bytes;
}

void cp_layers_free(CPLayers *x) {
    dev_free(x->start);
    free(x->start_host);
    for (int i = 0; i < 2; i++) dev_free(x->kv[i]), dev_free(x->dkv[i]);
    dev_free(x->o), dev_free(x->run_max), dev_free(x->run_sum), dev_free(x->delta), dev_free(x->scratch);
    free_per_layer(x->kept_out, x->n_layers);
    dev_free(x->send), dev_free(x->recv);
}

// ---- evaluation -------------------------------------------------------------------------------

typedef struct {
    Activations *a;
    const Weights *w;
    const GPTConfig *mc;
    const CPGrid *g;
    Batch local;
} ChunkLoss;

static double chunk_loss(void *ctx, const Batch *batch) {
    ChunkLoss *f = ctx;
    cp_local_batch(f->g, batch, &f->local);
    gpt_forward(f->a, f->w, f->local.inputs, f->local.rows, f->local.T);
    copy_to_device(f->a->targets, f->local.targets, (size_t)f->local.rows * f->local.T * sizeof(int));
    return gpt_loss_forward(f->a, f->mc, f->local.rows, f->local.T);
}

void cp_evaluate_sums(Activations *a, const Weights *w, const GPTConfig *mc, const Dataset *data,
                      const Config *cfg, const CPGrid *g, double sums[2]) {
    ChunkLoss f = {a, w, mc, g, {0}};
    evaluate_batches(chunk_loss, &f, data, cfg, g->replica, g->dp, sums);
    if (g->cp_rank != 0) sums[1] = 0;  // every rank of a replica saw its targets: count them once
    batch_free(&f.local);
}
