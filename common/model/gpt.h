// gpt.h: the model, written once for every stage.
//
// Three parts, each in a file of its own:
//  1. the description (layout.c): an architecture is a table of tensors (Hugging Face names,
//     shapes, init, weight decay, role in the block) that the layout, the initialiser and the
//     checkpoints read;
//  2. the layout (layout.c): ONE flat buffer with named pointers into it (and the gradients in a
//     second buffer of the same layout), for the whole model or for a range of its blocks;
//  3. the layer steps (gpt.c, with their activations in activations.c): the embedding, one
//     transformer block and the head, each with a forward and a backward, calling their linear
//     layers, LayerNorms, attention and MLP through a LayerOps table. A stage that runs a layer its
//     own way (bf16, tensor-parallel, with a KV cache) plugs in its version of that layer; the block
//     itself exists only here.
//
// The optimizer, the checkpoint, an all-reduce or a shard sees one array; the layer code sees
// names. The layout is per unit: first the root tensors (wte, wpe, ln_f), then block 0's tensors,
// then block 1's, ... so that one block is one contiguous range (one FSDP unit).
#ifndef GPT_H
#define GPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ops/ops.h"

typedef struct Arch Arch;
typedef struct MoEMLP MoEMLP;

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
    // mixture of experts (stage 08, which the checkpoints' config.json describes): the MoE blocks'
    // MLP is n_experts MLPs and a router. The core lays out and runs that MLP only through moe_mlp.
    int n_experts;          // E; 0: every block has its one dense MLP
    int experts_per_token;  // k: each token goes to its k most probable experts
    int moe_every;          // block l is a MoE block when (l + 1) % moe_every == 0
    float capacity_factor;  // rows per expert per sequence: ceil(factor * T * k / E); 0: no limit
    float aux_loss_coef;    // weight of the load-balancing loss in the objective
    const MoEMLP *moe_mlp;  // the MoE blocks' MLP (08_mixture_of_experts/moe.h's MOE_MLP), set by
                            // the programs that run one; NULL: this program runs dense MLPs only
} GPTConfig;

// the most experts a configuration may give a MoE block
#define MAX_EXPERTS 64
// whether block l's MLP is a mixture of experts
bool gpt_block_is_moe(const GPTConfig *cfg, int l);
// the MoE blocks in [first, first + n)
int gpt_moe_blocks(const GPTConfig *cfg, int first, int n);

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
    bool repeated;        // one tensor per repeat (a MoE block's expert; GPTConfig.n_experts of
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

// ---- 2. the layout ----------------------------------------------------------------------------

// The parameter table: one entry per tensor, in buffer order, with what the optimizer, the
// initialiser and the checkpoint need to know.
typedef struct {
    char name[64];      // Hugging Face name, e.g. "transformer.h.3.attn.c_attn.weight"
    TensorRole role;
    size_t offset;      // first element in the flat buffer
    size_t numel;
    int ndim;
    int shape[2];       // our layout: linear weights are (out, in)
    int hf_transposed;  // stored (in, out) in Hugging Face files (Conv1D)
    int hf_rows;        // rows in Hugging Face files (V for wte, which we pad to Vp)
    int decay;          // weight decay applies (matrices and embeddings, not biases or norms)
    int block;          // block index, or -1 for root tensors
    int repeat;         // which repeat of a repeated tensor (a MoE block's expert), or -1
    int moe_slot;       // a MoE block's MLP tensor: its place in BlockWeights.moe_mlp, else -1
    int init_stream;    // the tensor's index in the whole model: its stream of random numbers
    float init_std;     // 0: a constant init (init_value)
    float init_value;
} TensorInfo;

typedef struct {
    GPTConfig cfg;
    const Arch *arch;
    size_t num_params;        // elements in the flat buffer (including vocab padding rows)
    int num_tensors;
    TensorInfo *tensors;      // [num_tensors]
    int first_block, n_blocks;  // the blocks held: [first_block, first_block + n_blocks)
    bool has_embed, has_head;   // the embedding (wte, wpe), the head (ln_f and, tied, wte)
    int first_repeat, n_repeats;  // MoE blocks: the repeats (experts) held [first, first + n)
    size_t root_numel;        // the root tensors', which come first
    size_t *block_first;      // [n_blocks + 1]: where each held block starts (MoE blocks are larger)
} ParamLayout;

// the whole model
void gpt_layout(ParamLayout *layout, const GPTConfig *cfg);
// blocks [first, first + n) with or without the embedding and the head (a pipeline stage). The
// tensors keep their names and random streams: any range initialises as the whole model does.
void gpt_layout_range(ParamLayout *layout, const GPTConfig *cfg, int first, int n, bool embed, bool head);
// the whole model with the MoE blocks' repeated tensors [first_repeat, first_repeat + n) only
// (expert parallelism: 08's moe_layout_experts); they keep their names and random streams
void gpt_layout_repeats(ParamLayout *layout, const GPTConfig *cfg, int first_repeat, int n);
void gpt_layout_free(ParamLayout *layout);
// the tensor of that Hugging Face name, or NULL when the layout does not hold it
const TensorInfo *layout_tensor(const ParamLayout *layout, const char *name);
// where block b's elements start in the flat buffer, and how many it has
size_t layout_block_start(const ParamLayout *layout, int block);
size_t layout_block_numel(const ParamLayout *layout, int block);
// copies the tensors `part` holds between its buffer and a buffer laid out as `whole`, by name
// (to_whole: into whole_buf); only those take(t, ctx) accepts, or all when take is NULL
typedef bool (*TensorFilter)(const TensorInfo *t, const void *ctx);
void layout_copy_tensors(const ParamLayout *part, float *part_buf, const ParamLayout *whole, float *whole_buf,
                         bool to_whole, TensorFilter take, const void *ctx);

// The weights of a layer, pointing into a flat buffer (bf16 copies: stage 02's matmul inputs)
typedef struct {
    float *w;    // (out, in)
    float *b;    // (out), or NULL
    half16 *w16;   // bf16 copy of w, or NULL: when set, the layer multiplies in bf16
} Linear;

typedef struct {
    float *w, *b;  // (C), (C)
} Norm;

typedef struct {
    Norm ln1, ln2;
    Linear qkv;        // (3C, C)
    Linear attn_proj;  // (C, C)
    Linear fc;         // (4C, C)
    Linear fc_proj;    // (C, 4C)
    // a MoE block's MLP instead of fc and fc_proj: its tensors in MoEMLP.tensors' order, the
    // repeated ones repeat by repeat (TensorInfo.moe_slot; 08's moe.c reads them); NULL: dense
    float **moe_mlp;
} BlockWeights;

typedef struct {
    float *wte;        // (Vp, C) token embedding
    float *wpe;        // (maxT, C) position embedding
    Norm lnf;          // final LayerNorm
    Linear head;       // the lm_head (Vp, C): GPT-2's is wte itself (tied), without a bias
    BlockWeights *h;   // [L], by block index; only a range layout's blocks are set
    int n_layer;
    float **moe_slots; // what the MoE blocks' moe_mlp point into
} Weights;

// named views into a flat buffer laid out as `layout`; w->h and w->moe_slots are malloc'd (free
// with weights_free)
void weights_point(Weights *w, const ParamLayout *layout, float *flat);
void weights_free(Weights *w);
// points the root tensors into `root`, a buffer holding exactly the root elements (they come
// first in the layout; a gathered FSDP unit), and root16 (its bf16 copy, or NULL); w->h NULL
void root_weights_point(Weights *w, const ParamLayout *layout, float *root, half16 *root16);
// points one block's tensors into `unit`, a buffer holding exactly that block's elements in
// layout order (a gathered FSDP unit; a dense block); bf16 pointers NULL
void block_weights_point(BlockWeights *bw, const ParamLayout *layout, int block, float *unit);
// points w's bf16 matrices into flat16, a bf16 copy of the whole flat buffer (same layout)
void weights_point_16(Weights *w, const ParamLayout *layout, half16 *flat16);
// points one block's bf16 matrices into unit16, a bf16 copy of that block's elements in layout
// order (a gathered FSDP unit, cast)
void block_weights_point_16(BlockWeights *bw, const ParamLayout *layout, int block, half16 *unit16);
// whether a block's tensor of this role is a matrix that the linears read as a bf16 copy when
// there is one (the rest, biases and LayerNorm weights, are always read in fp32)
bool block_role_read_in_16_bits(TensorRole role);
// fills params[first, first+n) of the flat buffer with the initial values: N(0, 0.02), residual
// projections N(0, 0.02/sqrt(2L)), LayerNorm weights 1, biases 0, padded vocab rows 0.
// Element-wise counter-based, so any rank can initialise any slice identically.
void gpt_init_range(float *params_slice, const ParamLayout *layout, size_t first, size_t n, uint64_t seed);

// ---- 3. the layer steps -----------------------------------------------------------------------

// What one rank holds of a block: the whole block, or a tensor-parallel share of it.
typedef struct {
    int C;        // residual stream width held (the hidden dimension, or its shard)
    int C_total;  // the whole hidden dimension (LayerNorm divides by it)
    int n_head;   // attention heads held
    int C_attn;   // their width: n_head * head size
    int C_mlp;    // MLP width held
    int v_lo, v_rows;  // the vocabulary rows held of wte and the lm_head: [v_lo, v_lo + v_rows)
    bool parallel_block;  // the architecture's block and position encoding (Arch, GPTConfig)
    int rotary_dim;       // 0: no rotary embedding
    Rope rope;
    int n_kv_head, C_kv;  // key/value heads held and their width (n_head, C_attn without GQA)
    bool rms_norm;        // the architecture's norm (RMSNorm with norm_eps) and MLP (SwiGLU)
    float norm_eps;
    bool gated_mlp;
    // a MoE block's repeats (experts) held here, [first_repeat, first_repeat + n_repeats), and the
    // ranks a block's repeats are spread over (1: all here)
    int first_repeat, n_repeats, repeat_ranks;
} ModelShape;

ModelShape whole_model_shape(const GPTConfig *cfg);

typedef enum { LIN_QKV, LIN_ATTN_PROJ, LIN_FC, LIN_FC_PROJ, LIN_HEAD } LinearKind;

// How the layers run. The block calls these; serial_layer_ops() runs them on one rank (f32, or
// bf16 when a Linear has w16), and a stage plugs in its own: tensor parallelism (05) adds the
// collectives of its split layers, generation (06) reads keys and values from a KV cache.
// Sizes are this rank's (ModelShape); backward functions add into their gradients.
typedef struct LayerOps LayerOps;
typedef struct Activations Activations;
typedef void (*MLPForward)(LayerOps *ops, Activations *a, int layer, const BlockWeights *w, int B, int T);
typedef void (*MLPBackward)(LayerOps *ops, Activations *a, int layer, float *dinp, const BlockWeights *w,
                            BlockWeights *g, const float *dout, int B, int T);
struct LayerOps {
    // out (B*T, C) = embedding of tokens at positions t (or start[b] + t, start on the device)
    void (*embed_forward)(LayerOps *ops, float *out, const int *tokens, const int *start,
                          const Weights *w, const ModelShape *s, int B, int T);
    void (*embed_backward)(LayerOps *ops, Weights *g, const float *dout, const int *tokens,
                           const ModelShape *s, int B, int T);
    // out (N, out_dim) = inp (N, in_dim) @ w^T + b; inp16: where a bf16 layer rounds its input
    // (kept for backward)
    void (*linear_forward)(LayerOps *ops, LinearKind k, float *out, const float *inp, half16 *inp16,
                           const Linear *w, int N, int in_dim, int out_dim);
    // dinp (zeroed by the caller) +=, g->w, g->b +=; dout16: bf16 scratch for dout
    void (*linear_backward)(LayerOps *ops, LinearKind k, float *dinp, Linear *g, const float *dout,
                            half16 *dout16, const float *inp, const half16 *inp16, const Linear *w,
                            int N, int in_dim, int out_dim);
    void (*norm_forward)(LayerOps *ops, float *out, float *mean, float *rstd, const float *inp,
                         const Norm *w, const ModelShape *s, int N);
    void (*norm_backward)(LayerOps *ops, float *dinp, Norm *g, const float *dout, const float *inp,
                          const Norm *w, const float *mean, const float *rstd, const ModelShape *s, int N);
    // causal attention of block `layer` over qkv (B, T, 3 C_attn) into out (B, T, C_attn); att:
    // what backward needs (ops.h: the probabilities, or each row's log-sum-exp), or scratch
    void (*attention_forward)(LayerOps *ops, int layer, float *out, float *att, const float *qkv,
                              const ModelShape *s, int B, int T);
    // its backward: dqkv (zeroed by the caller) +=, from dout (B, T, C_attn), the forward's qkv, out
    // and att (out is scratch in a bf16 block, which keeps only its bf16 copy); datt: scratch of
    // att's size
    void (*attention_backward)(LayerOps *ops, int layer, float *dqkv, float *datt, const float *dout,
                               const float *qkv, const float *out, const float *att, const ModelShape *s,
                               int B, int T);
    // block `layer`'s MLP, from its input (ln2(res2), or ln1(x) in a parallel block) into the
    // block's out (the block adds the residual); backward adds into dinp. The dense MLP (fc, GELU,
    // fc_proj) runs through linear_forward/backward above; serial_layer_ops() hands a MoE block's
    // to GPTConfig.moe_mlp, and stage 08 plugs in its expert-parallel version.
    MLPForward mlp_forward;
    MLPBackward mlp_backward;
};

LayerOps *serial_layer_ops(void);

// What one block keeps from its forward for its backward, for N = B*T rows (this rank's sizes).
typedef struct {
    float *ln1, *ln1_mean, *ln1_rstd;  // (N, C), (N), (N)
    float *qkv;                        // (N, 3 C_attn)
    float *att;                        // (B, n_head, T, keys): what attention keeps for backward (ops.h)
    float *atty;                       // (N, C_attn) attention output before the projection
    float *res2;                       // (N, C) residual after attention
    float *ln2, *ln2_mean, *ln2_rstd;  // (N, C), (N), (N)
    float *fch, *fch_gelu;             // (N, C_mlp) or, SwiGLU, (N, 2 C_mlp): gate | up; (N, C_mlp)
    float *out;                        // (N, C) block output = residual after the MLP
    // bf16 mode: the four matmul inputs are kept for backward as bf16 copies only (their f32
    // versions above then point to scratch shared by every block)
    half16 *ln1_16, *atty16, *ln2_16, *fch_gelu16;
} BlockActs;

// The core's allocator of activations, which a MoE MLP allocates its own with (MoEMLP.alloc_acts):
// device and host buffers that acts_free frees, or when only counting (acts_bytes), NULL and the
// device bytes added up.
typedef struct ActsAllocator ActsAllocator;
void *acts_alloc_device(ActsAllocator *al, size_t bytes);
void *acts_alloc_host(ActsAllocator *al, size_t bytes);  // zeroed; not counted

// The MLP of GPTConfig's MoE blocks (gpt_block_is_moe), which the core does not know: stage 08's
// mixture of experts describes it here (08_mixture_of_experts/moe.h). The layout puts its tensors
// in place of the dense MLP's, the activations leave out the dense MLP's for its blocks and let it
// allocate its own, and serial_layer_ops() runs it.
struct MoEMLP {
    // its tensors in buffer order, each ROLE_MOE_MLP: first those not repeated, then the repeated
    // ones once per repeat held (ParamLayout.first_repeat, n_repeats)
    const TensorSpec *tensors;
    int n_tensors;
    // what its blocks in a->spec keep, into a->moe (a MoE block's, or one set for every block
    // when recomputing)
    void (*alloc_acts)(Activations *a, ActsAllocator *al);
    MLPForward forward;    // on one rank, holding every repeat
    MLPBackward backward;
};

// What to allocate activations for.
typedef struct {
    int B, T;            // capacity: B sequences of at most T tokens
    int keys;            // attention keys per query (the attention matrix's width): T, or a cache's length
    ModelShape shape;
    GPTConfig model;     // the model: which blocks are MoE blocks, and their MLP (moe_mlp)
    LayerOps *ops;       // NULL: serial_layer_ops()
    int first_layer, n_layers;
    bool embed, head;    // this rank runs the embedding / the head (and keeps their buffers)
    bool half;           // matmul inputs kept in 16 bits, bf16 or fp16 (stage 02)
    bool recompute;      // activation recomputation: blocks keep only their output, and backward
                         // runs the block's forward again first
} ActsSpec;

// the whole model on one rank
ActsSpec whole_model_acts(const GPTConfig *cfg, int B, int T, bool half, bool recompute);

// Everything the forward and backward passes need besides the weights; allocated once.
struct Activations {
    ActsSpec spec;
    LayerOps *ops;
    float *encoded;             // (B, T, C) block first_layer's input: the embedding's output,
                                // or what a pipeline stage received
    BlockActs *blocks;          // [n_layers], blocks[i] for layer first_layer + i
    float *lnf, *lnf_mean, *lnf_rstd;  // (N, C), (N), (N)
    float *logits;              // (N, v_rows); overwritten by dlogits in training
    float *losses;              // (N)
    int *inputs, *targets;      // (B, T) on the device
    // backward scratch, reused by every block
    float *dres;                // (N, C) gradient flowing down the residual stream
    float *dbig, *dbig2, *dsmall;  // the widest gradients of a block
    float *datt;                // attention probabilities' gradient
    float *dln;                 // (N, C) parallel block: the MLP's input gradient, until attention's joins it
    const int *start;           // (B) on the device: sequence b's rows are positions start[b] + t (a
                                // KV cache's decode); NULL: 0 + t. Rotary embeddings turn by it.
    half16 *lnf16;                // (N, C) bf16 mode: the lm_head's input
    half16 *dout16;               // bf16 mode: a matmul's output gradient
    struct MoEActs *moe;        // what the MoE blocks' MLP keeps (GPTConfig.moe_mlp's), or NULL
    size_t bytes;
    void **owned;               // every buffer allocated (some are shared), to free once
    int n_owned;
    void **host_owned;          // and the host ones
    int n_host_owned;
};

// flags for acts_alloc
enum { ACTS_16BIT = 1, ACTS_RECOMPUTE = 2 };
// the whole model on one rank, with ACTS_* flags
void acts_alloc(Activations *a, const GPTConfig *cfg, int B, int T, int flags);
void acts_alloc_spec(Activations *a, const ActsSpec *spec);
// the device bytes acts_alloc_spec would allocate for spec, allocating nothing
size_t acts_bytes(const ActsSpec *spec);
void acts_free(Activations *a);
// block l's input (its predecessor's output, or a->encoded), and the head's input
const float *block_input(const Activations *a, int l);
// the input of block l's MLP: ln2(res2), or ln1(x) in a parallel block
const float *block_mlp_input(const Activations *a, int l);
const float *head_input(const Activations *a);

// ---- the layer steps (B, T: this micro-batch's shape, within the allocated capacity) ----------
void gpt_embed_forward(Activations *a, const Weights *w, int B, int T);
void gpt_block_forward(Activations *a, int l, const BlockWeights *w, int B, int T);
// the final LayerNorm and the lm_head over N rows of x into a->logits
void gpt_head_forward(Activations *a, const float *x, const Weights *w, int N);
// loss + its gradient, scaled by dloss (= 1 / target count of the global batch): a->logits
// becomes dlogits; returns this micro-batch's summed loss (not yet divided).
double gpt_loss_forward_backward(Activations *a, const GPTConfig *cfg, int B, int T, float dloss);
// summed loss only, for evaluation
double gpt_loss_forward(Activations *a, const GPTConfig *cfg, int B, int T);
// head backward: from dlogits to a->dres = gradient w.r.t. the head's input
void gpt_head_backward(Activations *a, const Weights *w, Weights *g, int B, int T);
// block backward: on entry a->dres holds dL/d(block output); on exit dL/d(block input).
void gpt_block_backward(Activations *a, int l, const BlockWeights *w, BlockWeights *g, int B, int T);
void gpt_embed_backward(Activations *a, Weights *g, int B, int T);

// out (N, OC) = inp (N, C) @ w^T + b in f32, or in bf16 when w->w16 is set (inp is then rounded
// into inp16, N x C bf16 scratch, which backward reads): stage 02's recipe, written once
void linear_forward(float *out, const float *inp, half16 *inp16, const Linear *w, int N, int C, int OC);

// ---- the passes over the layers a rank holds (inputs/targets (B, T) host arrays) --------------
// embedding (if held), blocks, head (if held): the logits in a->logits
void gpt_forward(Activations *a, const Weights *w, const int *inputs, int B, int T);
// from a->logits holding dlogits (or a->dres holding the gradient of the last block's output,
// without the head) back through the blocks and the embedding, adding into g; hook(l, ctx) is
// called as soon as block l's gradients are final (l from last to first) and hook(-1, ctx) when
// the root tensors' are, so that a stage can start communicating gradients while backward goes
// on (PyTorch's DDP does this with autograd hooks). hook may be NULL.
typedef void (*GradReadyHook)(int layer, void *ctx);
void gpt_backward(Activations *a, const Weights *w, Weights *g, int B, int T, GradReadyHook hook, void *ctx);
// forward + loss + backward on one rank, adding into g; returns the summed loss of the micro-batch
double gpt_forward_backward(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                            const int *inputs, const int *targets, int B, int T, float dloss);
double gpt_forward_backward_hooked(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                                   const int *inputs, const int *targets, int B, int T, float dloss,
                                   GradReadyHook hook, void *ctx);

#endif
