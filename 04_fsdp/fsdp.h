// fsdp.h: fully sharded data parallelism (FSDP), the technique of stage 04.
//
// The model is cut into units: unit 0 is the root (wte, wpe, ln_f: the tensors used at both ends
// of the model) and unit 1 + l is transformer block l, each one contiguous range of the flat
// parameter layout (common/model/gpt.h). Every unit is padded to a multiple of P elements and cut into
// P equal shards: rank r keeps shard r of every unit's parameters, gradients and AdamW moments,
// and nothing else. A unit's full parameters exist only while it computes:
//
//   forward   all-gather the unit -> compute -> free          (the root stays for the head)
//   backward  all-gather the unit -> compute -> reduce-scatter its gradient -> free
//   step      clip with the norm summed over shards, AdamW on this rank's shards
//
// "Free" means the gathered buffer is reused by the next unit: memory holds the root plus one
// block (two with prefetching) at a time, never the model.
//
// That is the top rung of a ladder (zero_stage; ZeRO's stages, named after the paper):
//   zero_stage 1  parameters and gradients whole on every rank, AdamW's m and v sharded: after
//                 the step's backward each unit's gradient is reduce-scattered, each rank updates
//                 its shard, and the updated shards are all-gathered into every rank's parameters
//   zero_stage 2  the gradients sharded too: each unit's gradient is reduce-scattered as soon as
//                 its backward is done (the units are the buckets; with overlap_communication
//                 while the next one computes) and added into the shard; the all-gather as in 1
//   zero_stage 3  the parameters sharded too: the gathers above (the default)
// hsdp_replicas R (hybrid sharding): the P ranks form R groups of P / R consecutive ranks; every
// rung shards inside its group ("shard"), and after backward the gradient shards are summed over
// the R ranks holding the same shard ("replicas", one all-reduce per step).
#ifndef FSDP_H
#define FSDP_H

#include <stdbool.h>
#include <stddef.h>

#include "comm/comm.h"
#include "config/config.h"
#include "model/gpt.h"
#include "run/trainable.h"
#include "run/muon.h"
#include "run/run_stats.h"

typedef struct {
    size_t first, numel;  // the unit's range of the flat layout
    size_t shard;         // elements per rank: ceil(numel / P); the last shards end in padding
    size_t local;         // where this rank's shard starts in the rank's shard buffers
    size_t whole_at;      // where the unit starts in a whole (replicated) buffer, padded units
} FsdpUnit;

typedef struct {
    Comm *world;
    Comm *group;           // the ranks sharing the shards: world, or HSDP's "shard" group
    Comm *replicas;        // HSDP: the ranks holding the same shard (NULL: hsdp_replicas 1)
    Comm *io;              // the group's ranks, for checkpoints: counted apart from training
    int rank, P;           // within the group
    int zero_stage, n_replicas;
    const ParamLayout *layout;
    int n_units;           // 1 + L
    FsdpUnit *units;       // [n_units]
    size_t shard_numel;    // elements this rank holds of each of m and v (and grads, params when sharded)
    size_t whole_numel;    // elements of every unit, padded: a replicated buffer
    size_t params_numel, grads_numel;  // elements of f->params and f->grads: shard or whole
    size_t max_block;      // elements of the largest block unit, padded
    bool prefetch, use_16bit;
    // this rank's shards of every unit, one after the other; zero_stage < 3 keeps params whole
    // (units at whole_at) and zero_stage 1 the grads too: a shard is then a slice of each unit
    float *params, *grads, *adam_m, *adam_v;
    // the gathered ("full") units, allocated once and reused: "free" = let the next unit in
    float *root, *root_grad;   // the root unit, held through a whole micro-batch
    float *block[2];           // a block's gathered parameters; [1] is the prefetch slot
    // a block's full gradient, and the shard its reduce-scatter returns; [1] when overlapping:
    // block l's reduce-scatter runs while block l - 1's backward computes into the other slot
    float *block_grad[2], *shard_scratch[2];
    half16 *root16, *block16[2]; // bf16 copies of the gathered units (bf16 precisions)
    // In bf16 precisions a block travels as its shards' bf16 copies, half the bytes of the fp32
    // shards and the same numbers the matmuls read after rounding; its few tensors that stay fp32
    // (biases, LayerNorm weights) travel apart, each rank's part packed into `fp32_pack` floats
    // (the most any rank's shard of any block holds). The root stays fp32: the embedding reads wte.
    size_t fp32_pack;
    half16 *shard16[2];          // this rank's shard of the block in flight, rounded
    float *pack_send[2], *pack_recv[2];  // its fp32 part, and every rank's (P x fp32_pack)
    size_t gathered_bytes;     // what the fp32 gathered buffers above take (grads, packs included)
    size_t gathered16_bytes;   // and their bf16 copies
    // optimizer muon (fsdp_muon_step): Muon orthogonalizes whole matrices, and a rank holds only
    // its shard of each. Each block's updates are all-gathered; each matrix is orthogonalized by
    // one owner rank, the largest matrices first to the least loaded rank, into an otherwise zero
    // block that a reduce-scatter brings back to the shards (a sum of one value and zeros: exact).
    // muon_redundant: every rank orthogonalizes every matrix and keeps its shard, no reduce-scatter.
    bool muon_on, muon_redundant;
    int *muon_owner;           // [layout->num_tensors]: the group rank that orthogonalizes it, -1: AdamW's
    float *muon_unit, *muon_mine;  // a block's gathered updates; those this rank orthogonalized (owner)
    Muon muon;                 // the orthogonalization's scratch
    size_t muon_bytes;         // what the three take on a rank
    double muon_flops_max, muon_flops_min;  // a step's orthogonalization flops on the busiest and idlest rank
    // the trained set beside a frozen base (fsdp_freeze_base; NULL: the base trains), whole on
    // every rank; grads and grads_numel then name its gradients: the base has none
    Trainable *trained;
} Fsdp;

// Cuts the layout into units for world rank `rank` of P (its group: P / replicas ranks) and sizes
// every buffer, allocating nothing and making no group: what fsdp_init allocates, and what the
// planner (tools/plan.c) predicts.
void fsdp_plan(Fsdp *f, const ParamLayout *layout, int rank, int P, bool prefetch, bool use_16bit, int zero_stage,
               int replicas);
// optimizer muon: sizes Muon's buffers and picks each matrix's owner rank (fsdp_plan first; what
// fsdp_init allocates, and what the planner predicts)
void fsdp_plan_muon(Fsdp *f, bool redundant, int ns_steps);
// whether hsdp_replicas divides the P ranks into whole groups; why not, if not (fsdp_init ends
// the job with it; the planner skips the layout)
bool fsdp_replicas_fit(int replicas, int P, char *why, size_t why_size);
// fsdp_plan, then makes the groups and allocates this rank's shards (zero) and the gathered buffers.
void fsdp_init(Fsdp *f, Comm *world, const ParamLayout *layout, const Config *cfg, bool use_16bit);
// The base is frozen and t trains instead (a model transform's tensors: common/run/trainable.h;
// t NULL: nothing happens). Frees the base's gradients, AdamW moments and gathered gradient
// buffers. The base's shards, gathers and frees stay FSDP's as ever, but it has no gradient to
// reduce-scatter and no moments to shard: a rank holds 1/P of its parameters and nothing else of
// it. t is small: every rank holds it whole, as DDP's replicas hold a model, and its gradients are
// all-reduced once a step (fsdp_reduce_gradients); sharding it would save little and cost a gather
// per block. The gathered blocks all pass through the same slots, so each block's forward and
// backward first tells t which block runs (trainable_run_block).
void fsdp_freeze_base(Fsdp *f, Trainable *t);
// the rung and the groups, one line (rank 0 prints it)
void fsdp_print_sharding(const Fsdp *f);
void fsdp_free(Fsdp *f);
// bytes of parameters + gradients + optimizer state this rank holds (shards, and whole buffers)
size_t fsdp_state_bytes(const Fsdp *f);

// Sharded initialisation: each rank initialises only its shard, with the counter-based RNG, and
// gets exactly the values the whole model would get.
void fsdp_init_shards(Fsdp *f, uint64_t seed);
// Checkpoints are the full safetensors files every stage reads. Loading (init_from, or resume:
// returns the step to continue from) reads the file on rank 0 and re-shards it; saving gathers
// the shards on rank 0 and writes. Only then, only on rank 0 and only for that moment, does a
// whole model (with m and v: three) exist in one process.
long fsdp_load_checkpoint(Fsdp *f, const Config *cfg);
void fsdp_save_checkpoint(Fsdp *f, const Config *cfg, long step);

// One micro-batch: forward, loss, backward, with gathers before each unit computes and a
// reduce-scatter after each unit's backward that adds into this rank's gradient shard.
// Returns the micro-batch's summed loss (of this rank's rows).
double fsdp_forward_backward(Fsdp *f, Activations *a, const GPTConfig *cfg, const int *inputs,
                             const int *targets, int B, int T, float dloss);
// Forward only, for evaluation: a->logits filled (a ForwardFn of evaluate.h, ctx = the Fsdp).
void fsdp_forward(void *fsdp, Activations *a, const int *inputs, int B, int T);

// After the step's last micro-batch: ZeRO-1 reduce-scatters every unit's gradient (each rank keeps
// its shard's sum), and HSDP all-reduces the gradient shards over the replicas.
void fsdp_reduce_gradients(Fsdp *f);
// the global gradient norm: each rank sums the squares of its shard, the group adds the sums
double fsdp_grad_norm(Fsdp *f);
// AdamW on this rank's shard of every unit (the padding is not a parameter: skipped), reading
// the gradients times `clip` (clip_factor); zero_stage < 3 then all-gathers the updated shards
// into every rank's whole parameters. With optimizer muon, Muon's step instead: AdamW and the
// momentum on the shards, each block's matrices orthogonalized whole (the muon fields above)
void fsdp_optimizer_step(Fsdp *f, const Config *cfg, double lr, long t, float clip);
// pure bf16 keeps no fp32 master: round this rank's parameters (shards or whole) to bf16 and back
void fsdp_round_to_bf16(Fsdp *f);

// the memory report's rows for this rank (FSDP) and for DDP on the same run (NULL: not wanted):
// FSDP_MEMORY_ITEMS, one fewer without Muon (its buffers' row last); returns how many
enum { FSDP_MEMORY_ITEMS = 7 };
int fsdp_memory_items(const Fsdp *f, const char *params_label, size_t acts_bytes,
                       MemoryItem fsdp[FSDP_MEMORY_ITEMS], MemoryItem ddp[FSDP_MEMORY_ITEMS]);
// Rank 0 prints this rank's memory next to what DDP would hold for the same run.
// (The activations are the same: both cut the global batch into P x acc micro-batches.)
void fsdp_print_memory(const Fsdp *f, const char *params_label, size_t acts_bytes);
// the ranks' largest and smallest peak resident memory (VmHWM) so far
void fsdp_print_peak_memory(const Fsdp *f);

#endif
