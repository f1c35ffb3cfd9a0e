// layout.c: the descriptions of GPT-2, phi-1_5 and Llama (gpt.c runs their block), the layout of their
// parameters in one flat buffer, the named views into it, and their initial values.
#include "layout.h"
#include "moe_mlp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "ops/ops.h"

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

const Arch ARCH_GPT2 = {"gpt2", GPT2_ROOT, 4, GPT2_BLOCK, 12, true, false, false, true, false, false};

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

const Arch ARCH_PHI = {"phi", PHI_ROOT, 5, PHI_BLOCK, 14, false, true, true, false, false, false};

// Llama (Hugging Face LlamaForCausalLM): RMSNorms without biases, rotary positions, no biases at
// all, an lm_head of its own unless tie_word_embeddings. k and v have n_kv_head heads
// (grouped-query attention); gate and up, like q, k and v, are laid out back to back.
static const TensorSpec LLAMA_ROOT[] = {
    {"model.embed_tokens.weight", ROLE_WTE, DIM_VOCAB, DIM_C, INIT_NORMAL, true, false, false},
    {"model.norm.weight", ROLE_LNF_W, DIM_C, DIM_NONE, INIT_ONES, false, false, false},
    {"lm_head.weight", ROLE_HEAD_W, DIM_VOCAB, DIM_C, INIT_NORMAL, true, false, false},
};

static const TensorSpec LLAMA_BLOCK[] = {
    {"model.layers.%d.input_layernorm.weight", ROLE_LN1_W, DIM_C, DIM_NONE, INIT_ONES, false, false, false},
    {"model.layers.%d.self_attn.q_proj.weight", ROLE_QKV_W, DIM_C, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.self_attn.k_proj.weight", ROLE_QKV_PART, DIM_KV, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.self_attn.v_proj.weight", ROLE_QKV_PART, DIM_KV, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.self_attn.o_proj.weight", ROLE_ATTN_PROJ_W, DIM_C, DIM_C, INIT_RESIDUAL, true, false, false},
    {"model.layers.%d.post_attention_layernorm.weight", ROLE_LN2_W, DIM_C, DIM_NONE, INIT_ONES, false, false, false},
    {"model.layers.%d.mlp.gate_proj.weight", ROLE_FC_W, DIM_FFN, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.mlp.up_proj.weight", ROLE_FC_PART, DIM_FFN, DIM_C, INIT_NORMAL, true, false, false},
    {"model.layers.%d.mlp.down_proj.weight", ROLE_FC_PROJ_W, DIM_C, DIM_FFN, INIT_RESIDUAL, true, false, false},
};

const Arch ARCH_LLAMA = {"llama", LLAMA_ROOT, 3, LLAMA_BLOCK, 9, false, false, true, false, true, true};
const Arch ARCH_LLAMA_TIED = {"llama", LLAMA_ROOT, 2, LLAMA_BLOCK, 9, true, false, true, false, true, true};

const Arch *gpt_arch(const GPTConfig *cfg) { return cfg->arch ? cfg->arch : &ARCH_GPT2; }

bool gpt_block_is_moe(const GPTConfig *cfg, int l) { return cfg->moe && (l + 1) % cfg->moe->moe_every == 0; }

int gpt_experts(const GPTConfig *cfg) { return cfg->moe ? cfg->moe->n_experts : 0; }

MoEConfig *moe_config_new(int n_experts, int experts_per_token, int moe_every) {
    if (!n_experts) return NULL;
    MoEConfig *moe = calloc_or_die(1, sizeof *moe);
    *moe = (MoEConfig){.n_experts = n_experts, .experts_per_token = experts_per_token, .moe_every = moe_every};
    return moe;
}

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
    case DIM_REPEATS: return gpt_experts(cfg);
    case DIM_KV: return (cfg->n_kv_head ? cfg->n_kv_head : cfg->n_head) * (cfg->n_embd / cfg->n_head);
    case DIM_FFN: return cfg->ffn_dim;
    case DIM_NONE: break;
    }
    return 0;
}

static void add_tensor(ParamLayout *l, const TensorSpec *spec, int block, int repeat, int init_stream) {
    const GPTConfig *cfg = &l->cfg;
    TensorInfo *t = &l->tensors[l->num_tensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, spec->hf_name, block, repeat);
    t->role = spec->role;
    t->repeat = repeat;
    t->moe_slot = -1;
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

// the tensors of a MoE block's MLP: those not repeated, then each repeat's, repeat by repeat
static int moe_mlp_tensors(const MoEMLP *mlp, int n_repeats) {
    int n = 0;
    for (int i = 0; i < mlp->n_tensors; i++) n += mlp->tensors[i].repeated ? n_repeats : 1;
    return n;
}

static int block_tensors(const Arch *arch, const GPTConfig *cfg, int b) {
    int n = arch->n_block;
    if (!gpt_block_is_moe(cfg, b)) return n;
    for (int i = 0; i < arch->n_block; i++) n -= is_mlp_role(arch->block[i].role);
    return n + moe_mlp_tensors(cfg->moe->mlp, cfg->moe->n_experts);
}

// A block's tensors in buffer order; a MoE block's MLP (MoEConfig.mlp) holds the repeats
// [first_repeat, first_repeat + n_repeats). Each tensor's random stream is its index in the whole
// model, whatever the range holds.
static void add_block(ParamLayout *l, int b, int stream) {
    const Arch *arch = l->arch;
    bool moe = gpt_block_is_moe(&l->cfg, b);
    for (int i = 0; i < arch->n_block; i++)
        if (!moe || !is_mlp_role(arch->block[i].role)) add_tensor(l, &arch->block[i], b, -1, stream++);
    if (!moe) return;
    const MoEMLP *mlp = l->cfg.moe->mlp;
    int n_per_repeat = 0, slot = 0;
    for (int i = 0; i < mlp->n_tensors; i++) n_per_repeat += mlp->tensors[i].repeated;
    for (int i = 0; i < mlp->n_tensors; i++)
        if (!mlp->tensors[i].repeated) {
            add_tensor(l, &mlp->tensors[i], b, -1, stream++);
            l->tensors[l->num_tensors - 1].moe_slot = slot++;
        }
    for (int e = l->first_repeat; e < l->first_repeat + l->n_repeats; e++)
        for (int i = 0, j = 0; i < mlp->n_tensors; i++)
            if (mlp->tensors[i].repeated) {
                add_tensor(l, &mlp->tensors[i], b, e, stream + e * n_per_repeat + j++);
                l->tensors[l->num_tensors - 1].moe_slot = slot++;
            }
}

// a configuration with MoE blocks needs an architecture that has them and a program that runs them
static void check_moe_blocks(const GPTConfig *cfg, const Arch *arch) {
    if (!gpt_moe_blocks(cfg, 0, cfg->n_layer)) return;
    if (!arch->has_moe) fatal("the %s architecture has no mixture-of-experts version", arch->name);
    if (!cfg->moe->mlp)
        fatal("the model has mixture-of-experts blocks (%d experts), which this program does not run: "
              "stage 08 trains them, stage 06 generates with them", cfg->moe->n_experts);
}

static void lay_out(ParamLayout *l, const GPTConfig *cfg, int first, int n, bool embed, bool head,
                    int first_repeat, int n_repeats) {
    const Arch *arch = gpt_arch(cfg);
    check_moe_blocks(cfg, arch);
    memset(l, 0, sizeof *l);
    l->cfg = *cfg;
    l->arch = arch;
    l->first_block = first;
    l->n_blocks = n;
    l->has_embed = embed;
    l->has_head = head;
    l->first_repeat = first_repeat;
    l->n_repeats = n_repeats;
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
    lay_out(l, cfg, first, n, embed, head, 0, gpt_experts(cfg));
}

void gpt_layout_range_repeats(ParamLayout *l, const GPTConfig *cfg, int first, int n, bool embed, bool head,
                              int first_repeat, int n_repeats) {
    lay_out(l, cfg, first, n, embed, head, first_repeat, n_repeats);
}

void gpt_layout_repeats(ParamLayout *l, const GPTConfig *cfg, int first_repeat, int n) {
    lay_out(l, cfg, 0, cfg->n_layer, true, true, first_repeat, n);
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
    case ROLE_MOE_MLP:
        if (!bw->moe_mlp) fatal("internal: tensor %s of a MoE block pointed without room for it", t->name);
        return &bw->moe_mlp[t->moe_slot];
    case ROLE_QKV_PART: return NULL;  // reached through the q tensor before it
    case ROLE_FC_PART: return NULL;   // reached through the gate tensor before it
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
static half16 **block_slot16(BlockWeights *bw, TensorRole role) {
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

void root_weights_point(Weights *w, const ParamLayout *l, float *root, half16 *root16) {
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

// room for each held MoE block's MLP tensors (BlockWeights.moe_mlp), in w->moe_slots
static void make_moe_slots(Weights *w, const ParamLayout *l) {
    if (!gpt_moe_blocks(&l->cfg, l->first_block, l->n_blocks)) return;
    size_t per_block = (size_t)moe_mlp_tensors(l->cfg.moe->mlp, l->n_repeats);
    w->moe_slots = calloc_or_die((size_t)l->n_blocks * per_block, sizeof(float *));
    for (int b = l->first_block, i = 0; b < l->first_block + l->n_blocks; b++, i++)
        if (gpt_block_is_moe(&l->cfg, b)) w->h[b].moe_mlp = w->moe_slots + (size_t)i * per_block;
}

void weights_point(Weights *w, const ParamLayout *l, float *flat) {
    root_weights_point(w, l, flat, NULL);
    w->h = calloc_or_die((size_t)w->n_layer, sizeof(BlockWeights));
    make_moe_slots(w, l);
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

void weights_point_16(Weights *w, const ParamLayout *l, half16 *flat16) {
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *t = &l->tensors[i];
        if (t->block >= 0) {
            half16 **slot = block_slot16(&w->h[t->block], t->role);
            if (slot) *slot = flat16 + t->offset;
        } else if ((t->role == ROLE_WTE && l->arch->tied_head) || t->role == ROLE_HEAD_W) {
            w->head.w16 = flat16 + t->offset;
        }
    }
}

void block_weights_point_16(BlockWeights *bw, const ParamLayout *l, int block, half16 *unit16) {
    size_t start = layout_block_start(l, block);
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *t = &l->tensors[i];
        half16 **slot = t->block == block ? block_slot16(bw, t->role) : NULL;
        if (slot) *slot = unit16 + (t->offset - start);
    }
}

void weights_free(Weights *w) {
    free(w->h);
    free(w->moe_slots);
    w->h = NULL;
    w->moe_slots = NULL;
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

