// ring_blocks.h: the steps of ring attention on this rank's device, over whole buffers (device
// pointers; CPU: OpenMP loops, CUDA: a thread per row and head, both over ring_math.h's math), and
// the column copies that move Ulysses' rows between the sequence and the head layouts.
// N = 2 * B * c rows (RingBlock), heads of hs = C / NH floats.
#ifndef RING_BLOCKS_H
#define RING_BLOCKS_H

#include <stdbool.h>

#include "ring_math.h"

// kv (N, 2C) = the k | v columns of qkv (N, 3C): the block this rank sends around the ring
void ring_pack_kv(float *kv, const float *qkv, int N, int C);
// dqkv's k | v columns (N, 3C) += dkv (N, 2C)
void ring_add_dkv(float *dqkv, const float *dkv, int N, int C);
// before the first block: o (N, C) = 0, each (row, head)'s running max -inf and sum 0 (N * NH)
void ring_forward_start(float *o, float *run_max, float *run_sum, int N, int C, int NH);
// one key/value block into the running softmax; scores: N * NH * c floats of scratch
void ring_forward_block(const RingBlock *r, float *o, float *run_max, float *run_sum, float *scores,
                        const float *qkv, const float *kv);
// after the last: out (N, C) = o / sum, lse (N * NH) = max + log(sum)
void ring_forward_finish(float *out, float *lse, const float *o, const float *run_max, const float *run_sum,
                         int N, int C, int NH);
// delta (N * NH) = dout . out per row and head: softmax backward's row sum of p dp
void ring_backward_delta(float *delta, const float *dout, const float *out, int N, int C, int NH);
// one key/value block's share of the gradients: the q columns of dqkv += (scratch ds: N * NH * c
// floats), and dkv (the block's gradient, N x 2C) +=
void ring_backward_block(const RingBlock *r, float *dqkv, float *dkv, float *ds, const float *qkv,
                         const float *dout, const float *lse, const float *delta, const float *kv);

// Ulysses' reshuffles between the rows' columns and the head groups': for each of `rows` rows,
// `width` floats from src's column src_col (row stride src_stride) to dst's column dst_col (=, or
// += when add)
void cp_copy_rows(float *dst, int dst_stride, int dst_col, const float *src, int src_stride, int src_col, int rows,
                  int width, bool add);

#endif
