// layer_ops.h: a layer's weights (named views into the flat buffer of layout.h), what one rank holds
// of a block (ModelShape) and how its layers run (LayerOps). The
// block (gpt.h) calls its linears, norms, attention and MLP through a LayerOps table:
// serial_layer_ops() runs them on one rank, and a stage plugs in its own version of a layer
// (tensor parallelism's split linears, generation's KV-cached attention) without copying the block.
#ifndef LAYER_OPS_H
#define LAYER_OPS_H

#include <stdbool.h>

#include "arch.h"
#include "ops/ops.h"

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

// What one rank holds of a block: the whole block, or a tensor-parallel share of it.
typedef struct {
    int C;        // residual stream width held (the hidden dimension, or its shard)
    int n_head;   // attention heads held
    int C_attn;   // their width: n_head * head size
    int C_mlp;    // MLP width held
    int v_rows;   // the vocabulary rows held of wte and the lm_head (which rows: 05's TPModel.v_lo)
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
    bool half;  // the matmul inputs are 16-bit (ActsSpec.half, copied here): attention's products too
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
    // to MoEConfig.mlp (moe_mlp.h), and stage 08 plugs in its expert-parallel version.
    MLPForward mlp_forward;
    MLPBackward mlp_backward;
    // Sequence parallelism (ActsSpec.seq_shards > 1; NULL without): the residual stream holds this
    // rank's rows of the N = B*T tokens only. full (N, C) = every rank's shard (rows, C) in order;
    // shard = this rank's rows of the sum of every rank's full (a partial sum).
    void (*seq_gather)(LayerOps *ops, float *full, const float *shard, int N);
    void (*seq_reduce_scatter)(LayerOps *ops, float *shard, const float *full, int N);
};

LayerOps *serial_layer_ops(void);

#endif
