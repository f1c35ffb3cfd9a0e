// gpt.h: the GPT-2 model as a set of layer steps. The embedding, one transformer block and the
// head + loss each have a forward and a backward; a stage strings them together (gpt_forward /
// gpt_backward do it for a single process) and puts its technique between them.
//
// All parameters live in ONE flat buffer with named pointers into it (and the gradients in a
// second buffer of the same layout): the optimizer, the checkpoint, an all-reduce or a shard
// sees one array, while the layer code sees names. The layout is per unit: first the root
// tensors (wte, wpe, lnfw, lnfb), then block 0's twelve tensors, then block 1's, ... so that one
// block is one contiguous range (one FSDP unit).
#ifndef GPT_H
#define GPT_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"

typedef struct {
    int max_seq_len;        // maxT: rows of the position embedding
    int vocab_size;         // V: 257 for the byte tokenizer, 50257 for GPT-2's
    int padded_vocab_size;  // Vp: V rounded up to a multiple of 128, for fast matmuls
    int n_layer;            // L
    int n_head;             // NH
    int n_embd;             // C
} GPTConfig;

int gpt_padded_vocab(int vocab_size);

// one transformer block's tensors, in their order in the flat buffer
typedef struct {
    float *ln1w, *ln1b;          // (C), (C)
    float *qkvw, *qkvb;          // (3C, C), (3C)
    float *attprojw, *attprojb;  // (C, C), (C)
    float *ln2w, *ln2b;          // (C), (C)
    float *fcw, *fcb;            // (4C, C), (4C)
    float *fcprojw, *fcprojb;    // (C, 4C), (C)
    // bf16 copies of the four matrices (stage 02). NULL in fp32, where the matmuls use the
    // float ones; when set, every matmul of the block runs in bf16.
    bf16 *qkvw16, *attprojw16, *fcw16, *fcprojw16;
} BlockWeights;
#define BLOCK_TENSORS 12  // the float tensors above, in buffer order

typedef struct {
    float *wte;         // (Vp, C) token embedding, also the lm_head (tied)
    float *wpe;         // (maxT, C) position embedding
    float *lnfw, *lnfb; // (C) final LayerNorm
    BlockWeights *h;    // [L] blocks
    bf16 *wte16;        // bf16 copy of wte for the lm_head matmul (stage 02), else NULL
} Weights;
#define ROOT_TENSORS 4

// The parameter table: one entry per tensor, in buffer order, with what the optimizer, the
// initialiser and the checkpoint need to know.
typedef struct {
    char name[64];      // Hugging Face GPT-2 name, e.g. "transformer.h.3.attn.c_attn.weight"
    size_t offset;      // first element in the flat buffer
    size_t numel;
    int ndim;
    int shape[2];       // our layout: linear weights are (out, in)
    int hf_transposed;  // stored (in, out) in Hugging Face files (Conv1D)
    int hf_rows;        // rows in Hugging Face files (V for wte, which we pad to Vp)
    int decay;          // weight decay applies (matrices and embeddings, not biases or norms)
    int block;          // block index, or -1 for root tensors
    float init_std;     // 0: a constant init (init_value)
    float init_value;
} TensorInfo;

typedef struct {
    GPTConfig cfg;
    size_t num_params;        // elements in the flat buffer (including vocab padding rows)
    int num_tensors;
    TensorInfo *tensors;      // [num_tensors]
    size_t block_offset[2];   // block 0 starts at [0]; each block has [1] elements
    size_t root_numel;        // wte + wpe + lnfw + lnfb
} ParamLayout;

void gpt_layout(ParamLayout *layout, const GPTConfig *cfg);
void gpt_layout_free(ParamLayout *layout);
// named views into a flat buffer laid out as `layout`; w->h is malloc'd (free with weights_free)
void weights_point(Weights *w, const ParamLayout *layout, float *flat);
void weights_free(Weights *w);
// points one block's tensors into `unit`, a buffer holding exactly that block's elements in
// layout order (a gathered FSDP unit); bf16 pointers NULL
void block_weights_point(BlockWeights *bw, const ParamLayout *layout, int block, float *unit);
// points w's bf16 matrices into flat16, a bf16 copy of the whole flat buffer (same layout)
void weights_point_bf16(Weights *w, const ParamLayout *layout, bf16 *flat16);
// points one block's four bf16 matrices into unit16, a bf16 copy of that block's elements in
// layout order (a gathered FSDP unit, cast)
void block_weights_point_bf16(BlockWeights *bw, const ParamLayout *layout, int block, bf16 *unit16);
// fills params[first, first+n) of the flat buffer with the GPT-2 initial values: N(0, 0.02),
// residual projections N(0, 0.02/sqrt(2L)), LayerNorm weights 1, biases 0, padded vocab rows 0.
// Element-wise counter-based, so any rank can initialise any slice identically.
void gpt_init_range(float *params_slice, const ParamLayout *layout, size_t first, size_t n, uint64_t seed);

// What one block keeps from its forward for its backward, for N = B*T rows.
typedef struct {
    float *ln1, *ln1_mean, *ln1_rstd;  // (N, C), (N), (N)
    float *qkv;                        // (N, 3C)
    float *att;                        // (B, NH, T, T) softmax probabilities
    float *atty;                       // (N, C) attention output before the projection
    float *res2;                       // (N, C) residual after attention
    float *ln2, *ln2_mean, *ln2_rstd;  // (N, C), (N), (N)
    float *fch, *fch_gelu;             // (N, 4C), (N, 4C)
    float *out;                        // (N, C) block output = residual after the MLP
    // bf16 mode: the four matmul inputs are kept for backward as bf16 copies only (their f32
    // versions above then point to scratch shared by every block)
    bf16 *ln1_16, *atty16, *ln2_16, *fch_gelu16;
} BlockActs;

// Everything the forward and backward passes need besides the weights, for B sequences of at
// most T tokens; allocated once.
typedef struct {
    int B, T;                   // capacity
    int n_layer;
    int bf16;                   // matmul inputs kept in bf16 (stage 02)
    float *encoded;             // (B, T, C) embedding output = block 0's input
    BlockActs *blocks;          // [L]
    float *lnf, *lnf_mean, *lnf_rstd;  // (N, C), (N), (N)
    float *logits;              // (N, Vp); overwritten by dlogits in training
    float *losses;              // (N)
    int *inputs, *targets;      // (B, T) on the device
    // backward scratch, reused by every block
    float *dres;                // (N, C) gradient flowing down the residual stream
    float *dbig;                // (N, 4C)
    float *dbig2;               // (N, 4C)
    float *dsmall;              // (N, 3C)
    float *datt;                // (B, NH, T, T)
    bf16 *lnf16;                // (N, C) bf16 mode: the lm_head's input
    bf16 *dout16;               // (N, max(4C, Vp)) bf16 mode: a matmul's output gradient
    size_t bytes;
} Activations;

// bf16 != 0 keeps the matmul inputs in bf16 (for weights with bf16 copies)
void acts_alloc(Activations *a, const GPTConfig *cfg, int B, int T, int bf16);
void acts_free(Activations *a);

// ---- the layer steps (B, T: this micro-batch's shape, within the allocated capacity) ----------
void gpt_embed_forward(Activations *a, const Weights *w, const GPTConfig *cfg, int B, int T);
void gpt_block_forward(BlockActs *acts, const float *x, const BlockWeights *w,
                       const GPTConfig *cfg, int B, int T);
// forward of the final LayerNorm and the tied lm_head into a->logits; x is the last block's output
void gpt_head_forward(Activations *a, const float *x, const Weights *w, const GPTConfig *cfg, int B, int T);
// loss + its gradient, scaled by dloss (= 1 / target count of the global batch): a->logits
// becomes dlogits; returns this micro-batch's summed loss (not yet divided).
double gpt_loss_forward_backward(Activations *a, const GPTConfig *cfg, int B, int T, float dloss);
// summed loss only, for evaluation
double gpt_loss_forward(Activations *a, const GPTConfig *cfg, int B, int T);
// head backward: from dlogits to a->dres = gradient w.r.t. x (the last block's output)
void gpt_head_backward(Activations *a, const float *x, const Weights *w, Weights *g,
                       const GPTConfig *cfg, int B, int T);
// block backward: on entry a->dres holds dL/d(block output); on exit dL/d(block input) = dL/dx.
void gpt_block_backward(Activations *a, BlockActs *acts, const float *x, const BlockWeights *w,
                        BlockWeights *g, const GPTConfig *cfg, int B, int T);
void gpt_embed_backward(Activations *a, Weights *g, const GPTConfig *cfg, int B, int T);

// out (N, OC) = inp (N, C) @ w^T + b, in f32, or in bf16 when w16 is set (inp is then rounded into
// inp16, N x C bf16 scratch, which backward reads); the linear layer of every block here and of
// stage 05's parallel layer, so stage 02's recipe is written once
void gpt_linear_forward(float *out, const float *inp, bf16 *inp16, const float *w, const bf16 *w16,
                        const float *b, int N, int C, int OC);

// ---- the whole model, for a single process (inputs/targets (B, T) host arrays) ----------------
void gpt_forward(Activations *a, const Weights *w, const GPTConfig *cfg, const int *inputs, int B, int T);
// forward + loss + backward, adding into g; returns the summed loss of the micro-batch
double gpt_forward_backward(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                            const int *inputs, const int *targets, int B, int T, float dloss);
// the same, calling hook(l, ctx) as soon as block l's gradients are final (l = L-1 down to 0) and
// hook(-1, ctx) when the embedding's are, so that a stage can start communicating gradients
// while backward goes on (PyTorch's DDP does this with autograd hooks)
typedef void (*GradReadyHook)(int layer, void *ctx);
double gpt_forward_backward_hooked(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                                   const int *inputs, const int *targets, int B, int T, float dloss,
                                   GradReadyHook hook, void *ctx);

#endif
