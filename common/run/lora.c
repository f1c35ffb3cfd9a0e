// lora.c: LoRA adapters as a plug-in of the layer table (lora.h).
#include "lora.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "base/device.h"
#include "base/files.h"
#include "base/log.h"
#include "base/numbers.h"
#include "model/activations.h"
#include "model/checkpoint.h"
#include "ops/ops.h"

#define PEFT_PREFIX "base_model.model."
// the adapters' random streams, apart from the base's (whose stream is a tensor's index)
#define LORA_STREAM_BASE (1ULL << 40)
// the dropout masks' streams: (step, layer, kind, part) in bits above every other stream's
#define LORA_DROPOUT_STREAM (1ULL << 62)

// ---- which linears: the description's matrices, by Hugging Face module name ---------------------

static LinearKind kind_of_role(TensorRole role) {
    switch (role) {
    case ROLE_QKV_W: return LIN_QKV;
    case ROLE_ATTN_PROJ_W: return LIN_ATTN_PROJ;
    case ROLE_FC_W: case ROLE_FC_PART: return LIN_FC;
    case ROLE_FC_PROJ_W: return LIN_FC_PROJ;
    default: return LIN_HEAD;  // not a block linear
    }
}

// PEFT's default target_modules for the architecture (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
static const char *default_targets(const Arch *arch) {
    if (arch == &ARCH_GPT2) return "c_attn";
    if (arch == &ARCH_PHI) return "q_proj,v_proj,fc1,fc2";
    return "q_proj,v_proj";
}

// "model.layers.0.self_attn.q_proj" from "model.layers.0.self_attn.q_proj.weight"
static void module_of(char *out, size_t size, const char *tensor_name) {
    snprintf(out, size, "%s", tensor_name);
    char *dot = strrchr(out, '.');
    if (dot) *dot = '\0';
}

// PEFT's match: the module's whole name, or its name ending in "." + target
static bool target_matches(const char *module, const char *target) {
    size_t m = strlen(module), t = strlen(target);
    if (m == t) return strcmp(module, target) == 0;
    return m > t && module[m - t - 1] == '.' && strcmp(module + m - t, target) == 0;
}

// Calls visit for every block linear of the base (a part of a fused one counts apart), with its
// kind, its rows in the fused output and the fused weight's start.
typedef void (*LinearVisit)(const TensorInfo *t, LinearKind kind, int row0, size_t fused_offset, void *ctx);
static void each_block_linear(const ParamLayout *base, LinearVisit visit, void *ctx) {
    LinearKind kind = LIN_HEAD;
    int row0 = 0, prev_rows = 0;
    size_t fused = 0;
    for (int i = 0; i < base->num_tensors; i++) {
        const TensorInfo *t = &base->tensors[i];
        if (t->block < 0 || t->ndim != 2 || t->role == ROLE_MOE_MLP) continue;
        if (t->role == ROLE_QKV_PART || t->role == ROLE_FC_PART) {
            row0 += prev_rows;  // continues the matrix before it
        } else {
            kind = kind_of_role(t->role);
            row0 = 0;
            fused = t->offset;
        }
        prev_rows = t->shape[0];
        if (kind != LIN_HEAD) visit(t, kind, row0, fused, ctx);
    }
}

static void *grow(void *p, size_t bytes) {
    void *q = realloc(p, bytes);
    if (!q) fatal("out of memory (%zu bytes) describing the LoRA adapters", bytes);
    return q;
}

typedef struct {
    Lora *lo;
    char names[32][64];   // the targets
    int n_names;
    int matched[32];      // linears each one matched
    int part;             // the visited linear's part of its fused linear
    char known[512];      // the last components of every linear's name, for the message
} Describe;

static void add_known(Describe *d, const char *module) {
    const char *last = strrchr(module, '.');
    last = last ? last + 1 : module;
    char padded[80];
    snprintf(padded, sizeof padded, ",%s,", last);
    char list[520];
    snprintf(list, sizeof list, ",%s,", d->known);
    if (strstr(list, padded)) return;
    size_t n = strlen(d->known);
    snprintf(d->known + n, sizeof d->known - n, "%s%s", n ? "," : "", last);
}

static void add_site(const TensorInfo *t, LinearKind kind, int row0, size_t fused, void *ctx) {
    Describe *d = ctx;
    Lora *lo = d->lo;
    d->part = row0 ? d->part + 1 : 0;
    char module[64];
    module_of(module, sizeof module, t->name);
    add_known(d, module);
    bool wanted = false;
    for (int i = 0; i < d->n_names; i++)
        if (target_matches(module, d->names[i])) d->matched[i]++, wanted = true;
    if (!wanted) return;
    lo->sites = grow(lo->sites, (size_t)(lo->n_sites + 1) * sizeof(LoraSite));
    LoraSite *s = &lo->sites[lo->n_sites++];
    *s = (LoraSite){.kind = kind, .layer = t->block, .row0 = row0, .rows = t->shape[0], .in_dim = t->shape[1],
                    .base_offset = fused, .part = d->part};
    ParamLayout *l = &lo->trained.layout;
    l->tensors = grow(l->tensors, (size_t)(l->num_tensors + 2) * sizeof(TensorInfo));
    int shapes[2][2] = {{lo->rank, s->in_dim}, {s->rows, lo->rank}};
    for (int ab = 0; ab < 2; ab++) {
        TensorInfo *ti = &l->tensors[l->num_tensors];
        *ti = (TensorInfo){.role = t->role, .offset = l->num_params, .ndim = 2, .decay = 1, .block = t->block,
                           .repeat = -1, .moe_slot = -1, .init_stream = l->num_tensors};
        int n = snprintf(ti->name, sizeof ti->name, "%s.lora_%c.weight", module, ab ? 'B' : 'A');
        if (n < 0 || (size_t)n >= sizeof ti->name)
            fatal("LoRA: the adapter name %s.lora_%c.weight is longer than a tensor name may be (%zu characters)",
                  module, ab ? 'B' : 'A', sizeof ti->name - 1);
        ti->shape[0] = shapes[ab][0], ti->shape[1] = shapes[ab][1];
        ti->hf_rows = ti->shape[0];
        ti->numel = (size_t)ti->shape[0] * ti->shape[1];
        l->num_params += ti->numel;
        if (ab) s->b = l->num_tensors;
        else s->a = l->num_tensors;
        l->num_tensors++;
    }
}

// where each block's adapters start in the layout (the sites come in block order): what lets DDP's
// gradient buckets launch after a block's backward
static void mark_block_starts(ParamLayout *l) {
    l->block_first = calloc_or_die((size_t)l->n_blocks + 1, sizeof(size_t));
    int t = 0;
    for (int b = 0; b <= l->n_blocks; b++) {
        while (t < l->num_tensors && l->tensors[t].block < l->first_block + b) t++;
        l->block_first[b] = t < l->num_tensors ? l->tensors[t].offset : l->num_params;
    }
}

void lora_describe(Lora *lo, const ParamLayout *base, int rank, double alpha, const char *targets, const char *where) {
    memset(lo, 0, sizeof *lo);
    lo->rank = rank;
    lo->alpha = (float)alpha;
    lo->scale = (float)(alpha / rank);
    lo->arch = base->arch;
    lo->trained.layout.cfg = base->cfg;
    lo->trained.layout.arch = base->arch;
    lo->trained.layout.first_block = base->first_block;
    lo->trained.layout.n_blocks = base->n_blocks;
    snprintf(lo->targets, sizeof lo->targets, "%s", targets[0] ? targets : default_targets(base->arch));
    Describe d = {.lo = lo};
    char list[256];
    snprintf(list, sizeof list, "%s", lo->targets);
    for (char *save = NULL, *name = strtok_r(list, ", ", &save); name; name = strtok_r(NULL, ", ", &save)) {
        if (d.n_names == 32) fatal("%s: key 'lora_targets': more than 32 names", where);
        snprintf(d.names[d.n_names++], sizeof d.names[0], "%s", name);
    }
    if (!d.n_names) fatal("%s: key 'lora_targets': no module names in \"%s\"", where, targets);
    each_block_linear(base, add_site, &d);
    mark_block_starts(&lo->trained.layout);
    for (int i = 0; i < d.n_names; i++)
        if (!d.matched[i])
            fatal("%s: key 'lora_targets': \"%s\" names no linear layer of this %s model; its linears are %s",
                  where, d.names[i], base->arch->name, d.known);
}

// ---- PEFT's files -------------------------------------------------------------------------------

static const cJSON *json_item(const cJSON *root, const char *key) {
    return cJSON_GetObjectItemCaseSensitive(root, key);
}

// a key we do not implement must be absent, null, false, empty or its default
static void require_unset(const cJSON *root, const char *key, const char *path, const char *dflt) {
    const cJSON *v = json_item(root, key);
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v)) return;
    if (cJSON_IsString(v) && dflt && strcmp(v->valuestring, dflt) == 0) return;
    if ((cJSON_IsObject(v) || cJSON_IsArray(v)) && !cJSON_GetArraySize(v)) return;
    char *text = cJSON_PrintUnformatted(v);
    fatal("%s: key '%s' is %s, which we do not implement (expected %s)", path, key, text ? text : "?",
          dflt ? dflt : "null, false or empty");
}

void lora_read_adapter_config(const char *dir, int *rank, double *alpha, char *targets, size_t targets_size) {
    char path[FILE_PATH_LEN];
    join_path(path, dir, "adapter_config.json");
    char *text = read_file_or_die(path, NULL);
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsObject(root)) fatal("%s: not a JSON object", path);
    const cJSON *type = json_item(root, "peft_type");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "LORA") != 0)
        fatal("%s: key 'peft_type': expected \"LORA\", found %s", path,
              cJSON_IsString(type) ? type->valuestring : "none");
    const cJSON *r = json_item(root, "r"), *a = json_item(root, "lora_alpha"), *t = json_item(root, "target_modules");
    if (!cJSON_IsNumber(r) || r->valuedouble < 1 || r->valuedouble != (int)r->valuedouble)
        fatal("%s: key 'r': expected a positive integer", path);
    if (!cJSON_IsNumber(a) || a->valuedouble <= 0) fatal("%s: key 'lora_alpha': expected a positive number", path);
    *rank = r->valueint;
    *alpha = a->valuedouble;
    targets[0] = '\0';
    if (cJSON_IsString(t)) {
        snprintf(targets, targets_size, "%s", t->valuestring);
    } else if (cJSON_IsArray(t) && cJSON_GetArraySize(t)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, t) {
            if (!cJSON_IsString(e)) fatal("%s: key 'target_modules': expected names", path);
            size_t n = strlen(targets);
            snprintf(targets + n, targets_size - n, "%s%s", n ? "," : "", e->valuestring);
        }
    } else {
        fatal("%s: key 'target_modules': expected a list of module names", path);
    }
    require_unset(root, "bias", path, "none");
    require_unset(root, "use_rslora", path, NULL);
    require_unset(root, "use_dora", path, NULL);
    require_unset(root, "modules_to_save", path, NULL);
    require_unset(root, "layers_to_transform", path, NULL);
    require_unset(root, "rank_pattern", path, NULL);
    require_unset(root, "alpha_pattern", path, NULL);
    cJSON_Delete(root);
}

void lora_init(const Lora *lo, float *host, uint64_t seed) {
    memset(host, 0, lo->trained.layout.num_params * sizeof(float));
    for (int i = 0; i < lo->n_sites; i++) {
        const TensorInfo *a = &lo->trained.layout.tensors[lo->sites[i].a];
        // torch's kaiming_uniform_(a=sqrt(5)), PEFT's init of A: gain sqrt(2 / 6), bound gain * sqrt(3 / in)
        float bound = 1.0f / sqrtf((float)a->shape[1]);
        for (size_t j = 0; j < a->numel; j++) {
            uint64_t h = rng_hash(seed, LORA_STREAM_BASE + (uint64_t)a->init_stream, j);
            double u = (double)(h >> 11) * (1.0 / 9007199254740992.0);  // [0, 1), 53 bits
            host[a->offset + j] = (float)((2 * u - 1) * bound);
        }
    }
}

void lora_read_adapter(const Lora *lo, const char *dir, float *host) {
    char path[FILE_PATH_LEN];
    join_path(path, dir, "adapter_model.safetensors");
    SafeTensors st;
    safetensors_open(&st, path);
    for (int i = 0; i < lo->trained.layout.num_tensors; i++) {
        const TensorInfo *t = &lo->trained.layout.tensors[i];
        char name[160];
        snprintf(name, sizeof name, PEFT_PREFIX "%s", t->name);
        const SafeTensor *s = safetensors_find(&st, name);
        if (!s) fatal("%s: tensor '%s' is missing (the adapter's config targets its module)", path, name);
        if (s->ndim != 2 || s->shape[0] != t->shape[0] || s->shape[1] != t->shape[1]) {
            char found[64];
            fatal("%s: tensor '%s': expected shape [%d, %d], found %s", path, name, t->shape[0], t->shape[1],
                  safetensors_shape_str(found, sizeof found, s->ndim, s->shape));
        }
        safetensors_read_floats(&st, s, host + t->offset);
    }
    if (st.num_tensors != lo->trained.layout.num_tensors)
        fatal("%s: expected %d tensors (lora_A and lora_B of %d linears), found %d", path, lo->trained.layout.num_tensors,
              lo->n_sites, st.num_tensors);
    safetensors_close(&st);
}

void lora_write_adapter(const Lora *lo, const char *dir, const float *host, const char *base_model) {
    safetensors_save_layout(dir, "adapter_model.safetensors", PEFT_PREFIX, &lo->trained.layout, host);
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "peft_type", "LORA");
    cJSON_AddStringToObject(c, "task_type", "CAUSAL_LM");
    cJSON_AddStringToObject(c, "base_model_name_or_path", base_model);
    cJSON_AddNumberToObject(c, "r", lo->rank);
    cJSON_AddNumberToObject(c, "lora_alpha", lo->alpha);
    cJSON_AddNumberToObject(c, "lora_dropout", lo->dropout);
    cJSON *targets = cJSON_AddArrayToObject(c, "target_modules");
    char list[256];
    snprintf(list, sizeof list, "%s", lo->targets);
    for (char *save = NULL, *name = strtok_r(list, ", ", &save); name; name = strtok_r(NULL, ", ", &save))
        cJSON_AddItemToArray(targets, cJSON_CreateString(name));
    cJSON_AddStringToObject(c, "bias", "none");
    cJSON_AddBoolToObject(c, "fan_in_fan_out", lo->arch == &ARCH_GPT2);  // GPT-2's Conv1D stores W (in, out)
    cJSON_AddBoolToObject(c, "inference_mode", 1);
    cJSON_AddBoolToObject(c, "init_lora_weights", 1);
    cJSON_AddBoolToObject(c, "use_rslora", 0);
    cJSON_AddBoolToObject(c, "use_dora", 0);
    cJSON_AddNullToObject(c, "modules_to_save");
    char *text = cJSON_Print(c);
    cJSON_Delete(c);
    write_text_file(dir, "adapter_config.json", text);
    free(text);
}

void lora_merge(const Lora *lo, const float *adapters, float *base_params) {
    for (int i = 0; i < lo->n_sites; i++) {
        const LoraSite *s = &lo->sites[i];
        const float *A = adapters + lo->trained.layout.tensors[s->a].offset, *B = adapters + lo->trained.layout.tensors[s->b].offset;
        float *W = base_params + s->base_offset + (size_t)s->row0 * s->in_dim;
        for (int o = 0; o < s->rows; o++)
            for (int c = 0; c < s->in_dim; c++) {
                double sum = 0;
                for (int k = 0; k < lo->rank; k++)
                    sum += (double)B[(size_t)o * lo->rank + k] * A[(size_t)k * s->in_dim + c];
                W[(size_t)o * s->in_dim + c] += (float)(lo->scale * sum);
            }
    }
}

// ---- the layers ---------------------------------------------------------------------------------

static Lora *of(LayerOps *ops) { return (Lora *)ops; }
static const float *adapter(const Lora *lo, int tensor) { return lo->trained.params + lo->trained.layout.tensors[tensor].offset; }
static float *adapter_grad(const Lora *lo, int tensor) { return lo->trained.grads + lo->trained.layout.tensors[tensor].offset; }

// the adapters' input: in a 16-bit layer, the rounded input the base multiplied (and keeps)
static const float *adapter_input(Lora *lo, const float *inp, const half16 *inp16, int N, int in_dim) {
    if (!inp16) return inp;
    cast_to_float(lo->x32, inp16, (size_t)N * in_dim);
    return lo->x32;
}

// whether site s adapts the linear that runs: its kind, and its weight (or the block the stage runs)
static bool site_runs(const Lora *lo, const LoraSite *s, LinearKind k, const Linear *w) {
    return s->kind == k && (lo->by_block ? s->layer == lo->block : s->base_w == w->w);
}

void lora_site_mask(const Lora *lo, const LoraSite *s, DropoutMask *mask) {
    *mask = lo->rows;
    mask->stream = LORA_DROPOUT_STREAM | (uint64_t)lo->step << 15 | (uint64_t)s->layer << 5 | (uint64_t)s->kind << 2 |
                   (uint64_t)s->part;
    mask->col0 = s->col0;
}

// the input adapter s sees: x itself, or in training x with its dropout mask applied (into xd)
static const float *adapter_x(Lora *lo, const LoraSite *s, const float *x, int N, int in_dim, DropoutMask *mask) {
    if (!lo->training) return x;
    lora_site_mask(lo, s, mask);
    dropout_apply(lo->xd, x, N, in_dim, mask, 0);
    return lo->xd;
}

// h = x A^T, completed over the ranks that hold A's other columns
static void adapter_down(Lora *lo, LinearKind k, LoraSite *s, const float *x, int N, int in_dim) {
    matmul_forward(s->h, x, adapter(lo, s->a), NULL, N, in_dim, lo->rank);
    if (lo->complete) lo->complete(lo->complete_ctx, k, false, s->h, (size_t)N * lo->rank);
}

static void lora_linear_forward(LayerOps *ops, LinearKind k, float *out, const float *inp, half16 *inp16,
                                const Linear *w, int N, int in_dim, int out_dim) {
    Lora *lo = of(ops);
    lo->inner->linear_forward(lo->inner, k, out, inp, inp16, w, N, in_dim, out_dim);
    const float *x = NULL;
    for (int i = 0; i < lo->n_sites; i++) {
        LoraSite *s = &lo->sites[i];
        if (!site_runs(lo, s, k, w)) continue;
        if (!x) x = adapter_input(lo, inp, inp16, N, in_dim);
        DropoutMask mask;
        adapter_down(lo, k, s, adapter_x(lo, s, x, N, in_dim, &mask), N, in_dim);
        matmul_forward(lo->dy, s->h, adapter(lo, s->b), NULL, N, lo->rank, s->rows);  // h B^T
        add_columns_scaled(out + s->row0, out_dim, lo->dy, s->rows, N, s->rows, lo->scale);
    }
}

static void lora_linear_backward(LayerOps *ops, LinearKind k, float *dinp, Linear *g, const float *dout,
                                 half16 *dout16, const float *inp, const half16 *inp16, const Linear *w, int N,
                                 int in_dim, int out_dim) {
    (void)g;  // the base is frozen
    Lora *lo = of(ops);
    Linear none = {0};  // no weight gradient: dinp only
    lo->inner->linear_backward(lo->inner, k, dinp, &none, dout, dout16, inp, inp16, w, N, in_dim, out_dim);
    const float *x = NULL;
    for (int i = 0; i < lo->n_sites; i++) {
        LoraSite *s = &lo->sites[i];
        if (!site_runs(lo, s, k, w)) continue;
        if (!x) x = adapter_input(lo, inp, inp16, N, in_dim);
        // the adapter's input again, its mask recomputed rather than kept from forward: a hash per
        // element instead of N x in_dim floats per adapter held from forward to backward
        DropoutMask mask;
        const float *xs = adapter_x(lo, s, x, N, in_dim, &mask);
        if (lo->recompute_h) adapter_down(lo, k, s, xs, N, in_dim);
        // dy = scale * dout's rows of this adapter; dh = dy B, dB += dy^T h; dinp += dh A, dA += dh^T xs
        dev_zero(lo->dy, (size_t)N * s->rows * sizeof(float));
        add_columns_scaled(lo->dy, s->rows, dout + s->row0, out_dim, N, s->rows, lo->scale);
        dev_zero(lo->dh, (size_t)N * lo->rank * sizeof(float));
        matmul_backward(lo->dh, adapter_grad(lo, s->b), NULL, lo->dy, s->h, adapter(lo, s->b), N, lo->rank, s->rows);
        if (lo->complete) lo->complete(lo->complete_ctx, k, true, lo->dh, (size_t)N * lo->rank);
        if (!lo->training) {
            matmul_backward(dinp, adapter_grad(lo, s->a), NULL, lo->dh, xs, adapter(lo, s->a), N, in_dim, lo->rank);
            continue;
        }
        // through the dropout: dinp += mask(dh A)
        dev_zero(lo->dxd, (size_t)N * in_dim * sizeof(float));
        matmul_backward(lo->dxd, adapter_grad(lo, s->a), NULL, lo->dh, xs, adapter(lo, s->a), N, in_dim, lo->rank);
        dropout_apply(dinp, lo->dxd, N, in_dim, &mask, 1);
    }
}

static void lora_norm_backward(LayerOps *ops, float *dinp, Norm *g, const float *dout, const float *inp,
                               const Norm *w, const float *mean, const float *rstd, const ModelShape *s, int N) {
    (void)g;  // frozen: its weight gradient goes to scratch
    Lora *lo = of(ops);
    lo->inner->norm_backward(lo->inner, dinp, &lo->norm_grads, dout, inp, w, mean, rstd, s, N);
}

static void lora_embed_backward(LayerOps *ops, Weights *g, const float *dout, const int *tokens,
                                const ModelShape *s, int B, int T) {
    (void)ops, (void)g, (void)dout, (void)tokens, (void)s, (void)B, (void)T;  // frozen: nothing to compute
}

// The layers LoRA leaves alone run the wrapped ones', given their own table: a stage's layers
// (context parallelism's attention and embedding) find their state behind it
static void lora_embed_forward(LayerOps *ops, float *out, const int *tokens, const int *start, const Weights *w,
                               const ModelShape *s, int B, int T) {
    LayerOps *in = of(ops)->inner;
    in->embed_forward(in, out, tokens, start, w, s, B, T);
}

static void lora_norm_forward(LayerOps *ops, float *out, float *mean, float *rstd, const float *inp, const Norm *w,
                              const ModelShape *s, int N) {
    LayerOps *in = of(ops)->inner;
    in->norm_forward(in, out, mean, rstd, inp, w, s, N);
}

static void lora_attention_forward(LayerOps *ops, int layer, float *out, float *att, const float *qkv,
                                   const ModelShape *s, int B, int T) {
    LayerOps *in = of(ops)->inner;
    in->attention_forward(in, layer, out, att, qkv, s, B, T);
}

static void lora_attention_backward(LayerOps *ops, int layer, float *dqkv, float *datt, const float *dout,
                                    const float *qkv, const float *out, const float *att, const ModelShape *s, int B,
                                    int T) {
    LayerOps *in = of(ops)->inner;
    in->attention_backward(in, layer, dqkv, datt, dout, qkv, out, att, s, B, T);
}

// ---- in a stage -----------------------------------------------------------------------------------

// the Lora whose trained set t is
static Lora *owner(Trainable *t) { return (Lora *)((char *)t - offsetof(Lora, trained)); }

// the hooks a stage's loop calls through the trained set (trainable.h)
static void run_block(Trainable *t, int block) { owner(t)->block = block; }
static void run_micro(Trainable *t, int after) {
    Lora *lo = owner(t);
    lo->rows.first_seq = lo->first_seq + after;
}

// lora_adapter's config must describe the adapters the keys do
static void require_adapter_fits_keys(const Lora *lo, const Config *cfg, const ParamLayout *base) {
    int rank;
    double alpha;
    char targets[256];
    lora_read_adapter_config(cfg->lora_adapter, &rank, &alpha, targets, sizeof targets);
    char where[600];
    snprintf(where, sizeof where, "%s/adapter_config.json", cfg->lora_adapter);
    if (rank != lo->rank || (float)alpha != lo->alpha)
        fatal("%s: r %d and lora_alpha %g, but keys 'lora_rank' and 'lora_alpha' (%s) are %d and %g", where, rank,
              alpha, config_source("lora_rank"), lo->rank, lo->alpha);
    Lora theirs;
    lora_describe(&theirs, base, rank, alpha, targets, where);
    bool same = theirs.n_sites == lo->n_sites;
    for (int i = 0; same && i < lo->n_sites; i++) same = theirs.sites[i].a == lo->sites[i].a &&
                                                        strcmp(theirs.trained.layout.tensors[theirs.sites[i].a].name,
                                                               lo->trained.layout.tensors[lo->sites[i].a].name) == 0;
    if (!same)
        fatal("%s: target_modules %s, but key 'lora_targets' (%s) is \"%s\": they adapt different linears", where,
              theirs.targets, config_source("lora_targets"), lo->targets);
    lora_free(&theirs);
}

void lora_plug(Lora *lo, const float *adapters, const float *base_params, Activations *acts) {
    lo->trained.bytes = lo->trained.layout.num_params * sizeof(float);
    lo->trained.params = dev_malloc(lo->trained.bytes);
    lo->trained.grads = dev_malloc(lo->trained.bytes);
    lo->trained.m = dev_malloc(lo->trained.bytes);
    lo->trained.v = dev_malloc(lo->trained.bytes);
    copy_to_device(lo->trained.params, adapters, lo->trained.bytes);
    // what forward keeps per site, and backward's scratch, for the activations' rows
    size_t N = (size_t)acts->spec.B * acts->spec.T, widest = 0, in_widest = 0;
    for (int i = 0; i < lo->n_sites; i++) {
        LoraSite *s = &lo->sites[i];
        s->base_w = base_params ? base_params + s->base_offset : NULL;
        s->h = dev_malloc(N * lo->rank * sizeof(float));
        if ((size_t)s->rows > widest) widest = (size_t)s->rows;
        if ((size_t)s->in_dim > in_widest) in_widest = (size_t)s->in_dim;
    }
    lo->dy = dev_malloc(N * widest * sizeof(float));
    lo->dh = dev_malloc(N * lo->rank * sizeof(float));
    lo->x32 = acts->spec.half ? dev_malloc(N * in_widest * sizeof(float)) : NULL;
    lo->xd = lo->dropout > 0 ? dev_malloc(N * in_widest * sizeof(float)) : NULL;
    lo->dxd = lo->dropout > 0 ? dev_malloc(N * in_widest * sizeof(float)) : NULL;
    int C = acts->spec.shape.C;
    lo->norm_grads = (Norm){dev_malloc((size_t)C * sizeof(float)), dev_malloc((size_t)C * sizeof(float))};
    lo->trained.acts_bytes = (lo->n_sites * N * lo->rank + N * widest + N * lo->rank + (lo->x32 ? N * in_widest : 0) +
                      (lo->xd ? 2 * N * in_widest : 0) + 2 * C) *
                     sizeof(float);
    // the plug-in: LoRA's linears, norms' and embedding's backward; the rest passed to the wrapped
    // layers, but for the MLP, whose dense form calls the table's linears (the adapted ones)
    lo->inner = acts->ops;
    lo->ops = *acts->ops;
    lo->ops.embed_forward = lora_embed_forward;
    lo->ops.embed_backward = lora_embed_backward;
    lo->ops.linear_forward = lora_linear_forward;
    lo->ops.linear_backward = lora_linear_backward;
    lo->ops.norm_forward = lora_norm_forward;
    lo->ops.norm_backward = lora_norm_backward;
    lo->ops.attention_forward = lora_attention_forward;
    lo->ops.attention_backward = lora_attention_backward;
    acts->ops = &lo->ops;
    lo->by_block = !base_params;
    lo->trained.run_block = run_block;
    lo->trained.run_micro = run_micro;
}

void lora_plug_slots(Lora *lo, const float *adapters, const float *base_params, Activations *slots, int n_slots) {
    lora_plug(lo, adapters, base_params, &slots[0]);
    for (int i = 1; i < n_slots; i++) slots[i].ops = &lo->ops;  // the slots' layers are all alike
    lo->recompute_h = n_slots > 1;  // one h per site, shared by the micro-batches in flight
}

void lora_training(Lora *lo, long step, int first_seq, int T) {
    lo->training = lo->dropout > 0;
    lo->step = step;
    lo->first_seq = first_seq;
    lo->rows = (DropoutMask){.seed = lo->seed, .p = lo->dropout, .first_seq = first_seq, .T = T, .n_chunks = 1};
}

void lora_training_chunks(Lora *lo, int pos0, int pos1) {
    lo->rows.n_chunks = 2;
    lo->rows.pos0[0] = pos0, lo->rows.pos0[1] = pos1;
}

void lora_training_done(Lora *lo) { lo->training = false; }

void lora_describe_keys(Lora *lo, const Config *cfg, const ParamLayout *base) {
    lora_describe(lo, base, cfg->lora_rank, cfg->lora_alpha, cfg->lora_targets, config_source("lora_targets"));
    lo->dropout = (float)cfg->lora_dropout;
    lo->seed = (uint64_t)cfg->seed;
}

float *lora_start(const Lora *lo, const Config *cfg, const ParamLayout *base) {
    float *host = malloc_or_die(lo->trained.layout.num_params * sizeof(float));
    if (cfg->lora_adapter[0]) {
        require_adapter_fits_keys(lo, cfg, base);
        lora_read_adapter(lo, cfg->lora_adapter, host);
    } else {
        lora_init(lo, host, (uint64_t)cfg->seed);
    }
    return host;
}

void lora_attach(Lora *lo, const Config *cfg, ParamLayout *layout, ModelBuffers *mb, Activations *acts) {
    memset(lo, 0, sizeof *lo);
    if (!cfg->lora_rank) return;
    lora_describe_keys(lo, cfg, layout);
    float *host = lora_start(lo, cfg, layout);
    lora_plug(lo, host, mb->params, acts);
    free(host);
    lora_print_summary(lo, layout->num_params);
    trainable_take_base(&lo->trained, layout, mb);
}

Trainable *lora_attach_blocks(Lora *lo, const Config *cfg, const ParamLayout *base, Activations *acts) {
    memset(lo, 0, sizeof *lo);
    if (!cfg->lora_rank) return NULL;
    lora_describe_keys(lo, cfg, base);
    float *host = lora_start(lo, cfg, base);  // the same on every rank: the replicas start alike
    lora_plug(lo, host, NULL, acts);          // no base address: the blocks are known by index
    free(host);
    lora_print_summary(lo, base->num_params);
    return &lo->trained;
}

// host buffers: part's tensors from whole's of the same name
static void take_by_name(const ParamLayout *whole, const float *from, const ParamLayout *part, float *to) {
    for (int i = 0; i < part->num_tensors; i++) {
        const TensorInfo *t = &part->tensors[i], *w = layout_tensor(whole, t->name);
        if (!w) fatal("internal: the whole model has no adapter %s", t->name);
        memcpy(to + t->offset, from + w->offset, t->numel * sizeof(float));
    }
}

Trainable *lora_attach_part(Lora *lo, const Config *cfg, ParamLayout *layout, ParamLayout *full, ModelBuffers *mb,
                            Activations *slots, int n_slots) {
    memset(lo, 0, sizeof *lo);
    if (!cfg->lora_rank) return NULL;
    Lora whole;
    lora_describe_keys(&whole, cfg, full);
    float *all = lora_start(&whole, cfg, full);  // the values every part starts from
    lora_describe_keys(lo, cfg, layout);
    float *mine = malloc_or_die(lo->trained.layout.num_params * sizeof(float));
    take_by_name(&whole.trained.layout, all, &lo->trained.layout, mine);
    lora_plug_slots(lo, mine, mb->params, slots, n_slots);
    free(mine), free(all);
    lora_print_summary(lo, layout->num_params);
    trainable_take_base(&lo->trained, layout, mb);
    gpt_layout_free(full);
    *full = whole.trained.layout;  // the table the saved adapter is assembled in
    whole.trained.layout = (ParamLayout){0};
    lora_free(&whole);
    return &lo->trained;
}

void lora_print_summary(const Lora *lo, size_t base_params) {
    size_t n = lo->trained.layout.num_params;
    if (log_rank() == 0)
        printf("LoRA: r %d, alpha %g on %s: %d adapters, %zu trained parameters (%.2f%% of the base's %zu, frozen)\n",
               lo->rank, lo->alpha, lo->targets, lo->n_sites, n, 100.0 * (double)n / base_params, base_params);
}

void lora_save(const Config *cfg, const ParamLayout *adapters, const float *host) {
    char targets[256] = "";  // the modules' last names, in the order the adapters first name them
    for (int i = 0; i < adapters->num_tensors; i++) {
        char module[64];
        module_of(module, sizeof module, adapters->tensors[i].name);  // <module>.lora_A
        *strrchr(module, '.') = '\0';
        const char *last = strrchr(module, '.') + 1;
        char padded[80], list[260];
        snprintf(padded, sizeof padded, ",%s,", last);
        snprintf(list, sizeof list, ",%s,", targets);
        if (strstr(list, padded)) continue;
        size_t n = strlen(targets);
        snprintf(targets + n, sizeof targets - n, "%s%s", n ? "," : "", last);
    }
    Lora lo = {.rank = adapters->tensors[0].shape[0], .alpha = (float)cfg->lora_alpha,
               .dropout = (float)cfg->lora_dropout, .arch = adapters->arch, .trained.layout = *adapters};
    snprintf(lo.targets, sizeof lo.targets, "%s", targets);
    lora_write_adapter(&lo, cfg->out_dir, host, cfg->init_from);
}

void lora_free(Lora *lo) {
    for (int i = 0; i < lo->n_sites; i++) dev_free(lo->sites[i].h);
    free(lo->sites);
    if (lo->trained.base_params) {  // lora_attach: the adapters' buffers and table are the stage's now
        trainable_free_base(&lo->trained);
    } else {
        gpt_layout_free(&lo->trained.layout);
        dev_free(lo->trained.params), dev_free(lo->trained.grads), dev_free(lo->trained.m), dev_free(lo->trained.v);
    }
    dev_free(lo->dy), dev_free(lo->dh), dev_free(lo->x32), dev_free(lo->xd), dev_free(lo->dxd);
    dev_free(lo->norm_grads.w), dev_free(lo->norm_grads.b);
    memset(lo, 0, sizeof *lo);
}
