// moe.h: a mixture-of-experts MLP (stage 08), written once, as steps.
//
// A MoE block replaces the block's one MLP by E experts (each a GPT-2 MLP) and a router, a linear
// layer C -> E. For each token the router's softmax picks the k most probable experts; the
// token's MLP output is the sum of those experts' outputs, each weighted by its probability
// renormalised over the k (Mixtral's sparse block). Each expert takes at most `capacity` rows of
// each sequence, ceil(capacity_factor * T * k / E), first come first served in position order; a
// token-expert pair over capacity is dropped (that expert's output is left out; the residual still
// carries the token). Capacity is counted per sequence so that the same tokens are dropped however
// the batch is split over ranks.
//
// The load-balancing loss (Switch Transformer, Mixtral): for each sequence s and MoE block,
// aux = E * sum_e f_e * P_e, where f_e is the share of the sequence's tokens routed to expert e
// (before dropping, k choices each) and P_e the mean router probability of e. It is smallest when
// both are uniform; the objective adds aux_loss_coef x its mean over sequences and MoE blocks.
//
// The steps below are what moe_forward / moe_backward (one rank, every expert) run; stage 08
// puts an all-to-all between them to run each expert on the rank that holds it.
#ifndef MOE_H
#define MOE_H

#include "gpt.h"

// rows one expert takes from one sequence of T tokens (0: no limit)
int moe_capacity(const ModelShape *s, int T);
// rows the experts a rank holds can receive in one micro-batch of B x T tokens per rank
int moe_receive_capacity(const ModelShape *s, int B, int T);

// The gradient weight of the load-balancing loss: aux_loss_coef / (sequences in the global batch x
// MoE blocks), so that the objective is the mean over both. Call before each step's backward.
void moe_set_global_batch(Activations *a, const GPTConfig *cfg, int global_sequences);
void moe_stats_reset(Activations *a);

// block l's routing and expert rows
MoEActs *moe_acts(const Activations *a, int l);

// ---- the steps --------------------------------------------------------------------------------
// Routes the block's MLP input: router logits, softmax, top-k, capacity; packs each kept token row
// into `packed`, grouped by expert (m->counts[0..E) rows each); adds the load-balancing loss, the
// rows each expert ran and the dropped pairs to a->moe_stats.
void moe_route(Activations *a, int l, const BlockWeights *w, int B, int T);
// runs the held experts over expert_in (m->expert_rows says whose rows are whose) into expert_out
void moe_experts_forward(Activations *a, int l, const BlockWeights *w);
// the block's out = each token's kept experts' outputs (in `returned`), weighted
void moe_combine_outputs(Activations *a, int l, int B, int T);
// backward of moe_combine_outputs: the gradient of `returned` into dreturned, and of each chosen
// expert's weight (kept in a->moe for moe_route_backward)
void moe_combine_outputs_backward(Activations *a, int l, const float *dout, float *dreturned, int B, int T);
// from the gradient of expert_out to that of expert_in, adding the held experts' weight gradients
void moe_experts_backward(Activations *a, int l, const BlockWeights *w, BlockWeights *g, const float *dexpert_out,
                          float *dexpert_in);
// from the gradient of `packed` and of the weights: dinp += the MLP input's gradient (through the
// rows and through the router), g->router +=
void moe_route_backward(Activations *a, int l, float *dinp, const BlockWeights *w, BlockWeights *g,
                        const float *dpacked, int B, int T);

// the MoE MLP on one rank holding every expert (LayerOps' moe_forward / moe_backward)
void moe_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T);
void moe_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w, BlockWeights *g,
                  const float *dout, int B, int T);

#endif
