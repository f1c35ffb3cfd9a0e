// activations.c: what the layer steps (gpt.c) keep from forward for backward, and their backward
// scratch: allocated once for a capacity of B x T tokens, or only counted (acts_bytes), by the one
// function that says what a rank keeps.
#include "activations.h"
#include "moe_mlp.h"

#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "ops/ops.h"

struct ActsAllocator {
    Activations *a;
    bool count_only;  // add up the bytes, allocate nothing (acts_bytes)
    void **owned;     // every buffer allocated, to free
    int n_owned;
    void **host_owned;  // and every host one
    int n_host_owned;
};

static void own(void ***list, int *n, void *p) {
    *list = realloc(*list, (size_t)(*n + 1) * sizeof(void *));
    if (!*list) fatal("out of host memory");
    (*list)[(*n)++] = p;
}

void *acts_alloc_device(ActsAllocator *al, size_t bytes) {
    al->a->bytes += bytes;
    if (al->count_only) return NULL;
    void *p = dev_malloc(bytes);
    own(&al->owned, &al->n_owned, p);
    return p;
}

// host memory (a MoE block's routing), which the device bytes do not count
void *acts_alloc_host(ActsAllocator *al, size_t bytes) {
    if (al->count_only) return NULL;
    void *p = calloc_or_die(1, bytes);
    own(&al->host_owned, &al->n_host_owned, p);
    return p;
}

static float *alloc_floats(ActsAllocator *al, size_t n) { return acts_alloc_device(al, n * sizeof(float)); }

// a buffer with the residual stream's rows: what sequence parallelism divides
static float *residual_floats(ActsAllocator *al, size_t n) {
    al->a->residual_bytes += n * sizeof(float);
    return alloc_floats(al, n);
}

int residual_rows(const ActsSpec *spec, int N) { return spec->seq_shards > 1 ? N / spec->seq_shards : N; }

// the residual rows at capacity (a shard of a capacity the shards do not divide is rounded up; a
// batch they do not divide is refused by the stage that splits it)
static size_t residual_capacity(const ActsSpec *sp) {
    size_t N = (size_t)sp->B * sp->T, n = sp->seq_shards > 1 ? (size_t)sp->seq_shards : 1;
    return (N + n - 1) / n;
}
static half16 *alloc_16(ActsAllocator *al, size_t n, bool on) { return on ? acts_alloc_device(al, n * sizeof(half16)) : NULL; }

// In bf16 mode a matmul input is read in f32 only by the cast that rounds it, right before its
// matmul: the backward scratch (unused during forward) holds it, and each block keeps only its
// bf16 copy. In f32 mode each block keeps its own for backward.
static float *matmul_input(ActsAllocator *al, size_t n) {
    return al->a->spec.half ? al->a->dbig : alloc_floats(al, n);
}

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

// the MLP's first projection: SwiGLU's is gate and up side by side
static size_t fc_width(const ModelShape *s) { return (size_t)s->C_mlp * (s->gated_mlp ? 2 : 1); }

// what datty's scratch holds after attention's backward: grouped-query attention's projection gradient
static size_t attention_scratch_width(const ModelShape *s) {
    return s->C_kv < s->C_attn ? (size_t)s->C_attn + 2 * (size_t)s->C_kv : (size_t)s->C_attn;
}

// One block's activations, with its dense MLP's or without (a MoE block keeps its MLP's apart).
static void alloc_block(ActsAllocator *al, BlockActs *k, bool dense) {
    const ActsSpec *sp = &al->a->spec;
    size_t N = (size_t)sp->B * sp->T, C = sp->shape.C, Ca = sp->shape.C_attn, F = sp->shape.C_mlp;
    size_t R = residual_capacity(sp);
    bool b16 = sp->half;
    // a parallel block's MLP reads ln1 after attention has reused the bf16 mode's scratch: its own
    k->ln1 = sp->shape.parallel_block ? alloc_floats(al, N * C) : matmul_input(al, N * C);
    k->ln1_mean = residual_floats(al, R);
    k->ln1_rstd = residual_floats(al, R);
    k->qkv = alloc_floats(al, N * 3 * Ca);
    k->att = alloc_floats(al, (size_t)sp->B * sp->shape.n_head * sp->T * sp->keys);
    k->atty = matmul_input(al, N * Ca);
    k->res2 = residual_floats(al, R * C);
    if (!sp->shape.parallel_block) {  // a parallel block's MLP reads ln1
        k->ln2 = matmul_input(al, N * C);
        k->ln2_mean = residual_floats(al, R);
        k->ln2_rstd = residual_floats(al, R);
    }
    if (dense) {
        k->fch = alloc_floats(al, N * fc_width(&sp->shape));
        k->fch_gelu = matmul_input(al, N * F);
    }
    k->out = residual_floats(al, R * C);
    k->mlp_out = sp->seq_shards > 1 ? al->a->seq_full : k->out;
    k->ln1_16 = alloc_16(al, N * C, b16);
    k->atty16 = alloc_16(al, N * Ca, b16);
    k->ln2_16 = alloc_16(al, N * C, b16 && !sp->shape.parallel_block);
    k->fch_gelu16 = alloc_16(al, N * F, b16 && dense);
}

ActsSpec whole_model_acts(const GPTConfig *cfg, int B, int T, bool half, bool recompute) {
    return (ActsSpec){.B = B, .T = T, .keys = T, .shape = whole_model_shape(cfg), .model = *cfg, .first_layer = 0,
                      .n_layers = cfg->n_layer, .embed = true, .head = true, .half = half,
                      .recompute = recompute};
}

void acts_alloc(Activations *a, const GPTConfig *cfg, int B, int T, int flags) {
    ActsSpec spec = whole_model_acts(cfg, B, T, flags & ACTS_16BIT, flags & ACTS_RECOMPUTE);
    acts_alloc_spec(a, &spec);
}

// Lays out the activations of spec, allocating each buffer, or (count_only) adding up their bytes
// alone: the one place that says what a rank keeps, so what is allocated and what is reported agree.
static void lay_out_acts(Activations *a, const ActsSpec *spec, bool count_only) {
    memset(a, 0, sizeof *a);
    a->spec = *spec;
    a->spec.shape.half = spec->half;
    if (!a->spec.keys) a->spec.keys = spec->T;
    a->ops = spec->ops ? spec->ops : serial_layer_ops();
    ActsAllocator al = {.a = a, .count_only = count_only};
    const ActsSpec *sp = &a->spec;
    size_t N = (size_t)sp->B * sp->T, C = sp->shape.C, Ca = sp->shape.C_attn, F = sp->shape.C_mlp;
    size_t V = sp->shape.v_rows, R = residual_capacity(sp);
    // the backward scratch first: in bf16 mode the forward's f32 matmul inputs pass through dbig
    a->dres = residual_floats(&al, R * C);
    a->dbig = alloc_floats(&al, N * max3(F, attention_scratch_width(&sp->shape), C));
    a->dbig2 = alloc_floats(&al, N * max3(fc_width(&sp->shape), C, 0));
    a->dsmall = alloc_floats(&al, N * max3(C, 3 * Ca, 0));
    a->datt = alloc_floats(&al, (size_t)sp->B * sp->shape.n_head * sp->T * sp->keys);
    if (sp->shape.parallel_block) a->dln = alloc_floats(&al, N * C);
    a->dout16 = alloc_16(&al, N * max3(max3(fc_width(&sp->shape), 3 * Ca, C), sp->head ? V : 0, 0), sp->half);
    a->encoded = residual_floats(&al, R * C);
    if (sp->seq_shards > 1) {
        a->seq_shard = alloc_floats(&al, R * C);
        a->seq_full = alloc_floats(&al, N * C);
    }
    a->blocks = calloc_or_die((size_t)(sp->n_layers > 0 ? sp->n_layers : 1), sizeof(BlockActs));
    int moe_blocks = gpt_moe_blocks(&sp->model, sp->first_layer, sp->n_layers);
    if (moe_blocks && !sp->model.moe->mlp)
        fatal("internal: activations for mixture-of-experts blocks without their MLP (MoEConfig.mlp)");
    for (int i = 0; i < sp->n_layers; i++) {
        bool moe = gpt_block_is_moe(&sp->model, sp->first_layer + i);
        if (sp->recompute && i > 0) {  // one set of activations, recomputed for each block in
            a->blocks[i] = a->blocks[0];  // backward; each block keeps its output (the next's input)
            a->blocks[i].out = residual_floats(&al, R * C);
            if (sp->seq_shards <= 1) a->blocks[i].mlp_out = a->blocks[i].out;
        } else {  // when recomputing, the shared set serves dense and MoE blocks alike
            alloc_block(&al, &a->blocks[i], sp->recompute ? moe_blocks < sp->n_layers : !moe);
        }
    }
    if (moe_blocks) sp->model.moe->mlp->alloc_acts(a, &al);
    if (sp->embed) a->inputs = acts_alloc_device(&al, N * sizeof(int));
    if (sp->head) {
        a->lnf = matmul_input(&al, N * C);
        a->lnf_mean = residual_floats(&al, R);
        a->lnf_rstd = residual_floats(&al, R);
        a->lnf16 = alloc_16(&al, N * C, sp->half);
        a->logits = alloc_floats(&al, N * V);
        a->losses = alloc_floats(&al, N);
        a->targets = acts_alloc_device(&al, N * sizeof(int));
    }
    a->owned = al.owned;
    a->n_owned = al.n_owned;
    a->host_owned = al.host_owned;
    a->n_host_owned = al.n_host_owned;
}

void acts_alloc_spec(Activations *a, const ActsSpec *spec) { lay_out_acts(a, spec, false); }

size_t acts_bytes(const ActsSpec *spec) {
    Activations a;
    lay_out_acts(&a, spec, true);
    free(a.blocks);
    return a.bytes;
}

void acts_free(Activations *a) {
    for (int i = 0; i < a->n_owned; i++) dev_free(a->owned[i]);
    for (int i = 0; i < a->n_host_owned; i++) free(a->host_owned[i]);
    free(a->owned);
    free(a->host_owned);
    free(a->blocks);
    memset(a, 0, sizeof *a);
}

const float *block_input(const Activations *a, int l) {
    int i = l - a->spec.first_layer;
    return i == 0 ? a->encoded : a->blocks[i - 1].out;
}

const float *block_mlp_input(const Activations *a, int l) {
    const BlockActs *k = &a->blocks[l - a->spec.first_layer];
    return a->spec.shape.parallel_block ? k->ln1 : k->ln2;
}

const float *head_input(const Activations *a) { return block_input(a, a->spec.first_layer + a->spec.n_layers); }
