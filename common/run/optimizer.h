// optimizer.h: one optimizer step's arithmetic that every stage shares: the learning-rate
// schedule, AdamW over the parameter table (whole or a shard) and the gradient-clipping factor.
#ifndef OPTIMIZER_H
#define OPTIMIZER_H

#include <stddef.h>

#include "config/config.h"
#include "model/gpt.h"
#include "ops/ops.h"  // half16

// Linear warm-up from lr/warmup to lr over warmup_steps, then cosine decay to min_lr at the last
// step. `step` counts from 0.
double learning_rate(const Config *cfg, long step, long total_steps);

// whether optimizer muon updates the tensor (common/run/muon.h): a transformer block's matrix (q, k, v
// taken apart where the architecture's files keep them apart); everything else is AdamW's
bool muon_updates(const TensorInfo *ti);

// The part of tensor ti inside the flat range [first, first + n): how many elements (0: none), and
// where they start relative to `first` (*at). An optimizer's per-tensor loop over a whole model or
// any shard of it.
size_t tensor_in_range(const TensorInfo *ti, size_t first, size_t n, size_t *at);

// AdamW over the flat range [first, first + n) of the parameter table: weight decay only where
// the table says so (matrices and embeddings). Works on a whole model or on any shard of it.
// It reads each gradient times `clip` (clip_factor): clipping costs no pass of its own. With
// optimizer muon it skips the tensors Muon updates (muon_updates).
void adamw_step(const ParamLayout *layout, float *params, const float *grads, float *m, float *v,
                size_t first, size_t n, const Config *cfg, double lr, long t, float clip);
// ... writing the updated weights' 16-bit copy params16 (the same range) in the same pass, where
// params16 is not NULL: mixed precision's next matmul weights without a cast of their own
void adamw_step_16(const ParamLayout *layout, float *params, half16 *params16, const float *grads, float *m,
                   float *v, size_t first, size_t n, const Config *cfg, double lr, long t, float clip);

// The factor that brings gradients of global norm `norm` down to max_norm (1 when they are
// within it, or max_norm is 0: no clipping).
float clip_factor(double norm, double max_norm);

#endif
