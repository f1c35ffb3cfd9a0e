// layout.h: ONE flat buffer with named pointers into it (and the gradients in a second buffer of
// the same layout), for the whole model or for a range of its blocks (layout.c).
//
// The optimizer, the checkpoint, an all-reduce or a shard sees one array; the layer code sees
// names. The layout is per unit: first the root tensors (wte, wpe, ln_f), then block 0's tensors,
// then block 1's, ... so that one block is one contiguous range (one FSDP unit).
#ifndef LAYOUT_H
#define LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "arch.h"
#include "layer_ops.h"
#include "ops/ops.h"

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
// both: a range of blocks holding those repeats (a pipeline stage's part with its experts: stage 10)
void gpt_layout_range_repeats(ParamLayout *layout, const GPTConfig *cfg, int first, int n, bool embed, bool head,
                              int first_repeat, int n_repeats);
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

#endif
