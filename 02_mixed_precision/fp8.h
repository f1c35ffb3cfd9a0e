// fp8.h: precision fp8-tensorwise, FP8 training's first recipe (torchao's and Transformer
// Engine's tensorwise scaling with current scaling), as a plug-in around the block's layers.
//
// Each of the block's four linears multiplies FP8 numbers: its input and its weight in e4m3
// (the precision: 3 mantissa bits), the gradient of its output in e5m2 (the range: 5 exponent
// bits), each tensor scaled first so that its amax lands on the format's largest finite
// (fp8_scale_pow2: this step's amax, a power of two), the products accumulated in fp32. What
// stays in bf16 and fp32 is what FP8 would hurt most for least gain: the lm_head (its logits feed
// the softmax over the whole vocabulary; a small error on the largest logit moves every
// probability) and the embedding, the loss, LayerNorm and softmax statistics (fp32: they are
// sums and exponentials, not matmuls), the fp32 master weights and AdamW.
//
// Emulated: with a power-of-two scale, fp8(x scale) / scale is a bf16 value exactly
// (cast_to_fp8_grid), so stage 02's bf16 matmuls, fed those values, compute the FP8 matmul's
// products exactly and accumulate them in fp32 as FP8 tensor cores do.
#ifndef FP8_H
#define FP8_H

#include "model/gpt.h"

typedef struct {
    LayerOps ops;      // first: the block calls these
    LayerOps *inner;   // the layers wrapped (the head, the norms, attention run there)
    half16 *weight8;   // the weight of the linear in flight, on the FP8 grid (a block's worth)
    size_t bytes;
} Fp8Layers;

// plugs the FP8 linears in around acts' layers (the model's blocks laid out as `layout`)
void fp8_attach(Fp8Layers *f, Activations *acts, const ParamLayout *layout);
void fp8_free(Fp8Layers *f);

#endif
