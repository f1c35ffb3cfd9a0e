// activations.h: what the forward keeps for the backward, allocated once for a rank's layers at
// the run's largest micro-batch (activations.c).
#ifndef ACTIVATIONS_H
#define ACTIVATIONS_H

#include <stdbool.h>
#include <stddef.h>

#include "layer_ops.h"

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
    float *mlp_out;                    // where the MLP writes: out, or (sequence parallel) the partial sum
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

typedef struct {
    int B, T;            // capacity: B sequences of at most T tokens
    int keys;            // attention keys per query (the attention matrix's width): T, or a cache's length
    ModelShape shape;
    GPTConfig model;     // the model: which blocks are MoE blocks, and their MLP (moe)
    LayerOps *ops;       // NULL: serial_layer_ops()
    int first_layer, n_layers;
    bool embed, head;    // this rank runs the embedding / the head (and keeps their buffers)
    bool half;           // matmul inputs kept in 16 bits, bf16 or fp16 (stage 02)
    bool recompute;      // activation recomputation: blocks keep only their output, and backward
                         // runs the block's forward again first
    int seq_shards;      // sequence parallelism: the residual stream, its LayerNorms' statistics and
                         // its gradient hold 1/seq_shards of the B*T rows (LayerOps.seq_gather); 0, 1: all
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
    bool dlogits16_made;          // dout16 holds the logits' gradient's copy, until the head's backward
    struct MoEActs *moe;        // what the MoE blocks' MLP keeps (MoEConfig.mlp's), or NULL
    bool write_grads;           // the next gpt_backward writes the weight gradients (gpt_gradients_begin)
    float *seq_shard;           // sequence parallel: (rows, C) a norm's output, a reduce-scattered gradient
    float *seq_full;            // and (N, C): a partial sum before its reduce-scatter, a gathered gradient
    size_t bytes;
    size_t residual_bytes;      // of bytes, the buffers with the residual stream's rows (what seq_shards divides)
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
// the rows of the N = B*T tokens this rank's residual stream holds (all N without seq_shards)
int residual_rows(const ActsSpec *spec, int N);
// the input of block l's MLP: ln2(res2), or ln1(x) in a parallel block
const float *block_mlp_input(const Activations *a, int l);
const float *head_input(const Activations *a);

#endif
