// tp_sequence.h: Megatron's sequence parallelism (Korthikanti et al. 2022) for 1-D tensor
// parallelism, tp_dimensions [x, 1, 1] (key sequence_parallel).
//
// Plain 1-D tensor parallelism repeats what lies between its regions on every x rank: the
// LayerNorms, the residual stream, its gradient. Sequence parallelism splits those over the
// tokens instead: rank x keeps rows [x N/X, (x+1) N/X) of the micro-batch's N = B*T tokens (a
// sequence's positions stay together, as in Megatron's contiguous split of its sequence rows).
// Each region's all-reduce becomes a pair of collectives of the same bus bytes:
//   before a region (qkv, fc, the lm_head):  all-gather the norm's output over x       (g)
//   after a region (attention's and the MLP's projection, the embedding): reduce-scatter its
//     partial sums over x, into this rank's rows                                       (g-bar)
//   backward: the reduce-scatter's conjugate is an all-gather of the gradient, and back.
// The block does it (gpt.c: ActsSpec.seq_shards, LayerOps.seq_gather/seq_reduce_scatter); this
// file gives it the collectives. A norm's weight gradient then holds only this rank's rows: the
// x ranks' gradients are summed (tp_sequence_reduce_norm_grads).
#ifndef TP_SEQUENCE_H
#define TP_SEQUENCE_H

#include "config/config.h"
#include "tp_model.h"

// With key sequence_parallel, turns it on for m (before tp_acts_alloc): its linears leave their
// sums over x to the block's gather and reduce-scatter, and the activations keep 1/x of the
// residual rows, and gives the model the block's collectives (TPModel.seq_gather, seq_reduce_scatter).
// Refuses what it cannot split (fatal, naming the key and why): y or z > 1 (config.c refuses
// the other keys it does not run with).
void tp_sequence_apply(TPModel *m, const Config *cfg);
// the memory report's line and stats.json's "residual_activation_bytes": what the split divides
void tp_sequence_report(const TPModel *m, const Activations *a);
// After the micro-batches' backward: the norms' gradients, each rank's from its own rows, summed
// over the x ranks (group "tp", apart from the activations' collectives over "x").
void tp_sequence_reduce_norm_grads(const TPModel *m, float *grads);

#endif
