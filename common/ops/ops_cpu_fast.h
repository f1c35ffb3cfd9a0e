// ops_cpu_fast.h: the CPU backend's paths that exist only for speed (ops_cpu_fast.c), and the plain
// loops of ops_cpu.c each must match. A learner reads an op in ops_cpu.c; where it hands work to a
// function here, that function computes what the plain loop named beside it computes, in the same
// order (the same bits), and says what it speeds up. tests/test_ops.c holds each to its plain loop.
#pragma once

#include <stddef.h>

#include "ops.h"  // half16

// ---- a decode step's few rows through a linear layer (the speed of reading the weights)

#define FEW_ROWS_MAX 16  // input rows at most; past it oneDNN's blocking wins

// out (N, OC) = x (N, C) @ weight (OC, C)^T + bias for N <= FEW_ROWS_MAX; f32 weights with f32 x
// rows, or bf16 weights with x rows from bf16_rows_for_few_rows; x_row: elements from one x row to
// the next. Each output sums its products in the order ops_cpu_fast.c documents, the same at any
// number of rows (tests/test_ops.c: few_rows_dot is that order written as a plain loop).
void few_rows_matmul(float *out, const void *x, size_t x_row, const void *weight, int is_bf16,
                     const float *bias, int N, int C, int OC);
// The bf16 input rows as few_rows_matmul reads them; *x_row: elements from one row to the next.
const void *bf16_rows_for_few_rows(const half16 *x, int N, int C, size_t *x_row);

// ---- a decode task's cached attention (the speed of reading the cache)
// nh query heads (q: head j at q + j hs) of one new row against its npos cached positions; head
// j's keys and values start at column kc[j] of a cache row; s: head j's scores at s + j s_head.

#define TASK_HEADS_MAX 16  // heads per task: the sums a task keeps between its passes

// the plain loops (ops_cpu.c): kernels.h's pieces, a position and a head at a time
void cached_scores_plain(float *s, size_t s_head, const float *q, const float *k_pool, const int *blocks,
                         int block_size, int Ckv, const int *kc, int nh, int t0, int npos, int hs, float scale);
void cached_values_plain(float *o, const float *p, size_t s_head, const float *inv_sum, const float *v_pool,
                         const int *blocks, int block_size, int Ckv, const int *kc, int nh, int npos, int hs);
// ... and in vectors, several heads from each cache row (ops_cpu_fast.c): the same bits. Scores of
// positions [0, npos); values o[j hs ..] = inv_sum[j] times the sum over t of p[j s_head + t] times
// position t's values.
void cached_scores_fast(float *s, size_t s_head, const float *q, const float *k_pool, const int *blocks,
                        int block_size, int Ckv, const int *kc, int nh, int npos, int hs, float scale);
void cached_values_fast(float *o, const float *p, size_t s_head, const float *inv_sum, const float *v_pool,
                        const int *blocks, int block_size, int Ckv, const int *kc, int nh, int npos, int hs);
