// gpt.c: GPT-2 (pre-LayerNorm blocks, causal multi-head attention, GELU-tanh MLP, tied lm_head)
// and phi-1_5 (the same block with one LayerNorm feeding attention and MLP in parallel, rotary
// positions, an untied lm_head with a bias): their descriptions, the layout of their parameters,
// and the one block's layer steps over a LayerOps table.
// Backward mirrors forward line for line.
#include "gpt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "log.h"
#include "moe.h"
#include "ops.h"
#include "trace.h"

int gpt_padded_vocab(int vocab_size) { return (vocab_size + 127) / 128 * 128; }

// ---- 1. the description -----------------------------------------------------------------------

static const TensorSpec GPT2_ROOT[] = {
    {"transformer.wte.weight", ROLE_WTE, DIM_VOCAB, DIM_C, INIT_NORMAL, true, false, false},
    {"transformer.wpe.weight", ROLE_WPE, DIM_POSITIONS, DIM_C, INIT_NORMAL, true, false, false},
    {"transformer.ln_f.weight", ROLE_LNF_W, DIM_C, DIM_NONE, INIT_ONES, false, false, false},
    {"transformer.ln_f.bias", ROLE_LNF_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
};

// The projections into the residual stream (INIT_RESIDUAL) are scaled down so that the stream's
// variance does not grow with depth (GPT-2 paper, section 2.3). Linear weights are Conv1D in
// Hugging Face files: stored (in, out), here (out, in).
static const TensorSpec GPT2_BLOCK[] = {
    {"transformer.h.%d.ln_1.weight", ROLE_LN1_W, DIM_C, DIM_NONE, INIT_ONES, false, false, false},
    {"transformer.h.%d.ln_1.bias", ROLE_LN1_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"transformer.h.%d.attn.c_attn.weight", ROLE_QKV_W, DIM_3C, DIM_C, INIT_NORMAL, true, true, false},
    {"transformer.h.%d.attn.c_attn.bias", ROLE_QKV_B, DIM_3C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"transformer.h.%d.attn.c_proj.weight", ROLE_ATTN_PROJ_W, DIM_C, DIM_C, INIT_RESIDUAL, true, true, false},
    {"transformer.h.%d.attn.c_proj.bias", ROLE_ATTN_PROJ_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"transformer.h.%d.ln_2.weight", ROLE_LN2_W, DIM_C, DIM_NONE, INIT_ONES, false, false, false},
    {"transformer.h.%d.ln_2.bias", ROLE_LN2_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"transformer.h.%d.mlp.c_fc.weight", ROLE_FC_W, DIM_4C, DIM_C, INIT_NORMAL, true, true, false},
    {"transformer.h.%d.mlp.c_fc.bias", ROLE_FC_B, DIM_4C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"transformer.h.%d.mlp.c_proj.weight", ROLE_FC_PROJ_W, DIM_C, DIM_4C, INIT_RESIDUAL, true, true, false},
    {"transformer.h.%d.mlp.c_proj.bias", ROLE_FC_PROJ_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
};

// A MoE block's MLP: a router and E experts, each a GPT-2 MLP. Named as Mixtral names its
// sparse block's parts (block_sparse_moe.gate, .experts.N), with GPT-2's names inside an expert.
static const TensorSpec GPT2_MOE_MLP[] = {
    {"transformer.h.%d.mlp.gate.weight", ROLE_ROUTER_W, DIM_EXPERTS, DIM_C, INIT_NORMAL, true, false, false},
    {"transformer.h.%d.mlp.experts.%d.c_fc.weight", ROLE_EXPERT_FC_W, DIM_4C, DIM_C, INIT_NORMAL, true, true, true},
    {"transformer.h.%d.mlp.experts.%d.c_fc.bias", ROLE_EXPERT_FC_B, DIM_4C, DIM_NONE, INIT_ZEROS, false, false, true},
    {"transformer.h.%d.mlp.experts.%d.c_proj.weight", ROLE_EXPERT_PROJ_W, DIM_C, DIM_4C, INIT_RESIDUAL, true, true, true},
    {"transformer.h.%d.mlp.experts.%d.c_proj.bias", ROLE_EXPERT_PROJ_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, true},
};

const Arch ARCH_GPT2 = {"gpt2", GPT2_ROOT, 4, GPT2_BLOCK, 12, true, false, false, GPT2_MOE_MLP, 5};

// phi-1_5 (Hugging Face PhiForCausalLM): no position embedding (rotary instead), an untied lm_head
// with a bias, one LayerNorm per block. Its linear layers are nn.Linear, stored (out, in) as ours.
static const TensorSpec PHI_ROOT[] = {
    {"model.embed_tokens.weight", ROLE_WTE, DIM_VOCAB, DIM_C, INIT_NORMAL, true, false, false},
    {"model.final_layernorm.weight", ROLE_LNF_W, DIM_C, DIM_NONE, INIT_ONES, false, false, false},
    {"model.final_layernorm.bias", ROLE_LNF_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"lm_head.weight", ROLE_HEAD_W, DIM_VOCAB, DIM_C, INIT_NORMAL, true, false, false},
    {"lm_head.bias", ROLE_HEAD_B, DIM_VOCAB, DIM_NONE, INIT_ZEROS, false, false, false},
};

// q, k and v are three files' tensors but one matrix to the block: laid out one after the other
static const TensorSpec PHI_BLOCK[] = {
    {"model.layers.%d.input_layernorm.weight", ROLE_LN1_W, DIM_C, DIM_NONE, INIT_ONES, false, false, false},
    {"model.layers.%d.input_layernorm.bias", ROLE_LN1_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"model.layers.%d.self_attn.q_proj.weight", ROLE_QKV_W, DIM_C, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.self_attn.k_proj.weight", ROLE_QKV_PART, DIM_C, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.self_attn.v_proj.weight", ROLE_QKV_PART, DIM_C, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.self_attn.q_proj.bias", ROLE_QKV_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"model.layers.%d.self_attn.k_proj.bias", ROLE_QKV_PART, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"model.layers.%d.self_attn.v_proj.bias", ROLE_QKV_PART, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"model.layers.%d.self_attn.dense.weight", ROLE_ATTN_PROJ_W, DIM_C, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.self_attn.dense.bias", ROLE_ATTN_PROJ_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"model.layers.%d.mlp.fc1.weight", ROLE_FC_W, DIM_4C, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.mlp.fc1.bias", ROLE_FC_B, DIM_4C, DIM_NONE, INIT_ZEROS, false, false, false},
    {"model.layers.%d.mlp.fc2.weight", ROLE_FC_PROJ_W, DIM_C, DIM_4C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.mlp.fc2.bias", ROLE_FC_PROJ_B, DIM_C, DIM_NONE, INIT_ZEROS, false, false, false},
};

const Arch ARCH_PHI = {"phi", PHI_ROOT, 5, PHI_BLOCK, 14, false, true, true, NULL, 0};

const Arch *gpt_arch(const GPTConfig *cfg) { return cfg->arch ? cfg->arch : &ARCH_GPT2; }

static bool is_moe(int n_experts, int moe_every, int l) { return n_experts > 0 && (l + 1) % moe_every == 0; }
bool gpt_block_is_moe(const GPTConfig *cfg, int l) { return is_moe(cfg->n_experts, cfg->moe_every, l); }

int gpt_moe_blocks(const GPTConfig *cfg, int first, int n) {
    int count = 0;
    for (int l = first; l < first + n; l++) count += gpt_block_is_moe(cfg, l);
    return count;
}

// ---- 2. the layout ----------------------------------------------------------------------------

static int extent(Dim d, const GPTConfig *cfg) {
    switch (d) {
    case DIM_C: return cfg->n_embd;
    case DIM_3C: return 3 * cfg->n_embd;
    case DIM_4C: return 4 * cfg->n_embd;
    case DIM_VOCAB: return cfg->padded_vocab_size;
    case DIM_POSITIONS: return cfg->max_seq_len;
    case DIM_EXPERTS: return cfg->n_experts;
    case DIM_NONE: break;
    }
    return 0;
}

static void add_tensor(ParamLayout *l, const TensorSpec *spec, int block, int expert, int init_stream) {
    const GPTConfig *cfg = &l->cfg;
    TensorInfo *t = &l->tensors[l->num_tensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, spec->hf_name, block, expert);
    t->role = spec->role;
    t->expert = expert;
    t->offset = l->num_params;
    t->ndim = spec->cols == DIM_NONE ? 1 : 2;
    t->shape[0] = extent(spec->rows, cfg);
    t->shape[1] = extent(spec->cols, cfg);
    t->numel = (size_t)t->shape[0] * (size_t)(t->ndim == 2 ? t->shape[1] : 1);
    t->hf_rows = spec->rows == DIM_VOCAB ? cfg->vocab_size : t->shape[0];
    t->hf_transposed = spec->hf_transposed;
    t->decay = spec->decay;
    t->block = block;
    t->init_stream = init_stream;
    t->init_std = spec->init == INIT_NORMAL ? 0.02f
                  : spec->init == INIT_RESIDUAL ? 0.02f / sqrtf(2.0f * (float)cfg->n_layer) : 0.0f;
    t->init_value = spec->init == INIT_ONES ? 1.0f : 0.0f;
    l->num_params += t->numel;
}

// which root tensors a range holds: the embedding's with the embedding, the final LayerNorm
// (and a tied lm_head's wte) with the head
static bool holds_root(const ParamLayout *l, TensorRole role) {
    bool embedding = role == ROLE_WTE || role == ROLE_WPE;
    if (embedding && l->has_embed) return true;
    return l->has_head && (!embedding || (role == ROLE_WTE && l->arch->tied_head));
}

static bool is_mlp_role(TensorRole r) {
    return r == ROLE_FC_W || r == ROLE_FC_B || r == ROLE_FC_PROJ_W || r == ROLE_FC_PROJ_B;
}

// the tensors of a MoE block's MLP: the router, then each expert's, expert by expert
static int moe_mlp_tensors(const Arch *arch, int n_experts) {
    int n = 0;
    for (int i = 0; i < arch->n_moe_mlp; i++) n += arch->moe_mlp[i].per_expert ? n_experts : 1;
    return n;
}

static int block_tensors(const Arch *arch, const GPTConfig *cfg, int b) {
    int n = arch->n_block;
    if (!gpt_block_is_moe(cfg, b)) return n;
    for (int i = 0; i < arch->n_block; i++) n -= is_mlp_role(arch->block[i].role);
    return n + moe_mlp_tensors(arch, cfg->n_experts);
}

// A block's tensors in buffer order; a MoE block's MLP holds the experts [e_first, e_first + e_n).
// Each tensor's random stream is its index in the whole model, whatever the range holds.
static void add_block(ParamLayout *l, int b, int stream) {
    const Arch *arch = l->arch;
    bool moe = gpt_block_is_moe(&l->cfg, b);
    for (int i = 0; i < arch->n_block; i++)
        if (!moe || !is_mlp_role(arch->block[i].role)) add_tensor(l, &arch->block[i], b, -1, stream++);
    if (!moe) return;
    int n_per_expert = 0;
    for (int i = 0; i < arch->n_moe_mlp; i++) n_per_expert += arch->moe_mlp[i].per_expert;
    for (int i = 0; i < arch->n_moe_mlp; i++)
        if (!arch->moe_mlp[i].per_expert) add_tensor(l, &arch->moe_mlp[i], b, -1, stream++);
    for (int e = l->first_expert; e < l->first_expert + l->n_experts_held; e++)
        for (int i = 0, j = 0; i < arch->n_moe_mlp; i++)
            if (arch->moe_mlp[i].per_expert) add_tensor(l, &arch->moe_mlp[i], b, e, stream + e * n_per_expert + j++);
}

static void lay_out(ParamLayout *l, const GPTConfig *cfg, int first, int n, bool embed, bool head,
                    int first_expert, int n_experts) {
    const Arch *arch = gpt_arch(cfg);
    if (cfg->n_experts && !arch->moe_mlp) fatal("the %s architecture has no mixture-of-experts version", arch->name);
    memset(l, 0, sizeof *l);
    l->cfg = *cfg;
    l->arch = arch;
    l->first_block = first;
    l->n_blocks = n;
    l->has_embed = embed;
    l->has_head = head;
    l->first_expert = first_expert;
    l->n_experts_held = n_experts;
    int max_tensors = arch->n_root, stream = arch->n_root;
    for (int b = first; b < first + n; b++) max_tensors += block_tensors(arch, cfg, b);
    l->tensors = calloc_or_die((size_t)max_tensors, sizeof(TensorInfo));
    l->block_first = calloc_or_die((size_t)n + 1, sizeof(size_t));
    for (int i = 0; i < arch->n_root; i++)
        if (holds_root(l, arch->root[i].role)) add_tensor(l, &arch->root[i], -1, -1, i);
    l->root_numel = l->num_params;
    for (int b = 0; b < first; b++) stream += block_tensors(arch, cfg, b);
    for (int b = first; b < first + n; b++) {
        l->block_first[b - first] = l->num_params;
        add_block(l, b, stream);
        stream += block_tensors(arch, cfg, b);
    }
    l->block_first[n] = l->num_params;
}

void gpt_layout_range(ParamLayout *l, const GPTConfig *cfg, int first, int n, bool embed, bool head) {
    lay_out(l, cfg, first, n, embed, head, 0, cfg->n_experts);
}

void gpt_layout_experts(ParamLayout *l, const GPTConfig *cfg, int first_expert, int n) {
    lay_out(l, cfg, 0, cfg->n_layer, true, true, first_expert, n);
}

void gpt_layout(ParamLayout *l, const GPTConfig *cfg) {
    gpt_layout_range(l, cfg, 0, cfg->n_layer, true, true);
}

void gpt_layout_free(ParamLayout *l) {
    free(l->tensors);
    free(l->block_first);
    l->tensors = NULL;
    l->block_first = NULL;
}

const TensorInfo *layout_tensor(const ParamLayout *l, const char *name) {
    for (int i = 0; i < l->num_tensors; i++)
        if (strcmp(l->tensors[i].name, name) == 0) return &l->tensors[i];
    return NULL;
}

static int held_block(const ParamLayout *l, int block) {
    if (block < l->first_block || block >= l->first_block + l->n_blocks)
        fatal("internal: block %d is not in this layout's [%d, %d)", block, l->first_block,
              l->first_block + l->n_blocks);
    return block - l->first_block;
}

size_t layout_block_start(const ParamLayout *l, int block) { return l->block_first[held_block(l, block)]; }

size_t layout_block_numel(const ParamLayout *l, int block) {
    int i = held_block(l, block);
    return l->block_first[i + 1] - l->block_first[i];
}

void layout_copy_tensors(const ParamLayout *part, float *part_buf, const ParamLayout *whole, float *whole_buf,
                         bool to_whole, TensorFilter take, const void *ctx) {
    for (int i = 0; i < part->num_tensors; i++) {
        const TensorInfo *t = &part->tensors[i];
        if (take && !take(t, ctx)) continue;
        const TensorInfo *f = layout_tensor(whole, t->name);
        if (!f) fatal("internal: the whole model has no tensor %s", t->name);
        float *dst = to_whole ? whole_buf + f->offset : part_buf + t->offset;
        const float *src = to_whole ? part_buf + t->offset : whole_buf + f->offset;
        dev_copy(dst, src, t->numel * sizeof(float));
    }
}

// where a tensor of a given role is pointed to, by name
static float **block_slot(BlockWeights *bw, const TensorInfo *t) {
    switch (t->role) {
    case ROLE_LN1_W: return &bw->ln1.w;
    case ROLE_LN1_B: return &bw->ln1.b;
    case ROLE_QKV_W: return &bw->qkv.w;
    case ROLE_QKV_B: return &bw->qkv.b;
    case ROLE_ATTN_PROJ_W: return &bw->attn_proj.w;
    case ROLE_ATTN_PROJ_B: return &bw->attn_proj.b;
    case ROLE_LN2_W: return &bw->ln2.w;
    case ROLE_LN2_B: return &bw->ln2.b;
    case ROLE_FC_W: return &bw->fc.w;
    case ROLE_FC_B: return &bw->fc.b;
    case ROLE_FC_PROJ_W: return &bw->fc_proj.w;
    case ROLE_FC_PROJ_B: return &bw->fc_proj.b;
    case ROLE_ROUTER_W: return &bw->router.w;
    case ROLE_EXPERT_FC_W: return &bw->expert_fc[t->expert].w;
    case ROLE_EXPERT_FC_B: return &bw->expert_fc[t->expert].b;
    case ROLE_EXPERT_PROJ_W: return &bw->expert_proj[t->expert].w;
    case ROLE_EXPERT_PROJ_B: return &bw->expert_proj[t->expert].b;
    case ROLE_QKV_PART: return NULL;  // reached through the q tensor before it
    default: fatal("internal: tensor role %d is not a block's", (int)t->role);
    }
}

static float **root_slot(Weights *w, TensorRole role) {
    switch (role) {
    case ROLE_WTE: return &w->wte;
    case ROLE_WPE: return &w->wpe;
    case ROLE_LNF_W: return &w->lnf.w;
    case ROLE_LNF_B: return &w->lnf.b;
    case ROLE_HEAD_W: return &w->head.w;
    case ROLE_HEAD_B: return &w->head.b;
    default: fatal("internal: tensor role %d is not a root tensor", (int)role);
    }
}

// the bf16 copy of a matrix that a linear layer multiplies, or NULL
static bf16 **block_slot16(BlockWeights *bw, TensorRole role) {
    switch (role) {
    case ROLE_QKV_W: return &bw->qkv.w16;
    case ROLE_ATTN_PROJ_W: return &bw->attn_proj.w16;
    case ROLE_FC_W: return &bw->fc.w16;
    case ROLE_FC_PROJ_W: return &bw->fc_proj.w16;
    default: return NULL;
    }
}

bool block_role_read_in_16_bits(TensorRole role) {
    BlockWeights bw;
    return block_slot16(&bw, role) != NULL;
}

void root_weights_point(Weights *w, const ParamLayout *l, float *root, bf16 *root16) {
    memset(w, 0, sizeof *w);
    w->n_layer = l->cfg.n_layer;
    for (int i = 0; i < l->num_tensors; i++)
        if (l->tensors[i].block < 0) *root_slot(w, l->tensors[i].role) = root + l->tensors[i].offset;
    if (l->arch->tied_head) w->head.w = w->wte;  // the lm_head is the embedding itself
    if (root16 && w->head.w) w->head.w16 = root16 + (w->head.w - root);
}

static void point_block_tensor(BlockWeights *bw, const TensorInfo *t, float *at) {
    float **slot = block_slot(bw, t);
    if (slot) *slot = at;
}

void weights_point(Weights *w, const ParamLayout *l, float *flat) {
    root_weights_point(w, l, flat, NULL);
    w->h = calloc_or_die((size_t)w->n_layer, sizeof(BlockWeights));
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *t = &l->tensors[i];
        if (t->block >= 0) point_block_tensor(&w->h[t->block], t, flat + t->offset);
    }
}

void block_weights_point(BlockWeights *bw, const ParamLayout *l, int block, float *unit) {
    size_t start = layout_block_start(l, block);
    memset(bw, 0, sizeof *bw);
    for (int i = 0; i < l->num_tensors; i++)
        if (l->tensors[i].block == block) point_block_tensor(bw, &l->tensors[i], unit + (l->tensors[i].offset - start));
}

void weights_point_bf16(Weights *w, const ParamLayout *l, bf16 *flat16) {
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *t = &l->tensors[i];
        if (t->block >= 0) {
            bf16 **slot = block_slot16(&w->h[t->block], t->role);
            if (slot) *slot = flat16 + t->offset;
        } else if ((t->role == ROLE_WTE && l->arch->tied_head) || t->role == ROLE_HEAD_W) {
            w->head.w16 = flat16 + t->offset;
        }
    }
}

void block_weights_point_bf16(BlockWeights *bw, const ParamLayout *l, int block, bf16 *unit16) {
    size_t start = layout_block_start(l, block);
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *t = &l->tensors[i];
        bf16 **slot = t->block == block ? block_slot16(bw, t->role) : NULL;
        if (slot) *slot = unit16 + (t->offset - start);
    }
}

void weights_free(Weights *w) {
    free(w->h);
    w->h = NULL;
}

// Initialises the part of tensor t that falls in the flat range [first, first + n).
static void init_tensor_part(float *slice, const TensorInfo *t, size_t first, size_t n, uint64_t seed) {
    size_t lo = t->offset > first ? t->offset : first;
    size_t hi = t->offset + t->numel < first + n ? t->offset + t->numel : first + n;
    if (lo >= hi) return;
    float *out = slice + (lo - first);
    size_t count = hi - lo, start = lo - t->offset;
    if (t->init_std == 0) {
        fill_constant(out, count, t->init_value);
        return;
    }
    // the rows past the real vocabulary never see a token: keep them zero
    size_t real = (size_t)t->hf_rows * (size_t)(t->ndim == 2 ? t->shape[1] : 1);
    size_t random = start < real ? (real - start < count ? real - start : count) : 0;
    init_normal(out, random, seed, (uint64_t)t->init_stream, start, t->init_std);
    if (random < count) fill_constant(out + random, count - random, 0.0f);
}

void gpt_init_range(float *slice, const ParamLayout *l, size_t first, size_t n, uint64_t seed) {
    for (int i = 0; i < l->num_tensors; i++) init_tensor_part(slice, &l->tensors[i], first, n, seed);
}

// ---- 3. the layers on one rank ----------------------------------------------------------------

ModelShape whole_model_shape(const GPTConfig *cfg) {
    int C = cfg->n_embd;
    return (ModelShape){.C = C, .C_total = C, .n_head = cfg->n_head, .C_attn = C, .C_mlp = 4 * C,
                        .v_lo = 0, .v_rows = cfg->padded_vocab_size,
                        .parallel_block = gpt_arch(cfg)->parallel_block,
                        .rotary_dim = gpt_arch(cfg)->rotary ? cfg->rotary_dim : 0, .rope_theta = cfg->rope_theta,
                        .n_experts = cfg->n_experts, .top_k = cfg->experts_per_token,
                        .capacity_factor = cfg->capacity_factor, .aux_loss_coef = cfg->aux_loss_coef,
                        .moe_every = cfg->moe_every, .first_expert = 0, .n_local_experts = cfg->n_experts, .ep = 1};
}

bool shape_block_is_moe(const ModelShape *s, int l) { return is_moe(s->n_experts, s->moe_every, l); }

// out (N, OC) = inp (N, C) @ w^T + b. With bf16 weights (w16 set) the input is rounded to bf16
// into inp16, which is also what backward will read, and the matmul accumulates in f32.
void linear_forward(float *out, const float *inp, bf16 *inp16, const Linear *w, int N, int C, int OC) {
    // bf16 activations keep no f32 matmul input for backward: an f32 layer there would read scratch
    if (inp16 && !w->w16) fatal("internal: activations allocated for bf16, weights without a bf16 copy");
    if (!w->w16) {
        matmul_forward(out, inp, w->w, w->b, N, C, OC);
        return;
    }
    if (!inp16) fatal("internal: bf16 weights need activations allocated for bf16");
    cast_to_bf16(inp16, inp, (size_t)N * C);
    matmul_forward_bf16(out, inp16, w->w16, w->b, N, C, OC);
}

static void zero_floats(float *x, size_t n) { dev_zero(x, n * sizeof(float)); }

static void serial_embed_forward(LayerOps *ops, float *out, const int *tokens, const int *start,
                                 const Weights *w, const ModelShape *s, int B, int T) {
    (void)ops;
    embedding_forward(out, tokens, start, w->wte, w->wpe, s->v_lo, s->v_rows, B, T, s->C);
}

static void serial_embed_backward(LayerOps *ops, Weights *g, const float *dout, const int *tokens,
                                  const ModelShape *s, int B, int T) {
    (void)ops;
    embedding_backward(g->wte, g->wpe, dout, tokens, s->v_lo, s->v_rows, B, T, s->C);
}

static void serial_linear_forward(LayerOps *ops, LinearKind k, float *out, const float *inp, bf16 *inp16,
                                  const Linear *w, int N, int in_dim, int out_dim) {
    (void)ops, (void)k;
    linear_forward(out, inp, inp16, w, N, in_dim, out_dim);
}

// the matching backward: in bf16 the output gradient is rounded too (into dout16); the gradients
// come out in f32 and the bias gradient is summed from the f32 dout
static void serial_linear_backward(LayerOps *ops, LinearKind k, float *dinp, Linear *g, const float *dout,
                                   bf16 *dout16, const float *inp, const bf16 *inp16, const Linear *w,
                                   int N, int in_dim, int out_dim) {
    (void)ops, (void)k;
    if (!w->w16) {
        matmul_backward(dinp, g->w, g->b, dout, inp, w->w, N, in_dim, out_dim);
        return;
    }
    cast_gradient_to_bf16(dout16, dout, (size_t)N * out_dim);
    matmul_backward_bf16(dinp, g->w, g->b, dout, dout16, inp16, w->w16, N, in_dim, out_dim);
}

static void serial_norm_forward(LayerOps *ops, float *out, float *mean, float *rstd, const float *inp,
                                const Norm *w, const ModelShape *s, int N) {
    (void)ops;
    layernorm_forward(out, mean, rstd, inp, w->w, w->b, N, s->C);
}

static void serial_norm_backward(LayerOps *ops, float *dinp, Norm *g, const float *dout, const float *inp,
                                 const Norm *w, const float *mean, const float *rstd, const ModelShape *s,
                                 int N) {
    (void)ops;
    layernorm_backward(dinp, g->w, g->b, dout, inp, w->w, mean, rstd, N, s->C);
}

static void serial_attention_forward(LayerOps *ops, int layer, float *out, float *att, const float *qkv,
                                     const ModelShape *s, int B, int T) {
    (void)ops, (void)layer;
    attention_forward(out, att, qkv, B, T, s->C_attn, s->n_head);
}

static BlockActs *block_acts(const Activations *a, int l) { return &a->blocks[l - a->spec.first_layer]; }
static bf16 *mlp_input16(const BlockActs *k, const ModelShape *s) { return s->parallel_block ? k->ln1_16 : k->ln2_16; }

// out = fc_proj(gelu(fc(inp)))
static void dense_mlp_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T) {
    const ModelShape *s = &a->spec.shape;
    BlockActs *k = block_acts(a, l);
    int N = B * T, C = s->C, F = s->C_mlp;
    ops->linear_forward(ops, LIN_FC, k->fch, block_mlp_input(a, l), mlp_input16(k, s), &w->fc, N, C, F);
    gelu_forward(k->fch_gelu, k->fch, (size_t)N * F);
    ops->linear_forward(ops, LIN_FC_PROJ, k->out, k->fch_gelu, k->fch_gelu16, &w->fc_proj, N, F, C);
}

static void dense_mlp_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w,
                               BlockWeights *g, const float *dout, int B, int T) {
    const ModelShape *s = &a->spec.shape;
    BlockActs *k = block_acts(a, l);
    int N = B * T, C = s->C, F = s->C_mlp;
    float *dfch_gelu = a->dbig, *dfch = a->dbig2;
    zero_floats(dfch_gelu, (size_t)N * F);
    zero_floats(dfch, (size_t)N * F);
    ops->linear_backward(ops, LIN_FC_PROJ, dfch_gelu, &g->fc_proj, dout, a->dout16, k->fch_gelu,
                         k->fch_gelu16, &w->fc_proj, N, F, C);
    gelu_backward(dfch, k->fch, dfch_gelu, (size_t)N * F);
    ops->linear_backward(ops, LIN_FC, dinp, &g->fc, dfch, a->dout16, block_mlp_input(a, l), mlp_input16(k, s),
                         &w->fc, N, C, F);
}

LayerOps *serial_layer_ops(void) {
    static LayerOps serial = {serial_embed_forward, serial_embed_backward, serial_linear_forward,
                              serial_linear_backward, serial_norm_forward, serial_norm_backward,
                              serial_attention_forward, dense_mlp_forward, dense_mlp_backward,
                              moe_forward, moe_backward};
    return &serial;
}

// ---- activations ------------------------------------------------------------------------------

typedef struct {
    Activations *a;
    bool count_only;  // add up the bytes, allocate nothing (acts_bytes)
    void **owned;     // every buffer allocated, to free
    int n_owned;
    void **host_owned;  // and every host one
    int n_host_owned;
} Alloc;

static void own(void ***list, int *n, void *p) {
    *list = realloc(*list, (size_t)(*n + 1) * sizeof(void *));
    if (!*list) fatal("out of host memory");
    (*list)[(*n)++] = p;
}

static void *alloc_bytes(Alloc *al, size_t bytes) {
    al->a->bytes += bytes;
    if (al->count_only) return NULL;
    void *p = dev_malloc(bytes);
    own(&al->owned, &al->n_owned, p);
    return p;
}

// host memory (the MoE routing), which the device bytes do not count
static void *alloc_host(Alloc *al, size_t bytes) {
    if (al->count_only) return NULL;
    void *p = calloc_or_die(1, bytes);
    own(&al->host_owned, &al->n_host_owned, p);
    return p;
}

static float *alloc_floats(Alloc *al, size_t n) { return alloc_bytes(al, n * sizeof(float)); }
static bf16 *alloc_bf16(Alloc *al, size_t n, bool on) { return on ? alloc_bytes(al, n * sizeof(bf16)) : NULL; }

// In bf16 mode a matmul input is read in f32 only by the cast that rounds it, right before its
// matmul: the backward scratch (unused during forward) holds it, and each block keeps only its
// bf16 copy. In f32 mode each block keeps its own for backward.
static float *matmul_input(Alloc *al, size_t n) {
    return al->a->spec.bf16 ? al->a->dbig : alloc_floats(al, n);
}

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

// A MoE block's routing and expert rows. The held experts receive at most R rows: every token of
// the group's ranks routed here, or with a capacity, the held experts' capacity per sequence.
static MoEActs *alloc_moe(Alloc *al) {
    const ActsSpec *sp = &al->a->spec;
    const ModelShape *s = &sp->shape;
    size_t N = (size_t)sp->B * sp->T, C = s->C, F = s->C_mlp, E = s->n_experts, k = s->top_k;
    MoEActs *m = alloc_host(al, sizeof(MoEActs));
    MoEActs shape = {.N = (int)N, .R = moe_receive_capacity(s, sp->B, sp->T)};
    if (!m) m = &shape;  // counting only: the sizes, nothing kept
    *m = shape;
    size_t R = (size_t)m->R;
    m->logits = alloc_floats(al, N * E);
    m->probs = alloc_host(al, N * E * sizeof(float));
    m->choice = alloc_host(al, N * k * sizeof(int));
    m->weight = alloc_host(al, N * k * sizeof(float));
    m->slot = alloc_host(al, N * k * sizeof(int));
    m->routed = alloc_host(al, E * sizeof(int));
    m->expert_rows = alloc_host(al, ((size_t)s->n_local_experts + 1) * sizeof(int));
    m->slot_dev = alloc_bytes(al, N * k * sizeof(int));
    m->weight_dev = alloc_floats(al, N * k);
    m->packed = alloc_floats(al, N * k * C);
    m->expert_in = s->ep > 1 ? alloc_floats(al, R * C) : m->packed;
    m->fch = alloc_floats(al, R * F);
    m->fch_gelu = alloc_floats(al, R * F);
    m->expert_out = alloc_floats(al, R * C);
    m->returned = s->ep > 1 ? alloc_floats(al, N * k * C) : m->expert_out;
    return m == &shape ? NULL : m;
}

static void alloc_moe_scratch(Alloc *al) {
    const ActsSpec *sp = &al->a->spec;
    const ModelShape *s = &sp->shape;
    size_t N = (size_t)sp->B * sp->T, C = s->C, F = s->C_mlp, E = s->n_experts, k = s->top_k;
    size_t R = (size_t)moe_receive_capacity(s, sp->B, sp->T);
    MoEScratch *d = &al->a->moe;
    if (s->ep > 1) {  // the rows' gradients before and after their trip to the experts' ranks
        d->dreturned = alloc_floats(al, N * k * C);
        d->dpacked = alloc_floats(al, N * k * C);
    }
    d->dexpert_out = alloc_floats(al, R * C);
    d->dexpert_in = alloc_floats(al, R * C);
    d->dfch = alloc_floats(al, R * F);
    d->dfch_gelu = alloc_floats(al, R * F);
    d->dlogits = alloc_floats(al, N * E);
    d->dprobs = alloc_host(al, N * E * sizeof(float));
    d->dweight = alloc_host(al, N * k * sizeof(float));
    d->dweight_dev = alloc_floats(al, N * k);
    al->a->moe_stats.load = alloc_host(al, (size_t)sp->n_layers * E * sizeof(long));
}

// One block's activations: its dense MLP's, its MoE MLP's, or (one set shared by every block, when
// recomputing) both.
static void alloc_block(Alloc *al, BlockActs *k, bool dense, bool moe) {
    const ActsSpec *sp = &al->a->spec;
    size_t N = (size_t)sp->B * sp->T, C = sp->shape.C, Ca = sp->shape.C_attn, F = sp->shape.C_mlp;
    bool b16 = sp->bf16;
    // a parallel block's MLP reads ln1 after attention has reused the bf16 mode's scratch: its own
    k->ln1 = sp->shape.parallel_block ? alloc_floats(al, N * C) : matmul_input(al, N * C);
    k->ln1_mean = alloc_floats(al, N);
    k->ln1_rstd = alloc_floats(al, N);
    k->qkv = alloc_floats(al, N * 3 * Ca);
    k->att = alloc_floats(al, (size_t)sp->B * sp->shape.n_head * sp->T * sp->keys);
    k->atty = matmul_input(al, N * Ca);
    k->res2 = alloc_floats(al, N * C);
    if (!sp->shape.parallel_block) {  // a parallel block's MLP reads ln1
        k->ln2 = matmul_input(al, N * C);
        k->ln2_mean = alloc_floats(al, N);
        k->ln2_rstd = alloc_floats(al, N);
    }
    if (moe) k->moe = alloc_moe(al);
    if (dense) {
        k->fch = alloc_floats(al, N * F);
        k->fch_gelu = matmul_input(al, N * F);
    }
    k->out = alloc_floats(al, N * C);
    k->ln1_16 = alloc_bf16(al, N * C, b16);
    k->atty16 = alloc_bf16(al, N * Ca, b16);
    k->ln2_16 = alloc_bf16(al, N * C, b16 && !sp->shape.parallel_block);
    k->fch_gelu16 = alloc_bf16(al, N * F, b16 && dense);
}

ActsSpec whole_model_acts(const GPTConfig *cfg, int B, int T, bool bf16, bool recompute) {
    return (ActsSpec){.B = B, .T = T, .keys = T, .shape = whole_model_shape(cfg), .first_layer = 0,
                      .n_layers = cfg->n_layer, .embed = true, .head = true, .bf16 = bf16,
                      .recompute = recompute};
}

void acts_alloc(Activations *a, const GPTConfig *cfg, int B, int T, int flags) {
    ActsSpec spec = whole_model_acts(cfg, B, T, flags & ACTS_BF16, flags & ACTS_RECOMPUTE);
    acts_alloc_spec(a, &spec);
}

// Lays out the activations of spec, allocating each buffer, or (count_only) adding up their bytes
// alone: the one place that says what a rank keeps, so what is allocated and what is reported agree.
static void lay_out_acts(Activations *a, const ActsSpec *spec, bool count_only) {
    memset(a, 0, sizeof *a);
    a->spec = *spec;
    if (!a->spec.keys) a->spec.keys = spec->T;
    a->ops = spec->ops ? spec->ops : serial_layer_ops();
    Alloc al = {.a = a, .count_only = count_only};
    const ActsSpec *sp = &a->spec;
    size_t N = (size_t)sp->B * sp->T, C = sp->shape.C, Ca = sp->shape.C_attn, F = sp->shape.C_mlp;
    size_t V = sp->shape.v_rows;
    // the backward scratch first: in bf16 mode the forward's f32 matmul inputs pass through dbig
    a->dres = alloc_floats(&al, N * C);
    a->dbig = alloc_floats(&al, N * max3(F, Ca, C));
    a->dbig2 = alloc_floats(&al, N * max3(F, C, 0));
    a->dsmall = alloc_floats(&al, N * max3(C, 3 * Ca, 0));
    a->datt = alloc_floats(&al, (size_t)sp->B * sp->shape.n_head * sp->T * sp->keys);
    if (sp->shape.parallel_block) a->dln = alloc_floats(&al, N * C);
    a->dout16 = alloc_bf16(&al, N * max3(max3(F, 3 * Ca, C), sp->head ? V : 0, 0), sp->bf16);
    a->encoded = alloc_floats(&al, N * C);
    a->blocks = calloc_or_die((size_t)(sp->n_layers > 0 ? sp->n_layers : 1), sizeof(BlockActs));
    int moe_blocks = 0;
    for (int l = sp->first_layer; l < sp->first_layer + sp->n_layers; l++) moe_blocks += shape_block_is_moe(&sp->shape, l);
    if (moe_blocks) alloc_moe_scratch(&al);
    MoEActs *shared_moe = NULL;
    for (int i = 0; i < sp->n_layers; i++) {
        bool moe = shape_block_is_moe(&sp->shape, sp->first_layer + i);
        if (sp->recompute && i > 0) {  // one set of activations, recomputed for each block in
            a->blocks[i] = a->blocks[0];  // backward; each block keeps its output (the next's input)
            a->blocks[i].out = alloc_floats(&al, N * C);
        } else if (sp->recompute) {  // the shared set serves dense and MoE blocks alike
            alloc_block(&al, &a->blocks[i], moe_blocks < sp->n_layers, moe_blocks > 0);
            shared_moe = a->blocks[i].moe;
        } else {
            alloc_block(&al, &a->blocks[i], !moe, moe);
        }
        if (sp->recompute) a->blocks[i].moe = moe ? shared_moe : NULL;  // what makes it a MoE block
    }
    if (sp->embed) a->inputs = alloc_bytes(&al, N * sizeof(int));
    if (sp->head) {
        a->lnf = matmul_input(&al, N * C);
        a->lnf_mean = alloc_floats(&al, N);
        a->lnf_rstd = alloc_floats(&al, N);
        a->lnf16 = alloc_bf16(&al, N * C, sp->bf16);
        a->logits = alloc_floats(&al, N * V);
        a->losses = alloc_floats(&al, N);
        a->targets = alloc_bytes(&al, N * sizeof(int));
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
    const BlockActs *k = block_acts(a, l);
    return a->spec.shape.parallel_block ? k->ln1 : k->ln2;
}

const float *head_input(const Activations *a) { return block_input(a, a->spec.first_layer + a->spec.n_layers); }

// ---- forward ----------------------------------------------------------------------------------

// one span on the trace's compute track (trace.h); layer < 0 for the embedding and the head
static void trace_layer(const char *what, int layer, int m0) {
    if (m0 < 0) return;
    char name[48];
    if (layer >= 0) snprintf(name, sizeof name, "block %d %s", layer, what);
    else snprintf(name, sizeof name, "%s", what);
    trace_span(name, TRACK_COMPUTE, m0, trace_mark(), NULL);
}


void gpt_embed_forward(Activations *a, const Weights *w, int B, int T) {
    int m0 = trace_mark();
    a->ops->embed_forward(a->ops, a->encoded, a->inputs, NULL, w, &a->spec.shape, B, T);
    trace_layer("embedding forward", -1, m0);
}


void gpt_block_forward(Activations *a, int l, const BlockWeights *w, int B, int T) {
    int m0 = trace_mark();
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    BlockActs *k = &a->blocks[l - a->spec.first_layer];
    const float *x = block_input(a, l);
    int N = B * T, C = s->C, Ca = s->C_attn;
    // attention sub-block: res2 = x + proj(attention(rotary(qkv(ln1(x)))))
    ops->norm_forward(ops, k->ln1, k->ln1_mean, k->ln1_rstd, x, &w->ln1, s, N);
    ops->linear_forward(ops, LIN_QKV, k->qkv, k->ln1, k->ln1_16, &w->qkv, N, C, 3 * Ca);
    if (s->rotary_dim) rotary_forward(k->qkv, a->start, B, T, Ca, s->n_head, s->rotary_dim, s->rope_theta);
    ops->attention_forward(ops, l, k->atty, k->att, k->qkv, s, B, T);
    ops->linear_forward(ops, LIN_ATTN_PROJ, k->res2, k->atty, k->atty16, &w->attn_proj, N, Ca, C);
    add_inplace(k->res2, x, (size_t)N * C);
    // MLP sub-block: out = res2 + mlp(ln2(res2)), or in a parallel block out = res2 + mlp(ln1(x));
    // the MLP is proj(gelu(fc(.))), or in a MoE block the router's experts
    if (!s->parallel_block) ops->norm_forward(ops, k->ln2, k->ln2_mean, k->ln2_rstd, k->res2, &w->ln2, s, N);
    if (k->moe) ops->moe_forward(ops, a, l, w, B, T);
    else ops->mlp_forward(ops, a, l, w, B, T);
    add_inplace(k->out, k->res2, (size_t)N * C);
    trace_layer("forward", l, m0);
}

void gpt_head_forward(Activations *a, const float *x, const Weights *w, int N) {
    int m0 = trace_mark();
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    ops->norm_forward(ops, a->lnf, a->lnf_mean, a->lnf_rstd, x, &w->lnf, s, N);
    ops->linear_forward(ops, LIN_HEAD, a->logits, a->lnf, a->lnf16, &w->head, N, s->C, s->v_rows);
    trace_layer("head forward", -1, m0);
}

double gpt_loss_forward_backward(Activations *a, const GPTConfig *cfg, int B, int T, float dloss) {
    int m0 = trace_mark();
    int N = B * T;
    cross_entropy_forward_backward(a->logits, a->losses, a->targets, dloss, N, cfg->vocab_size,
                                   cfg->padded_vocab_size);
    double sum = sum_values(a->losses, (size_t)N);
    trace_layer("loss", -1, m0);
    return sum;
}

double gpt_loss_forward(Activations *a, const GPTConfig *cfg, int B, int T) {
    int N = B * T;
    cross_entropy_forward(a->losses, a->logits, a->targets, N, cfg->vocab_size, cfg->padded_vocab_size);
    return sum_values(a->losses, (size_t)N);
}

// ---- backward: each step undoes its forward, in reverse order ---------------------------------

void gpt_head_backward(Activations *a, const Weights *w, Weights *g, int B, int T) {
    int m0 = trace_mark();
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    int N = B * T;
    float *dlnf = a->dbig;  // (N, C) scratch
    zero_floats(dlnf, (size_t)N * s->C);
    zero_floats(a->dres, (size_t)N * s->C);
    ops->linear_backward(ops, LIN_HEAD, dlnf, &g->head, a->logits, a->dout16, a->lnf, a->lnf16, &w->head,
                         N, s->C, s->v_rows);
    ops->norm_backward(ops, a->dres, &g->lnf, dlnf, head_input(a), &w->lnf, a->lnf_mean, a->lnf_rstd, s, N);
    trace_layer("head backward", -1, m0);
}

void gpt_block_backward(Activations *a, int l, const BlockWeights *w, BlockWeights *g, int B, int T) {
    int m0 = trace_mark();
    if (a->spec.recompute) gpt_block_forward(a, l, w, B, T);  // the activations it did not keep
    LayerOps *ops = a->ops;
    const ModelShape *s = &a->spec.shape;
    BlockActs *k = &a->blocks[l - a->spec.first_layer];
    const float *x = block_input(a, l);
    int N = B * T, C = s->C, Ca = s->C_attn;
    float *dres = a->dres;  // dL/d(out) now; the residual connection passes it on unchanged
    // MLP sub-block, backwards: out = res2 + mlp(ln2(res2)). In a parallel block the MLP's input
    // is ln1(x): its gradient waits in dln for attention's (dsmall is attention's dqkv).
    float *dln2 = s->parallel_block ? a->dln : a->dsmall;
    zero_floats(dln2, (size_t)N * C);
    if (k->moe) ops->moe_backward(ops, a, l, dln2, w, g, dres, B, T);
    else ops->mlp_backward(ops, a, l, dln2, w, g, dres, B, T);
    if (!s->parallel_block)
        ops->norm_backward(ops, dres, &g->ln2, dln2, k->res2, &w->ln2, k->ln2_mean, k->ln2_rstd, s, N);
    // dres is now dL/d(res2). Attention sub-block, backwards: res2 = x + proj(attention(ln1(x)))
    float *datty = a->dbig, *dqkv = a->dsmall, *dln1 = a->dbig2;
    zero_floats(datty, (size_t)N * Ca);
    zero_floats(dqkv, (size_t)N * 3 * Ca);
    zero_floats(dln1, (size_t)N * C);
    ops->linear_backward(ops, LIN_ATTN_PROJ, datty, &g->attn_proj, dres, a->dout16, k->atty, k->atty16,
                         &w->attn_proj, N, Ca, C);
    attention_backward(dqkv, a->datt, datty, k->qkv, k->att, B, T, Ca, s->n_head);
    if (s->rotary_dim) rotary_backward(dqkv, a->start, B, T, Ca, s->n_head, s->rotary_dim, s->rope_theta);
    ops->linear_backward(ops, LIN_QKV, dln1, &g->qkv, dqkv, a->dout16, k->ln1, k->ln1_16, &w->qkv, N, C, 3 * Ca);
    // ln1(x) fed attention and the MLP: its gradient is the sum. (Each linear layer's backward
    // completes its own dinp, a tensor-parallel one with an all-reduce: the two must not share one.)
    if (s->parallel_block) add_inplace(dln1, a->dln, (size_t)N * C);
    ops->norm_backward(ops, dres, &g->ln1, dln1, x, &w->ln1, k->ln1_mean, k->ln1_rstd, s, N);
    trace_layer("backward", l, m0);
}

void gpt_embed_backward(Activations *a, Weights *g, int B, int T) {
    int m0 = trace_mark();
    a->ops->embed_backward(a->ops, g, a->dres, a->inputs, &a->spec.shape, B, T);
    trace_layer("embedding backward", -1, m0);
}

// ---- the passes -------------------------------------------------------------------------------

static void upload_tokens(int *dst, const int *src, int B, int T) {
    if (src) copy_to_device(dst, src, (size_t)B * T * sizeof(int));
}

void gpt_forward(Activations *a, const Weights *w, const int *inputs, int B, int T) {
    const ActsSpec *sp = &a->spec;
    if (B > sp->B || T > sp->T) fatal("internal: batch %dx%d exceeds the activations' %dx%d", B, T, sp->B, sp->T);
    if (sp->embed) {
        upload_tokens(a->inputs, inputs, B, T);
        gpt_embed_forward(a, w, B, T);
    }
    for (int l = sp->first_layer; l < sp->first_layer + sp->n_layers; l++) gpt_block_forward(a, l, &w->h[l], B, T);
    if (sp->head) gpt_head_forward(a, head_input(a), w, B * T);
}

void gpt_backward(Activations *a, const Weights *w, Weights *g, int B, int T, GradReadyHook hook, void *ctx) {
    const ActsSpec *sp = &a->spec;
    if (sp->head) gpt_head_backward(a, w, g, B, T);
    for (int l = sp->first_layer + sp->n_layers - 1; l >= sp->first_layer; l--) {
        gpt_block_backward(a, l, &w->h[l], &g->h[l], B, T);
        if (hook) hook(l, ctx);
    }
    if (sp->embed) gpt_embed_backward(a, g, B, T);
    if (hook) hook(-1, ctx);
}

double gpt_forward_backward_hooked(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                                   const int *inputs, const int *targets, int B, int T, float dloss,
                                   GradReadyHook hook, void *ctx) {
    gpt_forward(a, w, inputs, B, T);
    upload_tokens(a->targets, targets, B, T);
    double loss_sum = gpt_loss_forward_backward(a, cfg, B, T, dloss);
    gpt_backward(a, w, g, B, T, hook, ctx);
    return loss_sum;
}

double gpt_forward_backward(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                            const int *inputs, const int *targets, int B, int T, float dloss) {
    return gpt_forward_backward_hooked(a, w, g, cfg, inputs, targets, B, T, dloss, NULL, NULL);
}
