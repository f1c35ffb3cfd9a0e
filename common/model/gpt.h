// gpt.h: the model's block, written once for every stage.
//
// The layer steps (gpt.c): the embedding, one transformer block and the head, each with a forward
// and a backward, calling their linear layers, LayerNorms, attention and MLP through a LayerOps
// table (layer_ops.h). A stage that runs a layer its own way (bf16, tensor-parallel, with a KV
// cache) plugs in its version of that layer; the block itself exists only here. What they run on
// is in the headers beside this one: the description (arch.h: the config and the table of
// tensors), the layout (layout.h: one flat buffer of parameters, named views into it) and the
// activations (activations.h: what forward keeps for backward).
#ifndef GPT_H
#define GPT_H

#include "layer_ops.h"
#include "layout.h"

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
// without the head) back through the blocks and the embedding, adding into g (or writing, the pass
// after gpt_gradients_begin); hook(l, ctx) is
// called as soon as block l's gradients are final (l from last to first) and hook(-1, ctx) when
// the root tensors' are, so that a stage can start communicating gradients while backward goes
// on (PyTorch's DDP does this with autograd hooks). hook may be NULL.
typedef void (*GradReadyHook)(int layer, void *ctx);
void gpt_backward(Activations *a, const Weights *w, Weights *g, int B, int T, GradReadyHook hook, void *ctx);
// A step's gradients start here, in place of zeroing `grads` (bytes), the flat buffer g views: the
// next gpt_backward writes the weight gradients over what the buffer holds instead of adding to
// them, where its layers can (serial_layer_ops() over a dense whole model; only the embedding's
// gradients, which add, are zeroed); otherwise `grads` is zeroed here. Later passes add (gradient
// accumulation).
void gpt_gradients_begin(Activations *a, Weights *g, float *grads, size_t bytes);
// forward + loss + backward on one rank, adding into g; returns the summed loss of the micro-batch
double gpt_forward_backward(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                            const int *inputs, const int *targets, int B, int T, float dloss);
double gpt_forward_backward_hooked(Activations *a, const Weights *w, Weights *g, const GPTConfig *cfg,
                                   const int *inputs, const int *targets, int B, int T, float dloss,
                                   GradReadyHook hook, void *ctx);

#endif
