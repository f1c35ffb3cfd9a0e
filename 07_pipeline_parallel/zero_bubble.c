// zero_bubble.c: the backward split in two for zero-bubble schedules (ZB-H1), as a LayerOps
// around the stage's layers (the serial ones of gpt.h, or another technique's: stage 10's
// tensor-parallel ones), so the block's math stays in common/model/gpt.c.
//
// A linear layer's backward computes two things: dinp = dout @ w, which the layer below (and the
// previous stage) waits for, and dw = dout^T @ inp, db = sum(dout), which nothing waits for until
// the optimizer. During B, each linear layer computes dinp only and leaves a note of what its
// weight gradient needs: its input, which stays in the slot's activations until W, and dout, which
// is copied (it lives in backward scratch that the next layer reuses) -- except the head's, the
// dlogits, which stay in the slot. W runs the notes. The copies are zero bubble's memory price:
// a block's four output gradients, N rows of the linear layers' output widths added up
// (deferred_floats_per_row), for each micro-batch between its B and its W.
// What stays in B: LayerNorm's weight gradient comes out of the same pass over the rows as its
// input gradient (deferring it would keep its dout for little compute), attention has no weights,
// and the embedding's gradient is the first stage's last op, which no stage waits for.
#include "zero_bubble.h"

#include <stdlib.h>

#include "base/device.h"
#include "base/log.h"
#include "config/config.h"
#include "model/activations.h"

typedef struct {
    LinearKind kind;
    Linear *g;             // where the gradients go
    const float *dout;     // the copy (or the head's dlogits)
    const float *inp;
    const half16 *inp16;
    const Linear *w;
    int N, in_dim, out_dim;
} DeferredLinear;

struct DeferredWeights {
    LayerOps ops;          // first: the activations' ops point at the struct
    LayerOps *inner;       // the stage's layers that compute
    bool deferring;        // inside a B pass
    half16 *dout16;        // the slot's bf16 scratch for dout
    DeferredLinear *notes;
    int n_notes, max_notes;
    float *douts;          // the copies of dout: [capacity] floats on the device
    size_t used, capacity;
};

static DeferredWeights *of(LayerOps *ops) { return (DeferredWeights *)ops; }

static void deferred_linear_backward(LayerOps *ops, LinearKind k, float *dinp, Linear *g, const float *dout,
                                     half16 *dout16, const float *inp, const half16 *inp16, const Linear *w, int N,
                                     int in_dim, int out_dim) {
    DeferredWeights *d = of(ops);
    if (!d->deferring) {  // evaluation never runs backward; a whole backward would land here
        d->inner->linear_backward(d->inner, k, dinp, g, dout, dout16, inp, inp16, w, N, in_dim, out_dim);
        return;
    }
    Linear none = {0};  // no weight gradient now: dinp only
    d->inner->linear_backward(d->inner, k, dinp, &none, dout, dout16, inp, inp16, w, N, in_dim, out_dim);
    const float *kept = dout;
    if (k != LIN_HEAD) {  // the head's dout is the dlogits, which stay in the slot
        size_t n = (size_t)N * out_dim;
        if (d->used + n > d->capacity || d->n_notes == d->max_notes)
            fatal("internal: the deferred weight gradients outgrow their %zu floats", d->capacity);
        float *copy = d->douts + d->used;
        dev_copy(copy, dout, n * sizeof(float));
        d->used += n;
        kept = copy;
    }
    d->notes[d->n_notes++] = (DeferredLinear){k, g, kept, inp, inp16, w, N, in_dim, out_dim};
    d->dout16 = dout16;
}

// The layers the split leaves alone run the wrapped ones', given their own table: a stage's
// layers (05's tensor-parallel ones) find their state behind it
static void wrapped_embed_forward(LayerOps *ops, float *out, const int *tokens, const int *start, const Weights *w,
                                  const ModelShape *s, int B, int T) {
    LayerOps *in = of(ops)->inner;
    in->embed_forward(in, out, tokens, start, w, s, B, T);
}

static void wrapped_embed_backward(LayerOps *ops, Weights *g, const float *dout, const int *tokens,
                                   const ModelShape *s, int B, int T) {
    LayerOps *in = of(ops)->inner;
    in->embed_backward(in, g, dout, tokens, s, B, T);
}

static void wrapped_linear_forward(LayerOps *ops, LinearKind k, float *out, const float *inp, half16 *inp16,
                                   const Linear *w, int N, int in_dim, int out_dim) {
    LayerOps *in = of(ops)->inner;
    in->linear_forward(in, k, out, inp, inp16, w, N, in_dim, out_dim);
}

static void wrapped_norm_forward(LayerOps *ops, float *out, float *mean, float *rstd, const float *inp,
                                 const Norm *w, const ModelShape *s, int N) {
    LayerOps *in = of(ops)->inner;
    in->norm_forward(in, out, mean, rstd, inp, w, s, N);
}

static void wrapped_norm_backward(LayerOps *ops, float *dinp, Norm *g, const float *dout, const float *inp,
                                  const Norm *w, const float *mean, const float *rstd, const ModelShape *s, int N) {
    LayerOps *in = of(ops)->inner;
    in->norm_backward(in, dinp, g, dout, inp, w, mean, rstd, s, N);
}

static void wrapped_attention_forward(LayerOps *ops, int layer, float *out, float *att, const float *qkv,
                                      const ModelShape *s, int B, int T) {
    LayerOps *in = of(ops)->inner;
    in->attention_forward(in, layer, out, att, qkv, s, B, T);
}

static void wrapped_attention_backward(LayerOps *ops, int layer, float *dqkv, float *datt, const float *dout,
                                       const float *qkv, const float *out, const float *att, const ModelShape *s,
                                       int B, int T) {
    LayerOps *in = of(ops)->inner;
    in->attention_backward(in, layer, dqkv, datt, dout, qkv, out, att, s, B, T);
}

// the widths gpt.c's block gives its linear layers' outputs: qkv (q, and k and v of the key/value
// heads), attn_proj, fc (gate and up side by side in a gated MLP) and fc_proj. GPT-2 and phi come
// to 9 C; Llama's grouped-query qkv is narrower and its SwiGLU fc as wide as twice the MLP.
size_t deferred_floats_per_row(const ModelShape *s) {
    size_t qkv = (size_t)s->C_attn + 2 * (size_t)s->C_kv, fc = (size_t)s->C_mlp * (s->gated_mlp ? 2 : 1);
    return qkv + (size_t)s->C + fc + (size_t)s->C;
}

size_t deferred_weights_floats(const ActsSpec *spec) {
    return (size_t)spec->n_layers * spec->B * spec->T * deferred_floats_per_row(&spec->shape);
}

DeferredWeights *deferred_weights_new(Activations *a) {
    // sequence parallelism gathers a linear's input into scratch the next linear reuses: W would
    // read another layer's rows
    if (a->spec.seq_shards > 1)
        fatal("%s: key 'sequence_parallel' is true but pp_schedule is zb-h1, whose weight pass reads each linear "
              "layer's input after the backward, and sequence parallelism keeps a gathered input only until "
              "the next layer's: set one of them otherwise", config_source("sequence_parallel"));
    DeferredWeights *d = calloc_or_die(1, sizeof *d);
    d->inner = a->ops;
    d->ops = *a->ops;  // the MLP's dense form calls the table's linears: the deferring ones
    d->ops.embed_forward = wrapped_embed_forward;
    d->ops.embed_backward = wrapped_embed_backward;
    d->ops.linear_forward = wrapped_linear_forward;
    d->ops.linear_backward = deferred_linear_backward;
    d->ops.norm_forward = wrapped_norm_forward;
    d->ops.norm_backward = wrapped_norm_backward;
    d->ops.attention_forward = wrapped_attention_forward;
    d->ops.attention_backward = wrapped_attention_backward;
    d->max_notes = 4 * a->spec.n_layers + 1;  // four linears a block, and the head
    d->notes = calloc_or_die((size_t)d->max_notes, sizeof *d->notes);
    d->capacity = deferred_weights_floats(&a->spec);
    d->douts = d->capacity ? dev_malloc(d->capacity * sizeof(float)) : NULL;
    a->ops = &d->ops;
    return d;
}

size_t deferred_weights_bytes(const DeferredWeights *d) { return d->capacity * sizeof(float); }

void deferred_weights_free(DeferredWeights *d) {
    if (!d) return;
    if (d->douts) dev_free(d->douts);
    free(d->notes);
    free(d);
}

void deferred_begin(DeferredWeights *d) {
    if (d->n_notes) fatal("internal: a backward before the weight pass of the one before");
    d->deferring = true;
}

void deferred_end(DeferredWeights *d) { d->deferring = false; }

void deferred_weight_pass(void *notes) {
    DeferredWeights *d = notes;
    for (int i = 0; i < d->n_notes; i++) {
        const DeferredLinear *n = &d->notes[i];
        d->inner->linear_backward(d->inner, n->kind, NULL, n->g, n->dout, d->dout16, n->inp, n->inp16, n->w, n->N,
                                  n->in_dim, n->out_dim);
    }
    d->n_notes = 0, d->used = 0;
}
