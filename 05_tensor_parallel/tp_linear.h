// tp_linear.h: AxoNN's 3D tensor-parallel linear layer ("expert mode") over an [x, y, z] grid,
// with data parallelism as a fourth, slowest dimension.
//
//                    W (out, in) of one layer, the serial model's weight
//              in-features split over y  ->
//          +-----------+-----------+
//   out    | (x0, y0)  | (x0, y1)  |    rank (x, y) keeps block W[x-th rows, y-th columns];
//   split  +-----------+-----------+    each block is cut again into z equal 1-D pieces
//   over x | (x1, y0)  | (x1, y1)  |    (depth), one per rank of the z group
//          +-----------+-----------+
//
// Forward:  W_block = all-gather(W_shard) over z;  Y = X_block @ W_block^T;  all-reduce Y over y
//           (each y rank multiplied a slice of the in-features: partial sums)
// Backward: dX = dY @ W_block, all-reduce over x (each x rank held a slice of the out-features);
//           dW_block = dY^T X, reduce-scatter over z (the z ranks saw different rows)
// A "transposed" layer swaps the roles of x and y: its input is split over x and its output over
// y. Pairing a normal layer with a transposed one (fc -> proj) chains them without moving data:
// the normal layer's output split over x is exactly the transposed layer's input.
//
// Nothing here is tied to training: tp_linear_forward works on any rows with a gathered block,
// so inference (a KV-cache decode step over [x, y, 1]) reuses it as it is.
#ifndef TP_LINEAR_H
#define TP_LINEAR_H

#include <stdbool.h>
#include <stddef.h>

#include "comm/comm.h"
#include "model/gpt.h"
#include "ops/ops.h"

// ---- the grid ---------------------------------------------------------------------------------
// world rank = ((data * Z + z) * X + x) * Y + y: y fastest (AxoNN's "inner"/column group), then
// x ("outer"/row), then z (depth), data slowest. Ranks of one y group are neighbours (the most
// frequent all-reduces stay inside a node).
typedef struct {
    int X, Y, Z, D;             // sizes; D = world / (X Y Z) data-parallel replicas
    int x, y, z, d;             // this rank's coordinates
    Comm *gx, *gy, *gz, *gdata; // vary one coordinate, fix the others; named "x", "y", "z", "data"
    Comm *tp;                   // the X*Y*Z ranks of one replica (host sums only: the grad norm)
    // the batch's rows: the global batch is cut into z * data * acc slices, and the x, y ranks of
    // a slice share it; one rank of those counts its tokens and losses
    int row_ranks, row_rank;
    bool counts_rows;
} TPGrid;

// Creates the groups (every rank must call it). The caller has validated that X*Y*Z divides the
// world size.
void tp_grid_init(TPGrid *g, Comm *world, const int dims[3]);

// all-reduce that skips groups of one rank (no call, nothing counted)
void tp_all_reduce(Comm *c, float *buf, size_t count);
CommRequest *tp_all_reduce_start(Comm *c, float *buf, size_t count);  // NULL for one rank
void tp_wait(CommRequest *r);                                          // NULL: nothing to wait

// ---- one layer --------------------------------------------------------------------------------
typedef struct {
    Comm *in_group;       // splits the in-features: the forward all-reduce is over it
    Comm *out_group;      // splits the out-features: the backward all-reduce of dX is over it
    Comm *depth;          // shards the block 1/z
    int in, out;          // the whole layer
    int in_local, out_local;  // the block this rank multiplies: (out_local, in_local)
    size_t block, shard;  // elements of the block, and of the piece this rank stores
    bool partial_sums;    // sequence parallelism: the output's and dX's sums are the block's (tp_sequence.h)
} TPLinear;

// transposed = false: in over y, out over x (qkv, fc, lm_head); true: in over x, out over y
// (attention projection, MLP projection). Sizes must divide (validated by the caller).
TPLinear tp_linear_make(const TPGrid *g, int in, int out, bool transposed);

// out (N, out_local) = inp (N, in_local) @ W.w^T + W.b (out_local, may be NULL), complete after
// the all-reduce over in_group. W is a gathered block (tp_stream_next) with this rank's bias;
// bf16 mode (W.w16 set): inp is rounded into inp16 (kept for backward).
void tp_linear_forward(const TPLinear *l, float *out, const float *inp, half16 *inp16, Linear W, int N);

// dinp (N, in_local) += complete dX (after the all-reduce over out_group: dinp must hold zeros on
// entry, as the all-reduce sums the whole buffer); dw_block (out_local, in_local) += dY^T X of
// this rank's rows (not yet summed over z: see TPGradSlot); dbias (may be NULL) += column sums.
// dinp NULL: the weight gradients only; dw_block and dbias NULL: dinp only (zero bubble's split).
// overlap: the dX all-reduce runs while the weight-gradient matmul computes. dout16: bf16 scratch
// for dout (N * out_local) in bf16 mode.
void tp_linear_backward(const TPLinear *l, float *dinp, float *dw_block, float *dbias,
                        const float *dout, half16 *dout16, const float *inp, const half16 *inp16,
                        Linear W, int N, bool overlap);

// ---- depth: gathering weights before use, reduce-scattering their gradients -------------------

// The weights a pass uses, in order. tp_stream_next returns the next one gathered over z (or the
// shard itself when z = 1); with prefetch the all-gather of the following one is started at
// once, so it travels while this one is multiplied (AxoNN's overlap of all-gathers).
typedef struct {
    const TPLinear *layer;
    float *shard;
    half16 *shard16;  // bf16 mode with z = 1: the shard's bf16 copy (made once per step)
} TPWeightUse;

#define TP_STREAM_MAX 512
typedef struct {
    TPWeightUse uses[TP_STREAM_MAX];
    int n, next;
    bool prefetch, half;
    float *buf[2];        // two gathered blocks: the one in use and the one arriving
    half16 *buf16[2];
    CommRequest *req[2];
} TPWeightStream;

// buffers for blocks of up to max_block elements (none when z = 1)
void tp_stream_init(TPWeightStream *s, const TPGrid *g, size_t max_block, bool prefetch, bool half_mode);
void tp_stream_free(TPWeightStream *s);
void tp_stream_begin(TPWeightStream *s);  // call after filling uses[0..n)
Linear tp_stream_next(TPWeightStream *s);  // the next weight (no bias)

// A weight gradient in flight: dW of this micro-batch's rows (block), reduce-scattered over z
// into `shard`, then added into the gradient shard `grad` (accumulating micro-batches).
typedef struct {
    float *block, *shard;
    float *grad;
    const TPLinear *layer;
    CommRequest *req;
} TPGradSlot;

void tp_grad_slot_alloc(TPGradSlot *s, size_t max_block);
void tp_grad_slot_free(TPGradSlot *s);
// zeroed block for layer l's dW, to be reduce-scattered into grad (waits for the slot's last use)
float *tp_grad_slot_open(TPGradSlot *s, const TPLinear *l, float *grad);
void tp_grad_slot_launch(TPGradSlot *s);  // starts the reduce-scatter
void tp_grad_slot_finish(TPGradSlot *s);  // waits and adds into grad (nothing if not in flight)

#endif
