// flash_tiles.h: the tiling of the CUDA attention on the tensor cores (ops_cuda.cu:
// flash_forward_kernel and flash_backward_key_kernel, behind OPS_CUDA_KERNELS=flash_bf16),
// FlashAttention-2's: the steps written
// once, run by the kernel and driven on the host by tests/test_ops.c exactly as the kernel drives
// them, so that the CPU tests check the tiling (tile sizes, the causal skip, the online-softmax
// order) and a GPU run checks the products.
//
// A block of FLASH_WARPS warps takes FLASH_BR query rows of one (sequence, head), FLASH_ROWS a
// warp, q, k and v rounded to bf16. It walks the key tiles of FLASH_BC keys from the first on,
// stopping after the tile holding its last query (flash_key_tiles: the tiles after it are all in
// the causal mask's future). For each tile each warp
//   1. multiplies its 16 query rows by the tile's keys on the tensor cores: s (16 x FLASH_BC), f32
//      accumulation, unscaled;
//   2. per row (flash_row_tile): the tile's largest scaled score among the keys the row may see,
//      the running max and sum rescaled (kernels.h's online_softmax_rescale), the probabilities
//      exp(scale s - max) rounded to bf16 (zero for keys in the future or past T), their bf16
//      values added to the running sum;
//   3. o = alpha o + p v (16 x hs, f32 accumulation on the tensor cores);
// and at the end each row's out = o / sum and its log-sum-exp (kernels.h's attention_finish),
// which the existing backward reads. Nothing of size T x T is kept.
//
// Backward, the keys' side (dk, dv; the f32 query kernel computes delta and dq before it): a block
// takes FLASH_BR keys, 16 a warp, and walks the query tiles of FLASH_BC queries from the one
// holding its first key to the end (the earlier ones cannot see these keys). For each tile each
// warp
//   1. s^T = k q^T and dp^T = v dout^T for its 16 keys (tensor cores, f32 accumulation, unscaled);
//   2. per key (flash_key_tile): p = exp(scale s - lse) of the queries that see the key, and
//      ds = scale p (dp - delta), both rounded to bf16;
//   3. dv += p^T dout and dk += ds^T q, accumulated across the tiles (no rescaling: lse is final);
// and at the end adds dk and dv into dqkv.
#ifndef FLASH_TILES_H
#define FLASH_TILES_H

#include <math.h>

#include "kernels.h"  // OnlineSoftmax, online_softmax_rescale, attention_scale, attention_finish

#define FLASH_ROWS 16                       // query rows a warp (the tensor cores' 16 x 16 tiles)
#define FLASH_WARPS 4
#define FLASH_BR (FLASH_ROWS * FLASH_WARPS)  // query rows a block
#define FLASH_BC 64                         // keys a tile
#define FLASH_MAX_HS 128                    // head sizes: multiples of 16 up to this

// 1 when the tensor-core forward takes heads of hs columns
KERNEL_FN int flash_head_size_ok(int hs) { return hs % 16 == 0 && hs > 0 && hs <= FLASH_MAX_HS; }

// the key tiles a block of queries from q0 reads: up to the one holding its last query (< T)
KERNEL_FN int flash_key_tiles(int q0, int T) {
    int last = (q0 + FLASH_BR < T ? q0 + FLASH_BR : T) - 1;
    return last / FLASH_BC + 1;
}

// Step 2 for query row q over the tile of keys from k0: s holds its FLASH_BC unscaled scores; p
// gets the probabilities (bf16 bits) before normalisation; run is the row's running max and sum.
// Returns alpha, the factor the row's o is rescaled by before this tile's p v is added.
KERNEL_FN float flash_row_tile(uint16_t *p, const float *s, int q, int k0, int T, float scale, OnlineSoftmax *run) {
    float tile_max = -INFINITY;
    for (int j = 0; j < FLASH_BC; j++)
        if (k0 + j <= q && k0 + j < T) tile_max = fmaxf(tile_max, s[j] * scale);
    float alpha = online_softmax_rescale(run, tile_max), sum = 0.0f;
    for (int j = 0; j < FLASH_BC; j++) {
        float e = k0 + j <= q && k0 + j < T ? expf(s[j] * scale - run->max) : 0.0f;
        p[j] = bf16_from_float(e);
        sum += bf16_to_float(p[j]);
    }
    run->sum += sum;
    return alpha;
}

// the first query tile that sees a key block starting at k0 (causal: queries from k0 on)
KERNEL_FN int flash_first_query_tile(int k0) { return k0 / FLASH_BC; }

// Step 2 of backward for key `key` over the tile of queries from q0: st and dpt hold its unscaled
// scores k.q and products v.dout with the tile's queries, lse and delta the tile's rows'. pt gets
// the probabilities and dst the scores' gradients, as bf16 bits; zero for queries before the key
// or past T.
KERNEL_FN void flash_key_tile(uint16_t *pt, uint16_t *dst, const float *st, const float *dpt, int key, int q0, int T,
                              float scale, const float *lse, const float *delta) {
    for (int i = 0; i < FLASH_BC; i++) {
        int sees = key <= q0 + i && q0 + i < T;
        float p = sees ? expf(st[i] * scale - lse[i]) : 0.0f;
        pt[i] = bf16_from_float(p);
        dst[i] = bf16_from_float(scale * p * (dpt[i] - delta[i]));
    }
}

#endif
