// ops_cpu.c: the CPU backend of ops.h, each op as a learner reads it. Matmuls go to oneDNN (several
// times faster than hand-written loops, and most of a training step is matmul), attention's
// products included; every other op is an OpenMP loop over rows or elements that calls the math in
// kernels.h, the same functions the CUDA backend calls. "Device memory" is ordinary host memory
// here, so the copies are memcpy.
// The paths that exist only for speed are in ops_cpu_fast.c, each checked against the plain loop
// it replaces (tests/test_ops.c): a decode step's few rows (few_rows_matmul), its cached attention
// in vectors, and the short spin of OpenMP's idle threads.
//
// Builds against oneDNN 2.x (Debian 12 ships 2.6) and 3.x: the two differ in how memory
// descriptors and matmul primitive descriptors are created, and in the sum post-op's signature;
// those few lines are behind DNNL_VERSION_MAJOR below.
//
// Not thread-safe: ops are called from one host thread (OpenMP parallelises inside each op).
#define _DEFAULT_SOURCE  // madvise's MADV_HUGEPAGE (sys/mman.h)
#include "ops.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <oneapi/dnnl/dnnl.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "kernels.h"
#include "ops_cpu_fast.h"
#include "ops_peak.h"

// ----------------------------------------------------------------------------------------------
// oneDNN plumbing

#define DNNL_CHECK(call)                                                                       \
    do {                                                                                       \
        dnnl_status_t s_ = (call);                                                             \
        if (s_ != dnnl_success)                                                                \
            fatal("oneDNN call %s failed with status %d (%s:%d)", #call, (int)s_, __FILE__,    \
                  __LINE__);                                                                   \
    } while (0)

static dnnl_engine_t g_engine = NULL;
static dnnl_stream_t g_stream = NULL;

void ops_init(void) {
    if (g_engine) return;
    DNNL_CHECK(dnnl_engine_create(&g_engine, dnnl_cpu, 0));
    DNNL_CHECK(dnnl_stream_create(&g_stream, g_engine, dnnl_stream_default_flags));
}

const char *ops_backend_name(void) { return "cpu"; }

// i * row_stride + j * col_stride. Strides are how we hand oneDNN a transposed operand without
// copying it: W (OC, C) stored row-major *is* W^T (C, OC) with strides (1, C).
#if DNNL_VERSION_MAJOR >= 3
typedef dnnl_memory_desc_t md_t;  // 3.x: an opaque handle, created and destroyed
#define MD(md) (md)
static md_t md_matrix(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
                      dnnl_data_type_t type) {
    dnnl_dims_t dims = {rows, cols}, strides = {row_stride, col_stride};
    md_t md;
    DNNL_CHECK(dnnl_memory_desc_create_with_strides(&md, 2, dims, type, strides));
    return md;
}
static void md_release(md_t md) { dnnl_memory_desc_destroy(md); }
#else
typedef dnnl_memory_desc_t md_t;  // 2.x: a plain struct, passed by address
#define MD(md) (&(md))
static md_t md_matrix(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
                      dnnl_data_type_t type) {
    dnnl_dims_t dims = {rows, cols}, strides = {row_stride, col_stride};
    md_t md;
    DNNL_CHECK(dnnl_memory_desc_init_by_strides(&md, 2, dims, type, strides));
    return md;
}
static void md_release(md_t md) { (void)md; }
#endif

// A stack of `batch` such matrices, the next one batch_stride elements on: attention's heads,
// side by side in a row of qkv (batch_stride hs, row_stride 3C), or its (T, T) squares.
static md_t md_batch(int64_t batch, int64_t rows, int64_t cols, int64_t batch_stride, int64_t row_stride,
                     int64_t col_stride, dnnl_data_type_t type) {
    dnnl_dims_t dims = {batch, rows, cols}, strides = {batch_stride, row_stride, col_stride};
    md_t md;
#if DNNL_VERSION_MAJOR >= 3
    DNNL_CHECK(dnnl_memory_desc_create_with_strides(&md, 3, dims, type, strides));
#else
    DNNL_CHECK(dnnl_memory_desc_init_by_strides(&md, 3, dims, type, strides));
#endif
    return md;
}

// The three products a linear layer needs. oneDNN's matmul computes dst (M, N) = src (M, K) @
// weights (K, N) [+ bias]; each kind says which of our tensors plays which role.
// MM_WEIGHTS_WRITTEN is MM_BACKWARD_WEIGHTS writing dweight instead of adding to it (GRAD_WRITE).
enum { MM_FORWARD, MM_BACKWARD_DATA, MM_BACKWARD_WEIGHTS, MM_WEIGHTS_WRITTEN };
// ... and the six of attention, each over all NH heads of one sequence (describe_attention)
enum { ATT_SCORES = MM_WEIGHTS_WRITTEN + 1, ATT_VALUES, ATT_DPROBS, ATT_DQUERIES, ATT_DKEYS, ATT_DVALUES };

// A created primitive and its memory objects, reused for every call of the same shape: creating a
// primitive means choosing and JIT-compiling a kernel (milliseconds), so a training step, which
// repeats the same dozen shapes, creates each once and afterwards only swaps the data pointers.
typedef struct {
    int kind, N, C, OC, has_bias, bf16;  // bf16: the two inputs are bf16 (the output stays f32);
                                         // attention (describe_attention): N = T, C = hs, OC = NH
    int row0;                            // attention's: the tile's first row; else 0
    dnnl_primitive_t prim;
    dnnl_memory_t src, weights, bias, dst;
    char impl[64];  // which oneDNN implementation was picked, e.g. "brg:avx512_core"
} MatmulPlan;

// A run's shapes: each linear layer's three products and attention's six by tiles, at each batch
// length (a multiple of 8 up to max_seq_len: at 1024, 128 lengths of up to 111 plans), and the
// experts' row chunks. Each plan is allocated on its own, so a pointer to one stays valid as the
// list grows.
static MatmulPlan **g_plans;
static int g_nplans = 0, g_plans_capacity = 0;

static dnnl_memory_t memory_for(md_t md) {
    dnnl_memory_t mem;
    DNNL_CHECK(dnnl_memory_create(&mem, MD(md), g_engine, DNNL_MEMORY_NONE));
    return mem;
}

static MatmulPlan *find_plan(int kind, int N, int C, int OC, int has_bias, int bf16, int row0) {
    for (int i = 0; i < g_nplans; i++) {
        MatmulPlan *p = g_plans[i];
        if (p->kind == kind && p->N == N && p->C == C && p->OC == OC && p->has_bias == has_bias &&
            p->bf16 == bf16 && p->row0 == row0)
            return p;
    }
    return NULL;
}

// The memory descriptors of one product; returns 1 when it adds into dst (the backward kinds but
// MM_WEIGHTS_WRITTEN).
static int describe_operands(int kind, int N, int C, int OC, int bf16, md_t *src, md_t *weights,
                             md_t *dst) {
    dnnl_data_type_t in = bf16 ? dnnl_bf16 : dnnl_f32, f32 = dnnl_f32;
    if (kind == MM_FORWARD) {
        // out (N, OC) = inp (N, C) @ weight^T (C, OC): the weight read transposed via strides
        *src = md_matrix(N, C, C, 1, in);
        *weights = md_matrix(C, OC, 1, C, in);
        *dst = md_matrix(N, OC, OC, 1, f32);
        return 0;
    }
    if (kind == MM_BACKWARD_DATA) {
        // dinp (N, C) += dout (N, OC) @ weight (OC, C): both plain row-major
        *src = md_matrix(N, OC, OC, 1, in);
        *weights = md_matrix(OC, C, C, 1, in);
        *dst = md_matrix(N, C, C, 1, f32);
        return 1;
    }
    // dweight (OC, C) += dout^T (OC, N) @ inp (N, C): dout read transposed via strides
    *src = md_matrix(OC, N, 1, OC, in);
    *weights = md_matrix(N, C, C, 1, in);
    *dst = md_matrix(OC, C, C, 1, f32);
    return kind == MM_BACKWARD_WEIGHTS;
}

// attention's operands, over NH heads: each head's rows x cols of a (T, T) square of att or datt
// (or its transpose), and each head's hs columns of rows rows row_stride apart (qkv's q, k or v
// block: 3C; out or dout: C), or their transpose; of elements of the given type
static md_t attention_squares(int rows, int cols, int T, int NH, int transposed, dnnl_data_type_t type) {
    int64_t TT = (int64_t)T * T;
    return transposed ? md_batch(NH, rows, cols, TT, 1, T, type) : md_batch(NH, rows, cols, TT, T, 1, type);
}
static md_t attention_heads(int rows, int hs, int NH, int64_t row_stride, int transposed, dnnl_data_type_t type) {
    return transposed ? md_batch(NH, hs, rows, hs, 1, row_stride, type) : md_batch(NH, rows, hs, hs, row_stride, 1, type);
}

// The causal square in tiles of ATT_TILE rows: query rows [r0, r1) see keys [0, r1), and key rows
// [r0, r1) are seen by queries [r0, T). A tile's products skip the square's future beyond it: at
// T = 256, 4 tiles, 62% of the whole square's FLOPs (the causal half is 50%).
#define ATT_TILE 64
static int attention_tile_end(int r0, int T) { return r0 + ATT_TILE < T ? r0 + ATT_TILE : T; }

// The memory descriptors of one of attention's products for one tile (first row r0) of a sequence
// of T rows, NH heads of hs columns (C = NH hs): Q, K, V are qkv's column blocks, P and dS the
// squares of att and datt; the operands start at the tile (attention_backward and _forward offset
// the pointers). src and weights are bf16 or f32, dst f32. Returns 1 when it adds into dst (the
// gradients of q, k and v).
static int describe_attention(int kind, int T, int hs, int NH, int r0, int bf16, md_t *src, md_t *weights,
                              md_t *dst) {
    int64_t C = (int64_t)NH * hs, C3 = 3 * C;
    int r1 = attention_tile_end(r0, T), n = r1 - r0;  // the tile's rows
    dnnl_data_type_t in = bf16 ? dnnl_bf16 : dnnl_f32, f32 = dnnl_f32;
    switch (kind) {
    case ATT_SCORES:  // S[r0:r1, :r1] = Q[r0:r1] K[:r1]^T
        *src = attention_heads(n, hs, NH, C3, 0, in), *weights = attention_heads(r1, hs, NH, C3, 1, in);
        *dst = attention_squares(n, r1, T, NH, 0, f32);
        return 0;
    case ATT_VALUES:  // out[r0:r1] = P[r0:r1, :r1] V[:r1]
        *src = attention_squares(n, r1, T, NH, 0, in), *weights = attention_heads(r1, hs, NH, C3, 0, in);
        *dst = attention_heads(n, hs, NH, C, 0, f32);
        return 0;
    case ATT_DPROBS:  // dP[r0:r1, :r1] = dout[r0:r1] V[:r1]^T
        *src = attention_heads(n, hs, NH, C, 0, in), *weights = attention_heads(r1, hs, NH, C3, 1, in);
        *dst = attention_squares(n, r1, T, NH, 0, f32);
        return 0;
    case ATT_DQUERIES:  // dQ[r0:r1] += dS[r0:r1, :r1] K[:r1]
        *src = attention_squares(n, r1, T, NH, 0, in), *weights = attention_heads(r1, hs, NH, C3, 0, in);
        *dst = attention_heads(n, hs, NH, C3, 0, f32);
        return 1;
    case ATT_DKEYS:  // dK[r0:r1] += dS[r0:, r0:r1]^T Q[r0:]
        *src = attention_squares(n, T - r0, T, NH, 1, in), *weights = attention_heads(T - r0, hs, NH, C3, 0, in);
        *dst = attention_heads(n, hs, NH, C3, 0, f32);
        return 1;
    default:  // ATT_DVALUES: dV[r0:r1] += P[r0:, r0:r1]^T dout[r0:]
        *src = attention_squares(n, T - r0, T, NH, 1, in), *weights = attention_heads(T - r0, hs, NH, C, 0, in);
        *dst = attention_heads(n, hs, NH, C3, 0, f32);
        return 1;
    }
}

// The sum post-op turns dst = A @ B into dst = 1.0 * dst + A @ B inside the kernel, so the
// accumulation costs no extra pass over memory.
static dnnl_primitive_attr_t attr_for(int accumulate) {
    dnnl_primitive_attr_t attr;
    DNNL_CHECK(dnnl_primitive_attr_create(&attr));
    if (accumulate) {
        dnnl_post_ops_t post_ops;
        DNNL_CHECK(dnnl_post_ops_create(&post_ops));
#if DNNL_VERSION_MAJOR >= 3
        DNNL_CHECK(dnnl_post_ops_append_sum(post_ops, 1.0f, 0, dnnl_data_type_undef));
#else
        DNNL_CHECK(dnnl_post_ops_append_sum(post_ops, 1.0f));
#endif
        DNNL_CHECK(dnnl_primitive_attr_set_post_ops(attr, post_ops));
        DNNL_CHECK(dnnl_post_ops_destroy(post_ops));
    }
    return attr;
}

// oneDNN's choice of implementation for one product, or dnnl_unimplemented when it has none on
// this CPU (oneDNN 2.x has no bf16 matmul at all for a CPU without AVX-512).
static dnnl_status_t matmul_pd_create(dnnl_primitive_desc_t *pd, md_t src, md_t weights,
                                      md_t bias, md_t dst, int has_bias,
                                      dnnl_primitive_attr_t attr) {
#if DNNL_VERSION_MAJOR >= 3
    return dnnl_matmul_primitive_desc_create(pd, g_engine, src, weights, has_bias ? bias : NULL,
                                             dst, attr);
#else
    dnnl_matmul_desc_t desc;
    DNNL_CHECK(dnnl_matmul_desc_init(&desc, &src, &weights, has_bias ? &bias : NULL, &dst));
    return dnnl_primitive_desc_create(pd, &desc, attr, g_engine, NULL);
#endif
}

// The plan of one product, created on first use; NULL when oneDNN has no implementation for it
// here (only ever for bf16: ops_bf16_native() asks this way, the ops through matmul_plan).
static MatmulPlan *find_or_create_plan(int kind, int N, int C, int OC, int has_bias, int bf16, int row0) {
    MatmulPlan *p = find_plan(kind, N, C, OC, has_bias, bf16, row0);
    if (p) return p;
    ops_init();

    md_t src, weights, dst, bias = md_matrix(1, OC, OC, 1, dnnl_f32);  // bias: broadcast over the rows
    int accumulate = kind >= ATT_SCORES ? describe_attention(kind, N, C, OC, row0, bf16, &src, &weights, &dst)
                                        : describe_operands(kind, N, C, OC, bf16, &src, &weights, &dst);
    dnnl_primitive_attr_t attr = attr_for(accumulate);
    dnnl_primitive_desc_t pd;
    dnnl_status_t status = matmul_pd_create(&pd, src, weights, bias, dst, has_bias, attr);
    if (status != dnnl_success && status != dnnl_unimplemented)
        fatal("oneDNN could not set up a %s matmul of shape N=%d C=%d OC=%d: status %d",
              bf16 ? "bf16" : "f32", N, C, OC, (int)status);
    if (status == dnnl_success) {
        if (g_nplans == g_plans_capacity) {
            g_plans_capacity = g_plans_capacity ? 2 * g_plans_capacity : 64;
            g_plans = realloc(g_plans, (size_t)g_plans_capacity * sizeof *g_plans);
            if (!g_plans) fatal("out of memory for %d matmul plans", g_plans_capacity);
        }
        p = g_plans[g_nplans++] = malloc_or_die(sizeof *p);
        *p = (MatmulPlan){.kind = kind, .N = N, .C = C, .OC = OC, .has_bias = has_bias, .bf16 = bf16, .row0 = row0};
        DNNL_CHECK(dnnl_primitive_create(&p->prim, pd));
        const char *impl = NULL;
        DNNL_CHECK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl));
        snprintf(p->impl, sizeof p->impl, "%s", impl ? impl : "?");
        p->src = memory_for(src);
        p->weights = memory_for(weights);
        p->dst = memory_for(dst);
        p->bias = has_bias ? memory_for(bias) : NULL;
        DNNL_CHECK(dnnl_primitive_desc_destroy(pd));
    }
    DNNL_CHECK(dnnl_primitive_attr_destroy(attr));
    md_release(src);
    md_release(weights);
    md_release(dst);
    md_release(bias);
    return p;
}

static MatmulPlan *matmul_plan(int kind, int N, int C, int OC, int has_bias, int bf16) {
    MatmulPlan *p = find_or_create_plan(kind, N, C, OC, has_bias, bf16, 0);
    if (!p)
        fatal("oneDNN has no %s matmul implementation on this CPU (shape N=%d C=%d OC=%d)",
              bf16 ? "bf16" : "f32", N, C, OC);
    return p;
}

static void matmul_run(MatmulPlan *p, const void *src, const void *weights, const float *bias,
                       float *dst) {
    // oneDNN takes non-const handles; it only reads src, weights and bias
    DNNL_CHECK(dnnl_memory_set_data_handle(p->src, (void *)src));
    DNNL_CHECK(dnnl_memory_set_data_handle(p->weights, (void *)weights));
    DNNL_CHECK(dnnl_memory_set_data_handle(p->dst, dst));
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, p->src},
                               {DNNL_ARG_WEIGHTS, p->weights},
                               {DNNL_ARG_DST, p->dst},
                               {DNNL_ARG_BIAS, p->bias}};
    int nargs = 3;
    if (p->bias) {
        DNNL_CHECK(dnnl_memory_set_data_handle(p->bias, (void *)bias));
        nargs = 4;
    }
    DNNL_CHECK(dnnl_primitive_execute(p->prim, g_stream, nargs, args));
    DNNL_CHECK(dnnl_stream_wait(g_stream));
}

// ----------------------------------------------------------------------------------------------
// which engine does the matmuls, and MFU's peak

// A GPT-2 sized forward product, to ask oneDNN which implementation it picks on this CPU; for
// bf16, NULL when it has none.
static MatmulPlan *probe_plan(int bf16) {
    return bf16 ? find_or_create_plan(MM_FORWARD, 256, 768, 768, 1, bf16, 0) : matmul_plan(MM_FORWARD, 256, 768, 768, 1, 0);
}

// "oneDNN 3.6.2 bf16 matmul (brg:avx512_core_bf16), 2 threads"
static void describe_engine(char *out, size_t size, const char *type, const char *impl) {
    const dnnl_version_t *v = dnnl_version();
    snprintf(out, size, "oneDNN %d.%d.%d %s matmul (%s), %d threads", v->major, v->minor, v->patch,
             type, impl, omp_get_max_threads());
}

const char *ops_matmul_engine(void) {
    static char name[160];
    if (!name[0]) describe_engine(name, sizeof name, "f32", probe_plan(0)->impl);
    return name;
}

// TF32 is the tensor cores' format; oneDNN would take the request as a hint and multiply in f32
void ops_set_tf32(int on) {
    if (on)
        fatal("tf32: the CPU backend has no TF32 matmuls (TF32 is the NVIDIA tensor cores' format, "
              "compute capability 8.0 on): run the CUDA build, build/cuda/stage-1 --tf32=true");
}

// the 16-bit copies' format: bf16, or fp16 (precision 16-mixed)
static HalfFormat g_half = HALF_BF16;
static double g_grad_nonzero, g_grad_flushed;  // cast_gradient_to_16's counts

void ops_set_half_format(HalfFormat format) { g_half = format; }
HalfFormat ops_half_format(void) { return g_half; }

// which engine multiplies bf16 inputs: see choose_bf16_engine below
typedef struct {
    int native;      // 1: oneDNN's bf16 matmul; 0: widened to f32
    char why[200];   // "measured: ...", "OPS_BF16_MATMUL=f32", "oneDNN has no bf16 matmul on this CPU"
} Bf16Engine;

static const Bf16Engine *bf16_engine(void);

// fp16 inputs are always widened here: a product of two fp16 numbers is exact in f32, so an f32
// matmul over the widened values is what fp16 hardware with f32 accumulation computes
static int widen_half(void) { return g_half == HALF_FP16 || !ops_bf16_native(); }

const char *ops_matmul_engine_16(void) {
    static char name[400];
    if (!name[0]) {
        if (g_half == HALF_FP16)
            sentence_printf(name, sizeof name, "fp16 widened to f32 (exact: a product of two fp16 "
                            "numbers fits in f32): %s", ops_matmul_engine());
        else if (ops_bf16_native()) {
            char engine[160];
            describe_engine(engine, sizeof engine, "bf16", probe_plan(1)->impl);
            sentence_printf(name, sizeof name, "%s; %s", engine, bf16_engine()->why);
        } else sentence_printf(name, sizeof name, "bf16 widened to f32 (%s): %s", bf16_engine()->why,
                               ops_matmul_engine());
    }
    return name;
}

// MFU's peak is measured: the best rate of oneDNN's own matmul at a large square shape, with the
// OpenMP threads this run uses. Why not a formula or a hand-written loop:
//  - cores x clock x FLOPs per cycle cannot be read off the CPU. FLOPs per cycle differ between
//    CPUs with the same flags (Zen 4 runs AVX-512 as two 256-bit halves, 32 f32 FLOP/cycle; Zen 5
//    and Xeons with two 512-bit FMA units, 64; one-unit Xeons, 32; AMX adds 2048 bf16), the
//    clock under load is in no register (cpuid's frequency leaf is Intel-only, and a VM often has
//    no cpufreq), and the cores a run gets are what OpenMP was given, not what the CPU has.
//  - a register-only FMA loop measures the hardware well, but needs its own code for every
//    instruction set (AVX2, AVX-512, VDPBF16PS, AMX tiles, NEON) and a build for each.
// oneDNN already has a kernel for each of those and picks the best this CPU offers, and the
// measurement runs at the clock the CPU holds under load on the threads the run uses. MFU then
// reads "share of the best matmul rate of this machine's matmul engine" (what Bekman's ML
// Engineering book calls the maximum achievable matmul FLOPS): somewhat above a share of the
// data-sheet peak (a loop of independent FMAs can beat oneDNN's matmul by some).
// Timed by the wall clock, as the stages' tokens/s are: on a machine busy with other work at
// start-up the peak comes out lower, as the steps do, so MFU stays a share of what this run can
// get; OPS_PEAK_FLOPS_F32 pins it.
#define PEAK_BUDGET_S 0.15  // seconds (warm-up included) after which, past the minimum, it stops
#define PEAK_MIN_REPS 3
#define PEAK_MAX_REPS 50

// The square's side: 1024 for up to 8 threads, growing with the square root of the thread count
// beyond, so each thread keeps at least a 128-row share of a 1024-wide output (on a few threads
// 1024 reaches the rate of 2048 in an eighth of the time).
static int calibration_side(int threads) {
    return 1024 * (int)ceil(sqrt(threads / 8.0));
}

// An n x n matrix of 0.5 (f32 or bf16), 64-byte aligned. Written, not calloc'ed: untouched pages
// would all map the one shared zero page, and the matmul would read it from L1.
static void *calibration_matrix(int n, int bf16_values) {
    size_t count = (size_t)n * n, bytes = count * (bf16_values ? sizeof(half16) : sizeof(float));
    void *m = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!m) fatal("out of memory: %zu bytes for measuring MFU's peak", bytes);
    for (size_t i = 0; i < count; i++) {
        if (bf16_values) ((half16 *)m)[i] = bf16_from_float(0.5f);
        else ((float *)m)[i] = 0.5f;
    }
    return m;
}

// FLOP/s of oneDNN's best n x n x n product, f32 or bf16 inputs, after an untimed warm-up (OpenMP's
// threads start, caches fill): at least PEAK_MIN_REPS products, more until PEAK_BUDGET_S
static double square_matmul_rate(int n, int bf16, int *reps) {
    MatmulPlan *p = matmul_plan(MM_FORWARD, n, n, n, 0, bf16);
    void *a = calibration_matrix(n, bf16), *b = calibration_matrix(n, bf16);
    float *c = calibration_matrix(n, 0);
    double start = wall_seconds();
    matmul_run(p, a, b, NULL, c);
    double best = INFINITY;
    *reps = 0;
    while (*reps < PEAK_MIN_REPS || (*reps < PEAK_MAX_REPS && wall_seconds() - start < PEAK_BUDGET_S)) {
        double t = wall_seconds();
        matmul_run(p, a, b, NULL, c);
        t = wall_seconds() - t;
        if (t < best) best = t;
        ++*reps;
    }
    free(a), free(b), free(c);
    return 2.0 * n * n * n / best;
}

// ---- which engine multiplies bf16 inputs
// oneDNN's bf16 matmul, or its f32 matmul over the bf16 values widened to f32: the same products
// (a product of two bf16 numbers is exact in f32), only the order of the sums may differ. Widened
// where oneDNN has no fast bf16 matmul on this CPU (without AVX512-BF16 or AMX it has only its
// slow reference one, "ref" in the implementation's name, 3.x; or none, 2.x), and where its bf16
// matmul is measured slower than its f32 one: a Xeon with AVX512-BF16 and no AMX can run oneDNN's
// bf16 at about half its f32 rate, and bf16-mixed training would be slower than fp32.
// OPS_BF16_MATMUL (native, f32 or auto, the default) chooses instead: a run that must not depend
// on a measurement, or a test of both engines on one machine.
#define BF16_ENGINE_ENV "OPS_BF16_MATMUL"

static void choose_bf16_engine(Bf16Engine *e) {
    const char *forced = getenv(BF16_ENGINE_ENV);
    MatmulPlan *probe = probe_plan(1);
    int fast = probe && strstr(probe->impl, "ref") == NULL;
    if (forced && *forced && strcmp(forced, "auto")) {
        if (strcmp(forced, "native") && strcmp(forced, "f32"))
            fatal("environment variable %s is '%s': expected native, f32 or auto", BF16_ENGINE_ENV, forced);
        e->native = !strcmp(forced, "native");
        if (e->native && !fast)
            fatal("environment variable %s is 'native', but oneDNN has %s bf16 matmul on this CPU: "
                  "expected f32 or auto", BF16_ENGINE_ENV, probe ? "only its slow reference" : "no");
        snprintf(e->why, sizeof e->why, "%s=%s", BF16_ENGINE_ENV, forced);
    } else if (!fast) {
        e->native = 0;
        snprintf(e->why, sizeof e->why, "oneDNN has %s bf16 matmul on this CPU", probe ? "only its slow reference" : "no");
    } else {
        int n = calibration_side(omp_get_max_threads()), reps;
        double f32 = square_matmul_rate(n, 0, &reps), bf16 = square_matmul_rate(n, 1, &reps);
        e->native = bf16 > f32;
        snprintf(e->why, sizeof e->why, "measured: oneDNN's bf16 matmul at %.2fx its f32 rate, %dx%dx%d, "
                 "%s=native|f32 forces one", bf16 / f32, n, n, n, BF16_ENGINE_ENV);
    }
}

// the engine, chosen on the first call and kept
static const Bf16Engine *bf16_engine(void) {
    static Bf16Engine engine;
    static int chosen;
    if (!chosen) choose_bf16_engine(&engine), chosen = 1;
    return &engine;
}

static PeakFlops g_peak[2];  // f32, bf16

// The finder for peak_flops_once (ops_peak.h): f32 (bf16 == 0) or bf16 inputs.
static void measure_peak(PeakFlops *peak, int bf16) {
    if (bf16 && widen_half()) {
        char why[160];
        if (g_half == HALF_FP16) sentence_printf(why, sizeof why, "fp16 matmuls are widened to f32");
        else sentence_printf(why, sizeof why, "bf16 matmuls are widened to f32 (%s)", bf16_engine()->why);
        peak_of_widened_bf16(peak, peak_flops_once(g_peak, 0, measure_peak), why);
        return;
    }
    int threads = omp_get_max_threads(), n = calibration_side(threads), reps;
    double start = wall_seconds();
    peak->flops = square_matmul_rate(n, bf16, &reps);
    snprintf(peak->source, sizeof peak->source,
             "measured: best of %d oneDNN %s matmuls %dx%dx%d (%s) on %d threads, %.2f s", reps,
             bf16 ? "bf16" : "f32", n, n, n, matmul_plan(MM_FORWARD, n, n, n, 0, bf16)->impl, threads,
             wall_seconds() - start);
}

double ops_peak_flops(int bf16) { return peak_flops_once(g_peak, bf16, measure_peak)->flops; }

const char *ops_peak_flops_source(int bf16) {
    return peak_flops_once(g_peak, bf16, measure_peak)->source;
}

// ----------------------------------------------------------------------------------------------
// memory: 64-byte aligned (a cache line, one AVX-512 register) and zero-filled. A 64-byte header
// in front of each block remembers its size, so dev_free can keep the byte counts, and where its
// allocation starts.

#define DEV_ALIGN 64
static size_t g_bytes_in_use = 0, g_bytes_peak = 0;

// Buffers of HUGE_PAGE_MIN bytes or more sit on 2 MiB pages (Linux's transparent huge pages, which
// Debian gives only to memory that asks: madvise): fewer TLB misses where an op streams through
// the weights, their gradients and moments, or the KV cache (decode and training steps both gain
// a few percent against 4 KiB pages).
#define HUGE_PAGE (2u << 20)
#define HUGE_PAGE_MIN (8u << 20)

// what dev_malloc keeps in the DEV_ALIGN bytes before a buffer
typedef struct {
    size_t bytes;
    void *base;  // what aligned_alloc returned
} DevHeader;

void *dev_malloc(size_t bytes) {
    size_t rounded = (bytes + DEV_ALIGN - 1) / DEV_ALIGN * DEV_ALIGN;
    size_t align = rounded >= HUGE_PAGE_MIN ? HUGE_PAGE : DEV_ALIGN;
    size_t total = (align + rounded + align - 1) / align * align;  // aligned_alloc wants a multiple
    char *base = aligned_alloc(align, total);
    if (!base) fatal("out of memory: dev_malloc of %zu bytes (%zu already in use)", bytes,
                     g_bytes_in_use);
    if (align == HUGE_PAGE) madvise(base, total, MADV_HUGEPAGE);  // refused: 4 KiB pages, as before
    char *ptr = base + align;
    memcpy(ptr - DEV_ALIGN, &(DevHeader){bytes, base}, sizeof(DevHeader));
    memset(ptr, 0, rounded);
    g_bytes_in_use += bytes;
    if (g_bytes_in_use > g_bytes_peak) g_bytes_peak = g_bytes_in_use;
    return ptr;
}

void dev_free(void *ptr) {
    if (!ptr) return;
    DevHeader h;
    memcpy(&h, (char *)ptr - DEV_ALIGN, sizeof h);
    g_bytes_in_use -= h.bytes;
    free(h.base);
}

// An element-wise loop over fewer elements than this runs on the calling thread: handing it to
// the others and waiting for them costs more than the loop, and a decode step at batch 1 runs
// ~110 such loops of 768 to 3072 elements, under a microsecond of work each (traced, its
// LayerNorms, GELUs, casts, residual adds and embedding took several times longer shared out
// than on one thread).
#define ELEMENTWISE_PARALLEL_MIN 8192

// every thread zeroes a share of whole cache lines: one core's stores do not reach the write
// bandwidth of all of them
void dev_zero(void *ptr, size_t bytes) {
    int m0 = trace_op_begin();
#pragma omp parallel if (bytes >= ELEMENTWISE_PARALLEL_MIN * sizeof(float))
    {
        size_t lines = (bytes + 63) / 64, nthreads = (size_t)omp_get_num_threads();
        size_t per = (lines + nthreads - 1) / nthreads, lo = (size_t)omp_get_thread_num() * per * 64;
        size_t hi = lo + per * 64 < bytes ? lo + per * 64 : bytes;
        if (lo < hi) memset((char *)ptr + lo, 0, hi - lo);
    }
    trace_op_end("dev_zero", m0, (double)bytes, 0, NULL);
}
void dev_copy(void *dst, const void *src, size_t bytes) { if (bytes) memcpy(dst, src, bytes); }
void copy_to_device(void *dst, const void *src, size_t bytes) { if (bytes) memcpy(dst, src, bytes); }
void copy_to_host(void *dst, const void *src, size_t bytes) { if (bytes) memcpy(dst, src, bytes); }
void dev_synchronize(void) {}
double dev_busy_seconds(void) { return thread_cpu_seconds(); }
void *dev_stream(void) { return NULL; }  // the CPU runs every op to completion in order
void dev_on_wait(void (*check)(void)) { (void)check; }

// marks are clock readings: every op has finished by the time it returns
static struct { double *seconds; int n, cap; } g_marks;

int dev_mark(void) {
    if (g_marks.n == g_marks.cap) {
        g_marks.cap = g_marks.cap ? 2 * g_marks.cap : 1024;
        g_marks.seconds = realloc(g_marks.seconds, (size_t)g_marks.cap * sizeof *g_marks.seconds);
        if (!g_marks.seconds) fatal("out of memory for %d trace marks; lower trace_steps", g_marks.cap);
    }
    g_marks.seconds[g_marks.n] = wall_seconds();
    return g_marks.n++;
}

int dev_mark_stream(void *stream) {
    (void)stream;
    return dev_mark();
}

double dev_mark_seconds(int mark) { return g_marks.seconds[mark]; }
void dev_marks_clear(void) { g_marks.n = 0; }
size_t dev_bytes_in_use(void) { return g_bytes_in_use; }
size_t dev_bytes_peak(void) { return g_bytes_peak; }

size_t dev_free_bytes(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) fatal("the host's free memory: cannot open /proc/meminfo");
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) found = sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    fclose(f);
    if (!found) fatal("the host's free memory: /proc/meminfo has no 'MemAvailable: N kB' line");
    return (size_t)kib * 1024;
}

// ----------------------------------------------------------------------------------------------
// initialisation

void init_normal(float *out, size_t n, uint64_t seed, uint64_t stream, uint64_t first, float std) {
#pragma omp parallel for schedule(static)
    for (size_t j = 0; j < n; j++) out[j] = std * rng_normal(seed, stream, first + j);
}

void fill_constant(float *out, size_t n, float value) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = value;
}

// ----------------------------------------------------------------------------------------------
// layers

// Threads split the columns [0, ncols) of a column-owning loop into blocks of whole cache lines
// (16 floats), so no two threads write the same line.
static void column_block(int ncols, int *c0, int *c1) {
    int nthreads = omp_get_num_threads(), tid = omp_get_thread_num();
    int lines = (ncols + 15) / 16;
    int per = (lines + nthreads - 1) / nthreads;
    *c0 = tid * per * 16;
    *c1 = (tid + 1) * per * 16;
    if (*c0 > ncols) *c0 = ncols;
    if (*c1 > ncols) *c1 = ncols;
}

// backward: dinp's and dweight's), the shape "NxCxOC" beside them
static void trace_matmul(const char *name, int m0, double bytes, int products, int N, int C, int OC) {
    char shape[48];
    snprintf(shape, sizeof shape, "%dx%dx%d", N, C, OC);
    trace_op_end(name, m0, bytes, 2.0 * products * N * C * OC, shape);
}

// what a linear layer's backward reads and writes at least: dout (the 16-bit copy's `in_size`
// bytes an element, and the f32 one for dbias), the weight for dinp, the input for dweight;
// dinp, dweight and dbias are accumulated (read and written)
static double matmul_backward_bytes(const float *dinp, const float *dweight, const float *dbias, int in_size,
                                    int dout_size, int N, int C, int OC) {
    double bytes = (double)dout_size * N * OC;
    if (dinp) bytes += (double)in_size * C * OC + 8.0 * N * C;
    if (dweight) bytes += (double)in_size * N * C + 8.0 * C * OC;
    if (dbias) bytes += 8.0 * OC + (dout_size == 4 ? 0 : 4.0 * N * OC);
    return bytes;
}

void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
                    int C, int OC) {
    if (N <= FEW_ROWS_MAX) {  // a decode step's few rows: at the speed of reading the weights (ops_cpu_fast.c)
        few_rows_matmul(out, inp, C, weight, 0, bias, N, C, OC);
        return;
    }
    int m0 = trace_op_begin();
    matmul_run(matmul_plan(MM_FORWARD, N, C, OC, bias != NULL, 0), inp, weight, bias, out);
    trace_matmul("matmul_forward", m0, 4.0 * ((double)N * C + (double)C * OC + (double)N * OC + (bias ? OC : 0)), 1, N, C, OC);
}

// dbias (OC) += column sums of dout; GRAD_WRITE zeroes dbias first (a row of OC floats, not a
// pass over the gradients), so the sums are the same bits either way
static void bias_backward(float *dbias, const float *dout, int N, int OC, GradMode grads) {
    if (grads == GRAD_WRITE) memset(dbias, 0, (size_t)OC * sizeof(float));
#pragma omp parallel
    {
        int c0, c1;
        column_block(OC, &c0, &c1);
        column_sums(dbias, dout, N, OC, c0, c1);
    }
}

// the product that makes dweight: added (oneDNN's sum post-op) or written
static int weights_kind(GradMode grads) { return grads == GRAD_WRITE ? MM_WEIGHTS_WRITTEN : MM_BACKWARD_WEIGHTS; }

void matmul_backward_mode(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                          const float *weight, int N, int C, int OC, GradMode grads) {
    int m0 = trace_op_begin();
    if (dinp) matmul_run(matmul_plan(MM_BACKWARD_DATA, N, C, OC, 0, 0), dout, weight, NULL, dinp);
    if (dweight) matmul_run(matmul_plan(weights_kind(grads), N, C, OC, 0, 0), dout, inp, NULL, dweight);
    if (dbias) bias_backward(dbias, dout, N, OC, grads);
    trace_matmul("matmul_backward", m0, matmul_backward_bytes(dinp, dweight, dbias, 4, 4, N, C, OC),
                 (dinp != NULL) + (dweight != NULL), N, C, OC);
}


// ----------------------------------------------------------------------------------------------
// the 16-bit copies: bf16, or fp16 (precision 16-mixed)

void cast_to_16(half16 *out, const float *in, size_t n) {
    int m0 = trace_op_begin();
    int fp16 = g_half == HALF_FP16;
#pragma omp parallel for schedule(static) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) out[i] = half_from_float(in[i], fp16);
    trace_op_end("cast_to_16", m0, 6.0 * n, 0, NULL);
}

void cast_to_float(float *out, const half16 *in, size_t n) {
    int m0 = trace_op_begin();
    int fp16 = g_half == HALF_FP16;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = half_to_float(in[i], fp16);
    trace_op_end("cast_to_float", m0, 6.0 * n, 0, NULL);
}

static void add_half_underflow(unsigned long long nonzero, unsigned long long flushed) {
    g_grad_nonzero += (double)nonzero;
    g_grad_flushed += (double)flushed;
}

void cast_gradient_to_16(half16 *out, const float *in, size_t n) {
    int m0 = trace_op_begin();
    int fp16 = g_half == HALF_FP16;
    unsigned long long nonzero = 0, flushed = 0;
#pragma omp parallel for schedule(static) reduction(+ : nonzero, flushed)
    for (size_t i = 0; i < n; i++) out[i] = gradient_to_16(in[i], fp16, &nonzero, &flushed);
    add_half_underflow(nonzero, flushed);
    trace_op_end("cast_gradient_to_16", m0, 6.0 * n, 0, NULL);
}

void ops_half_underflow(double *nonzero, double *flushed) {
    *nonzero = g_grad_nonzero, *flushed = g_grad_flushed;
    g_grad_nonzero = g_grad_flushed = 0;
}

int ops_bf16_native(void) { return bf16_engine()->native; }

// Widens a bf16 matrix into one of two reusable f32 scratch buffers (the fallback path).
static const float *widened(const half16 *x, size_t n, int which) {
    static float *scratch[2];
    static size_t capacity[2];
    if (n > capacity[which]) {
        free(scratch[which]);
        scratch[which] = malloc_or_die(n * sizeof(float));
        capacity[which] = n;
    }
    cast_to_float(scratch[which], x, n);
    return scratch[which];
}

void matmul_forward_16(float *out, const half16 *inp, const half16 *weight, const float *bias, int N,
                         int C, int OC) {
    if (N <= FEW_ROWS_MAX && g_half == HALF_BF16) {  // as matmul_forward's few rows
        size_t x_row;
        const void *x = bf16_rows_for_few_rows(inp, N, C, &x_row);
        few_rows_matmul(out, x, x_row, weight, 1, bias, N, C, OC);
        return;
    }
    int m0 = trace_op_begin();
    if (widen_half())
        matmul_forward(out, widened(inp, (size_t)N * C, 0), widened(weight, (size_t)OC * C, 1), bias,
                       N, C, OC);
    else matmul_run(matmul_plan(MM_FORWARD, N, C, OC, bias != NULL, 1), inp, weight, bias, out);
    trace_matmul("matmul_forward_16", m0, 2.0 * ((double)N * C + (double)C * OC) + 4.0 * ((double)N * OC + (bias ? OC : 0)),
                 1, N, C, OC);
}

void matmul_backward_16_mode(float *dinp, float *dweight, float *dbias, const float *dout, const half16 *dout16,
                             const half16 *inp, const half16 *weight, int N, int C, int OC, GradMode grads) {
    int m0 = trace_op_begin();
    if (widen_half()) {
        const float *g = widened(dout16, (size_t)N * OC, 0);
        if (dinp) matmul_backward(dinp, NULL, NULL, g, NULL, widened(weight, (size_t)OC * C, 1), N, C, OC);
        if (dweight)
            matmul_backward_mode(NULL, dweight, NULL, g, widened(inp, (size_t)N * C, 1), NULL, N, C, OC, grads);
    } else {
        if (dinp) matmul_run(matmul_plan(MM_BACKWARD_DATA, N, C, OC, 0, 1), dout16, weight, NULL, dinp);
        if (dweight) matmul_run(matmul_plan(weights_kind(grads), N, C, OC, 0, 1), dout16, inp, NULL, dweight);
    }
    if (dbias) bias_backward(dbias, dout, N, OC, grads);
    trace_matmul("matmul_backward_16", m0, matmul_backward_bytes(dinp, dweight, dbias, 2, 2, N, C, OC),
                 (dinp != NULL) + (dweight != NULL), N, C, OC);
}

// the emulation: each operand's grid values are fp8(x scale) / scale, bf16 values exactly, so the
// bf16 products multiply the FP8 numbers and need no scale of their own
void matmul_forward_fp8(float *out, const half16 *inp, float inp_scale, const half16 *weight, float weight_scale,
                        const float *bias, int N, int C, int OC) {
    (void)inp_scale, (void)weight_scale;
    matmul_forward_16(out, inp, weight, bias, N, C, OC);
}

void matmul_backward_fp8(float *dinp, float *dweight, float *dbias, const float *dout, const half16 *dout8,
                         float dout_scale, const half16 *inp, float inp_scale, const half16 *weight,
                         float weight_scale, int N, int C, int OC) {
    (void)dout_scale, (void)inp_scale, (void)weight_scale;
    matmul_backward_16(dinp, dweight, dbias, dout, dout8, inp, weight, N, C, OC);
}

void embedding_forward(float *out, const int *tokens, const int *start, const float *wte,
                       const float *wpe, int v_lo, int v_count, int B, int T, int C) {
    int m0 = trace_op_begin();
#pragma omp parallel for schedule(static) if ((size_t)B * T * C >= ELEMENTWISE_PARALLEL_MIN)
    for (int bt = 0; bt < B * T; bt++) {
        float *o = out + (size_t)bt * C;
        int pos = (start ? start[bt / T] : 0) + bt % T;
        for (int c = 0; c < C; c++) o[c] = embedding_value(wte, wpe, tokens[bt], pos, c, C, v_lo, v_count);
    }
    trace_op_end("embedding_forward", m0, 4.0 * ((double)B * T * (1 + 2.0 * C) + (wpe ? (double)T * C : 0)), 0, NULL);
}

void embedding_backward(float *dwte, float *dwpe, const float *dout, const int *tokens, int v_lo,
                        int v_count, int B, int T, int C) {
    int m0 = trace_op_begin();
#pragma omp parallel
    {
        int c0, c1;
        column_block(C, &c0, &c1);
        embedding_backward_columns(dwte, dwpe, dout, tokens, B * T, T, C, v_lo, v_count, c0, c1);
    }
    trace_op_end("embedding_backward", m0, 4.0 * ((double)B * T * (1 + 3.0 * C) + (dwpe ? 2.0 * T * C : 0)), 0, NULL);
}

void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                       const float *weight, const float *bias, int N, int C) {
    int m0 = trace_op_begin();
#pragma omp parallel for schedule(static) if ((size_t)N * C >= ELEMENTWISE_PARALLEL_MIN)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        float m = sum_16_lanes(x, C) / (float)C;
        float r = layernorm_rstd(sqdev_16_lanes(x, m, C), C);
        for (int c = 0; c < C; c++) o[c] = layernorm_value(x[c], m, r, weight[c], bias[c]);
        mean[n] = m;
        rstd[n] = r;
    }
    trace_op_end("layernorm_forward", m0, 4.0 * (2.0 * N * C + 2.0 * C + 2.0 * N), 0, NULL);
}

// GRAD_WRITE: the norms' weight gradients (C floats each) are zeroed and then summed into as
// GRAD_ADD sums: the same bits, and no pass over the gradient buffer
static void zero_norm_grads(float *dweight, float *dbias, int C, GradMode grads) {
    if (grads != GRAD_WRITE) return;
    memset(dweight, 0, (size_t)C * sizeof(float));
    if (dbias) memset(dbias, 0, (size_t)C * sizeof(float));
}

void layernorm_backward_mode(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                             const float *weight, const float *mean, const float *rstd, int N, int C,
                             GradMode grads) {
    int m0 = trace_op_begin();
    zero_norm_grads(dweight, dbias, C, grads);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *g = dout + (size_t)n * C, *x = inp + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float sum_dnorm, sum_dnorm_norm;
            layernorm_backward_sums_16_lanes(&sum_dnorm, &sum_dnorm_norm, g, x, weight, mean[n], rstd[n], C);
            float mean_dnorm = sum_dnorm / (float)C, mean_dnorm_norm = sum_dnorm_norm / (float)C;
            // the row's mean and rstd in locals: read through the pointers inside the loop, they
            // might be what dx writes, and the loop would not vectorize
            float row_mean = mean[n], row_rstd = rstd[n];
            for (int c = 0; c < C; c++)
                dx[c] += layernorm_dinp(g[c], x[c], weight[c], row_mean, row_rstd, mean_dnorm, mean_dnorm_norm);
        }
        // the parameter gradients sum over rows: each thread owns a block of columns
        int c0, c1;
        column_block(C, &c0, &c1);
        layernorm_param_grad_columns(dweight, dbias, dout, inp, mean, rstd, N, C, c0, c1);
    }
    trace_op_end("layernorm_backward", m0, 4.0 * (4.0 * N * C + 5.0 * C + 2.0 * N), 0, NULL);
}

void rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C, float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        float r = rmsnorm_rstd(sqdev_16_lanes(x, 0.0f, C), C, eps);
        for (int c = 0; c < C; c++) o[c] = x[c] * r * weight[c];
        rstd[n] = r;
    }
}

void rmsnorm_backward_mode(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                           const float *rstd, int N, int C, GradMode grads) {
    zero_norm_grads(dweight, NULL, C, grads);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *g = dout + (size_t)n * C, *x = inp + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float row_rstd = rstd[n];  // in a local, as in layernorm_backward_mode
            float mean_dnorm_norm = rmsnorm_backward_sum_16_lanes(g, x, weight, row_rstd, C) / (float)C;
            for (int c = 0; c < C; c++) dx[c] += rmsnorm_dinp(g[c], x[c], weight[c], row_rstd, mean_dnorm_norm);
        }
        int c0, c1;
        column_block(C, &c0, &c1);
        rmsnorm_param_grad_columns(dweight, dout, inp, rstd, N, C, c0, c1);
    }
}

void rmsnorm_row_sums(float *sum_sq, const float *inp, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) sum_sq[n] = sqdev_16_lanes(inp + (size_t)n * C, 0.0f, C);
}

void rmsnorm_forward_stats(float *out, float *rstd, const float *inp, const float *weight, const float *sum_sq,
                           int N, int C, int C_total, float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        float r = rmsnorm_rstd(sum_sq[n], C_total, eps);
        for (int c = 0; c < C; c++) o[c] = x[c] * r * weight[c];
        rstd[n] = r;
    }
}

void rmsnorm_backward_row_sums(float *sums, const float *dout, const float *inp, const float *weight,
                               const float *rstd, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        sums[n] = rmsnorm_backward_sum_16_lanes(dout + (size_t)n * C, inp + (size_t)n * C, weight, rstd[n], C);
}

void rmsnorm_backward_stats(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                            const float *rstd, const float *sums, int N, int C, int C_total) {
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *g = dout + (size_t)n * C, *x = inp + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            for (int c = 0; c < C; c++) dx[c] += rmsnorm_dinp(g[c], x[c], weight[c], rstd[n], sums[n] / (float)C_total);
        }
        int c0, c1;
        column_block(C, &c0, &c1);
        rmsnorm_param_grad_columns(dweight, dout, inp, rstd, N, C, c0, c1);
    }
}

void gqa_expand(float *qkv, const float *proj, int N, int C_attn, int NH, int NKV) {
    int width = C_attn + 2 * (C_attn / NH) * NKV;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int c = 0; c < 3 * C_attn; c++)
            qkv[(size_t)n * 3 * C_attn + c] = gqa_expanded_value(proj + (size_t)n * width, c, C_attn, NH, NKV);
}

void gqa_reduce(float *dproj, const float *dqkv, int N, int C_attn, int NH, int NKV) {
    int width = C_attn + 2 * (C_attn / NH) * NKV;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int c = 0; c < width; c++)
            dproj[(size_t)n * width + c] = gqa_reduced_grad(dqkv + (size_t)n * 3 * C_attn, c, C_attn, NH, NKV);
}

// the attention probabilities a causal step computes (and forward keeps for backward): each
// query's scores against itself and the keys before it
static double causal_scores(int B, int T, int NH) { return (double)B * NH * T * (T + 1.0) / 2; }

// attention's operands as its products read them: the op's own f32 buffers, or (the _16 ops) copies
// rounded to bf16, kept as bf16 for oneDNN's bf16 matmul or widened back to f32 where bf16 matmuls
// are widened (the same products: choose_bf16_engine)
typedef struct {
    const void *qkv, *att, *dout, *datt;  // q k v; the probabilities P; dout; the scores' gradient dS
    int bf16;                             // the elements are bf16; else f32
} AttOperands;

// element i of x, one of o's operands
static const void *at(const AttOperands *o, const void *x, size_t i) {
    return (const char *)x + i * (o->bf16 ? sizeof(half16) : sizeof(float));
}

// one of attention's products for one tile (first row r0) of a sequence: src and weights are
// read (bf16 or f32), dst written (or added into: the gradients of q, k and v)
static void attention_matmul(int kind, int r0, int bf16, const void *src, const void *weights, float *dst, int T,
                             int C, int NH) {
    MatmulPlan *p = find_or_create_plan(kind, T, C / NH, NH, 0, bf16, r0);
    if (!p) fatal("oneDNN has no %s matmul implementation for attention (T=%d C=%d NH=%d)", bf16 ? "bf16" : "f32", T, C, NH);
    matmul_run(p, src, weights, NULL, dst);
}

// ---- the 16-bit operands: four buffers reused by every call, grown as needed
enum { ROUNDED_QKV, ROUNDED_PROBS, ROUNDED_DOUT, ROUNDED_DSCORES };

static void *rounded_buffer(int which, size_t n, int bf16) {
    static void *buffer[4];
    static size_t capacity[4];  // bytes
    size_t bytes = n * (bf16 ? sizeof(half16) : sizeof(float));
    if (bytes > capacity[which]) {
        free(buffer[which]);
        buffer[which] = malloc_or_die(bytes);
        capacity[which] = bytes;
    }
    return buffer[which];
}

// out[i] = x rounded to bf16: its bits, or widened, the f32 of the same value
static void store_rounded(void *out, size_t i, float x, int bf16) {
    half16 h = bf16_from_float(x);
    if (bf16) ((half16 *)out)[i] = h;
    else ((float *)out)[i] = bf16_to_float(h);
}

static const void *rounded_copy(int which, const float *x, size_t n, int bf16) {
    void *out = rounded_buffer(which, n, bf16);
#pragma omp parallel for schedule(static) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) store_rounded(out, i, x[i], bf16);
    return out;
}

// query row t of a (T, T) square (its first element `row`) into its rounded copy, up to the end
// of t's tile: no product reads further (describe_attention)
static void round_row(void *copy, size_t row, const float *x, int t, int T, int bf16) {
    int end = attention_tile_end(t / ATT_TILE * ATT_TILE, T);
    for (int j = 0; j < end; j++) store_rounded(copy, row + j, x[j], bf16);
}

// The products, a tile of ATT_TILE query rows at a time (describe_attention), with the tile's
// softmax rows between them: the tile's rows of the squares (NH x ATT_TILE x up to T floats) are
// still in cache when the next product reads them; the whole square (NH T^2 floats, 3 MB for
// GPT-2 at T = 256) is not. A tile's rows, (head, query) in order, go to the threads in even runs.
//
// Forward: S = Q K^T, its rows into probabilities (and, given att16, each row into its rounded
// copy while it is in cache), out = P V.
static void attention_forward_tiles(float *out, float *att, void *att16, const AttOperands *o, int B, int T, int C,
                                    int NH) {
    size_t TT = (size_t)T * T, C3 = 3 * (size_t)C;
    float scale = attention_scale(C / NH);
    for (int b = 0; b < B; b++) {
        size_t q = b * T * C3, square = b * NH * TT;
        for (int r0 = 0; r0 < T; r0 += ATT_TILE) {
            int r1 = attention_tile_end(r0, T);
            attention_matmul(ATT_SCORES, r0, o->bf16, at(o, o->qkv, q + r0 * C3), at(o, o->qkv, q + C),
                             att + square + (size_t)r0 * T, T, C, NH);
#pragma omp parallel for schedule(static) collapse(2)
            for (int h = 0; h < NH; h++)
                for (int t = r0; t < r1; t++) {
                    size_t row = square + ((size_t)h * T + t) * T;
                    attention_row_probabilities(att + row, t, T, scale);
                    if (att16) round_row(att16, row, att + row, t, T, o->bf16);
                }
            attention_matmul(ATT_VALUES, r0, o->bf16, at(o, o->att, square + (size_t)r0 * T), at(o, o->qkv, q + 2 * C),
                             out + ((size_t)b * T + r0) * C, T, C, NH);
        }
    }
}

// Backward, the tiles from the last: dP = dout V^T, its rows into the scores' gradients dS (and,
// given the copies, att's and datt's rows into them), then dQ = dS K, dK = dS^T Q, dV = P^T dout,
// added into dqkv. A key tile's dK and dV read dS and P from its first query row to the last,
// the rows of its own tile and of those after it: done by then.
static void attention_backward_tiles(float *dqkv, float *datt, const float *att, void *att16, void *datt16,
                                     const AttOperands *o, int B, int T, int C, int NH) {
    size_t TT = (size_t)T * T, C3 = 3 * (size_t)C;
    float scale = attention_scale(C / NH);
    for (int b = 0; b < B; b++) {
        size_t q = b * T * C3, g = (size_t)b * T * C, square = b * NH * TT;
        float *dq = dqkv + b * T * C3;
        for (int r0 = (T - 1) / ATT_TILE * ATT_TILE; r0 >= 0; r0 -= ATT_TILE) {
            int r1 = attention_tile_end(r0, T);
            size_t diagonal = square + (size_t)r0 * T + r0;  // (query r0, key r0): where a key tile's queries start
            attention_matmul(ATT_DPROBS, r0, o->bf16, at(o, o->dout, g + (size_t)r0 * C), at(o, o->qkv, q + 2 * C),
                             datt + square + (size_t)r0 * T, T, C, NH);
#pragma omp parallel for schedule(static) collapse(2)
            for (int h = 0; h < NH; h++)
                for (int t = r0; t < r1; t++) {
                    size_t row = square + ((size_t)h * T + t) * T;
                    attention_row_softmax_backward(datt + row, att + row, t, T, scale);
                    if (!att16) continue;
                    round_row(att16, row, att + row, t, T, o->bf16);
                    round_row(datt16, row, datt + row, t, T, o->bf16);
                }
            attention_matmul(ATT_DQUERIES, r0, o->bf16, at(o, o->datt, square + (size_t)r0 * T), at(o, o->qkv, q + C),
                             dq + r0 * C3, T, C, NH);
            attention_matmul(ATT_DKEYS, r0, o->bf16, at(o, o->datt, diagonal), at(o, o->qkv, q + r0 * C3),
                             dq + r0 * C3 + C, T, C, NH);
            attention_matmul(ATT_DVALUES, r0, o->bf16, at(o, o->att, diagonal), at(o, o->dout, g + (size_t)r0 * C),
                             dq + r0 * C3 + 2 * C, T, C, NH);
        }
    }
}

// what the ops trace: the bytes they must move (q, k, v, out and the causal half of the square
// forward; also dout, dqkv and datt backward) and the FLOPs of the causal half, what the step needs
static void trace_attention(const char *name, int m0, int backward, int B, int T, int C, int NH) {
    double scores = causal_scores(B, T, NH);
    double bytes = backward ? 4.0 * (7.0 * B * T * C + scores) : 4.0 * (4.0 * B * T * C + scores);
    trace_op_end(name, m0, bytes, (backward ? 4.0 : 2.0) * B * T * (T + 1.0) * C, NULL);
}

void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH) {
    int m0 = trace_op_begin();
    AttOperands o = {.qkv = qkv, .att = att};
    attention_forward_tiles(out, att, NULL, &o, B, T, C, NH);
    trace_attention("attention_forward", m0, 0, B, T, C, NH);
}

void attention_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, int B, int T, int C, int NH) {
    int m0 = trace_op_begin();
    AttOperands o = {.qkv = qkv, .att = att, .dout = dout, .datt = datt};
    attention_backward_tiles(dqkv, datt, att, NULL, NULL, &o, B, T, C, NH);
    trace_attention("attention_backward", m0, 1, B, T, C, NH);
}

// The 16-bit ops: the products over q, k, v, P, dout and dS rounded to bf16, on the bf16 engine,
// the softmax in f32 as above. fp16 (16-mixed) runs the f32 ops: its products are widened to f32
// anyway, and fp16's narrow range would put the scaled dS near overflow.
void attention_forward_16(float *out, float *att, const float *qkv, int B, int T, int C, int NH) {
    if (g_half == HALF_FP16) {
        attention_forward(out, att, qkv, B, T, C, NH);
        return;
    }
    int m0 = trace_op_begin(), bf16 = !widen_half();
    void *att16 = rounded_buffer(ROUNDED_PROBS, (size_t)B * NH * T * T, bf16);
    AttOperands o = {.qkv = rounded_copy(ROUNDED_QKV, qkv, (size_t)B * T * 3 * C, bf16), .att = att16, .bf16 = bf16};
    attention_forward_tiles(out, att, att16, &o, B, T, C, NH);
    trace_attention("attention_forward_16", m0, 0, B, T, C, NH);
}

void attention_backward_16(float *dqkv, float *datt, const float *dout, const float *qkv,
                           const float *att, int B, int T, int C, int NH) {
    if (g_half == HALF_FP16) {
        attention_backward(dqkv, datt, dout, qkv, att, B, T, C, NH);
        return;
    }
    int m0 = trace_op_begin(), bf16 = !widen_half();
    size_t square = (size_t)B * NH * T * T;
    void *att16 = rounded_buffer(ROUNDED_PROBS, square, bf16), *datt16 = rounded_buffer(ROUNDED_DSCORES, square, bf16);
    AttOperands o = {.qkv = rounded_copy(ROUNDED_QKV, qkv, (size_t)B * T * 3 * C, bf16),
                     .dout = rounded_copy(ROUNDED_DOUT, dout, (size_t)B * T * C, bf16),
                     .att = att16, .datt = datt16, .bf16 = bf16};
    attention_backward_tiles(dqkv, datt, att, att16, datt16, &o, B, T, C, NH);
    trace_attention("attention_backward_16", m0, 1, B, T, C, NH);
}

// GELU with its exponential from expf_vectorizable (kernels.h), within 1 ulp of expf's: each loop
// vectorizes whole (with the C library's expf, a call per element, it did not, and GELU forward
// and backward were a visible share of a GPT-2 124M bench step)
void gelu_forward(float *restrict out, const float *restrict inp, size_t n) {
    int m0 = trace_op_begin();
    // exercise gelu-speed: begin
#pragma omp parallel for schedule(static) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) out[i] = gelu_value_of_exp(inp[i], expf_vectorizable(-gelu_z(inp[i])));
    // exercise gelu-speed: end
    trace_op_end("gelu_forward", m0, 8.0 * n, 0, NULL);
}

static float gelu_backward_value(float inp, float dout) {
    return dout * gelu_grad_of_exp(inp, expf_vectorizable(-gelu_z(inp)));
}

void gelu_backward(float *restrict dinp, const float *restrict inp, const float *restrict dout, size_t n) {
    int m0 = trace_op_begin();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) dinp[i] = gelu_backward_value(inp[i], dout[i]);
    trace_op_end("gelu_backward", m0, 12.0 * n, 0, NULL);
}

// The fused backwards below make a block's gradients, then round them while they are in L1:
// one loop doing both would not vectorize, and the op would be slower than its two passes.
#define ROUNDED_BLOCK 1024

// out[0, n) = in's values rounded as cast_gradient_to_16 rounds them, and counted (nothing
// without out): a block or a row of gradients while it is still in this core's cache. Counted in
// locals, which the compiler keeps in vector registers (through the pointers, it would not
// vectorize the loop).
static void gradients_to_16_counted(half16 *restrict out, const float *restrict in, size_t n,
                                    unsigned long long *nonzero, unsigned long long *flushed) {
    if (!out) return;
    int fp16 = g_half == HALF_FP16;
    unsigned long long nz = 0, fl = 0;
    for (size_t i = 0; i < n; i++) out[i] = gradient_to_16(in[i], fp16, &nz, &fl);
    *nonzero += nz, *flushed += fl;
}

static size_t block_end(size_t b, size_t n) { return b + ROUNDED_BLOCK < n ? b + ROUNDED_BLOCK : n; }

void gelu_backward_16(float *restrict dinp, half16 *restrict dinp16, const float *restrict inp,
                      const float *restrict dout, size_t n) {
    int m0 = trace_op_begin();
    unsigned long long nonzero = 0, flushed = 0;
#pragma omp parallel for schedule(static) reduction(+ : nonzero, flushed)
    for (size_t b = 0; b < n; b += ROUNDED_BLOCK) {
        size_t end = block_end(b, n);
        for (size_t i = b; i < end; i++) dinp[i] = gelu_backward_value(inp[i], dout[i]);
        gradients_to_16_counted(dinp16 + b, dinp + b, end - b, &nonzero, &flushed);
    }
    add_half_underflow(nonzero, flushed);
    trace_op_end("gelu_backward_16", m0, 14.0 * n, 0, NULL);
}

void swiglu_forward(float *h, const float *gate_up, int N, int F) {
    size_t n = (size_t)N * F;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) h[i] = swiglu_value(gate_up, i, F);
}

void swiglu_backward(float *dgate_up, const float *gate_up, const float *dh, int N, int F) {
    size_t n = (size_t)N * F;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) swiglu_grad(dgate_up, gate_up, dh, i, F);
}

void swiglu_backward_16(float *dgate_up, half16 *dgate_up16, const float *gate_up, const float *dh, int N, int F) {
    unsigned long long nonzero = 0, flushed = 0;
#pragma omp parallel for schedule(static) reduction(+ : nonzero, flushed)
    for (int row = 0; row < N; row++) {  // a row's gate | up, 2F wide, rounded once it is made
        size_t at = (size_t)row * 2 * F;
        for (size_t i = (size_t)row * F; i < (size_t)(row + 1) * F; i++) swiglu_grad(dgate_up, gate_up, dh, i, F);
        gradients_to_16_counted(dgate_up16 + at, dgate_up + at, 2 * (size_t)F, &nonzero, &flushed);
    }
    add_half_underflow(nonzero, flushed);
}

static void rotary_apply(float *qkv, const int *start, int B, int T, int C_attn, int NH, int rot_dim,
                         Rope rope, float direction) {
    long pairs = (long)B * T * 2 * NH * (rot_dim / 2);
#pragma omp parallel for schedule(static)
    for (long p = 0; p < pairs; p++) rotary_qkv_pair(qkv, start, p, T, C_attn, NH, rot_dim, rope, direction);
}

void rotary_forward(float *qkv, const int *start, int B, int T, int C_attn, int NH, int rot_dim, Rope rope) {
    rotary_apply(qkv, start, B, T, C_attn, NH, rot_dim, rope, 1.0f);
}

void rotary_backward(float *dqkv, const int *start, int B, int T, int C_attn, int NH, int rot_dim, Rope rope) {
    rotary_apply(dqkv, start, B, T, C_attn, NH, rot_dim, rope, -1.0f);
}

void add_forward(float *out, const float *a, const float *b, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

// one thread per token: its rows are its own
void moe_dispatch(float *packed, const float *x, const int *slot, int N, int k, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) moe_dispatch_row(packed, x + (size_t)n * C, slot + (size_t)n * k, k, C, 0, 1);
}

void moe_dispatch_backward(float *dx, const float *dpacked, const int *slot, int N, int k, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        moe_dispatch_backward_row(dx + (size_t)n * C, dpacked, slot + (size_t)n * k, k, C, 0, 1);
}

void moe_combine(float *out, const float *y, const int *slot, const float *weight, int N, int k, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        moe_combine_row(out + (size_t)n * C, y, slot + (size_t)n * k, weight + (size_t)n * k, k, C, 0, 1);
}

void moe_combine_backward(float *dy, float *dweight, const float *dout, const float *y, const int *slot,
                          const float *weight, int N, int k, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *d = dout + (size_t)n * C;
        moe_combine_backward_row(dy, d, slot + (size_t)n * k, weight + (size_t)n * k, k, C, 0, 1);
        for (int j = 0; j < k; j++) dweight[(size_t)n * k + j] = moe_weight_grad_partial(d, y, slot[(size_t)n * k + j], C, 0, 1);
    }
}

void add_inplace(float *acc, const float *x, size_t n) {
    int m0 = trace_op_begin();
#pragma omp parallel for schedule(static) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) acc[i] += x[i];
    trace_op_end("add_inplace", m0, 12.0 * n, 0, NULL);
}

void add_columns_scaled(float *dst, int dst_stride, const float *src, int src_stride, int N, int width, float s) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int j = 0; j < width; j++) dst[(size_t)n * dst_stride + j] += s * src[(size_t)n * src_stride + j];
}

void dropout_apply(float *out, const float *inp, int N, int width, const DropoutMask *m, int add) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int c = 0; c < width; c++) {
            size_t i = (size_t)n * width + c;
            float v = inp[i] * dropout_factor(m, N, n, c);
            out[i] = add ? out[i] + v : v;
        }
}

void scale_inplace(float *x, float s, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

// A target outside [0, V) (other than the "no loss" negatives) would read outside the row; the
// check is a pass over N ints, cheap next to the N x V logits.
static void check_targets(const int *targets, int N, int V) {
    for (int n = 0; n < N; n++)
        if (targets[n] >= V) fatal("cross-entropy: target %d of row %d is outside the vocabulary "
                                   "of %d tokens", targets[n], n, V);
}

void cross_entropy_forward(float *losses, const float *logits, const int *targets, int N, int V,
                           int Vp) {
    check_targets(targets, N, V);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vp;
        if (targets[n] < 0) {
            losses[n] = 0.0f;
            continue;
        }
        float max = max_16_lanes(x, V);
        losses[n] = cross_entropy_loss(x[targets[n]], max, sumexp_16_lanes(x, max, V));
    }
}

void cross_entropy_forward_backward(float *logits_then_dlogits, half16 *dlogits16, float *losses,
                                    const int *targets, float dloss, int N, int V, int Vp) {
    int m0 = trace_op_begin();
    check_targets(targets, N, V);
    unsigned long long nonzero = 0, flushed = 0;
#pragma omp parallel for schedule(static) reduction(+ : nonzero, flushed)
    for (int n = 0; n < N; n++) {
        float *x = logits_then_dlogits + (size_t)n * Vp;
        half16 *x16 = dlogits16 ? dlogits16 + (size_t)n * Vp : NULL;
        int target = targets[n];
        if (target < 0) {  // no loss, so no gradient either
            losses[n] = 0.0f;
            memset(x, 0, (size_t)Vp * sizeof(float));
            gradients_to_16_counted(x16, x, (size_t)Vp, &nonzero, &flushed);
            continue;
        }
        // Passes over a row of 200 KB, which stays in this core's L2 cache after the first: the
        // max; the exponentials, written in place and summed (the costly part; the lanes and the
        // values of cross_entropy_forward's sumexp_16_lanes: the same loss); then the scaling
        // into gradients. Each vectorizes. From memory, the row is read once and written once.
        float max = max_16_lanes(x, V);
        float x_target = x[target];
        float sumexp = exp_in_place_16_lanes(x, 1.0f, max, V);
        losses[n] = cross_entropy_loss(x_target, max, sumexp);
        float inv_sum = 1.0f / sumexp;
        for (int i = 0; i < V; i++) x[i] = cross_entropy_dlogit(x[i] * inv_sum, i == target, dloss);
        for (int i = V; i < Vp; i++) x[i] = 0.0f;  // padded vocabulary: never a prediction
        gradients_to_16_counted(x16, x, (size_t)Vp, &nonzero, &flushed);
    }
    if (dlogits16) add_half_underflow(nonzero, flushed);
    double copy_bytes = dlogits16 ? 2.0 * N * Vp : 0.0;
    trace_op_end("cross_entropy_forward_backward", m0, 4.0 * (2.0 * N * Vp + 2.0 * N) + copy_bytes, 0, NULL);
}

// Sums over a whole buffer, in double, split into a fixed number of chunks whatever the thread
// count, then added in chunk order: the result is the same bits on 1 thread or 16.
#define SUM_CHUNKS 64

double sum_squares(const float *x, size_t n) {
    int m0 = trace_op_begin();
    double partial[SUM_CHUNKS];
#pragma omp parallel for schedule(static)
    for (int k = 0; k < SUM_CHUNKS; k++) {
        size_t lo = n * k / SUM_CHUNKS, hi = n * (k + 1) / SUM_CHUNKS;
        double acc[8] = {0};  // eight running sums, as in dot_product, for speed
        size_t i = lo;
        for (; i + 8 <= hi; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += (double)x[i + j] * (double)x[i + j];
        for (; i < hi; i++) acc[0] += (double)x[i] * (double)x[i];
        partial[k] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
    double total = 0.0;
    for (int k = 0; k < SUM_CHUNKS; k++) total += partial[k];
    trace_op_end("sum_squares", m0, 4.0 * n, 0, NULL);
    return total;
}

double sum_values(const float *x, size_t n) {
    int m0 = trace_op_begin();
    double partial[SUM_CHUNKS];
#pragma omp parallel for schedule(static)
    for (int k = 0; k < SUM_CHUNKS; k++) {
        size_t lo = n * k / SUM_CHUNKS, hi = n * (k + 1) / SUM_CHUNKS;
        double acc[8] = {0};
        size_t i = lo;
        for (; i + 8 <= hi; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += (double)x[i + j];
        for (; i < hi; i++) acc[0] += (double)x[i];
        partial[k] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
    double total = 0.0;
    for (int k = 0; k < SUM_CHUNKS; k++) total += partial[k];
    trace_op_end("sum_values", m0, 4.0 * n, 0, NULL);
    return total;
}

double abs_max(const float *x, size_t n) {
    int m0 = trace_op_begin();
    float m = 0.0f;
#pragma omp parallel for schedule(static) reduction(max : m) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    trace_op_end("abs_max", m0, 4.0 * n, 0, NULL);
    return m;
}

void cast_to_fp8_grid(half16 *out, const float *in, size_t n, Fp8Format format, float scale,
                      unsigned long long *clips) {
    int m0 = trace_op_begin();
    unsigned long long saturated = 0, flushed = 0;
#pragma omp parallel for schedule(static) reduction(+ : saturated, flushed) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) {
        out[i] = fp8_grid_element(in[i], format, scale);
        saturated += fp8_saturates(in[i], format, scale);
        flushed += fp8_flushes(in[i], out[i]);
    }
    if (clips) clips[FP8_SATURATED] += saturated, clips[FP8_FLUSHED] += flushed;
    trace_op_end("cast_to_fp8_grid", m0, 6.0 * n, 0, NULL);
}

void cast_to_fp8_grid_grouped(half16 *out, const float *in, int rows, int cols, int group, int along_columns,
                              Fp8Format format, int mx, unsigned long long *clips) {
    int m0 = trace_op_begin();
    // a group is `len` elements `stride` apart: a row's run of columns, or a column's run of rows
    int lines = along_columns ? cols : rows, line_len = along_columns ? rows : cols;
    long per_line = (line_len + group - 1) / group, groups = lines * per_line;
    size_t stride = along_columns ? (size_t)cols : 1, line_step = along_columns ? 1 : (size_t)cols;
    unsigned long long saturated = 0, flushed = 0;
#pragma omp parallel for schedule(static) reduction(+ : saturated, flushed)
    for (long g = 0; g < groups; g++) {
        int start = (int)(g % per_line) * group, len = line_len - start < group ? line_len - start : group;
        size_t first = (size_t)(g / per_line) * line_step + (size_t)start * stride;
        fp8_cast_group(out, in, first, stride, len, format, mx, &saturated, &flushed);
    }
    if (clips) clips[FP8_SATURATED] += saturated, clips[FP8_FLUSHED] += flushed;
    trace_op_end("cast_to_fp8_grid_grouped", m0, 8.0 * rows * cols, 0, NULL);
}

// One fused pass: each parameter, its gradient and both moments are read once and written once
// (28 bytes per parameter; for GPT-2 124M that is 3.5 GB per step, so this op is bound by
// memory bandwidth, not arithmetic). That holds only if gcc vectorises the loop, and it does so
// only under -fno-math-errno (otherwise sqrtf must be able to set errno, and the loop stays
// scalar and compute-bound, several times slower).
// With a 16-bit copy to write, 2 bytes more per parameter, and no pass of cast_to_16's (6 bytes).
// The copy is written block by block, each block's right after its update, while its parameters
// are still in cache: the update and the rounding are loops of their own, each of which the
// compiler vectorises (one loop doing both it does not).
#define ADAMW_BLOCK 2048  // parameters: 8 KiB of each of param, grad, m and v, in L1 or L2
void adamw_update_16(float *param, half16 *param16, const float *grad, float grad_scale, float *m, float *v,
                     size_t n, float lr, float beta1, float beta2, float eps, float weight_decay, int t) {
    int m0 = trace_op_begin();
    float bc1 = (float)(1.0 - pow(beta1, t));
    float bc2 = (float)(1.0 - pow(beta2, t));
    int fp16 = g_half == HALF_FP16;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < n; b += ADAMW_BLOCK) {
        size_t end = n - b < ADAMW_BLOCK ? n : b + ADAMW_BLOCK;
        for (size_t i = b; i < end; i++)
            adamw_element(&param[i], &m[i], &v[i], grad[i] * grad_scale, lr, beta1, beta2, eps, weight_decay,
                          bc1, bc2);
        if (param16)
            for (size_t i = b; i < end; i++) param16[i] = half_from_float(param[i], fp16);
    }
    trace_op_end(param16 ? "adamw_update_16" : "adamw_update", m0, (param16 ? 30.0 : 28.0) * n, 0, NULL);
}

void adamw_update(float *param, const float *grad, float grad_scale, float *m, float *v, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int t) {
    adamw_update_16(param, NULL, grad, grad_scale, m, v, n, lr, beta1, beta2, eps, weight_decay, t);
}

void muon_momentum(float *grad, float grad_scale, float *momentum, size_t n, float beta, int nesterov) {
    int m0 = trace_op_begin();
#pragma omp parallel for schedule(static) if (n >= ELEMENTWISE_PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) grad[i] = muon_momentum_element(&momentum[i], grad[i] * grad_scale, beta, nesterov);
    trace_op_end("muon_momentum", m0, 16.0 * n, 0, NULL);
}

// ----------------------------------------------------------------------------------------------
// ---- attention with a KV cache; CUDA graphs

void kv_cache_write(float *k_pool, float *v_pool, const float *qkv, const int *start, const int *table,
                    int B, int T, int C, int NH, int NKV, int block_size, int max_blocks) {
    int hs = C / NH, Ckv = NKV * hs;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const float *row = qkv + ((size_t)b * T + t) * 3 * C;
            const int *tab = table + (size_t)b * max_blocks;
            float *k = (float *)cache_row(k_pool, tab, start[b] + t, block_size, Ckv);
            float *v = (float *)cache_row(v_pool, tab, start[b] + t, block_size, Ckv);
            for (int c = 0; c < Ckv; c += hs) {  // a key/value head at a time
                int from = gqa_expanded_column(c, hs, NH, NKV);
                memcpy(k + c, row + C + from, (size_t)hs * sizeof(float));
                memcpy(v + c, row + 2 * C + from, (size_t)hs * sizeof(float));
            }
        }
}

// The plain loops of a decode task's attention, with kernels.h's pieces: the scores of nh query
// heads against positions [t0, npos), a position at a time (each row's heads read together: they
// are neighbours in the row) ...
void cached_scores_plain(float *s, size_t s_head, const float *q, const float *k_pool, const int *blocks,
                         int block_size, int Ckv, const int *kc, int nh, int t0, int npos, int hs, float scale) {
    for (int t = t0; t < npos; t++) {
        const float *k = cache_row(k_pool, blocks, t, block_size, Ckv);
        for (int j = 0; j < nh; j++) s[j * s_head + t] = attention_score(q + j * hs, k + kc[j], scale, hs);
    }
}

// ... and each head's output: its probabilities (unnormalised: p) times the values, added a position
// at a time, then scaled by the head's 1 / sum
void cached_values_plain(float *o, const float *p, size_t s_head, const float *inv_sum, const float *v_pool,
                         const int *blocks, int block_size, int Ckv, const int *kc, int nh, int npos, int hs) {
    for (int i = 0; i < nh * hs; i++) o[i] = 0.0f;
    for (int t = 0; t < npos; t++) {
        const float *v = cache_row(v_pool, blocks, t, block_size, Ckv);
        for (int j = 0; j < nh; j++) attention_add_row(o + j * hs, p[j * s_head + t], v + kc[j], hs, 0, 1);
    }
    for (int j = 0; j < nh; j++)
        for (int i = 0; i < hs; i++) o[j * hs + i] *= inv_sum[j];
}

// One task per new row and group of heads. A task reads its sequence's positions in order (a
// block of rows at a time, through its table), each row's heads in turn (a group's columns of a
// row are contiguous; consecutive query heads read the same or the next key/value head), so the
// cache streams from memory as the weights do. A task per head would read every row in hs-column
// pieces C columns apart, which the hardware prefetchers do not follow. With fewer rows than
// threads the heads split anyway, to give every thread tasks: one head a task, taken as threads
// come free. The loops run in vectors (cached_scores_fast, cached_values_fast: ops_cpu_fast.c),
// which add the same terms in the same order as the plain loops above: the same bits.
void attention_cached_forward(float *out, float *scores, const float *qkv, const float *k_pool,
                              const float *v_pool, const int *start, const int *table, int B, int T, int C,
                              int NH, int NKV, int block_size, int max_blocks) {
    int hs = C / NH, Ckv = NKV * hs, rows = B * T, threads = omp_get_max_threads();
    int groups = rows < threads ? NH : 1, fewest = (NH + TASK_HEADS_MAX - 1) / TASK_HEADS_MAX;
    if (groups < fewest) groups = fewest;
    if (groups > NH) groups = NH;
    int per_group = (NH + groups - 1) / groups;
    groups = (NH + per_group - 1) / per_group;  // none empty
    float scale = attention_scale(hs);
    int maxT = max_blocks * block_size;
    size_t head_scores = (size_t)T * maxT;  // scores (B, NH, T, maxT): one head's rows apart
#pragma omp parallel for schedule(dynamic)  // sequences of different lengths: tasks of different sizes
    for (int task = 0; task < rows * groups; task++) {
        int bt = task / groups, b = bt / T, t = bt % T, npos = start[b] + t + 1;
        int h0 = task % groups * per_group, nh = NH - h0 < per_group ? NH - h0 : per_group;
        size_t cols = (size_t)h0 * hs;  // the group's first column
        const float *q = qkv + (size_t)bt * 3 * C + cols;
        const int *blocks = table + (size_t)b * max_blocks;  // the sequence's blocks, in order
        float *o = out + (size_t)bt * C + cols, *s = scores + ((size_t)b * NH + h0) * head_scores + (size_t)t * maxT;
        // exercise decode-attention: begin
        float inv_sum[TASK_HEADS_MAX];
        int kc[TASK_HEADS_MAX];  // each head's key/value columns in a cache row
        for (int j = 0; j < nh; j++) kc[j] = gqa_kv_column(h0 + j, hs, NH, NKV);
        cached_scores_fast(s, head_scores, q, k_pool, blocks, block_size, Ckv, kc, nh, npos, hs, scale);
        for (int j = 0; j < nh; j++) {
            float *sj = s + j * head_scores, max = -INFINITY;
            for (int t2 = 0; t2 < npos; t2++) max = fmaxf(max, sj[t2]);
            inv_sum[j] = 1.0f / attention_exp(sj, max, npos, 0, 1);
        }
        cached_values_fast(o, s, head_scores, inv_sum, v_pool, blocks, block_size, Ckv, kc, nh, npos, hs);
        // exercise decode-attention: end
    }
}

// CUDA graphs are a CUDA feature: on the CPU every op runs when it is called
int ops_graphs_supported(void) { return 0; }
void ops_graph_begin(void) { fatal("internal: CUDA graphs are not available on the CPU backend"); }
void *ops_graph_end(void) { fatal("internal: CUDA graphs are not available on the CPU backend"); }
void ops_graph_replay(void *graph) {
    (void)graph;
    fatal("internal: CUDA graphs are not available on the CPU backend");
}
void ops_graph_free(void *graph) { (void)graph; }

// ----------------------------------------------------------------------------------------------
// ---- LayerNorm and cross-entropy over rows split into shards (the sums between the steps are
// the caller's)

void layernorm_row_sums(float *sums, const float *inp, const float *mean, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        sums[n] = mean ? sqdev_16_lanes(x, mean[n], C) : sum_16_lanes(x, C);
    }
}

void layernorm_forward_stats(float *out, float *rstd, const float *inp, const float *weight,
                             const float *bias, const float *mean, const float *sum_sqdev,
                             int N, int C, int C_total) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        float r = layernorm_rstd(sum_sqdev[n], C_total);
        for (int c = 0; c < C; c++) o[c] = layernorm_value(x[c], mean[n], r, weight[c], bias[c]);
        rstd[n] = r;
    }
}

void layernorm_backward_row_sums(float *sums, const float *dout, const float *inp,
                                 const float *weight, const float *mean, const float *rstd, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        layernorm_backward_sums_16_lanes(&sums[2 * n], &sums[2 * n + 1], dout + (size_t)n * C, inp + (size_t)n * C,
                                         weight, mean[n], rstd[n], C);
}

void layernorm_backward_stats(float *dinp, float *dweight, float *dbias, const float *dout,
                              const float *inp, const float *weight, const float *mean,
                              const float *rstd, const float *sums, int N, int C, int C_total) {
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *g = dout + (size_t)n * C, *x = inp + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float mean_dnorm = sums[2 * n] / (float)C_total, mean_dnorm_norm = sums[2 * n + 1] / (float)C_total;
            for (int c = 0; c < C; c++)
                dx[c] += layernorm_dinp(g[c], x[c], weight[c], mean[n], rstd[n], mean_dnorm, mean_dnorm_norm);
        }
        int c0, c1;
        column_block(C, &c0, &c1);
        layernorm_param_grad_columns(dweight, dbias, dout, inp, mean, rstd, N, C, c0, c1);
    }
}

void cross_entropy_shard_max(float *max, const float *logits, int N, int v_count, int Vl) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) max[n] = max_16_lanes(logits + (size_t)n * Vl, v_count);
}

void cross_entropy_shard_sums(float *sums, const float *logits, const float *maxes, int nmax,
                              const int *targets, int v_lo, int v_count, int N, int Vl) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vl;
        float m = max_over_shards(maxes, nmax, N, n);
        int local = vocab_shard_index(targets[n], v_lo, v_count);
        sums[2 * n] = sumexp_16_lanes(x, m, v_count);
        sums[2 * n + 1] = local >= 0 ? x[local] : 0.0f;
    }
}

void cross_entropy_shard_finish(float *losses, float *dlogits, const float *logits,
                                const float *maxes, int nmax, const float *sums, const int *targets,
                                float dloss, int v_lo, int v_count, int N, int Vl) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * Vl;
        float *dx = dlogits ? dlogits + (size_t)n * Vl : NULL;
        int target = targets[n];
        if (target < 0) {  // no loss, so no gradient either
            losses[n] = 0.0f;
            if (dx) memset(dx, 0, (size_t)Vl * sizeof(float));
            continue;
        }
        float m = max_over_shards(maxes, nmax, N, n), inv_sum = 1.0f / sums[2 * n];
        losses[n] = cross_entropy_loss(sums[2 * n + 1], m, sums[2 * n]);
        if (!dx) continue;
        int local = vocab_shard_index(target, v_lo, v_count);
        for (int i = 0; i < v_count; i++)
            dx[i] = cross_entropy_dlogit(expf_vectorizable(x[i] - m) * inv_sum, i == local, dloss);
        for (int i = v_count; i < Vl; i++) dx[i] = 0.0f;  // padded vocabulary
    }
}
