// moe_mlp.h: the hook through which the core lays out, allocates and runs an MLP it does not
// know, a mixture of experts: stage 08 describes it (08_mixture_of_experts/moe.h's MOE_MLP) and
// sets GPTConfig.moe_mlp; a dense model never reads this file's type.
#ifndef MOE_MLP_H
#define MOE_MLP_H

#include "arch.h"
#include "layer_ops.h"

// activations.h's allocator, which the MLP allocates its own buffers with
typedef struct ActsAllocator ActsAllocator;

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


#endif
