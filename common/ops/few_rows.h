// few_rows.h: a decode step's matrix-vector products (a few input rows, one per sequence) in the
// order the CPU backend sums them (ops_cpu.c: few_rows_matmul), written once as plain C that the
// GPU's kernel runs and the CPU tests drive.
//
// The order: output (n, o) = x row n . weight row o is split over FEW_ROWS_LANES lanes. Lane j
// adds its columns' products in column order: f32, the columns c = j, j + 16, ..., each a fused
// multiply-add; bf16, in blocks of 32 columns, the odd column 2j + 1 of each block, then the even
// one 2j (products of two bf16 numbers are exact in f32). Then the lanes add pairwise, 8 + 8,
// 4 + 4, 2 + 2, 1 + 1 (few_rows_combine: on the GPU a shuffle within 16 lanes does each step),
// then the bias. The order is the same at any number of rows, so a sequence decodes to the same
// bits alone or in a batch, and on the GPU to the CPU's bits.
//
// Why this shape reads each weight once: the 16 lanes of one weight row read 16 neighbouring
// columns at a time (64 bytes of f32), and every input row is multiplied by the weight element
// loaded once (FEW_ROWS_PASS rows a pass; the inputs are small and stay in cache).
#ifndef FEW_ROWS_H
#define FEW_ROWS_H

#include <stddef.h>

#include "base/numbers.h"  // KERNEL_FN, bf16_to_float

#define FEW_ROWS_LANES 16  // lanes per output, the CPU's vector width
#define FEW_ROWS_PASS 8    // input rows a pass holds sums for (the CPU's too)

// acc[r] (r < rows) = lane `lane`'s sum of weight w's f32 columns times x row r's; x rows x_row
// floats apart
KERNEL_FN void few_rows_lane_f32(float acc[FEW_ROWS_PASS], const float *w, const float *x, size_t x_row,
                                 int rows, int C, int lane) {
    for (int r = 0; r < FEW_ROWS_PASS; r++) acc[r] = 0.0f;
    for (int c = lane; c < C; c += FEW_ROWS_LANES) {
        float wc = w[c];
        for (int r = 0; r < FEW_ROWS_PASS; r++)
            if (r < rows) acc[r] = fmaf(wc, x[(size_t)r * x_row + c], acc[r]);
    }
}

// the same with bf16 weights and bf16 x rows: lane j takes the pair (2j, 2j + 1) of each block of
// 2 * FEW_ROWS_LANES columns, odd column first
KERNEL_FN void few_rows_lane_bf16(float acc[FEW_ROWS_PASS], const uint16_t *w, const uint16_t *x, size_t x_row,
                                  int rows, int C, int lane) {
    for (int r = 0; r < FEW_ROWS_PASS; r++) acc[r] = 0.0f;
    for (int c = 2 * lane; c < C; c += 2 * FEW_ROWS_LANES) {
        int odd = c + 1 < C;
        float we = bf16_to_float(w[c]), wo = odd ? bf16_to_float(w[c + 1]) : 0.0f;
        for (int r = 0; r < FEW_ROWS_PASS; r++)
            if (r < rows) {
                const uint16_t *xr = x + (size_t)r * x_row;
                if (odd) acc[r] += wo * bf16_to_float(xr[c + 1]);
                acc[r] += we * bf16_to_float(xr[c]);
            }
    }
}

// the lanes' sums of one output combined as the GPU's shuffles combine them (lane i takes lane
// i + width's, width 8, 4, 2, 1), then the bias: the output's value
KERNEL_FN float few_rows_combine(float lane[FEW_ROWS_LANES], float bias) {
    for (int width = FEW_ROWS_LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) lane[i] += lane[i + width];
    return lane[0] + bias;
}

#endif
