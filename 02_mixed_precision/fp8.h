// fp8.h: the FP8 precisions, FP8 training's recipes as a plug-in around the block's layers:
//   fp8-tensorwise  one scale a tensor (torchao's and Transformer Engine's tensorwise scaling), from
//                   the tensor's amax now (fp8_scaling current) or from the largest amax of its last
//                   fp8_amax_history casts (delayed, Transformer Engine's recipe: known before the
//                   tensor is, so an FP8 kernel need not read it twice); or none, scale 1, to see
//                   what the scale protects against
//   fp8-rowwise     one scale a row of each matmul operand along its reduction dimension (torchao's
//                   rowwise recipe): an outlier row no longer crushes the others' values toward 0
//   mxfp8           one scale a block of 32 along the reduction dimension, E8M0 (OCP Microscaling:
//                   2^(floor(log2 amax) - 8)), elements e4m3: an outlier costs only its block
//
// Each of the block's four linears multiplies FP8 numbers: its input and its weight in e4m3
// (the precision: 3 mantissa bits); the gradient of its output in e5m2 (the range: 5 exponent
// bits) under tensorwise scaling, in e4m3 under rowwise and MX, whose finer scales give it the
// range. Each tensor is scaled first so that its amax lands on the format's largest finite (a
// power of two, fp8_scale_pow2; MX's own E8M0 scale), the products accumulated in fp32. Rowwise
// and MX scale along each matmul's reduction dimension, so the backward's two matmuls cast their
// operands again their own way: dinp = dout W reduces over out_dim (dout by rows, W by columns),
// dW = dout^T x over the tokens (both by columns).
// What stays in bf16 and fp32 is what FP8 would hurt most for least gain: the lm_head (its logits feed
// the softmax over the whole vocabulary; a small error on the largest logit moves every
// probability) and the embedding, the loss, LayerNorm and softmax statistics (fp32: they are
// sums and exponentials, not matmuls), the fp32 master weights and AdamW.
//
// Emulated: with a power-of-two scale, fp8(x scale) / scale is a bf16 value exactly
// (cast_to_fp8_grid), so stage 02's bf16 matmuls, fed those values, compute the FP8 matmul's
// products exactly and accumulate them in fp32 as FP8 tensor cores do. On a GPU whose tensor cores
// take FP8 with a scale a tensor (sm_89, sm_90), fp8-tensorwise's products run there, on the same FP8
// numbers (ops.h matmul_forward_fp8); rowwise and MX stay emulated everywhere.
#ifndef FP8_H
#define FP8_H

#include "config/config.h"
#include "model/gpt.h"
#include "run/metrics.h"

// tensorwise scaling, one operand of one linear: the scale its last cast used (backward casts the
// weight again with its forward's), and for delayed scaling its last amaxes
typedef struct {
    const float *weight;  // its linear's weight: which linear
    int operand;          // FP8_INPUT, FP8_WEIGHT or FP8_OUTPUT_GRAD (run/metrics.h)
    float last_scale;
    float *amax;          // delayed: a ring of fp8_amax_history amaxes, 0 where none yet
    int next;             // where the next amax goes
} AmaxHistory;

// a linear's input kept in fp32 for its backward, which casts it again its own way (the block keeps
// only the 16-bit copy, which holds the forward's cast); found by that copy, which linears sharing
// an input (phi's attention and MLP) share
typedef struct {
    const half16 *inp16;
    float *x;
} SavedInput;

typedef struct {
    LayerOps ops;      // first: the block calls these
    LayerOps *inner;   // the layers wrapped (the head, the norms, attention run there)
    Precision prec;    // which recipe
    half16 *weight8;   // the weight of the linear in flight, on the FP8 grid (a block's worth)
    half16 *input8;    // its input cast again for backward (rowwise, MX: down the columns, for dW)
    size_t bytes, input8_numel;
    SavedInput *inputs;    // one a distinct input of the block's linears, made on its first forward
    int n_inputs, max_inputs;
    size_t max_tokens;     // the activations' capacity: a saved input's rows
    int history_len;       // delayed scaling: fp8_amax_history (0: current scaling)
    bool unscaled;         // fp8_scaling none: every scale 1 (what the values do without one)
    AmaxHistory *histories;  // tensorwise: one an operand of each linear, made on its first cast
    int n_histories, max_histories;  // both bounded by the layout's linears
    float *resumed;  // delayed, resuming: the checkpoint's histories, a row each in the order made
    unsigned long long *clips;        // device: [operand][FP8_CLIPS] what the casts clipped
    double values[FP8_OPERANDS];      // ... out of how many values cast
    Fp8StepStats stats;
} Fp8Layers;

// plugs the FP8 linears in around acts' layers (the model's blocks laid out as `layout`) when the
// precision is one of FP8's; otherwise does nothing. Under delayed scaling every checkpoint keeps
// the amax histories (tensor fp8_amax_history of optimizer.safetensors, a row each, oldest amax
// first, in the order the linears first cast, which every run of a layout repeats), and a resumed
// run starts from them: the losses of a run stopped and resumed are an uninterrupted run's.
void fp8_attach(Fp8Layers *f, const Config *cfg, Activations *acts, const ParamLayout *layout);
// what the casts clipped since the last call (NULL when no FP8 linears run); resets the counts
const Fp8StepStats *fp8_step_stats(Fp8Layers *f);
void fp8_free(Fp8Layers *f);

#endif
