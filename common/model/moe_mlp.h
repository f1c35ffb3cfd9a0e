// moe_mlp.h: a mixture of experts as the core sees it: GPTConfig.moe (how many experts, which
// blocks, how tokens are routed) and the hook through which the core lays out, allocates and runs
// an MLP it does not know: stage 08 describes it (08_mixture_of_experts/moe.h's MOE_MLP) and sets
// MoEConfig.mlp; a dense model never reads this file's types.
#ifndef MOE_MLP_H
#define MOE_MLP_H

#include "arch.h"
#include "layer_ops.h"

typedef struct MoEMLP MoEMLP;

// the most experts a configuration may give a MoE block
#define MAX_EXPERTS 64

// GPTConfig.moe: the checkpoints' config.json describes the experts (Mixtral's names); the
// capacity and the load-balancing loss's weight are how the run trains them
struct MoEConfig {
    int n_experts;          // E, at least 1
    int experts_per_token;  // k: each token goes to its k most probable experts
    int moe_every;          // block l is a MoE block when (l + 1) % moe_every == 0
    float capacity_factor;  // rows per expert per sequence: ceil(factor * T * k / E); 0: no limit
    float aux_loss_coef;    // weight of the load-balancing loss in the objective
    const MoEMLP *mlp;      // the MoE blocks' MLP (08_mixture_of_experts/moe.h's MOE_MLP), set by
                            // the programs that run one; NULL: this program runs dense MLPs only
};

// a model's experts, for the program's lifetime (n_experts 0: NULL, a dense model)
MoEConfig *moe_config_new(int n_experts, int experts_per_token, int moe_every);

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
