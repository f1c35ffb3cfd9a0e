// composed_lora.h: LoRA (common/run/lora.h) on stage 10's mesh: 05's adapter slices (tp_lora.h) of
// each pipeline stage's blocks, in every slot of 07's pipeline.
//
// A rank holds the slices of its stage's adapters that 05 gives its x rank (A and B cut as their
// linear: A's columns of a row-parallel linear, B's rows of a column-parallel one); each stage
// holds the adapters of its blocks, as 07's. The adapters start from the whole model's (every mesh
// draws stage 01's values), run in every micro-batch slot in flight (backward recomputes x A^T),
// and only they have gradients: the replicas' all-reduce sums theirs, the tied wte (frozen) is not
// summed, the norm counts each element once in the replica (05's counting copy over x, each stage
// its own adapters), and the checkpoint is PEFT's adapter, put together from every stage's and x
// rank's slices (tp_lora.h).
#ifndef COMPOSED_LORA_H
#define COMPOSED_LORA_H

#include "../05_tensor_parallel/tp_lora.h"
#include "composed.h"

// lora_rank > 0: the adapters of m's blocks (full: the whole model's layout) plugged into every
// slot of pipe; layout and mb become this rank's slices' (tp_lora_attach_part), and the trained
// set is returned for pipe->trained. lora_rank 0: nothing happens, NULL. Refuses (fatal() on every
// rank alike) what stage 10 does not train adapters with: cp_size > 1 and a schedule that defers
// the weight gradients.
Trainable *composed_lora_attach(Lora *lo, const Config *cfg, TPModel *m, const ParamLayout *full, ParamLayout *layout,
                                ModelBuffers *mb, Pipeline *pipe);

#endif
