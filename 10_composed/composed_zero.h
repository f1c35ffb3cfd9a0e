// composed_zero.h: ZeRO as stage 10's data dimension (Megatron's distributed optimizer). Without
// zero_stage, the replicas of a pipeline stage's tensor-parallel share all-reduce its gradients
// and each keeps all of AdamW's state, as stage 03 does. zero_stage 1 (04's first rung, over the
// group `composed_replicas`: dp, or dp x cp) cuts that share's flat buffer into one shard per
// replica, ceil(n / R) elements:
//
//   after backward   the tied wte summed over the pipeline first (07's group, whole), then the
//                    gradients reduce-scattered over the replicas: each rank the sum of its shard
//   the norm         each rank the squares of its shard (05's owner rule, 07's tied copy left
//                    out), summed over the replica's pp x tp ranks and over the shards' group
//   the step         AdamW on the shard, its m and v 1/R of DDP's; the updated shards all-gathered
//   checkpoints      whole: m and v all-gathered for the moment of saving (a group of its own),
//                    sliced again on loading
//
// zero_stage 2 and 3 are refused: a pipeline stage adds every micro-batch's gradient into the
// same buffer until its last backward, so a sharded gradient (2) would save nothing unless each
// micro-batch were reduce-scattered, and sharded parameters (3) would need 05's layers to gather
// each block around every micro-batch's forward and backward (DeepSpeed refuses both with
// pipeline parallelism for the same reasons).
#ifndef COMPOSED_ZERO_H
#define COMPOSED_ZERO_H

#include <stdbool.h>
#include <stddef.h>

#include "composed.h"
#include "run/stage_run.h"

typedef struct {
    bool on;            // zero_stage 1 (else the replicas all-reduce, as stage 03)
    Comm *group;        // the replicas: the ranks holding this share, each one shard of it
    Comm *io;           // the same ranks, for checkpoints: counted apart from training
    int rank, R;        // within group
    size_t n;           // elements of the share (mb.n)
    size_t shard;       // ceil(n / R): every shard's length; the last ends in padding
    size_t first, real; // this rank's shard: elements [first, first + real) of the share
    float *scratch;     // shard elements: the reduce-scatter's output, the all-gather's input
} ComposedZero;

// Reads zero_stage (and refuses what stage 10 does not run, fatal() on every rank alike). With
// zero_stage 1: grows mb's parameters and gradients to R x shard elements (the padding zero;
// collectives cut equal shards), re-pointing mb->w and mb->g, and keeps only this rank's slice
// of mb's AdamW moments, which were loaded or zeroed whole.
void composed_zero_init(ComposedZero *z, Comm *replicas, const Config *cfg, ModelBuffers *mb,
                        const ParamLayout *layout);
// the memory the data dimension shards, rank 0's rows (after pipeline_print_memory: stats.json's
// "AdamW m and v (fp32)" row becomes the shard's) and the state formula
void composed_zero_print_memory(const ComposedZero *z);
// zero_stage 1: the gradients reduce-scattered over the replicas, each rank holding the sum of its
// shard in place (the rest of mb->grads is this rank's alone: unread); without it, the replicas
// all-reduce (composed_ep_reduce_gradients)
void composed_zero_reduce_gradients(ComposedZero *z, ModelBuffers *mb);
// zero_stage 1: the global gradient norm, each element of the model counted once (each rank its
// shard's squares)
double composed_zero_grad_norm(const ComposedZero *z, const ComposedGroups *g, const TPModel *m, const PipeGrid *pg,
                               const float *grads);
// AdamW reading the gradients times clip: on the whole share, or on the shard and all-gathered
void composed_zero_step(ComposedZero *z, const ParamLayout *layout, ModelBuffers *mb, const Config *cfg, double lr,
                        long t, float clip);
// composed_save_checkpoint, with m and v (shards under zero_stage 1) whole
void composed_zero_save(ComposedZero *z, const Config *cfg, const ComposedGroups *groups, const PipeGrid *pg,
                        const TPModel *m, const ParamLayout *full, const float *params, const float *adam_m,
                        const float *adam_v, long step);
void composed_zero_free(ComposedZero *z);

#endif
