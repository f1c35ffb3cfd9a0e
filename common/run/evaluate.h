// evaluate.h: the validation loss, cut over ranks as training cuts its batches.
#ifndef EVALUATE_H
#define EVALUATE_H

#include "config/config.h"
#include "data/alpaca.h"
#include "model/gpt.h"

// Validation loss over up to cfg->eval_batches global batches of the validation split, cut as
// training cuts them: this process takes micro-batches [rank * acc, (rank + 1) * acc) of
// world * acc slices (acc: micro_batches_per_step). Fills sums with the summed loss and the target
// count of its slices; add them up over ranks, then divide (count 0: no validation split).
void evaluate_sums(Activations *a, const Weights *w, const GPTConfig *mc, const Dataset *data,
                   const Config *cfg, int rank, int world, double sums[2]);
// The loop itself, for a model that is not a gpt.h one (stage 05's tensor-parallel model, stage
// 07's pipeline): loss(ctx, batch) returns the summed loss of one micro-batch however the stage
// computes it.
typedef double (*BatchLossFn)(void *ctx, const Batch *batch);
void evaluate_batches(BatchLossFn loss, void *ctx, const Dataset *data, const Config *cfg, int rank,
                      int world, double sums[2]);
// the same with the forward pass supplied by the stage (FSDP gathers its units inside it):
// forward(ctx, a, inputs, B, T) must leave the logits in a->logits
typedef void (*ForwardFn)(void *ctx, Activations *a, const int *inputs, int B, int T);
void evaluate_sums_with(Activations *a, ForwardFn forward, void *ctx, const GPTConfig *mc,
                        const Dataset *data, const Config *cfg, int rank, int world, double sums[2]);

#endif
