// ops_cpu_fast.c: the CPU backend's paths that exist only for speed. Each says what it speeds up,
// and each that computes computes what a plain loop computes (ops_cpu_fast.h names it), in the same
// order: tests/test_ops.c checks it against that loop, bit for bit. None is needed to understand an
// op.
//  - few_rows_matmul: a decode step's few rows through a linear layer, at the speed of reading the
//    weights (plain: its documented order of sums as a loop, tests/test_ops.c's few_rows_dot; past
//    FEW_ROWS_MAX rows ops_cpu.c's matmul_forward takes oneDNN's matmul);
//  - cached_scores_fast, cached_values_fast: a decode task's attention over its cached positions,
//    at the speed of reading the cache (plain: ops_cpu.c, cached_scores_plain and _values_plain);
//  - restart_with_short_spin: how long OpenMP's idle threads spin before sleeping, which sets what
//    every parallel region costs to start (plain: libgomp's default).
// Figures for these choices belong in the measured tables of the docs (the README's speed section),
// with the command and the date, not here: the next machine has figures of its own.
#define _DEFAULT_SOURCE  // execve (unistd.h) under -std=c11
#include "ops_cpu_fast.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__AVX512F__)
#include <immintrin.h>  // few_rows_matmul: _mm512_fmadd_ps, and _mm512_dpbf16_ps with AVX512-BF16
#endif

#include "base/log.h"
#include "kernels.h"

// ----------------------------------------------------------------------------------------------
// OpenMP's idle threads: a short spin, then sleep

// OpenMP threads spin for about SPIN_WAIT_NS between and at the end of parallel regions, then
// sleep on a futex, unless the environment says otherwise (OMP_WAIT_POLICY, or GOMP_SPINCOUNT,
// which libgomp lets win). Both of libgomp's own choices cost a lot on a small machine:
// - its default spins for about 300,000 pauses, far longer than the gap between two regions:
//   with another process on one of two cores, the thread sharing that core spends its time slice
//   spinning while the main thread works alone, then is descheduled when the next region needs
//   it, and every region waits a time slice for it;
// - OMP_WAIT_POLICY=passive sleeps at once, and waking a sleeping thread (whose idle core may have
//   halted) costs more than the small regions of a decode step take to run.
// SPIN_WAIT_NS is chosen to cover the gap between a step's back-to-back regions, so an idle
// machine wakes no thread inside a step, and to be short beside a time slice, so a shared core
// costs about what the core is worth. `make bench-sharing` measures it against passive waiting
// and libgomp's default.
// libgomp counts its spin in loop turns, each a pause instruction, whose length differs between
// CPUs by an order of magnitude: the count is the turns such a loop makes here in SPIN_WAIT_NS,
// timed at start-up.
// libgomp reads the variable once, in its own initialiser, before main, and has no call to
// change it afterwards. An executable's .preinit_array runs before every shared library's
// initialisers (ELF gABI), but before the C library has its environment too (setenv there is
// lost): so the process starts itself again, at once, with the variable added. That costs one
// exec and the timing, before anything else has happened (the same process id: mpirun and
// srun see nothing).
#define SPIN_WAIT_NS 15000

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();  // what libgomp's spin waits on x86
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#else
    __asm__ volatile("" ::: "memory");
#endif
}

// the turns of a spin loop like libgomp's (load a flag, compare, pause) that take SPIN_WAIT_NS
// here: the fastest of three timings of 2048 turns
static long spin_turns_for_wait(void) {
    static volatile int never_set = 0;
    double best = 1e30;
    for (int trial = 0; trial < 3; trial++) {
        double t0 = wall_seconds();
        for (int i = 0; i < 2048 && !never_set; i++) spin_pause();
        double dt = wall_seconds() - t0;
        if (dt < best) best = dt;
    }
    long turns = (long)(SPIN_WAIT_NS * 1e-9 * 2048 / (best > 1e-9 ? best : 1e-9));
    return turns < 100 ? 100 : turns > 1000000 ? 1000000 : turns;
}

// "GOMP_SPINCOUNT=<n>" into out, without the C library's formatting (its locale is not set up yet)
static void spin_count_variable(char *out, long n) {
    const char *name = "GOMP_SPINCOUNT=";
    char digits[24];
    int k = 0;
    do digits[k++] = (char)('0' + n % 10), n /= 10; while (n);
    while (*name) *out++ = *name++;
    while (k) *out++ = digits[--k];
    *out = 0;
}

static void restart_with_short_spin(int argc, char **argv, char **envp) {
    (void)argc;
    static char variable[48];
    int n = 0;
    for (; envp[n]; n++)
        if (!strncmp(envp[n], "OMP_WAIT_POLICY=", 16) || !strncmp(envp[n], "GOMP_SPINCOUNT=", 15)) return;
    char **env = malloc((size_t)(n + 2) * sizeof *env);
    if (!env) return;  // then libgomp's default, which is only slower when a core is busy
    spin_count_variable(variable, spin_turns_for_wait());
    memcpy(env, envp, (size_t)n * sizeof *env);
    env[n] = variable, env[n + 1] = NULL;
    execve("/proc/self/exe", argv, env);
    free(env);  // no /proc (or exec refused): run on with the default policy
}
__attribute__((section(".preinit_array"), used)) static void (*const g_restart_with_short_spin)(int, char **, char **) =
    restart_with_short_spin;

// ----------------------------------------------------------------------------------------------
// a decode step's few rows through a linear layer

// A decode step multiplies a few rows (one per sequence) by every weight matrix: 2 FLOPs per
// weight and row. At batch 1 the step's speed is the memory's, reading the weights; at batch 8 (16
// FLOPs per weight) the arithmetic takes about as long. oneDNN's matmul keeps neither busy while
// the other works: one row streams the weights well below the read ceiling, and eight cost several
// times one. Here each thread walks its share of the weight rows once, in order, two at a time,
// multiplying them by all the input rows (which stay in L1 or L2) while a prefetch brings the next
// two into L2; past FEW_ROWS_MAX input rows oneDNN's blocking wins.
//
// Each output is one dot product summed in the same order at any number of rows, so a sequence
// decodes to the same bits alone or in a batch: lane j of a 16-float vector adds its columns'
// products in order (f32: the columns c = j mod 16, each a fused multiply-add; bf16, in 32-column
// blocks: the odd column 2j+1 of each block, then the even one 2j, products exact in f32), then
// the lanes add pairwise (8 + 8, 4 + 4, 2 + 2, 1 + 1).
// The vectors are GCC's vector extensions (also in clang): one AVX-512 register here, two AVX or
// four NEON registers elsewhere.
#define ROWS_PER_PASS 8  // input rows per pass over two weight rows: 16 accumulators in registers
#define LANES 16
typedef float Floats __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t Uints __attribute__((vector_size(LANES * sizeof(uint32_t))));  // 2 bf16 each
// Vectors are read through `volatile` pointers with the rows' own alignment. volatile makes each
// load happen once, where the source reads it: otherwise GCC (tuned for Zen) folds the loads into
// the multiplies and repeats them there, two loads a multiply-add, and the loads set the pace.
typedef float FloatsInMemory __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef uint32_t UintsInMemory __attribute__((vector_size(LANES * sizeof(uint32_t)), aligned(2)));
#define LOAD(type, p) (*(const volatile type##InMemory *)(p))
#if defined(__AVX512BF16__)
#define BF16_ROWS_WIDENED 0  // the CPU multiplies bf16 pairs itself (bf16_step)
#else
#define BF16_ROWS_WIDENED 1  // the input rows are widened to floats once a matmul
#endif

// *v = the `bytes` at p, zeros after them: a row's last columns, fewer than a vector
static void load_tail(void *v, const void *p, size_t bytes) {
    unsigned char b[LANES * sizeof(float)] = {0};
    memcpy(b, p, bytes);
    memcpy(v, b, sizeof b);
}

// *acc += a * b lane by lane, each lane rounded once (a fused multiply-add). Written out: C11 does
// not fuse `acc += a * b` (GCC's -std=c11 keeps the multiply's rounding), and the separate
// multiply and add take twice the instructions. Vectors go by pointer, here and below: a 64-byte vector passed by value has
// no agreed ABI without AVX-512.
static inline __attribute__((always_inline)) void fma_lanes(Floats *acc, const Floats *a, const Floats *b) {
#if defined(__AVX512F__)
    *acc = (Floats)_mm512_fmadd_ps((__m512)*a, (__m512)*b, (__m512)*acc);
#else
    for (int i = 0; i < LANES; i++) (*acc)[i] = fmaf((*a)[i], (*b)[i], (*acc)[i]);
#endif
}

static inline float sum_lanes(const Floats *v) {
    float s[LANES];
    memcpy(s, v, sizeof s);
    for (int i = 0; i < 8; i++) s[i] += s[i + 8];
    for (int i = 0; i < 4; i++) s[i] += s[i + 4];
    for (int i = 0; i < 2; i++) s[i] += s[i + 2];
    return s[0] + s[1];
}

// f32, columns [c, c + count), count <= LANES: acc0[n] += w0's columns * x row n's, and acc1[n]
// with w1's, for the n < rows input rows. Each input vector loaded serves two weight rows (with
// one, a load per multiply-add would set the pace).
static inline __attribute__((always_inline)) void f32_step(Floats *acc0, Floats *acc1, const float *w0,
                                                         const float *w1, const float *x, size_t x_row,
                                                         int c, int count, int rows) {
    Floats v0, v1, xv;
    if (count == LANES) v0 = LOAD(Floats, w0 + c), v1 = LOAD(Floats, w1 + c);
    else load_tail(&v0, w0 + c, count * sizeof(float)), load_tail(&v1, w1 + c, count * sizeof(float));
    for (int n = 0; n < rows; n++) {
        const float *xn = x + n * x_row + c;
        if (count == LANES) xv = LOAD(Floats, xn);
        else load_tail(&xv, xn, count * sizeof(float));
        fma_lanes(&acc0[n], &v0, &xv);
        fma_lanes(&acc1[n], &v1, &xv);
    }
}

// bf16, columns [c, c + count), count <= 2 * LANES: as f32_step. Each 32-bit word holds two bf16
// numbers, an even column in its low half and the odd one after it in its high half; a bf16 number
// is the top half of a float's bits. The products of two bf16 numbers are exact in f32.
static inline __attribute__((always_inline)) void bf16_step(Floats *acc0, Floats *acc1, const half16 *w0,
                                                          const half16 *w1, const void *x, size_t x_row,
                                                          int c, int count, int rows) {
    Uints u0, u1;
    if (count == 2 * LANES) u0 = LOAD(Uints, w0 + c), u1 = LOAD(Uints, w1 + c);
    else load_tail(&u0, w0 + c, count * sizeof(half16)), load_tail(&u1, w1 + c, count * sizeof(half16));
#if defined(__AVX512BF16__)
    // One AVX512-BF16 instruction per row and weight row: the odd columns' product then the even
    // ones', each rounded as below (test_ops checks the bits), but subnormal numbers count as 0.
    // x: the bf16 rows as they are.
    for (int n = 0; n < rows; n++) {
        const half16 *xn = (const half16 *)x + n * x_row + c;
        Uints ux;
        if (count == 2 * LANES) ux = LOAD(Uints, xn);
        else load_tail(&ux, xn, count * sizeof(half16));
        acc0[n] = (Floats)_mm512_dpbf16_ps((__m512)acc0[n], (__m512bh)u0, (__m512bh)ux);
        acc1[n] = (Floats)_mm512_dpbf16_ps((__m512)acc1[n], (__m512bh)u1, (__m512bh)ux);
    }
#else
    // x: floats in 32-column blocks, each block's 16 even columns then its 16 odd ones, padded with
    // zeros to whole blocks (bf16_rows_for_few_rows)
    Floats even0 = (Floats)(u0 << 16), odd0 = (Floats)(u0 & 0xFFFF0000u);
    Floats even1 = (Floats)(u1 << 16), odd1 = (Floats)(u1 & 0xFFFF0000u);
    for (int n = 0; n < rows; n++) {
        const float *xn = (const float *)x + n * x_row + c;
        Floats x_even = LOAD(Floats, xn), x_odd = LOAD(Floats, xn + LANES);
        acc0[n] += odd0 * x_odd;
        acc1[n] += odd1 * x_odd;
        acc0[n] += even0 * x_even;
        acc1[n] += even1 * x_even;
    }
#endif
}

// out[n * OC] = w0 . x row n + bias0 and out[n * OC + next] = w1 . x row n + bias1 for the
// n < rows input rows (x_row elements apart). Inlined with rows and is_bf16 constants: the
// accumulators are registers. The prefetch asks for the next two weight rows, column for column,
// into L2: on its own the hardware keeps too few reads in flight while the arithmetic runs. One
// input row (a single stream, which the hardware follows) reads the weights fastest without it.
static inline __attribute__((always_inline)) void dot_rows(float *out, int OC, int next, const void *x,
                                                         size_t x_row, const void *w0, const void *w1,
                                                         float bias0, float bias1, int is_bf16,
                                                         int rows, int C, int prefetch) {
    Floats acc0[ROWS_PER_PASS] = {0}, acc1[ROWS_PER_PASS] = {0};
    size_t elem = is_bf16 ? sizeof(half16) : sizeof(float), row_bytes = (size_t)C * elem;
    int step = is_bf16 ? 2 * LANES : LANES, c = 0;
    for (; c + step <= C; c += step) {
        if (prefetch) {
            __builtin_prefetch((const char *)w0 + c * elem + 2 * row_bytes, 0, 2);
            __builtin_prefetch((const char *)w1 + c * elem + 2 * row_bytes, 0, 2);
        }
        if (is_bf16) bf16_step(acc0, acc1, w0, w1, x, x_row, c, step, rows);
        else f32_step(acc0, acc1, w0, w1, x, x_row, c, step, rows);
    }
    if (c < C) {
        if (is_bf16) bf16_step(acc0, acc1, w0, w1, x, x_row, c, C - c, rows);
        else f32_step(acc0, acc1, w0, w1, x, x_row, c, C - c, rows);
    }
    for (int n = 0; n < rows; n++) {
        out[(size_t)n * OC] = sum_lanes(&acc0[n]) + bias0;
        out[(size_t)n * OC + next] = sum_lanes(&acc1[n]) + bias1;
    }
}

// two weight rows times the N input rows, up to 8 in one pass: a copy of the loop for each count,
// so that the 5 rows of a step verifying 4 speculative tokens take one pass over the weights, not
// a pass of 4 and another of 1
static void weight_rows_times_rows(float *out, int OC, int next, const void *x, size_t x_row,
                                   const void *w0, const void *w1, float bias0, float bias1,
                                   int is_bf16, int N, int C) {
    size_t x_elem = is_bf16 && !BF16_ROWS_WIDENED ? sizeof(half16) : sizeof(float);
    for (int n = 0; n < N;) {
        int rows = N - n < ROWS_PER_PASS ? N - n : ROWS_PER_PASS;
        float *o = out + (size_t)n * OC;
        const void *xn = (const char *)x + n * x_row * x_elem;
#define DOT_ROWS(r) \
    case r: \
        if (is_bf16) dot_rows(o, OC, next, xn, x_row, w0, w1, bias0, bias1, 1, r, C, N > 1); \
        else dot_rows(o, OC, next, xn, x_row, w0, w1, bias0, bias1, 0, r, C, N > 1); \
        break;
        switch (rows) {
            DOT_ROWS(1) DOT_ROWS(2) DOT_ROWS(3) DOT_ROWS(4) DOT_ROWS(5) DOT_ROWS(6) DOT_ROWS(7) DOT_ROWS(8)
        }
#undef DOT_ROWS
        n += rows;
    }
}

// Outputs go in pairs; an odd last one pairs with itself (computed twice, the same
// bits). One input row goes one weight row at a time, paired with itself: one stream, which the
// hardware follows best (the second dot product is free next to reading the row).
void few_rows_matmul(float *out, const void *x, size_t x_row, const void *weight, int is_bf16,
                     const float *bias, int N, int C, int OC) {
    size_t row_bytes = (size_t)C * (is_bf16 ? sizeof(half16) : sizeof(float));
    int pair = N > 1;
#pragma omp parallel for schedule(static)
    for (int o = 0; o < OC; o += 1 + pair) {
        int next = pair && o + 1 < OC;
        const char *w0 = (const char *)weight + o * row_bytes;
        weight_rows_times_rows(out + o, OC, next, x, x_row, w0, w0 + next * row_bytes,
                               bias ? bias[o] : 0.0f, bias ? bias[o + next] : 0.0f, is_bf16, N, C);
    }
}


// With AVX512-BF16 the rows as they are; else widened to floats (exactly) in 32-column blocks, each
// block's 16 even columns then its 16 odd ones, padded with zeros to whole blocks.
const void *bf16_rows_for_few_rows(const half16 *x, int N, int C, size_t *x_row) {
    if (!BF16_ROWS_WIDENED) {
        *x_row = (size_t)C;
        return x;
    }
    static float *scratch;
    static size_t capacity;
    int blocks = (C + 2 * LANES - 1) / (2 * LANES);
    size_t row = (size_t)blocks * 2 * LANES;
    if ((size_t)N * row > capacity) {
        free(scratch);
        capacity = (size_t)N * row;
        scratch = malloc_or_die(capacity * sizeof(float));
    }
    for (int n = 0; n < N; n++)
        for (int k = 0; k < blocks; k++) {
            float *block = scratch + n * row + k * 2 * LANES;
            for (int i = 0; i < 2 * LANES; i++) {  // i < LANES: column 2i of the block; else 2(i - LANES) + 1
                int c = k * 2 * LANES + (i < LANES ? 2 * i : 2 * (i - LANES) + 1);
                block[i] = c < C ? bf16_to_float(x[(size_t)n * C + c]) : 0.0f;
            }
        }
    *x_row = row;
    return scratch;
}


// ----------------------------------------------------------------------------------------------
// a decode task's cached attention

// Written with kernels.h's pieces element by element (cached_scores_plain, cached_values_plain),
// each cache row's sums wait on the last row's, through memory, and the loads of the next rows (a
// head's few lines of each, scattered over the pool) do not run ahead far enough to hide the
// memory's latency. Here up to HEADS_TOGETHER of the task's heads are read together from each
// cache row, the sums stay in registers, and the rows PREFETCH_ROWS ahead are asked for while a
// row is summed. (Splitting a new row's positions between the threads instead, scores by
// positions and values by groups of heads, was slower: ops_cpu.c's tasks keep a row's heads.)
// Each score is dot_product's eight running sums (lane k of an 8-float vector takes the columns k
// mod 8) and each output adds the rows in order: the same bits as the pieces.
#define HEADS_TOGETHER 4
#define VALUE_VECTORS 16  // a pass's output columns at most: 16 vectors of LANES floats
#define PREFETCH_ROWS 8
typedef float Floats8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Floats8InMemory __attribute__((vector_size(8 * sizeof(float)), aligned(4)));

// heads read together: HEADS_TOGETHER, or fewer where that many heads of whole vectors would not
// keep their outputs in VALUE_VECTORS vectors (at least 1)
static int heads_read_together(int hs) {
    int n = hs % LANES ? HEADS_TOGETHER : VALUE_VECTORS * LANES / hs;
    return n < 1 ? 1 : n < HEADS_TOGETHER ? n : HEADS_TOGETHER;
}

// dot_product's last steps on a vector's eight sums
static inline float finish_dot(const Floats8 *acc, const float *a, const float *b, int i, int n) {
    float sum[8];
    memcpy(sum, acc, sizeof sum);
    return dot_product_finish(sum, a, b, i, n);
}

// s[j * s_head + t] = the score of query head j (q + j * hs) against position t's key, for
// nh <= HEADS_TOGETHER heads whose key columns start at kc[j]; two positions at a time: 2 nh
// independent sums
static void group_scores(float *s, size_t s_head, const float *q, const float *k_pool, const int *blocks,
                          int block_size, int Ckv, const int *kc, int nh, int npos, int hs, float scale) {
    int t = 0;
    for (; t + 2 <= npos; t += 2) {
        const float *k0 = cache_row(k_pool, blocks, t, block_size, Ckv);
        const float *k1 = cache_row(k_pool, blocks, t + 1, block_size, Ckv);
        if (t + PREFETCH_ROWS + 1 < npos)
            for (int r = 0; r < 2; r++) {
                const float *ahead = cache_row(k_pool, blocks, t + PREFETCH_ROWS + r, block_size, Ckv);
                for (int j = 0; j < nh; j++)
                    for (int i = 0; i < hs; i += LANES) __builtin_prefetch(ahead + kc[j] + i);
            }
        Floats8 a0[HEADS_TOGETHER] = {0}, a1[HEADS_TOGETHER] = {0};
        int i = 0;
        for (; i + 8 <= hs; i += 8)
#pragma GCC unroll 4
            for (int j = 0; j < HEADS_TOGETHER; j++)
                if (j < nh) {
                    Floats8 qv = LOAD(Floats8, q + j * hs + i);
                    a0[j] += qv * LOAD(Floats8, k0 + kc[j] + i);
                    a1[j] += qv * LOAD(Floats8, k1 + kc[j] + i);
                }
        for (int j = 0; j < nh; j++) {
            s[j * s_head + t] = finish_dot(&a0[j], q + j * hs, k0 + kc[j], i, hs) * scale;
            s[j * s_head + t + 1] = finish_dot(&a1[j], q + j * hs, k1 + kc[j], i, hs) * scale;
        }
    }
    cached_scores_plain(s, s_head, q, k_pool, blocks, block_size, Ckv, kc, nh, t, npos, hs, scale);  // an odd last one
}

// o[j * hs ..] = inv_sum[j] times the sum over positions t of p[j * s_head + t] times position t's
// values from column kc[j] on, for nh <= HEADS_TOGETHER heads: in vectors where the heads are
// whole vectors that fit in VALUE_VECTORS of them, else with the plain loop
static void group_values(float *o, const float *p, size_t s_head, const float *inv_sum, const float *v_pool,
                          const int *blocks, int block_size, int Ckv, const int *kc, int nh, int npos, int hs) {
    if (hs % LANES || nh * hs > VALUE_VECTORS * LANES) {
        cached_values_plain(o, p, s_head, inv_sum, v_pool, blocks, block_size, Ckv, kc, nh, npos, hs);
        return;
    }
    int per_head = hs / LANES, n = nh * per_head, col[VALUE_VECTORS];
    size_t p_row[VALUE_VECTORS];  // vector c: its columns in a cache row, its head's probabilities
    for (int c = 0; c < n; c++) col[c] = kc[c / per_head] + c % per_head * LANES, p_row[c] = c / per_head * s_head;
    Floats acc[VALUE_VECTORS] = {0};
    for (int t = 0; t < npos; t++) {
        const float *v = cache_row(v_pool, blocks, t, block_size, Ckv);
        if (t + PREFETCH_ROWS < npos) {
            const float *ahead = cache_row(v_pool, blocks, t + PREFETCH_ROWS, block_size, Ckv);
            for (int c = 0; c < n; c++) __builtin_prefetch(ahead + col[c]);
        }
#pragma GCC unroll 16
        for (int c = 0; c < VALUE_VECTORS; c++)
            if (c < n) acc[c] += p[p_row[c] + t] * LOAD(Floats, v + col[c]);
    }
    for (int c = 0; c < n; c++) {
        Floats x = acc[c] * inv_sum[c / per_head];
        memcpy(o + c * LANES, &x, sizeof x);
    }
}

void cached_scores_fast(float *s, size_t s_head, const float *q, const float *k_pool, const int *blocks,
                        int block_size, int Ckv, const int *kc, int nh, int npos, int hs, float scale) {
    int together = heads_read_together(hs);
    for (int j = 0; j < nh; j += together)
        group_scores(s + j * s_head, s_head, q + j * hs, k_pool, blocks, block_size, Ckv, kc + j,
                     nh - j < together ? nh - j : together, npos, hs, scale);
}

void cached_values_fast(float *o, const float *p, size_t s_head, const float *inv_sum, const float *v_pool,
                        const int *blocks, int block_size, int Ckv, const int *kc, int nh, int npos, int hs) {
    int together = heads_read_together(hs);
    for (int j = 0; j < nh; j += together)
        group_values(o + j * hs, p + j * s_head, s_head, inv_sum + j, v_pool, blocks, block_size, Ckv, kc + j,
                     nh - j < together ? nh - j : together, npos, hs);
}
