// loss_scale.h: fp16's dynamic loss scaling (precision 16-mixed).
//
// fp16 has 5 exponent bits: its smallest subnormal is 2^-24, and smaller gradients round to zero
// in the 16-bit copies the backward matmuls read. Multiplying the loss by a large scale (2^16)
// multiplies every gradient by it, lifting them into fp16's range; the gradients are divided by it
// again before clipping and the update, so the step is the one fp32 would take. A scale too large
// makes some gradient overflow to inf: that step is skipped (no update) and the scale halved;
// after loss_scale_window good steps it doubles again. bf16 has float32's exponent and needs none
// of this: in every other precision the scale is 1 and no step is skipped.
#ifndef LOSS_SCALE_H
#define LOSS_SCALE_H

#include <stdbool.h>
#include <stddef.h>

#include "config/config.h"
#include "model/checkpoint.h"  // TrainState

typedef struct {
    bool on;            // precision 16-mixed
    double scale;
    int window, good;   // window 0: a fixed scale; good: steps since the scale last changed
    long skipped;       // steps skipped so far
    bool skipped_now;   // the last step was skipped
    double underflow;   // the last step: share of the nonzero gradients cast to fp16 that became 0
    long inject_inf_at; // test hook WORKBOOK_INJECT_INF_STEP=N: step N's gradients are inf
} LossScaler;

// s starts at loss_scale, or (cfg->resume) where the resumed run's scaler was; save_checkpoint
// saves its state from now on, in the optimizer file's metadata beside the step (checkpoint.h,
// TrainState)
void loss_scaler_init(LossScaler *s, const Config *cfg);
// save_checkpoint's part: the state of the scaler loss_scaler_init last set up goes into state
// (nothing when that scaler is off, or there is none)
void loss_scaler_save(TrainState *state);
// the backward's dloss for a step with n_targets target tokens: 1 / n_targets, times the scale
float loss_scaler_dloss(const LossScaler *s, long n_targets, long step);
// After the gradients are complete (summed over ranks), with norm their global norm (scaled):
// false when the step must be skipped (an inf or NaN; every rank sees the same global norm, so
// all skip the same steps), updating the scale; else divides grads[0..n) by the scale, sets
// *norm to the unscaled norm and returns true.
bool loss_scaler_unscale(LossScaler *s, float *grads, size_t n, double *norm);

#endif
