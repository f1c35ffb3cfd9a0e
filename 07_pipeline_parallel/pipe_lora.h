// pipe_lora.h: LoRA (common/run/lora.h) on a pipeline: each stage trains the adapters of its blocks.
//
// A stage's adapters are those of the linears it holds; they train as its other tensors would,
// all-reduced over the replicas of the stage, and the base stays frozen (the tied wte of GPT-2
// too: nothing to sum between the first and the last stage). Two things differ from one process:
//  - a stage runs the forwards of later micro-batches before the backwards of earlier ones, and
//    every micro-batch in flight would need its own x A^T: instead backward recomputes it from the
//    input its block kept (r columns, a small matmul), so one buffer per adapter serves them all;
//  - the adapters start from the whole model's (A drawn per adapter of the whole model, or read
//    from lora_adapter), each stage taking its own by name, and the saved adapter is put together
//    from every stage's (pipe_save_checkpoint): the same file as one process writes.
#ifndef PIPE_LORA_H
#define PIPE_LORA_H

#include "pipeline.h"
#include "run/lora.h"

// A stage-07 run's LoRA (lora_rank > 0; otherwise nothing happens): lora_attach's work on this
// stage's layout, plugged into every activation slot of p. layout and mb become the stage's
// adapters' (mb.w still names its base), and full the whole model's adapters' table, which
// checkpoints are saved in (the base's table is freed).
void pipe_lora_attach(Lora *lo, const Config *cfg, ParamLayout *layout, ParamLayout *full, ModelBuffers *mb,
                      Pipeline *p);

#endif
