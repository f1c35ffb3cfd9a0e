// arch.h: what a model is, before any code runs it: its configuration (GPTConfig, from config.json
// or the run's keys) and its architecture as a table of tensors (Hugging Face names, shapes, init,
// weight decay, role in the block) that the layout, the initialiser and the checkpoints read.
// GPT-2, phi-1_5 and Llama are three such tables (layout.c).
#ifndef ARCH_H
#define ARCH_H

#include <stdbool.h>

typedef struct Arch Arch;
typedef struct MoEConfig MoEConfig;

typedef struct {
    const Arch *arch;       // the architecture's description; NULL: GPT-2
    int max_seq_len;        // maxT: rows of the position embedding
    int vocab_size;         // V: 257 for the byte tokenizer, 50257 for GPT-2's
    int padded_vocab_size;  // Vp: V rounded up to a multiple of 128, for fast matmuls
    int n_layer;            // L
    int n_head;             // NH
    int n_embd;             // C
    int rotary_dim;         // rotary position embedding: dims of each head it turns (phi)
    float rope_theta;       // and its base
    // Llama: grouped-query attention's key/value heads (0: n_head), the MLP's width (0: 4 n_embd),
    // RMSNorm's epsilon, and Llama 3's rope_scaling (rope_factor 0: none)
    int n_kv_head;
    int ffn_dim;
    float norm_eps;
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_original_max_positions;
    // mixture of experts (stage 08): its MoE blocks, their experts and MLP, which the core reads
    // only through moe_mlp.h; NULL: every block has its one dense MLP
    MoEConfig *moe;
} GPTConfig;

// whether block l's MLP is a mixture of experts
bool gpt_block_is_moe(const GPTConfig *cfg, int l);
// the MoE blocks in [first, first + n)
int gpt_moe_blocks(const GPTConfig *cfg, int first, int n);
// the experts of each MoE block (0: a dense model)
int gpt_experts(const GPTConfig *cfg);

int gpt_padded_vocab(int vocab_size);

// ---- 1. the description -----------------------------------------------------------------------

// what a tensor is to the layer code
typedef enum {
    ROLE_WTE, ROLE_WPE, ROLE_LNF_W, ROLE_LNF_B,                  // root
    ROLE_LN1_W, ROLE_LN1_B, ROLE_QKV_W, ROLE_QKV_B,              // block: attention
    ROLE_ATTN_PROJ_W, ROLE_ATTN_PROJ_B,
    ROLE_LN2_W, ROLE_LN2_B, ROLE_FC_W, ROLE_FC_B,                // block: MLP
    ROLE_FC_PROJ_W, ROLE_FC_PROJ_B,
    ROLE_HEAD_W, ROLE_HEAD_B,                                    // an untied lm_head (phi)
    ROLE_MOE_MLP,   // a MoE block's MLP tensor: its own code reads them (BlockWeights.moe_mlp)
    ROLE_QKV_PART,  // continues the tensor before it: phi's k and v projections follow q's in the
                    // buffer, so that q, k, v make one (3C, C) matrix and one (3C) bias
    ROLE_FC_PART,   // continues the tensor before it: Llama's up projection follows gate's, so that
                    // gate and up make one (2F, C) matrix
} TensorRole;

// a shape's extent, in the config's terms
typedef enum { DIM_NONE, DIM_C, DIM_3C, DIM_4C, DIM_VOCAB, DIM_POSITIONS, DIM_REPEATS,
               DIM_KV,    // the key/value heads' width: n_kv_head x head size (Llama)
               DIM_FFN,   // the MLP's width: ffn_dim (Llama)
} Dim;

typedef enum {
    INIT_NORMAL,    // N(0, 0.02)
    INIT_RESIDUAL,  // N(0, 0.02 / sqrt(2L)): a projection into the residual stream
    INIT_ONES,
    INIT_ZEROS,
} Init;

typedef struct {
    const char *hf_name;  // Hugging Face name; %d stands for the block index
    TensorRole role;
    Dim rows, cols;       // cols DIM_NONE: a vector of `rows`
    Init init;
    bool decay;           // weight decay applies (matrices and embeddings, not biases or norms)
    bool hf_transposed;   // stored (in, out) in Hugging Face files (GPT-2's Conv1D)
    bool repeated;        // one tensor per repeat (a MoE block's expert; gpt_experts() of
                          // them, DIM_REPEATS); a second %d in the name stands for the repeat
} TensorSpec;

struct Arch {
    const char *name;                // "gpt2", "phi"
    const TensorSpec *root;          // the tensors outside the blocks, in buffer order
    int n_root;
    const TensorSpec *block;         // one block's tensors, in buffer order
    int n_block;
    bool tied_head;                  // the lm_head is wte itself
    bool parallel_block;             // x + attn(ln(x)) + mlp(ln(x)): one LayerNorm, no ln2 (phi)
    bool rotary;                     // rotary position embedding on q and k instead of wpe (phi)
    bool has_moe;                    // its blocks may have a MoE MLP instead (GPT-2's)
    bool rms_norm;                   // RMSNorm (no mean, no bias) instead of LayerNorm (Llama)
    bool gated_mlp;                  // SwiGLU: down(silu(gate(x)) * up(x)) instead of GELU (Llama)
};

extern const Arch ARCH_GPT2;
extern const Arch ARCH_PHI;
extern const Arch ARCH_LLAMA;       // untied lm_head (Llama 2, Llama 3.1 8B)
extern const Arch ARCH_LLAMA_TIED;  // the head is the embedding (tie_word_embeddings: Llama 3.2 1B)
// cfg's architecture (GPT-2 when cfg->arch is NULL)
const Arch *gpt_arch(const GPTConfig *cfg);

#endif
