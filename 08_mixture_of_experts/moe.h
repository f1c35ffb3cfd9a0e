// moe.h: stage 08's lesson, a mixture-of-experts MLP, written once, as steps.
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
// puts an all-to-all between them to run each expert on the rank that holds it (experts.c).
//
// The core (common/model/gpt.h) knows the MoE blocks' MLP only as MOE_MLP, which the programs that run
// one put in MoEConfig.mlp (moe_model): its tensors, which the layout puts in place of the
// dense MLP's, the activations below, and moe_forward / moe_backward, which serial_layer_ops()
// runs for a MoE block. Stage 08 trains with it; stage 06 generates with it, and the planner
// sizes it: the one stage file they link besides their own.
#ifndef MOE_H
#define MOE_H

#include "model/gpt.h"
#include "model/moe_mlp.h"

// A MoE block's MLP as GPT-2's names it (after Mixtral's sparse block): the router
// (mlp.gate.weight, (E, C), no bias), then each expert held, one GPT-2 MLP each
// (mlp.experts.N.c_fc, mlp.experts.N.c_proj)
extern const MoEMLP MOE_MLP;
// the model cfg describes, with its MoE blocks' MLP (MoEConfig.mlp)
void moe_model(GPTConfig *cfg);
// the whole model with the experts [first_expert, first_expert + n) of each MoE block only
// (expert parallelism); the experts keep their names and random streams
void moe_layout_experts(ParamLayout *layout, const GPTConfig *cfg, int first_expert, int n);

// What the MoE blocks' MLP is (GPTConfig's) and what this rank holds of it (ModelShape's repeats).
typedef struct {
    int C, C_mlp;           // the residual stream's width, an expert's hidden width
    int n_experts, top_k;
    float capacity_factor, aux_loss_coef;
    int first_expert, n_local;  // the experts held: [first_expert, first_expert + n_local)
    int ep;                 // ranks a block's experts are spread over (1: all here)
} MoEShape;

MoEShape moe_shape(const GPTConfig *cfg, const ModelShape *s);
// rows one expert takes from one sequence of T tokens (0: no limit)
int moe_capacity(const MoEShape *s, int T);
// rows the experts a rank holds can receive in one micro-batch of B x T tokens per rank
int moe_receive_capacity(const MoEShape *s, int B, int T);

// One MoE block's weights (or gradients): its BlockWeights.moe_mlp, by name
typedef struct {
    Linear router;            // (E, C), no bias
    Linear fc[MAX_EXPERTS];   // the held experts' layers, by index among those held
    Linear proj[MAX_EXPERTS];
} MoEWeights;

void moe_weights(MoEWeights *mw, const BlockWeights *w, const MoEShape *s);

// What a MoE block keeps from its forward for N = B*T tokens. The routing is decided on the host
// (a few numbers per token: which experts, which row); the rows themselves stay on the device.
typedef struct {
    int N, R;               // tokens; rows the experts held here can receive
    float *logits;          // (N, E) router logits (device)
    float *probs;           // (N, E) their softmax (host)
    int *choice;            // (N, k) each token's experts, most probable first (host)
    float *weight;          // (N, k) their weights, renormalised over the k (host)
    int *slot;              // (N, k) the row of `packed` the token went to; -1: dropped (host)
    int *routed;            // (E) rows this rank packed for each expert, in expert order (host)
    int *expert_rows;       // (n_local + 1): held expert i runs expert_in rows [i], [i+1] (host)
    int *counts;            // (ep x E) rows each rank of the expert group sent to each expert, from
                            // the forward's exchange, which backward reuses (host; ep > 1). Kept per
                            // activations: a pipeline (stage 10) has several micro-batches in flight
    int *slot_dev;          // device copies of slot and weight
    float *weight_dev;
    float *packed;          // (N k, C) this rank's tokens, grouped by expert: the dispatch
    float *expert_in;       // (R, C) the rows the held experts run on (packed itself when ep is 1)
    float *fch, *fch_gelu;  // (R, 4C)
    float *expert_out;      // (R, C)
    float *returned;        // (N k, C) expert outputs of this rank's tokens (expert_out when ep is 1)
} MoEBlockActs;

// MoE blocks' backward scratch, shared by every MoE block
typedef struct {
    float *dreturned, *dpacked;        // (N k, C), when the experts are on other ranks
    float *dexpert_out, *dexpert_in;   // (R, C)
    float *dfch, *dfch_gelu;           // (R, 4C)
    float *dlogits;                    // (N, E) device
    float *dprobs;                     // (N, E) host
    float *dweight;                    // (N, k) host: the gradient of each chosen expert's weight
    float *dweight_dev;
} MoEScratch;

// What the MoE blocks report: summed over the micro-batches since the stage last reset it.
typedef struct {
    double aux_sum;    // load-balancing loss summed over sequences and MoE blocks
    long dropped;      // token-expert pairs over capacity (their expert's output is left out)
    long *load;        // [n_layers x E] rows each expert ran, by block (index in the range)
} MoEStats;

// What the MoE blocks of an Activations keep (Activations.moe, MOE_MLP.alloc_acts).
typedef struct MoEActs MoEActs;
struct MoEActs {
    MoEShape shape;
    MoEBlockActs **blocks;  // [n_layers]: block first_layer + i's, NULL for a dense block
    MoEScratch scratch;
    MoEStats stats;
    float aux_dloss;        // the gradient weight of one sequence's load-balancing loss in one
                            // block (moe_set_global_batch)
};

// The gradient weight of the load-balancing loss: aux_loss_coef / (sequences in the global batch x
// MoE blocks), so that the objective is the mean over both. Call before each step's backward.
void moe_set_global_batch(Activations *a, const GPTConfig *cfg, int global_sequences);
void moe_stats_reset(Activations *a);
// what the MoE blocks did since the last reset (NULL without MoE blocks)
const MoEStats *moe_stats(const Activations *a);

// block l's routing and expert rows
MoEBlockActs *moe_acts(const Activations *a, int l);

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

// the MoE MLP on one rank holding every expert (MOE_MLP's forward / backward)
void moe_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T);
void moe_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w, BlockWeights *g,
                  const float *dout, int B, int T);

#endif
