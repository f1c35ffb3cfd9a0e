// muon.h: Muon (MomentUm Orthogonalized by Newton-Schulz; Keller Jordan, 2024), key optimizer: muon.
//
// A transformer block's matrices step along their momentum made orthogonal: the momentum's
// singular values all set to about 1, so every direction the gradient points in moves at the same
// rate, the rare ones as much as the dominant ones. Five Newton-Schulz iterations of the quintic
// X <- a X + (b A + c A A) X, A = X Xᵀ, (a, b, c) = (3.4445, -4.7750, 2.0315), from X = M / ||M||_F
// (singular values then at most 1), push the singular values into [0.7, 1.2] without an SVD. The
// update is scaled by sqrt(max(1, out / in)) (the matrix's rows are its outputs) so a tall matrix's
// steps are as large per element as a square one's, and the parameter shrinks by lr x weight_decay
// first (decoupled weight decay). Embeddings, the head, norms and biases are no hidden linear maps:
// AdamW updates them (adamw_step skips the Muon tensors), as the published recipe does.
//
// The step is per element except the orthogonalization, which needs the whole matrix: a sharded
// optimizer (stage 04) runs the halves below on its shards and brings each matrix to one rank in
// between. muon_step is the whole step on one device.
#ifndef MUON_H
#define MUON_H

#include <stdbool.h>
#include <stddef.h>

#include "config/config.h"
#include "model/gpt.h"
#include "optimizer.h"  // muon_updates: which tensors are Muon's

// Scratch for orthogonalizing the largest matrix of a layout: a second (rows, cols) buffer and two
// Gram matrices (k, k), k = min(rows, cols)
typedef struct {
    float *next, *gram, *gram2;
    size_t bytes;
} Muon;

// the bytes muon_create allocates for `layout`: what Muon adds to a rank's memory (none of its state:
// the momentum lives in AdamW's m, whose v the Muon tensors leave unused)
size_t muon_scratch_bytes(const ParamLayout *layout);
// the scratch for `layout`'s matrices with optimizer muon; with adamw nothing (all zero)
Muon muon_create(const Config *cfg, const ParamLayout *layout);
void muon_free(Muon *mu);

// The step's first half on the flat range [first, first + n) (a whole model or a shard): AdamW on
// the tensors Muon does not update; the momentum (kept in m) on those it does, whose gradients
// (times clip) become the updates to orthogonalize, in place.
void muon_momentum_step(const ParamLayout *layout, float *params, float *grads, float *m, float *v, size_t first,
                        size_t n, const Config *cfg, double lr, long t, float clip);
// x (rows, cols), in place: muon_ns_steps Newton-Schulz iterations from x / ||x||_F, times
// sqrt(max(1, rows / cols))
void muon_orthogonalize(Muon *mu, float *x, int rows, int cols, int steps);
// The second half on [first, first + n): each Muon tensor's parameters shrink by weight decay and
// step along its orthogonalized update (read from `updates`, laid out as the range), at Muon's
// learning rate for AdamW's `lr`.
void muon_apply(const ParamLayout *layout, float *params, const float *updates, size_t first, size_t n,
                const Config *cfg, double lr);
// the flops of orthogonalizing a (rows, cols) matrix in `steps` iterations: per iteration the Gram
// matrix (2 k^2 n), its square (2 k^3) and the product with X (2 k^2 n), k = min(rows, cols),
// n = max(rows, cols)
double muon_flops(int rows, int cols, int steps);
// Muon's learning rate at the step where AdamW's is lr: muon_lr on the same warm-up and decay
double muon_learning_rate(const Config *cfg, double lr);

// The whole step on a range holding every Muon tensor it touches whole (one device); overwrites
// their gradients with their updates.
void muon_step(Muon *mu, const ParamLayout *layout, float *params, float *grads, float *m, float *v, size_t first,
               size_t n, const Config *cfg, double lr, long t, float clip);
// The run's optimizer on such a range: muon_step with optimizer muon, else adamw_step (mu unused);
// params16, where not NULL, the range's 16-bit copy, rewritten from the updated weights
void optimizer_step(Muon *mu, const ParamLayout *layout, float *params, half16 *params16, float *grads, float *m,
                    float *v, size_t first, size_t n, const Config *cfg, double lr, long t, float clip);

#endif
