// ops_cuda.cu: the CUDA backend of ops.h. Matmuls go to cuBLAS; every other op is a kernel that
// maps CUDA threads onto the rows or elements of a tensor and calls the math in kernels.h, the
// same functions the CPU backend calls (and the CPU tests check). What is written here, and
// only here, is the thread mapping and step 2 of a row reduction (kernels.h, top comment): the
// combine of per-lane partials, done by a warp shuffle or a shared-memory tree.
//
// How each op is mapped (rows of N, columns of C):
//   matmuls               cublasSgemm (f32) / cublasGemmEx (bf16 in, f32 out): see the comment
//                         above matmul_forward for the row-major -> column-major argument mapping
//   matmul dbias,         a thread per (chunk of 32 rows, column) adds its chunk into a partial
//   layernorm dw, db      row, then a thread per column adds the partial rows in order: the sum
//   (whole rows and       has a fixed order (deterministic) yet uses N/32 times more threads than
//   shards of rows)       one thread per column would
//   embedding forward     a thread per output element
//   embedding backward    dwpe: a thread per (position, column) over the B sequences; dwte: the
//                         rows radix-sorted by token (CUB, stable), then a thread per (run of one
//                         token, column) adds the run's rows in row order. No atomics, and the
//                         CPU's order of adds: the same bits
//   layernorm forward,    a warp per row: 32 lanes, partials combined by warp shuffles
//   layernorm dinp
//   attention             tiled (FlashAttention-2's shape): a block of 4 warps holds 16 rows of
//                         one (sequence, head) in shared memory and walks tiles of 32 keys (or
//                         queries), a warp per row and a lane per tile row, with kernels.h's
//                         block functions; online softmax forward, keeping each row's
//                         log-sum-exp; backward recomputes the probabilities: one launch over
//                         query blocks (delta, then dq), one over key blocks (dk, dv)
//   cross-entropy         a block per row: partial max / sum of exponentials, combined by a
//                         shared-memory tree
//   elementwise, AdamW,   grid-stride loops, a thread per element
//   casts
//   sum_squares/values    a fixed grid of 1024 x 256 threads, each summing in double, then one
//                         block adds the 1024 partials: the same bits on every GPU and every run
//   init_normal           computed on the host (kernels.h's advice: then CPU and GPU initialise
//                         bit-identical weights) and copied, in chunks
//
// Streams. Every op runs on one stream (dev_stream(), created by ops_init), so ops are ordered
// among themselves without synchronising; the host waits only where it must read a result
// (copy_to_host, sum_*, dev_synchronize), and then for the ops stream alone, never the whole
// device (dev_on_wait says why). Memory is freed in stream order. Errors: every CUDA and
// cuBLAS call is checked and reported through fatal() with file, line and the library's error
// string; every kernel launch is checked with cudaGetLastError(). A kernel that fails while
// running is reported at the next synchronisation (run with CUDA_LAUNCH_BLOCKING=1 to have it
// reported at its own launch).
//
// Not thread-safe: ops are called from one host thread, like the CPU backend.
#include <cub/device/device_radix_sort.cuh>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

extern "C" {  // ops.h and log.h are C headers (no extern "C" of their own)
#include "base/device.h"
#include "base/log.h"
#include "ops.h"
#include "ops_peak.h"
}
#include "few_rows.h"
#include "flash_tiles.h"
#include "kernels.h"

// ----------------------------------------------------------------------------------------------
// error checking: file, line, the call, and the library's own words

#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)
#define CUBLAS_CHECK(call) cublas_check((call), #call, __FILE__, __LINE__)

static void cuda_check(cudaError_t e, const char *what, const char *file, int line) {
    if (e != cudaSuccess)
        fatal("%s:%d: %s: CUDA error %d: %s", file, line, what, (int)e, cudaGetErrorString(e));
}

static void cublas_check(cublasStatus_t s, const char *what, const char *file, int line) {
    if (s != CUBLAS_STATUS_SUCCESS)
        fatal("%s:%d: %s: cuBLAS error %d: %s", file, line, what, (int)s, cublasGetStatusString(s));
}

// Launches a kernel on the ops stream and checks the launch (bad configuration, no kernel image
// for this GPU, ...). Errors while the kernel runs surface at the next synchronisation.
#define LAUNCH(kernel, grid, block, smem, ...)                                                 \
    do {                                                                                       \
        kernel<<<(grid), (block), (smem), g.stream>>>(__VA_ARGS__);                            \
        cuda_check(cudaGetLastError(), "launch of " #kernel, __FILE__, __LINE__);              \
    } while (0)

// ----------------------------------------------------------------------------------------------
// backend state

// A cross-entropy target outside the vocabulary is found on the device; the kernel records one
// here (pinned host memory the GPU writes through a mapped pointer, with plain stores) and the
// host reports it at the next synchronisation, where it waits anyway (sum_values right after the
// loss, in the model). The CPU backend checks before the loop instead; the message is the same.
// row_target packs (row + 1, target) into one 64-bit word, written by one store, so the pair read
// back always belongs together; 0 means none.
typedef struct {
    unsigned long long row_target;
    int V;
} BadTarget;

static struct {
    int ready;
    int device, sm_count, cc_major, cc_minor, clock_khz;
    int smem_optin;                    // shared memory a block may have when its kernel asks
    char name[256];
    cudaStream_t stream;
    cublasHandle_t cublas;
    double *host_result;               // pinned: where sum_* results land
    double *dev_sums;                  // SUM_BLOCKS partials + the total
    volatile BadTarget *bad_host;      // pinned and mapped
    BadTarget *bad_dev;                // the device's pointer to the same memory
    void *scratch;                     // internal workspace (not counted by dev_bytes_*)
    size_t scratch_bytes;
} g;

static HalfFormat g_half = HALF_BF16;  // the 16-bit copies' format (ops_set_half_format)

// Kernels not yet measured on a GPU run only where the environment asks for them, so that the
// one measuring them can compare both paths and flip the default (docs/CUDA.md, "Kernels behind a
// switch"): OPS_CUDA_KERNELS=few_rows,flash_bf16 (a comma-separated list of names, or all).
enum { KERNEL_FEW_ROWS = 1, KERNEL_FLASH_BF16 = 2, KERNEL_BIAS_EPILOGUE = 4 };
static const struct {
    const char *name;
    unsigned bit;
} switched_kernels[] = {{"few_rows", KERNEL_FEW_ROWS}, {"flash_bf16", KERNEL_FLASH_BF16},
                        {"bias_epilogue", KERNEL_BIAS_EPILOGUE}};
static unsigned g_switched;  // the bits of the kernels switched on

static unsigned switched_kernel_bit(const char *name, size_t len, const char *value) {
    if (len == 3 && strncmp(name, "all", 3) == 0) return ~0u;
    for (size_t i = 0; i < sizeof switched_kernels / sizeof switched_kernels[0]; i++)
        if (strlen(switched_kernels[i].name) == len && strncmp(name, switched_kernels[i].name, len) == 0)
            return switched_kernels[i].bit;
    fatal("environment variable OPS_CUDA_KERNELS is '%s': expected a comma-separated list of "
          "few_rows, flash_bf16 and bias_epilogue, or all; found '%.*s'", value, (int)len, name);
    return 0;
}

static unsigned switched_kernels_from_env(void) {
    const char *value = getenv("OPS_CUDA_KERNELS");
    unsigned bits = 0;
    for (const char *p = value; p && *p;) {
        size_t len = strcspn(p, ",");
        bits |= switched_kernel_bit(p, len, value);
        p += len + (p[len] == ',');
    }
    return bits;
}

#define THREADS 256  // block size of the element-wise and column kernels

// the local rank from the launcher's environment (Open MPI, Slurm, torchrun-style), else 0
static int local_rank(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (!v || !*v) continue;
        char *end;
        errno = 0;
        long r = strtol(v, &end, 10);
        if (errno || *end || r < 0 || r > 1000000)
            fatal("environment variable %s is '%s': expected a local rank (a number >= 0)", vars[i], v);
        return (int)r;
    }
    return 0;
}

static __global__ void probe_kernel(int *x) {
    if (x) *x = 0;
}

void ops_init(void) {
    if (g.ready) return;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
        fatal("no CUDA device: %s%s. This is the CUDA build (BACKEND=cuda); on a machine without "
              "an NVIDIA GPU, build and run the CPU one: make BACKEND=cpu",
              e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none",
              e == cudaErrorInsufficientDriver ? " (no NVIDIA driver is loaded, or it is older than "
                                                 "the CUDA runtime this binary was built with)" : "");
    int local = local_rank();
    g.device = local % count;
    CUDA_CHECK(cudaSetDevice(g.device));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, g.device));
    snprintf(g.name, sizeof g.name, "%s", prop.name);
    g.sm_count = prop.multiProcessorCount;
    g.cc_major = prop.major;
    g.cc_minor = prop.minor;
    g.smem_optin = (int)prop.sharedMemPerBlockOptin;
    g_switched = switched_kernels_from_env();
    if (cudaDeviceGetAttribute(&g.clock_khz, cudaDevAttrClockRate, g.device) != cudaSuccess)
        g.clock_khz = 0;
    (void)cudaGetLastError();  // the attribute query is optional: forget its error, if any

    // A GPU whose architecture this binary has no code for fails at the first kernel launch with
    // "no kernel image is available"; find that out now and say what to do about it.
    cudaFuncAttributes attr;
    e = cudaFuncGetAttributes(&attr, probe_kernel);
    if (e != cudaSuccess)
        fatal("CUDA device %d (%s, compute capability %d.%d) cannot run this build's kernels: %s. "
              "Rebuild for it: make BACKEND=cuda CUDA_ARCHS=\"%d%d\"",
              g.device, g.name, g.cc_major, g.cc_minor, cudaGetErrorString(e), g.cc_major, g.cc_minor);

    // A blocking stream (not cudaStreamNonBlocking): it also stays ordered with the legacy
    // default stream, so a stray cudaMemcpy elsewhere cannot race with the ops.
    CUDA_CHECK(cudaStreamCreate(&g.stream));
    CUBLAS_CHECK(cublasCreate(&g.cublas));
    CUBLAS_CHECK(cublasSetStream(g.cublas, g.stream));
    // CUBLAS_DEFAULT_MATH: f32 matmuls in full f32, no TF32 (TF32 keeps 10 mantissa bits, which
    // would break the CPU-equivalence tolerances of the f32 stages)
    CUBLAS_CHECK(cublasSetMathMode(g.cublas, CUBLAS_DEFAULT_MATH));

    CUDA_CHECK(cudaMallocHost((void **)&g.host_result, sizeof(double)));
    BadTarget *bad;
    CUDA_CHECK(cudaHostAlloc((void **)&bad, sizeof(BadTarget), cudaHostAllocMapped));
    memset(bad, 0, sizeof *bad);
    g.bad_host = bad;
    CUDA_CHECK(cudaHostGetDevicePointer((void **)&g.bad_dev, bad, 0));
    g.ready = 1;
}

static void ensure_init(void) {
    if (!g.ready) ops_init();
}

// Waits for the ops stream, then reports what the device found wrong in the meantime.
static void check_device_errors(void) {
    unsigned long long rt = g.bad_host->row_target;
    if (rt)
        fatal("cross-entropy: target %d of row %d is outside the vocabulary of %d tokens",
              (int)(unsigned)(rt & 0xffffffffu), (int)(rt >> 32) - 1, g.bad_host->V);
}

static void (*g_wait_check)(void);  // dev_on_wait's check, NULL until a comm layer sets one

void dev_on_wait(void (*check)(void)) { g_wait_check = check; }

// Waits for the ops stream, and with it for every collective the stream was made to wait for.
// Polled rather than cudaStreamSynchronize so that the comm layer's check runs while we wait: a
// collective that never finishes would otherwise hang the host here.
static void sync_stream(void) {
    struct timespec nap = {0, 20000};
    for (long polls = 0;; polls++) {
        cudaError_t e = cudaStreamQuery(g.stream);
        if (g_wait_check) g_wait_check();
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) cuda_check(e, "cudaStreamQuery", __FILE__, __LINE__);
        if (polls > 100) nanosleep(&nap, NULL);
    }
    check_device_errors();
}

const char *ops_backend_name(void) { return "cuda"; }

// "cuBLAS 13.0.2"
static void describe_cublas(char *out, size_t size) {
    int major = 0, minor = 0, patch = 0;
    CUBLAS_CHECK(cublasGetProperty(MAJOR_VERSION, &major));
    CUBLAS_CHECK(cublasGetProperty(MINOR_VERSION, &minor));
    CUBLAS_CHECK(cublasGetProperty(PATCH_LEVEL, &patch));
    snprintf(out, size, "cuBLAS %d.%d.%d", major, minor, patch);
}

static int g_tf32;  // ops_set_tf32

// written at each call: ops_set_tf32 may change it
const char *ops_matmul_engine(void) {
    static char text[400];
    ensure_init();
    char cublas[64];
    describe_cublas(cublas, sizeof cublas);
    sentence_printf(text, sizeof text, "%s SGEMM (%s) on %s (sm_%d%d, %d SMs, GPU %d)%s", cublas,
                    g_tf32 ? "f32 in TF32 on the tensor cores: inputs rounded to 10 mantissa bits" : "f32, no TF32",
                    g.name, g.cc_major, g.cc_minor, g.sm_count, g.device,
                    g_switched & KERNEL_FEW_ROWS ? ", up to 16 rows by the few-rows kernel" : "");
    return text;
}

void ops_set_tf32(int on) {
    ensure_init();
    if (on && g.cc_major < 8)
        fatal("tf32: %s (compute capability %d.%d) has no TF32 tensor cores (compute capability 8.0 on)",
              g.name, g.cc_major, g.cc_minor);
    CUBLAS_CHECK(cublasSetMathMode(g.cublas, on ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    g_tf32 = on;
}

const char *ops_matmul_engine_16(void) {
    static char text[500];
    if (!text[0]) {
        ensure_init();
        char cublas[64];
        describe_cublas(cublas, sizeof cublas);
        if (g_half == HALF_FP16)
            sentence_printf(text, sizeof text, "%s GemmEx (fp16 in, f32 accumulation) on the tensor "
                            "cores of %s (sm_%d%d, %d SMs, GPU %d)", cublas, g.name, g.cc_major,
                            g.cc_minor, g.sm_count, g.device);
        else if (ops_bf16_native())
            sentence_printf(text, sizeof text, "%s GemmEx (bf16 in, f32 accumulation) on the tensor "
                            "cores of %s (sm_%d%d, %d SMs, GPU %d)", cublas, g.name, g.cc_major,
                            g.cc_minor, g.sm_count, g.device);
        else
            sentence_printf(text, sizeof text, "bf16 widened to f32 (sm_%d%d has no bf16 tensor "
                            "cores): %s", g.cc_major, g.cc_minor, ops_matmul_engine());
    }
    return text;
}

// MFU's peak is derived from the device: SMs x FLOPs per clock per SM x the clock the device
// reports (cudaDevAttrClockRate: the maximum boost clock). Unlike a CPU's, a GPU's per-SM rate is
// fixed by its compute capability and published, and the device tells its SM count and clock, so
// this is the data-sheet peak, the usual denominator of MFU on GPUs. (The CPU backend measures
// instead, because there none of the three can be read off the machine: see ops_cpu.c.)
//
// FLOPs per clock per SM, from NVIDIA's data sheets and architecture whitepapers (each row's
// example multiplies back to the data sheet's figure) and the CUDA C++ Programming Guide's
// arithmetic-instruction throughput table (FP32 lanes per SM):
//   fp32: FP32 lanes x 2 (an FMA is two FLOPs). The f32 matmuls run as SGEMM on these lanes (TF32
//         is off, see ops_init), so the FP32 peak is their fair denominator.
//   bf16: dense bf16 tensor-core FLOPs with f32 accumulation (0: no bf16 tensor cores).
// A device missing from the table gets the nearest older row, and its sentence says so.
// GeForce cards run bf16 with f32 accumulation at half the rate of the same chip in a data-centre
// or workstation card (RTX 3090: 82 x 512 x 1.695 GHz = 71 TFLOP/s; RTX 4090: 128 x 512 x
// 2.52 GHz = 165; RTX 5090: 170 x 512 x 2.41 GHz = 209.5), so theirs is halved.
typedef struct {
    int major, minor, fp32, bf16;
} SmThroughput;
static const SmThroughput k_sm_throughput[] = {
    {7, 0, 128, 0},      // V100: 80 SMs x 128 x 1.53 GHz = 15.7 TFLOP/s f32
    {7, 5, 128, 0},      // T4: 40 x 128 x 1.59 GHz = 8.1 f32
    {8, 0, 128, 2048},   // A100: 108 x 2048 x 1.41 GHz = 312 bf16; f32 19.5
    {8, 6, 256, 1024},   // A40: 84 x 1024 x 1.74 GHz = 150 bf16; f32 37.4 (A10, RTX 30)
    {8, 9, 256, 1024},   // L40S: 142 x 1024 x 2.52 GHz = 366 bf16 (data sheet: 362); f32 91.6 (L4)
    {9, 0, 256, 4096},   // H100 SXM: 132 x 4096 x 1.83 GHz = 989 bf16; f32 66.9 at 1.98 GHz (H200)
    {10, 0, 256, 8192},  // B200: 148 x 8192 x 1.86 GHz = 2250 bf16 (twice Hopper's per SM)
    {12, 0, 256, 1024},  // RTX PRO 6000 Blackwell: 188 x 1024 x 2.62 GHz = 504 bf16 (RTX 50)
};

// this device's row: its own, else the nearest older one
static const SmThroughput *sm_throughput(int major, int minor) {
    const SmThroughput *row = &k_sm_throughput[0];
    for (size_t i = 0; i < sizeof k_sm_throughput / sizeof k_sm_throughput[0]; i++) {
        const SmThroughput *r = &k_sm_throughput[i];
        if (r->major < major || (r->major == major && r->minor <= minor)) row = r;
    }
    return row;
}

static PeakFlops g_peak[2];  // f32, bf16

// The finder for peak_flops_once (ops_peak.h): f32 (bf16 == 0) or bf16 inputs.
static void derive_peak(PeakFlops *peak, int bf16) {
    ensure_init();
    if (bf16 && !ops_bf16_native()) {
        peak_of_widened_bf16(peak, peak_flops_once(g_peak, 0, derive_peak),
                             "this GPU has no bf16 tensor cores and bf16 matmuls are widened to f32");
        return;
    }
    const SmThroughput *row = sm_throughput(g.cc_major, g.cc_minor);
    int per_clock = bf16 ? row->bf16 : row->fp32;
    int geforce = bf16 && strstr(g.name, "GeForce") != NULL;
    if (geforce) per_clock /= 2;
    double clock_hz = g.clock_khz > 0 ? g.clock_khz * 1e3 : 1.5e9;
    peak->flops = (double)g.sm_count * per_clock * clock_hz;

    char table[96] = "";
    if (row->major != g.cc_major || row->minor != g.cc_minor)
        snprintf(table, sizeof table, "; sm_%d%d is not in the table: sm_%d%d's figure",
                 g.cc_major, g.cc_minor, row->major, row->minor);
    sentence_printf(peak->source, sizeof peak->source,
                    "derived: %d SMs x %d FLOP/clock/SM (%s%s%s) x %.2f GHz (%s) on %s",
                    g.sm_count, per_clock, bf16 ? "dense bf16 tensor cores" : "FP32 lanes x 2",
                    geforce ? ", halved on GeForce" : "", table, clock_hz / 1e9,
                    g.clock_khz > 0 ? "its boost clock" : "assumed: the device reports none",
                    g.name);
}

double ops_peak_flops(int bf16) { return peak_flops_once(g_peak, bf16, derive_peak)->flops; }

const char *ops_peak_flops_source(int bf16) {
    return peak_flops_once(g_peak, bf16, derive_peak)->source;
}

int ops_bf16_native(void) {
    ensure_init();
    return g.cc_major >= 8;  // bf16 tensor cores from Ampere (sm_80) on
}

void *dev_stream(void) {
    ensure_init();
    return (void *)g.stream;
}

// ----------------------------------------------------------------------------------------------
// memory, from CUDA's stream-ordered allocator (cudaMallocAsync/cudaFreeAsync on the ops stream):
// a block is freed after the ops queued before the free, with no device-wide synchronisation,
// which would wait for every collective in flight on the communication streams (and deadlock
// if a peer were waiting for this rank). A collective's buffers are freed only after comm_wait,
// which orders the ops stream after the collective. A table remembers each block's size.

typedef struct {
    void *ptr;
    size_t bytes;
} Allocation;

static Allocation *g_allocs = NULL;
static size_t g_nallocs = 0, g_allocs_cap = 0;
static size_t g_bytes_in_use = 0, g_bytes_peak = 0;

static void *device_alloc_or_die(size_t bytes, const char *what) {
    void *p = NULL;
    cudaError_t e = cudaMallocAsync(&p, bytes ? bytes : 1, g.stream);
    if (e != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        (void)cudaGetLastError();
        if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) free_b = total_b = 0;
        fatal("out of GPU memory: %s of %zu bytes failed on GPU %d (%s): %s; dev_malloc holds %zu "
              "bytes, the device has %zu of %zu bytes free",
              what, bytes, g.device, g.name, cudaGetErrorString(e), g_bytes_in_use, free_b, total_b);
    }
    return p;
}

void *dev_malloc(size_t bytes) {
    ensure_init();
    void *p = device_alloc_or_die(bytes, "dev_malloc");
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g.stream));
    if (g_nallocs == g_allocs_cap) {
        g_allocs_cap = g_allocs_cap ? 2 * g_allocs_cap : 256;
        Allocation *grown = (Allocation *)realloc(g_allocs, g_allocs_cap * sizeof(Allocation));
        if (!grown) fatal("out of host memory for the dev_malloc table");
        g_allocs = grown;
    }
    g_allocs[g_nallocs].ptr = p;
    g_allocs[g_nallocs].bytes = bytes;
    g_nallocs++;
    g_bytes_in_use += bytes;
    if (g_bytes_in_use > g_bytes_peak) g_bytes_peak = g_bytes_in_use;
    return p;
}

void dev_free(void *ptr) {
    if (!ptr) return;
    size_t i = 0;
    while (i < g_nallocs && g_allocs[i].ptr != ptr) i++;
    if (i == g_nallocs) fatal("dev_free: %p was not allocated by dev_malloc (or was freed twice)", ptr);
    CUDA_CHECK(cudaFreeAsync(ptr, g.stream));
    g_bytes_in_use -= g_allocs[i].bytes;
    g_allocs[i] = g_allocs[--g_nallocs];
}

// A workspace the ops use internally (partial sums, bf16 -> f32 copies). It only grows; the ops
// are stream-ordered, so one op's use is finished before the next op's kernels start. A CUDA graph
// replays its kernels on the addresses it was recorded with, so while a graph exists an outgrown
// block is kept (retired) and freed only when the last graph goes.
static struct {
    void *blocks[64];  // the workspace doubles each time: 64 growths cannot happen
    int n;
} g_retired;
static int g_graphs_alive, g_capturing;

static void retire_or_free(void *block) {
    if (g_graphs_alive == 0) {
        CUDA_CHECK(cudaFreeAsync(block, g.stream));
        return;
    }
    if (g_retired.n == (int)(sizeof g_retired.blocks / sizeof g_retired.blocks[0]))
        fatal("the ops' workspace grew %d times while CUDA graphs exist", g_retired.n);
    g_retired.blocks[g_retired.n++] = block;
}

static void *scratch(size_t bytes) {
    if (bytes > g.scratch_bytes) {
        // allocating is not allowed while a graph is recorded; the step being recorded has run
        // once without recording first (kv_decode does), which sized the workspace
        if (g_capturing)
            fatal("the ops' workspace must grow from %zu to %zu bytes while a CUDA graph is "
                  "recorded: run the recorded step once without recording first",
                  g.scratch_bytes, bytes);
        if (g.scratch) retire_or_free(g.scratch);
        size_t want = bytes > 2 * g.scratch_bytes ? bytes : 2 * g.scratch_bytes;
        g.scratch = device_alloc_or_die(want, "the ops' workspace");
        g.scratch_bytes = want;
    }
    return g.scratch;
}

void dev_zero(void *ptr, size_t bytes) {
    if (!bytes) return;
    ensure_init();
    CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, g.stream));
}

void dev_copy(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    ensure_init();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g.stream));
}

// Both host copies return only when the copy is complete, so the caller may reuse or free its
// host buffer at once (and read what it copied to the host). A copy from pageable host memory
// waits for the stream anyway, so the synchronisation costs nothing extra.
void copy_to_device(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    ensure_init();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.stream));
    sync_stream();
}

void copy_to_host(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    ensure_init();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g.stream));
    sync_stream();
}

void dev_synchronize(void) {
    ensure_init();
    sync_stream();
}

double dev_busy_seconds(void) { return wall_seconds(); }

size_t dev_bytes_in_use(void) { return g_bytes_in_use; }
size_t dev_bytes_peak(void) { return g_bytes_peak; }

// cudaFreeAsync gives memory back to the stream-ordered allocator's pool, not to the device:
// trimmed, the pool's unused memory counts as free again
size_t dev_free_bytes(void) {
    ensure_init();
    sync_stream();
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetMemPool(&pool, g.device));
    CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return free_b;
}

// Marks are timed events. Their times come from cudaEventElapsedTime against an anchor event
// that the host saw the device pass (the stream drained, so the anchor's time is the host
// clock's reading just after it): one host/GPU clock pairing per trace, drift over a few steps
// being far below the microseconds the trace shows. The events are kept for the next trace.
static struct {
    cudaEvent_t *events, anchor;
    int n, cap;
    double anchor_seconds;  // < 0: no anchor yet since the last clear
} g_marks = {NULL, NULL, 0, 0, -1};

static void anchor_marks(void) {
    if (!g_marks.anchor) CUDA_CHECK(cudaEventCreate(&g_marks.anchor));
    sync_stream();  // (with the comm layer's check: a hung collective cannot hang this)
    CUDA_CHECK(cudaEventRecord(g_marks.anchor, g.stream));
    CUDA_CHECK(cudaEventSynchronize(g_marks.anchor));
    g_marks.anchor_seconds = wall_seconds();
}

int dev_mark_stream(void *stream) {
    ensure_init();
    if (g_marks.anchor_seconds < 0) anchor_marks();
    if (g_marks.n == g_marks.cap) {
        int cap = g_marks.cap ? 2 * g_marks.cap : 1024;
        g_marks.events = (cudaEvent_t *)realloc(g_marks.events, (size_t)cap * sizeof(cudaEvent_t));
        if (!g_marks.events) fatal("out of memory for %d trace marks; lower trace_steps", cap);
        for (int i = g_marks.cap; i < cap; i++) CUDA_CHECK(cudaEventCreate(&g_marks.events[i]));
        g_marks.cap = cap;
    }
    CUDA_CHECK(cudaEventRecord(g_marks.events[g_marks.n], (cudaStream_t)stream));
    return g_marks.n++;
}

int dev_mark(void) {
    ensure_init();
    return dev_mark_stream(g.stream);
}

double dev_mark_seconds(int mark) {
    float ms = 0;
    CUDA_CHECK(cudaEventSynchronize(g_marks.events[mark]));
    CUDA_CHECK(cudaEventElapsedTime(&ms, g_marks.anchor, g_marks.events[mark]));
    return g_marks.anchor_seconds + ms / 1e3;
}

void dev_marks_clear(void) {
    g_marks.n = 0;
    g_marks.anchor_seconds = -1;
}

// ----------------------------------------------------------------------------------------------
// launch geometry and the combine step of row reductions

// blocks for a grid-stride loop over n elements: enough to fill the GPU, no more
static unsigned grid_for(size_t n) {
    size_t blocks = (n + THREADS - 1) / THREADS, cap = (size_t)g.sm_count * 8;
    if (blocks > cap) blocks = cap;
    return blocks ? (unsigned)blocks : 1u;
}

static unsigned blocks_for(size_t threads, unsigned per_block) {
    return (unsigned)((threads + per_block - 1) / per_block);
}

#define GRID_STRIDE(i, n)                                                                      \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n);                    \
         i += (size_t)gridDim.x * blockDim.x)

struct SumOp {
    template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Butterfly over the 32 lanes of a warp (every lane must call it): each step adds the value of
// the lane `offset` away. a + b = b + a exactly, so all 32 lanes end with the same bits.
template <typename T, typename Op> __device__ T warp_reduce(T v, Op op) {
    for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Every thread of the block must call it (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. Each warp combines its lanes, warp leaders leave their values in
// shared memory, then every warp combines those, in the same order.
template <typename T, typename Op> __device__ T block_reduce(T v, T identity, Op op) {
    __shared__ T partial[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    v = warp_reduce(v, op);
    __syncthreads();  // a previous call's readers are done with partial[]
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < nwarps ? partial[lane] : identity;
    return warp_reduce(v, op);
}

// ----------------------------------------------------------------------------------------------
// initialisation

// Host threads fill the chunk: kernels.h's rng_normal compiled for the host, so the values are
// the CPU backend's, bit for bit (the integer hash is exact everywhere; log/cos come from the
// same libm).
typedef struct {
    float *out;
    size_t n;
    uint64_t seed, stream, first;
    float std;
} NormalJob;

static void *normal_job(void *arg) {
    NormalJob *j = (NormalJob *)arg;
    for (size_t i = 0; i < j->n; i++) j->out[i] = j->std * rng_normal(j->seed, j->stream, j->first + i);
    return NULL;
}

static void fill_normal_host(float *out, size_t n, uint64_t seed, uint64_t stream, uint64_t first,
                             float std) {
    const int max_threads = 16;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int nthreads = 1;
    if (n >= ((size_t)1 << 16) && cpus > 1) nthreads = cpus > max_threads ? max_threads : (int)cpus;
    NormalJob jobs[16];
    pthread_t threads[16];
    int started[16] = {0};
    for (int k = 0; k < nthreads; k++) {
        size_t lo = n * k / nthreads, hi = n * (k + 1) / nthreads;
        jobs[k].out = out + lo;
        jobs[k].n = hi - lo;
        jobs[k].seed = seed;
        jobs[k].stream = stream;
        jobs[k].first = first + lo;
        jobs[k].std = std;
        started[k] = k > 0 && pthread_create(&threads[k], NULL, normal_job, &jobs[k]) == 0;
        if (k > 0 && !started[k]) normal_job(&jobs[k]);  // no thread: do it here
    }
    normal_job(&jobs[0]);
    for (int k = 1; k < nthreads; k++)
        if (started[k]) pthread_join(threads[k], NULL);
}

void init_normal(float *out, size_t n, uint64_t seed, uint64_t stream, uint64_t first, float std) {
    if (!n) return;
    ensure_init();
    const size_t chunk = (size_t)1 << 22;  // 16 MB of floats at a time
    size_t len0 = n < chunk ? n : chunk;
    float *host = (float *)malloc_or_die(len0 * sizeof(float));
    for (size_t done = 0; done < n;) {
        size_t len = n - done < chunk ? n - done : chunk;
        fill_normal_host(host, len, seed, stream, first + done, std);
        copy_to_device(out + done, host, len * sizeof(float));
        done += len;
    }
    free(host);
}

static __global__ void fill_kernel(float *out, size_t n, float value) {
    GRID_STRIDE(i, n) out[i] = value;
}

void fill_constant(float *out, size_t n, float value) {
    if (!n) return;
    ensure_init();
    LAUNCH(fill_kernel, grid_for(n), THREADS, 0, out, n, value);
}

// ----------------------------------------------------------------------------------------------
// matmuls
//
// cuBLAS is column-major: it sees a row-major (R, K) matrix as a column-major (K, R) one, its
// transpose, with leading dimension K. So every row-major product Y = A @ B is handed over as
// Y^T = B^T @ A^T, the operands in swapped order, each already stored "as its transpose":
//
// forward  out (N, OC) = inp (N, C) @ W^T:   out^T (OC, N) = W (OC, C) @ inp^T (C, N)
//   cuBLAS C = out^T: m = OC, n = N, ldc = OC
//   cuBLAS A = W: stored column-major as W^T (C, OC), lda = C; we need W itself: transa = T, k = C
//   cuBLAS B = inp^T: stored column-major as inp^T (C, N), ldb = C; used as is: transb = N
// dinp (N, C) += dout (N, OC) @ W (OC, C):   dinp^T (C, N) += W^T (C, OC) @ dout^T (OC, N)
//   m = C, n = N, k = OC; A = W stored as W^T (C, OC), lda = C, transa = N;
//   B = dout stored as dout^T (OC, N), ldb = OC, transb = N; C = dinp^T, ldc = C; beta = 1
// dW (OC, C) += dout^T (OC, N) @ inp (N, C): dW^T (C, OC) += inp^T (C, N) @ dout (N, OC)
//   m = C, n = OC, k = N; A = inp stored as inp^T (C, N), lda = C, transa = N;
//   B = dout stored as dout^T (OC, N), ldb = OC, we need dout: transb = T; C = dW^T, ldc = C
// (llm.c's matmul_forward/backward make the same calls.) beta = 1 is how backward ADDs into the
// gradients. The bias: its rows are written into out first and the product added with beta = 1.

static const float ONE = 1.0f, ZERO = 0.0f;
// a weight gradient's product: beta 1 adds to dweight, beta 0 writes it (never reading it)
static const float *grad_beta(GradMode grads) { return grads == GRAD_WRITE ? &ZERO : &ONE; }

// out (N, OC): every row = bias
static __global__ void bias_rows_kernel(float *out, const float *bias, size_t N, size_t OC) {
    GRID_STRIDE(i, N * OC) out[i] = bias[i % OC];
}

// dbias (OC) += column sums of dout (N, OC), as kernels.h's column_sums, in two deterministic
// steps: a thread per (chunk of ROWS_PER_CHUNK rows, column) sums its chunk into a partial row,
// then a thread per column adds the partial rows in order. One thread per column alone would
// leave the GPU nearly idle (OC threads, each walking all N rows).
#define ROWS_PER_CHUNK 32

static __global__ void column_sums_chunks_kernel(float *partial, const float *dout, int N, int OC) {
    int nchunks = (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)nchunks * OC) return;
    int chunk = (int)(i / OC), c = (int)(i % OC);
    int n0 = chunk * ROWS_PER_CHUNK, rows = N - n0 < ROWS_PER_CHUNK ? N - n0 : ROWS_PER_CHUNK;
    column_sums(partial + (size_t)chunk * OC, dout + (size_t)n0 * OC, rows, OC, c, c + 1);
}

static __global__ void column_sums_kernel(float *dbias, const float *rows, int nrows, int OC) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < OC) column_sums(dbias, rows, nrows, OC, c, c + 1);
}

// GRAD_WRITE zeroes dbias first (OC floats, not a pass over the gradients): the same sums
static void bias_backward(float *dbias, const float *dout, int N, int OC, GradMode grads) {
    if (!dbias || N <= 0 || OC <= 0) return;
    if (grads == GRAD_WRITE) CUDA_CHECK(cudaMemsetAsync(dbias, 0, (size_t)OC * sizeof(float), g.stream));
    int nchunks = (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    size_t bytes = (size_t)nchunks * OC * sizeof(float);
    float *partial = (float *)scratch(bytes);
    CUDA_CHECK(cudaMemsetAsync(partial, 0, bytes, g.stream));
    LAUNCH(column_sums_chunks_kernel, blocks_for((size_t)nchunks * OC, THREADS), THREADS, 0,
           partial, dout, N, OC);
    LAUNCH(column_sums_kernel, blocks_for((size_t)OC, THREADS), THREADS, 0, dbias, partial, nchunks, OC);
}

// A decode step's few rows (OPS_CUDA_KERNELS=few_rows): few_rows.h's order, the CPU's, so the
// GPU decodes to the CPU's bits. A half-warp per weight row (two rows a warp), each lane summing
// its columns for up to FEW_ROWS_PASS input rows a pass, so each weight is read once a pass; the
// lanes combine by shuffles within their half (width 16), every lane of the warp taking part, the
// lanes of a row past OC too (they read row OC - 1 and store nothing).
#define FEW_ROWS_MAX 16     // input rows this path takes (the CPU's limit too); past it, cuBLAS
#define FEW_ROWS_THREADS 128

template <int IS_BF16>
static __global__ void few_rows_kernel(float *out, const void *x, const void *weight, const float *bias, int N,
                                       int C, int OC) {
    int lane = threadIdx.x % FEW_ROWS_LANES;
    int o = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / FEW_ROWS_LANES);
    int row = o < OC ? o : OC - 1;
    for (int n0 = 0; n0 < N; n0 += FEW_ROWS_PASS) {
        int rows = N - n0 < FEW_ROWS_PASS ? N - n0 : FEW_ROWS_PASS;
        float acc[FEW_ROWS_PASS];
        if (IS_BF16)
            few_rows_lane_bf16(acc, (const uint16_t *)weight + (size_t)row * C,
                               (const uint16_t *)x + (size_t)n0 * C, (size_t)C, rows, C, lane);
        else
            few_rows_lane_f32(acc, (const float *)weight + (size_t)row * C, (const float *)x + (size_t)n0 * C,
                              (size_t)C, rows, C, lane);
        for (int width = FEW_ROWS_LANES / 2; width > 0; width /= 2)
#pragma unroll
            for (int r = 0; r < FEW_ROWS_PASS; r++)
                acc[r] += __shfl_down_sync(0xffffffffu, acc[r], width, FEW_ROWS_LANES);
        if (lane == 0 && o < OC)
            for (int r = 0; r < rows; r++) out[(size_t)(n0 + r) * OC + o] = acc[r] + (bias ? bias[o] : 0.0f);
    }
}

// 1 when the few-rows kernel did the product
static int few_rows_matmul(float *out, const void *x, const void *weight, int is_bf16, const float *bias, int N,
                           int C, int OC) {
    if (!(g_switched & KERNEL_FEW_ROWS) || N > FEW_ROWS_MAX) return 0;
    unsigned blocks = blocks_for((size_t)OC * FEW_ROWS_LANES, FEW_ROWS_THREADS);
    if (is_bf16) LAUNCH(few_rows_kernel<1>, blocks, FEW_ROWS_THREADS, 0, out, x, weight, bias, N, C, OC);
    else LAUNCH(few_rows_kernel<0>, blocks, FEW_ROWS_THREADS, 0, out, x, weight, bias, N, C, OC);
    return 1;
}

void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
                    int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    ensure_init();
    if (few_rows_matmul(out, inp, weight, 0, bias, N, C, OC)) return;
    const float *beta = &ZERO;  // beta = 0: out's old contents are never read
    if (bias) {
        LAUNCH(bias_rows_kernel, grid_for((size_t)N * OC), THREADS, 0, out, bias, (size_t)N, (size_t)OC);
        beta = &ONE;
    }
    CUBLAS_CHECK(cublasSgemm(g.cublas, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &ONE, weight, C, inp, C,
                             beta, out, OC));
}

// dweight and dbias in one cuBLASLt matmul (OPS_CUDA_KERNELS=bias_epilogue): the dweight product
// above, dW^T (C, OC) += inp^T (C, N) dout (N, OC), with CUBLASLT_EPILOGUE_BGRADB, which sums B
// (dout) over the product's k dimension (the N rows) into a vector of D's OC columns: dbias's
// column sums without a pass of their own. The epilogue writes the vector (it does not add), so
// it lands in scratch and is added to dbias (or copied, GRAD_WRITE). Returns 0, and nothing is computed, where cuBLASLt
// offers no algorithm for it (the types, the GPU): the caller takes the two-pass path.
#define LT_WORKSPACE ((size_t)32 << 20)

// the cuBLASLt handle and its workspace (LT_WORKSPACE bytes), made on first use
static cublasLtHandle_t lt_handle(void **workspace) {
    static cublasLtHandle_t lt;
    static void *space;
    if (!lt) {
        CUBLAS_CHECK(cublasLtCreate(&lt));
        CUDA_CHECK(cudaMalloc(&space, LT_WORKSPACE));
    }
    *workspace = space;
    return lt;
}

// the algorithm cuBLASLt's heuristic puts first for op on these layouts within LT_WORKSPACE; 0 where
// it offers none (the types, the GPU)
static int lt_algorithm(cublasLtHandle_t lt, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                        cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulPreference_t pref;
    size_t ws = LT_WORKSPACE;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t found;
    int count = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, c, c, pref, 1, &found, &count);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (s != CUBLAS_STATUS_SUCCESS || count == 0) return 0;
    *algo = found.algo;
    return 1;
}

static void lt_destroy(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                       cublasLtMatrixLayout_t c) {
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(a));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(c));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(op));
}

static int dweight_with_bias_grad(float *dweight, float *dbias, const void *inp, const void *dout, cudaDataType_t t,
                                  int N, int C, int OC, GradMode grads) {
    void *workspace;
    cublasLtHandle_t lt = lt_handle(&workspace);
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_T;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BGRADB;
    float *column_sums = (float *)scratch((size_t)OC * sizeof(float));
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &column_sums,
                                                sizeof column_sums));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, t, C, N, C));    // inp^T: C x N, column-major
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, t, OC, N, OC));  // dout^T as stored; op T makes it N x OC
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, C, OC, C));
    cublasLtMatmulAlgo_t algo;
    int ran = lt_algorithm(lt, op, a, b, c, &algo);
    static int told[2];  // whoever measures the switch must know when it did nothing: once per type
    if (!ran && !told[t != CUDA_R_32F]++)
        fprintf(stderr, "note: OPS_CUDA_KERNELS=bias_epilogue: cuBLASLt offers no BGRADB algorithm for %s "
                "inputs on this GPU; their bias gradients take the two-pass path\n", t == CUDA_R_32F ? "f32" : "16-bit");
    if (ran) {
        CUBLAS_CHECK(cublasLtMatmul(lt, op, &ONE, inp, a, dout, b, grad_beta(grads), dweight, c, dweight, c, &algo,
                                    workspace, LT_WORKSPACE, g.stream));
        if (grads == GRAD_WRITE) dev_copy(dbias, column_sums, (size_t)OC * sizeof(float));
        else add_inplace(dbias, column_sums, (size_t)OC);
    }
    lt_destroy(op, a, b, c);
    return ran;
}

// 1 when dweight and dbias were computed together (bias_epilogue switched on, both wanted, cuBLASLt willing)
static int fused_bias_grad(float *dweight, float *dbias, const void *inp, const void *dout, cudaDataType_t t, int N,
                           int C, int OC, GradMode grads) {
    return (g_switched & KERNEL_BIAS_EPILOGUE) && dweight && dbias &&
           dweight_with_bias_grad(dweight, dbias, inp, dout, t, N, C, OC, grads);
}

void matmul_backward_mode(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                          const float *weight, int N, int C, int OC, GradMode grads) {
    if (N <= 0 || OC <= 0 || C <= 0) return;
    ensure_init();
    if (dinp)
        CUBLAS_CHECK(cublasSgemm(g.cublas, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &ONE, weight, C, dout,
                                 OC, &ONE, dinp, C));
    if (fused_bias_grad(dweight, dbias, inp, dout, CUDA_R_32F, N, C, OC, grads)) return;
    if (dweight)
        CUBLAS_CHECK(cublasSgemm(g.cublas, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &ONE, inp, C, dout,
                                 OC, grad_beta(grads), dweight, C));
    bias_backward(dbias, dout, N, OC, grads);
}

// ----------------------------------------------------------------------------------------------
// the 16-bit copies: bf16, or fp16 (precision 16-mixed). The gradient casts count what they flush
// to zero into two device counters (integer atomics: the counts do not depend on the order).

static unsigned long long *g_underflow;  // device: nonzero values cast, and those flushed to zero

void ops_set_half_format(HalfFormat format) { g_half = format; }
HalfFormat ops_half_format(void) { return g_half; }

static __global__ void cast_to_bf16_kernel(half16 *out, const float *in, size_t n, int fp16) {
    GRID_STRIDE(i, n) out[i] = half_from_float(in[i], fp16);
}

static __global__ void cast_to_float_kernel(float *out, const half16 *in, size_t n, int fp16) {
    GRID_STRIDE(i, n) out[i] = half_to_float(in[i], fp16);
}

// a thread's counts into ops_half_underflow's, with one integer atomic each (order-independent)
static __device__ void add_half_underflow(unsigned long long *counts, unsigned long long nonzero,
                                          unsigned long long flushed) {
    if (nonzero) atomicAdd(&counts[0], nonzero);
    if (flushed) atomicAdd(&counts[1], flushed);
}

static __global__ void cast_gradient_kernel(half16 *out, const float *in, size_t n, int fp16,
                                            unsigned long long *counts) {
    unsigned long long nonzero = 0, flushed = 0;
    GRID_STRIDE(i, n) out[i] = gradient_to_16(in[i], fp16, &nonzero, &flushed);
    add_half_underflow(counts, nonzero, flushed);
}

void cast_to_16(half16 *out, const float *in, size_t n) {
    if (!n) return;
    ensure_init();
    LAUNCH(cast_to_bf16_kernel, grid_for(n), THREADS, 0, out, in, n, g_half == HALF_FP16);
}

// the FP8 casts' clip counts, added to with one integer atomic a thread (order-independent)
static __device__ void add_fp8_clips(unsigned long long *clips, unsigned long long saturated,
                                     unsigned long long flushed) {
    if (clips && saturated) atomicAdd(&clips[FP8_SATURATED], saturated);
    if (clips && flushed) atomicAdd(&clips[FP8_FLUSHED], flushed);
}

static __global__ void cast_to_fp8_grid_kernel(half16 *out, const float *in, size_t n, Fp8Format format,
                                               float scale, unsigned long long *clips) {
    unsigned long long saturated = 0, flushed = 0;
    GRID_STRIDE(i, n) {
        out[i] = fp8_grid_element(in[i], format, scale);
        saturated += fp8_saturates(in[i], format, scale);
        flushed += fp8_flushes(in[i], out[i]);
    }
    add_fp8_clips(clips, saturated, flushed);
}

void cast_to_fp8_grid(half16 *out, const float *in, size_t n, Fp8Format format, float scale,
                      unsigned long long *clips) {
    if (!n) return;
    ensure_init();
    LAUNCH(cast_to_fp8_grid_kernel, grid_for(n), THREADS, 0, out, in, n, format, scale, clips);
}

// a thread per group: its amax, then its elements cast (cast_to_fp8_grid_grouped in ops_cpu.c)
static __global__ void cast_to_fp8_grid_grouped_kernel(half16 *out, const float *in, int rows, int cols,
                                                       int group, int along_columns, Fp8Format format, int mx,
                                                       unsigned long long *clips) {
    int line_len = along_columns ? rows : cols;
    long per_line = (line_len + group - 1) / group, groups = (along_columns ? cols : rows) * per_line;
    size_t stride = along_columns ? (size_t)cols : 1, line_step = along_columns ? 1 : (size_t)cols;
    unsigned long long saturated = 0, flushed = 0;
    GRID_STRIDE(g, (size_t)groups) {
        int start = (int)(g % per_line) * group, len = line_len - start < group ? line_len - start : group;
        size_t first = (size_t)(g / per_line) * line_step + (size_t)start * stride;
        fp8_cast_group(out, in, first, stride, len, format, mx, &saturated, &flushed);
    }
    add_fp8_clips(clips, saturated, flushed);
}

void cast_to_fp8_grid_grouped(half16 *out, const float *in, int rows, int cols, int group, int along_columns,
                              Fp8Format format, int mx, unsigned long long *clips) {
    if (!rows || !cols) return;
    ensure_init();
    int line_len = along_columns ? rows : cols;
    size_t groups = (size_t)(along_columns ? cols : rows) * ((line_len + group - 1) / group);
    LAUNCH(cast_to_fp8_grid_grouped_kernel, grid_for(groups), THREADS, 0, out, in, rows, cols, group,
           along_columns, format, mx, clips);
}

void cast_to_float(float *out, const half16 *in, size_t n) {
    if (!n) return;
    ensure_init();
    LAUNCH(cast_to_float_kernel, grid_for(n), THREADS, 0, out, in, n, g_half == HALF_FP16);
}

static unsigned long long *underflow_counts(void) {
    if (!g_underflow) g_underflow = (unsigned long long *)dev_malloc(2 * sizeof(unsigned long long));
    return g_underflow;
}

void cast_gradient_to_16(half16 *out, const float *in, size_t n) {
    if (!n) return;
    ensure_init();
    LAUNCH(cast_gradient_kernel, grid_for(n), THREADS, 0, out, in, n, g_half == HALF_FP16, underflow_counts());
}

void ops_half_underflow(double *nonzero, double *flushed) {
    unsigned long long counts[2] = {0, 0};
    if (g_underflow) {
        copy_to_host(counts, g_underflow, sizeof counts);
        dev_zero(g_underflow, sizeof counts);
    }
    *nonzero = (double)counts[0], *flushed = (double)counts[1];
}

// bf16 is widened to f32 on a GPU without bf16 tensor cores; fp16 runs on the tensor cores of
// every GPU this build targets (sm_75 on)
static int widen_half(void) { return g_half == HALF_BF16 && !ops_bf16_native(); }

// The same three products as the f32 ones (same argument mapping), with 16-bit A and B (bf16, or
// fp16 in 16-mixed), f32 C, and f32 accumulation (CUBLAS_COMPUTE_32F): tensor cores. Where bf16
// has none (widen_half), the inputs are widened to f32 in the workspace and the f32 path
// multiplies those: the same numbers, slower.
static void gemm_bf16(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                      const half16 *A, int lda, const half16 *B, int ldb, const float *beta, float *Cm,
                      int ldc) {
    cudaDataType_t t = g_half == HALF_FP16 ? CUDA_R_16F : CUDA_R_16BF;
    CUBLAS_CHECK(cublasGemmEx(g.cublas, ta, tb, m, n, k, &ONE, A, t, lda, B, t, ldb, beta, Cm,
                              CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void matmul_forward_16(float *out, const half16 *inp, const half16 *weight, const float *bias, int N,
                         int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    ensure_init();
    if (g_half == HALF_BF16 && few_rows_matmul(out, inp, weight, 1, bias, N, C, OC)) return;
    if (widen_half()) {
        float *inp32 = (float *)scratch(((size_t)N * C + (size_t)OC * C) * sizeof(float));
        float *w32 = inp32 + (size_t)N * C;
        cast_to_float(inp32, inp, (size_t)N * C);
        cast_to_float(w32, weight, (size_t)OC * C);
        matmul_forward(out, inp32, w32, bias, N, C, OC);
        return;
    }
    const float *beta = &ZERO;
    if (bias) {
        LAUNCH(bias_rows_kernel, grid_for((size_t)N * OC), THREADS, 0, out, bias, (size_t)N, (size_t)OC);
        beta = &ONE;
    }
    gemm_bf16(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, beta, out, OC);
}

void matmul_backward_16_mode(float *dinp, float *dweight, float *dbias, const float *dout, const half16 *dout16,
                             const half16 *inp, const half16 *weight, int N, int C, int OC, GradMode grads) {
    if (N <= 0 || OC <= 0 || C <= 0) return;
    ensure_init();
    if (widen_half()) {
        size_t nd = (size_t)N * OC, ni = (size_t)N * C, nw = (size_t)OC * C;
        float *dout32 = (float *)scratch((nd + ni + nw) * sizeof(float));
        float *inp32 = dout32 + nd, *w32 = inp32 + ni;
        cast_to_float(dout32, dout16, nd);
        if (dweight) cast_to_float(inp32, inp, ni);  // the operands only the products taken read (ops.h)
        if (dinp) cast_to_float(w32, weight, nw);
        matmul_backward_mode(dinp, dweight, NULL, dout32, inp32, w32, N, C, OC, grads);
    } else {
        if (dinp) gemm_bf16(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout16, OC, &ONE, dinp, C);
        // bias_epilogue: dbias summed from the 16-bit copy of dout, which the product reads
        if (fused_bias_grad(dweight, dbias, inp, dout16, g_half == HALF_FP16 ? CUDA_R_16F : CUDA_R_16BF, N, C, OC,
                            grads))
            return;
        if (dweight) gemm_bf16(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout16, OC, grad_beta(grads), dweight, C);
    }
    bias_backward(dbias, dout, N, OC, grads);  // from the f32 gradient
}

// ----------------------------------------------------------------------------------------------
// fp8-tensorwise on the FP8 tensor cores (sm_89, sm_90): cuBLASLt's FP8 GEMM multiplies FP8 codes and
// unscales the fp32 sums by the A and B scale pointers. Its FP8 kernels take the TN layout alone: in
// row-major terms both operands' rows run along the reduction dimension k, so the backward's
// operands are transposed as they become codes.

// The grid values back to FP8 codes: fp8(x scale) / scale times the power-of-two scale is the FP8
// number exactly, so the GEMM multiplies what the emulation multiplies. transpose: the (rows, cols)
// matrix is written (cols, rows).
static __global__ void fp8_codes_kernel(uint8_t *out, const half16 *grid, int rows, int cols, float scale,
                                        Fp8Format f, int transpose) {
    GRID_STRIDE(i, (size_t)rows * cols) {
        size_t r = i / cols, c = i % cols;
        out[transpose ? c * rows + r : i] = fp8_from_float(bf16_to_float(grid[i]) * scale, f, 1);
    }
}

// what the GEMM multiplies the codes' sums by: 1 / each operand's scale (device memory, as
// cuBLASLt reads its scale pointers)
static __global__ void fp8_unscale_kernel(float *unscale, float a_scale, float b_scale) {
    unscale[0] = 1.0f / a_scale;
    unscale[1] = 1.0f / b_scale;
}

typedef struct {
    const half16 *grid;  // the operand's grid values (rows, cols)
    int rows, cols, transpose;
    float scale;
    Fp8Format format;
} Fp8Operand;

static size_t round_up_256(size_t n) { return (n + 255) / 256 * 256; }

// D (n, m), row-major, f32: D = A B^T / (a_scale b_scale) (beta 0) or D += it (beta 1), where A (m, k)
// and B (n, k) are the operands after their transposes. Returns 0, having computed nothing, where
// cuBLASLt offers no algorithm (the caller emulates).
static int fp8_gemm(float *D, const Fp8Operand *a, const Fp8Operand *b, int m, int n, int k, const float *beta) {
    size_t a_bytes = round_up_256((size_t)m * k), b_bytes = round_up_256((size_t)n * k);
    uint8_t *codes = (uint8_t *)scratch(a_bytes + b_bytes + 2 * sizeof(float));
    uint8_t *a8 = codes, *b8 = codes + a_bytes;
    float *unscale = (float *)(codes + a_bytes + b_bytes);
    void *workspace;
    cublasLtHandle_t lt = lt_handle(&workspace);
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    float *a_unscale = unscale, *b_unscale = unscale + 1;
    cudaDataType_t ta = a->format == FP8_E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    cudaDataType_t tb = b->format == FP8_E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_unscale,
                                                sizeof a_unscale));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_unscale,
                                                sizeof b_unscale));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, ta, k, m, k));  // A^T as cuBLASLt sees it: k x m, column-major
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, tb, k, n, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, n, m));
    cublasLtMatmulAlgo_t algo;
    int ran = lt_algorithm(lt, op, la, lb, ld, &algo);
    static int told, told_ran;  // whoever compares the backends must know which way the products went
    if (ran && !told_ran++)
        fprintf(stderr, "note: fp8-tensorwise: the linears multiply on the FP8 tensor cores (cuBLASLt FP8 GEMMs, "
                "sm_%d%d)\n", g.cc_major, g.cc_minor);
    if (!ran && !told++)
        fprintf(stderr, "note: fp8-tensorwise: cuBLASLt offers no FP8 algorithm for a product of %d x %d by %d x %d "
                "on this GPU; such products multiply the FP8 grid values in bf16 (the emulation)\n", n, k, k, m);
    if (ran) {
        LAUNCH(fp8_codes_kernel, grid_for((size_t)m * k), THREADS, 0, a8, a->grid, a->rows, a->cols, a->scale,
               a->format, a->transpose);
        LAUNCH(fp8_codes_kernel, grid_for((size_t)n * k), THREADS, 0, b8, b->grid, b->rows, b->cols, b->scale,
               b->format, b->transpose);
        LAUNCH(fp8_unscale_kernel, 1, 1, 0, unscale, a->scale, b->scale);
        CUBLAS_CHECK(cublasLtMatmul(lt, op, &ONE, a8, la, b8, lb, beta, D, ld, D, ld, &algo, workspace,
                                    LT_WORKSPACE, g.stream));
    }
    lt_destroy(op, la, lb, ld);
    return ran;
}

// Whether this GPU and shape take the FP8 GEMMs (fp8_gemm_fits; the f32 outputs 16-byte aligned, as
// cuBLASLt's FP8 kernels ask), saying once when they do not
static int fp8_gemms_run(int m, int n, int k, const float *out1, const float *out2) {
    int aligned = (uintptr_t)out1 % 16 == 0 && (uintptr_t)out2 % 16 == 0;
    int fits = fp8_gemm_fits(g.cc_major, g.cc_minor, m, n, k) && aligned;
    static int told_gpu, told_shape;
    if (!fp8_gemm_fits(g.cc_major, g.cc_minor, 16, 16, 16) && !told_gpu++)
        fprintf(stderr, "note: fp8-tensorwise: sm_%d%d takes no tensorwise FP8 GEMM here (sm_89 and sm_90 do); "
                "the linears multiply the FP8 grid values in bf16 (the emulation)\n", g.cc_major, g.cc_minor);
    else if (!fits && !told_shape++)
        fprintf(stderr, "note: fp8-tensorwise: a product of %d x %d by %d x %d is not for cuBLASLt's FP8 GEMM "
                "(sizes multiples of 16, outputs 16-byte aligned); such products multiply the FP8 grid values "
                "in bf16 (the emulation)\n", n, k, k, m);
    return fits;
}

// forward: out (N, OC) = inp (N, C) W (OC, C)^T, both operands' rows along C already
void matmul_forward_fp8(float *out, const half16 *inp, float inp_scale, const half16 *weight, float weight_scale,
                        const float *bias, int N, int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    ensure_init();
    const float *beta = bias ? &ONE : &ZERO;
    Fp8Operand w = {weight, OC, C, 0, weight_scale, FP8_E4M3}, x = {inp, N, C, 0, inp_scale, FP8_E4M3};
    if (!fp8_gemms_run(OC, N, C, out, out)) {
        matmul_forward_16(out, inp, weight, bias, N, C, OC);
        return;
    }
    if (bias) LAUNCH(bias_rows_kernel, grid_for((size_t)N * OC), THREADS, 0, out, bias, (size_t)N, (size_t)OC);
    if (!fp8_gemm(out, &w, &x, OC, N, C, beta)) matmul_forward_16(out, inp, weight, bias, N, C, OC);  // rewrites out
}

// backward: dinp (N, C) += dout (N, OC) W (OC, C), W's rows along OC after a transpose; dW (OC, C) +=
// dout^T inp, both transposed to run along the tokens
void matmul_backward_fp8(float *dinp, float *dweight, float *dbias, const float *dout, const half16 *dout8,
                         float dout_scale, const half16 *inp, float inp_scale, const half16 *weight,
                         float weight_scale, int N, int C, int OC) {
    if (N <= 0 || OC <= 0 || C <= 0) return;
    ensure_init();
    if (!fp8_gemms_run(C, N, OC, dinp ? dinp : dweight, dweight ? dweight : dinp)) {
        matmul_backward_16(dinp, dweight, dbias, dout, dout8, inp, weight, N, C, OC);
        return;
    }
    Fp8Operand g_rows = {dout8, N, OC, 0, dout_scale, FP8_E5M2}, g_cols = {dout8, N, OC, 1, dout_scale, FP8_E5M2};
    Fp8Operand w_cols = {weight, OC, C, 1, weight_scale, FP8_E4M3}, x_cols = {inp, N, C, 1, inp_scale, FP8_E4M3};
    if (dinp && !fp8_gemm(dinp, &w_cols, &g_rows, C, N, OC, &ONE))
        matmul_backward_16(dinp, NULL, NULL, dout, dout8, NULL, weight, N, C, OC);
    if (dweight && !fp8_gemm(dweight, &x_cols, &g_cols, C, OC, N, &ONE))
        matmul_backward_16(NULL, dweight, NULL, dout, dout8, inp, NULL, N, C, OC);
    bias_backward(dbias, dout, N, OC, GRAD_ADD);  // from the f32 gradient, as the emulation's
}

// ----------------------------------------------------------------------------------------------
// embedding: a thread per output element forward. Backward, without atomics and in the CPU's order
// (kernels.h: the same bits): dwpe a thread per (position, column); dwte by rows sorted by token
// (CUB's radix sort, stable: a token's rows stay in row order), then a thread per (run of one
// token, column) adds the run's rows

static __global__ void embedding_forward_kernel(float *out, const int *tokens, const int *start,
                                                const float *wte, const float *wpe, int v_lo,
                                                int v_count, int T, size_t n, int C) {
    GRID_STRIDE(i, n) {
        int bt = (int)(i / C), c = (int)(i % C);
        int pos = (start ? start[bt / T] : 0) + bt % T;
        out[i] = embedding_value(wte, wpe, tokens[bt], pos, c, C, v_lo, v_count);
    }
}

void embedding_forward(float *out, const int *tokens, const int *start, const float *wte,
                       const float *wpe, int v_lo, int v_count, int B, int T, int C) {
    size_t n = (size_t)B * T * C;
    if (!n) return;
    ensure_init();
    LAUNCH(embedding_forward_kernel, grid_for(n), THREADS, 0, out, tokens, start, wte, wpe, v_lo,
           v_count, T, n, C);
}

static __global__ void embedding_position_grad_kernel(float *dwpe, const float *dout, int B, int T, int C) {
    GRID_STRIDE(i, (size_t)T * C) embedding_position_grad(dwpe, dout, B, T, C, (int)(i / C), (int)(i % C));
}

static __global__ void embedding_sort_keys_kernel(int *keys, int *rows, const int *tokens, int BT, int v_lo,
                                                  int v_count) {
    GRID_STRIDE(i, (size_t)BT) {
        keys[i] = embedding_sort_key(tokens[i], v_lo, v_count);
        rows[i] = (int)i;
    }
}

// blockIdx.x: a sorted position (the whole block leaves unless a run starts there); the block's
// threads: consecutive columns
static __global__ void embedding_token_grad_kernel(float *dwte, const float *dout, const int *keys,
                                                   const int *rows, int BT, int C, int v_count) {
    int i = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    int n = embedding_token_run(keys, BT, v_count, i);
    if (n > 0 && c < C) embedding_token_grad(dwte + (size_t)keys[i] * C, dout, rows + i, n, C, c);
}

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// the bits of the sort keys 0 .. v_count (the radix sort looks at no more)
static int key_bits(int v_count) {
    int bits = 1;
    while (bits < 31 && (1 << bits) <= v_count) bits++;
    return bits;
}

static void embedding_token_grads(float *dwte, const float *dout, const int *tokens, int v_lo, int v_count,
                                  int BT, int C) {
    size_t sort_bytes = 0, ints = round_up((size_t)BT * sizeof(int), 256);
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, sort_bytes, (const int *)NULL, (int *)NULL,
                                               (const int *)NULL, (int *)NULL, BT, 0, key_bits(v_count), g.stream));
    size_t head = round_up(sort_bytes, 256);  // the sort's own workspace, then four arrays of BT
    char *work = (char *)scratch(head + 4 * ints);
    int *keys = (int *)(work + head), *rows = (int *)(work + head + ints);
    int *sorted_keys = (int *)(work + head + 2 * ints), *sorted_rows = (int *)(work + head + 3 * ints);
    LAUNCH(embedding_sort_keys_kernel, grid_for((size_t)BT), THREADS, 0, keys, rows, tokens, BT, v_lo, v_count);
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(work, sort_bytes, keys, sorted_keys, rows, sorted_rows, BT, 0,
                                               key_bits(v_count), g.stream));
    dim3 grid((unsigned)BT, blocks_for((size_t)C, THREADS));
    LAUNCH(embedding_token_grad_kernel, grid, THREADS, 0, dwte, dout, sorted_keys, sorted_rows, BT, C, v_count);
}

void embedding_backward(float *dwte, float *dwpe, const float *dout, const int *tokens, int v_lo,
                        int v_count, int B, int T, int C) {
    if (B * T <= 0 || C <= 0) return;
    ensure_init();
    if (v_count > 0) embedding_token_grads(dwte, dout, tokens, v_lo, v_count, B * T, C);
    if (dwpe) LAUNCH(embedding_position_grad_kernel, grid_for((size_t)T * C), THREADS, 0, dwpe, dout, B, T, C);
}

// ----------------------------------------------------------------------------------------------
// layernorm: a warp per row (lane = 0..31 of nlanes = 32 in kernels.h's terms)

#define ROWS_PER_BLOCK (THREADS / 32)

static __global__ void layernorm_forward_kernel(float *out, float *mean, float *rstd,
                                                const float *inp, const float *weight,
                                                const float *bias, int N, int C) {
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp leaves together, so the shuffles stay full-warp
    const float *x = inp + (size_t)row * C;
    float *o = out + (size_t)row * C;
    float m = warp_reduce(row_partial_sum(x, C, lane, 32), SumOp()) / (float)C;
    float r = layernorm_rstd(warp_reduce(row_partial_sqdev(x, m, C, lane, 32), SumOp()), C);
    for (int c = lane; c < C; c += 32) o[c] = layernorm_value(x[c], m, r, weight[c], bias[c]);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                       const float *weight, const float *bias, int N, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(layernorm_forward_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, out, mean,
           rstd, inp, weight, bias, N, C);
}

static __global__ void layernorm_dinp_kernel(float *dinp, const float *dout, const float *inp,
                                             const float *weight, const float *mean,
                                             const float *rstd, int N, int C) {
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;  // whole warps only, as above
    const float *gr = dout + (size_t)row * C, *x = inp + (size_t)row * C;
    float *dx = dinp + (size_t)row * C;
    float m = mean[row], r = rstd[row];
    float sum_dnorm, sum_dnorm_norm;
    layernorm_backward_partials(&sum_dnorm, &sum_dnorm_norm, gr, x, weight, m, r, C, lane, 32);
    float mean_dnorm = warp_reduce(sum_dnorm, SumOp()) / (float)C;
    float mean_dnorm_norm = warp_reduce(sum_dnorm_norm, SumOp()) / (float)C;
    for (int c = lane; c < C; c += 32)
        dx[c] += layernorm_dinp(gr[c], x[c], weight[c], m, r, mean_dnorm, mean_dnorm_norm);
}

// dweight and dbias: kernels.h's column owner, over chunks of rows into partial rows (as for the
// matmul's dbias above), then the partial rows added in order
static __global__ void layernorm_param_chunks_kernel(float *pw, float *pb, const float *dout,
                                                     const float *inp, const float *mean,
                                                     const float *rstd, int N, int C) {
    int nchunks = (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)nchunks * C) return;
    int chunk = (int)(i / C), c = (int)(i % C);
    int n0 = chunk * ROWS_PER_CHUNK, rows = N - n0 < ROWS_PER_CHUNK ? N - n0 : ROWS_PER_CHUNK;
    layernorm_param_grad_columns(pw + (size_t)chunk * C, pb + (size_t)chunk * C,
                                 dout + (size_t)n0 * C, inp + (size_t)n0 * C, mean + n0, rstd + n0,
                                 rows, C, c, c + 1);
}

static __global__ void layernorm_param_sum_kernel(float *dweight, float *dbias, const float *pw,
                                                  const float *pb, int nchunks, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    column_sums(dweight, pw, nchunks, C, c, c + 1);
    column_sums(dbias, pb, nchunks, C, c, c + 1);
}

// the whole row's LayerNorm and a shard of it (layernorm_backward_stats) alike
static void layernorm_param_grads(float *dweight, float *dbias, const float *dout, const float *inp,
                                  const float *mean, const float *rstd, int N, int C) {
    int nchunks = (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    size_t part = (size_t)nchunks * C;
    float *pw = (float *)scratch(2 * part * sizeof(float)), *pb = pw + part;
    CUDA_CHECK(cudaMemsetAsync(pw, 0, 2 * part * sizeof(float), g.stream));
    LAUNCH(layernorm_param_chunks_kernel, blocks_for(part, THREADS), THREADS, 0, pw, pb, dout, inp,
           mean, rstd, N, C);
    LAUNCH(layernorm_param_sum_kernel, blocks_for((size_t)C, THREADS), THREADS, 0, dweight, dbias,
           pw, pb, nchunks, C);
}

// GRAD_WRITE: the norms' weight gradients (C floats each) zeroed, then summed into as GRAD_ADD sums
static void zero_norm_grads(float *dweight, float *dbias, int C, GradMode grads) {
    if (grads != GRAD_WRITE) return;
    CUDA_CHECK(cudaMemsetAsync(dweight, 0, (size_t)C * sizeof(float), g.stream));
    if (dbias) CUDA_CHECK(cudaMemsetAsync(dbias, 0, (size_t)C * sizeof(float), g.stream));
}

void layernorm_backward_mode(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                             const float *weight, const float *mean, const float *rstd, int N, int C,
                             GradMode grads) {
    if (N <= 0 || C <= 0) return;
    ensure_init();
    zero_norm_grads(dweight, dbias, C, grads);
    LAUNCH(layernorm_dinp_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, dinp, dout,
           inp, weight, mean, rstd, N, C);
    layernorm_param_grads(dweight, dbias, dout, inp, mean, rstd, N, C);
}

// RMSNorm: a warp per row, as LayerNorm's
static __global__ void rmsnorm_forward_kernel(float *out, float *rstd, const float *inp, const float *weight, int N,
                                              int C, float eps) {
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;  // whole warps only
    const float *x = inp + (size_t)row * C;
    float *o = out + (size_t)row * C;
    float r = rmsnorm_rstd(warp_reduce(row_partial_sqdev(x, 0.0f, C, lane, 32), SumOp()), C, eps);
    for (int c = lane; c < C; c += 32) o[c] = x[c] * r * weight[c];
    if (lane == 0) rstd[row] = r;
}

void rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C, float eps) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(rmsnorm_forward_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, out, rstd, inp, weight, N, C,
           eps);
}

// sums NULL: the whole row's, reduced here; else sums[row] / C_total (a shard's, added over shards)
static __global__ void rmsnorm_dinp_kernel(float *dinp, const float *dout, const float *inp, const float *weight,
                                           const float *rstd, const float *sums, int N, int C, int C_total) {
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;  // whole warps only
    const float *gr = dout + (size_t)row * C, *x = inp + (size_t)row * C;
    float *dx = dinp + (size_t)row * C;
    float r = rstd[row];
    float mean_dnorm_norm = sums ? sums[row] / (float)C_total
                                 : warp_reduce(rmsnorm_backward_partial(gr, x, weight, r, C, lane, 32), SumOp()) /
                                       (float)C;
    for (int c = lane; c < C; c += 32) dx[c] += rmsnorm_dinp(gr[c], x[c], weight[c], r, mean_dnorm_norm);
}

static __global__ void rmsnorm_row_sums_kernel(float *sums, const float *dout, const float *inp, const float *weight,
                                               const float *rstd, int N, int C) {
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;  // whole warps only
    const float *x = inp + (size_t)row * C;
    // dout NULL: the sum of squares (forward); else the sum of dnorm * norm (backward)
    float s = dout ? rmsnorm_backward_partial(dout + (size_t)row * C, x, weight, rstd[row], C, lane, 32)
                   : row_partial_sqdev(x, 0.0f, C, lane, 32);
    s = warp_reduce(s, SumOp());
    if (lane == 0) sums[row] = s;
}

static __global__ void rmsnorm_normalize_kernel(float *out, float *rstd, const float *inp, const float *weight,
                                                const float *sum_sq, int N, int C, int C_total, float eps) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)N * C) return;
    int n = (int)(i / C), c = (int)(i % C);
    float r = rmsnorm_rstd(sum_sq[n], C_total, eps);
    out[i] = inp[i] * r * weight[c];
    if (c == 0) rstd[n] = r;
}

void rmsnorm_row_sums(float *sum_sq, const float *inp, int N, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(rmsnorm_row_sums_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, sum_sq, (const float *)NULL,
           inp, (const float *)NULL, (const float *)NULL, N, C);
}

void rmsnorm_forward_stats(float *out, float *rstd, const float *inp, const float *weight, const float *sum_sq,
                           int N, int C, int C_total, float eps) {
    if (N <= 0 || C <= 0) return;
    ensure_init();
    LAUNCH(rmsnorm_normalize_kernel, blocks_for((size_t)N * C, THREADS), THREADS, 0, out, rstd, inp, weight, sum_sq,
           N, C, C_total, eps);
}

void rmsnorm_backward_row_sums(float *sums, const float *dout, const float *inp, const float *weight,
                               const float *rstd, int N, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(rmsnorm_row_sums_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, sums, dout, inp, weight, rstd,
           N, C);
}

static __global__ void rmsnorm_param_chunks_kernel(float *pw, const float *dout, const float *inp, const float *rstd,
                                                   int N, int C) {
    int nchunks = (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)nchunks * C) return;
    int chunk = (int)(i / C), c = (int)(i % C);
    int n0 = chunk * ROWS_PER_CHUNK, rows = N - n0 < ROWS_PER_CHUNK ? N - n0 : ROWS_PER_CHUNK;
    rmsnorm_param_grad_columns(pw + (size_t)chunk * C, dout + (size_t)n0 * C, inp + (size_t)n0 * C, rstd + n0, rows,
                               C, c, c + 1);
}

static __global__ void rmsnorm_param_sum_kernel(float *dweight, const float *pw, int nchunks, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    column_sums(dweight, pw, nchunks, C, c, c + 1);
}

static void rmsnorm_param_grads(float *dweight, const float *dout, const float *inp, const float *rstd, int N, int C) {
    int nchunks = (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    size_t part = (size_t)nchunks * C;
    float *pw = (float *)scratch(part * sizeof(float));
    CUDA_CHECK(cudaMemsetAsync(pw, 0, part * sizeof(float), g.stream));
    LAUNCH(rmsnorm_param_chunks_kernel, blocks_for(part, THREADS), THREADS, 0, pw, dout, inp, rstd, N, C);
    LAUNCH(rmsnorm_param_sum_kernel, blocks_for((size_t)C, THREADS), THREADS, 0, dweight, pw, nchunks, C);
}

void rmsnorm_backward_mode(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                           const float *rstd, int N, int C, GradMode grads) {
    if (N <= 0 || C <= 0) return;
    ensure_init();
    zero_norm_grads(dweight, NULL, C, grads);
    LAUNCH(rmsnorm_dinp_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, dinp, dout, inp, weight, rstd,
           (const float *)NULL, N, C, C);
    rmsnorm_param_grads(dweight, dout, inp, rstd, N, C);
}

void rmsnorm_backward_stats(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                            const float *rstd, const float *sums, int N, int C, int C_total) {
    if (N <= 0 || C <= 0) return;
    ensure_init();
    LAUNCH(rmsnorm_dinp_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, dinp, dout, inp, weight, rstd, sums,
           N, C, C_total);
    rmsnorm_param_grads(dweight, dout, inp, rstd, N, C);
}

// ----------------------------------------------------------------------------------------------
// attention, tiled: kernels.h's block functions in FlashAttention-2's shape (on the CUDA cores,
// in f32). A block of ATT_WARPS warps keeps ATT_ROWS rows of one (sequence, head) in shared
// memory and walks the other side of the (T, T) square in tiles of ATT_COLS rows, one per lane,
// loaded by the whole block (consecutive threads, consecutive columns: coalesced):
//   forward      rows: queries; tiles: keys and values. An online softmax per query row; writes
//                out and each row's log-sum-exp, into the first B*NH*T floats of att
//   backward 1   rows: queries; tiles: keys and values, swept twice: delta (into datt), then dq
//   backward 2   rows: keys and values; tiles: queries with their dout, lse and delta: dk, dv
// Nothing of size T x T is stored, and backward recomputes the probabilities from q, k and lse.
// Warp w owns rows w, w + ATT_WARPS, ... of its block (interleaved, so the causal diagonal's
// extra keys are shared out) and alone writes their accumulators: no atomics, every sum in a
// fixed order. Its lanes split a row's tile as kernels.h's lanes, partials combined by shuffles;
// every branch around a shuffle or __syncwarp depends on the warp's row, around __syncthreads on
// the block's tile. Shared rows are hs + 1 floats apart, so 32 lanes reading one column of 32
// rows hit 32 different banks.

#define ATT_WARPS 4
#define ATT_ROWS 16
#define ATT_COLS 32  // a tile row per lane
#define ATT_ROWS_PER_WARP (ATT_ROWS / ATT_WARPS)
#define ATT_STATIC_SMEM (48 * 1024)  // what a kernel may use without opting in

// A kernel's shared memory: matrices of ATT_ROWS and of ATT_COLS rows (hs + 1 floats each),
// vectors of ATT_COLS floats, and per-warp vectors of ATT_COLS floats.
typedef struct {
    int row_mats, col_mats, col_vecs, warp_vecs;
} AttSmem;
static const AttSmem ATT_FORWARD_SMEM = {2, 2, 0, 1};         // q, o | k, v | - | p
static const AttSmem ATT_QUERY_BACKWARD_SMEM = {3, 2, 0, 1};  // q, dout, dq | k, v | - | ds
static const AttSmem ATT_KEY_BACKWARD_SMEM = {4, 2, 2, 2};    // k, v, dk, dv | q, dout | lse, delta | p, ds

static size_t att_smem_bytes(AttSmem m, int hs) {
    size_t mats = (size_t)m.row_mats * ATT_ROWS + (size_t)m.col_mats * ATT_COLS;
    size_t vecs = (size_t)(m.col_vecs + m.warp_vecs * ATT_WARPS) * ATT_COLS;
    return (mats * (hs + 1) + vecs) * sizeof(float);
}

// the shared memory the kernel needs for head size hs, allowed beyond 48 KB up to the device's
// opt-in limit; a head size that cannot fit is refused, with the largest one that can
template <typename Kernel> static size_t att_prepare(Kernel kernel, AttSmem m, int hs) {
    size_t bytes = att_smem_bytes(m, hs);
    if (bytes > (size_t)g.smem_optin) {
        int largest = 0;
        while (att_smem_bytes(m, largest + 1) <= (size_t)g.smem_optin) largest++;
        fatal("attention: head size %d needs %zu bytes of shared memory per block, more than the %d "
              "that GPU %d (%s) allows; head sizes up to %d fit", hs, bytes, g.smem_optin, g.device,
              g.name, largest);
    }
    if (bytes > ATT_STATIC_SMEM)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return bytes;
}

// rows [0, n) of a head's (., hs) slice, src_stride floats apart, into shared rows hs + 1 apart
static __device__ void att_load(float *dst, const float *src, size_t src_stride, int n, int hs) {
    for (int e = threadIdx.x; e < n * hs; e += blockDim.x)
        dst[(e / hs) * (hs + 1) + e % hs] = src[(size_t)(e / hs) * src_stride + e % hs];
}

static __device__ void att_zero(float *dst, int n, int hs) {
    for (int e = threadIdx.x; e < n * (hs + 1); e += blockDim.x) dst[e] = 0.0f;
}

static __device__ void att_load_vector(float *dst, const float *src, int n) {
    for (int e = threadIdx.x; e < n; e += blockDim.x) dst[e] = src[e];
}

// a warp's accumulated row added into its place in global memory, this lane's columns
static __device__ void att_add_row(float *dst, const float *src, int hs, int lane) {
    for (int c = lane; c < hs; c += 32) dst[c] += src[c];
}

static __device__ int att_min(int a, int b) { return a < b ? a : b; }

// blockIdx.x = (b * NH + h) * row_blocks + which block of ATT_ROWS queries
static __global__ void attention_forward_kernel(float *out, float *lse, const float *qkv, int T, int C, int NH,
                                                int row_blocks) {
    extern __shared__ float smem[];
    int hs = C / NH, S = hs + 1, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int bh = blockIdx.x / row_blocks, q0 = (blockIdx.x % row_blocks) * ATT_ROWS, b = bh / NH, h = bh % NH;
    int nq = att_min(ATT_ROWS, T - q0), nkeys = q0 + nq;  // the last query sees keys 0 .. q0 + nq - 1
    size_t C3 = 3 * (size_t)C;
    const float *seq = qkv + (size_t)b * T * C3 + (size_t)h * hs;  // row 0's q; its k at + C, v at + 2C
    float *q = smem, *o = q + ATT_ROWS * S, *k = o + ATT_ROWS * S, *v = k + ATT_COLS * S;
    float *p = v + ATT_COLS * S + warp * ATT_COLS;
    att_load(q, seq + q0 * C3, C3, nq, hs);
    att_zero(o, nq, hs);
    OnlineSoftmax run[ATT_ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ATT_ROWS_PER_WARP; i++) run[i] = online_softmax_start();
    for (int k0 = 0; k0 < nkeys; k0 += ATT_COLS) {
        int nk = att_min(ATT_COLS, nkeys - k0);
        __syncthreads();  // the previous tile is no longer read
        att_load(k, seq + C + k0 * C3, C3, nk, hs);
        att_load(v, seq + 2 * C + k0 * C3, C3, nk, hs);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < ATT_ROWS_PER_WARP; i++) {
            int r = warp + i * ATT_WARPS, n = att_min(nk, q0 + r + 1 - k0);  // causal: keys up to the query
            if (r >= nq || n <= 0) continue;
            float m = warp_reduce(attention_scores(p, q + r * S, k, S, n, hs, lane, 32), MaxOp());
            float alpha = online_softmax_rescale(&run[i], m);
            run[i].sum += warp_reduce(attention_exp(p, run[i].max, n, lane, 32), SumOp());
            __syncwarp();  // every lane's p, seen by all
            attention_block_values(o + r * S, alpha, p, v, S, n, hs, lane, 32);
            __syncwarp();  // p is free for the next row
        }
    }
#pragma unroll
    for (int i = 0; i < ATT_ROWS_PER_WARP; i++) {
        int r = warp + i * ATT_WARPS, t = q0 + r;
        if (r >= nq) continue;
        float l = attention_finish(out + ((size_t)b * T + t) * C + (size_t)h * hs, o + r * S, &run[i], hs, lane, 32);
        if (lane == 0) lse[(size_t)bh * T + t] = l;
    }
}

// ---- attention forward on the tensor cores (OPS_CUDA_KERNELS=flash_bf16): flash_tiles.h's tiling,
// bf16 q, k, v and probabilities, f32 accumulation (wmma's 16 x 16 x 16 tiles, sm_80 on). Shared
// memory: the block's q (FLASH_BR x hs), a tile's k and v (FLASH_BC x hs), in bf16; per warp its
// scores s (16 x FLASH_BC f32), probabilities p (bf16), output o (16 x hs f32: the rescale by alpha
// needs each element's row, which a wmma accumulator does not tell) and the rows' alpha. Each
// region is a multiple of 32 bytes, as wmma's loads need. Lane r < 16 of a warp owns row r's
// online softmax (run, in its registers) for every tile.
static size_t flash_smem_bytes(int hs) {
    return (size_t)(FLASH_BR + 2 * FLASH_BC) * hs * sizeof(__nv_bfloat16) +
           (size_t)FLASH_WARPS * FLASH_ROWS * (FLASH_BC * (sizeof(float) + sizeof(uint16_t)) + hs * sizeof(float)) +
           (size_t)FLASH_WARPS * FLASH_ROWS * sizeof(float);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // bf16 wmma: the kernel's body exists from sm_80 on
// rows [r0, r0 + n) of a head's slice (rows `stride` floats apart) as bf16, zeros past T; the block's threads
static __device__ void flash_load(__nv_bfloat16 *dst, const float *src, size_t stride, int r0, int n, int T, int hs) {
    for (int i = threadIdx.x; i < n * hs; i += blockDim.x) {
        int r = i / hs, d = i % hs;
        dst[i] = __float2bfloat16_rn(r0 + r < T ? src[(size_t)(r0 + r) * stride + d] : 0.0f);
    }
}
#endif

static __global__ void __launch_bounds__(FLASH_WARPS * 32)
    flash_forward_kernel(float *out, float *lse, const float *qkv, int T, int C, int NH, int row_blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // never launched before sm_80 (flash_forward)
    using namespace nvcuda;
    extern __shared__ __align__(128) unsigned char flash_smem[];
    int hs = C / NH, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int bh = blockIdx.x / row_blocks, q0 = (blockIdx.x % row_blocks) * FLASH_BR, b = bh / NH, h = bh % NH;
    int row = q0 + warp * FLASH_ROWS + lane;  // lanes < 16: the query row whose softmax the lane keeps
    size_t C3 = 3 * (size_t)C;
    const float *seq = qkv + (size_t)b * T * C3 + (size_t)h * hs;
    float scale = attention_scale(hs);
    unsigned char *at = flash_smem;
    __nv_bfloat16 *q = (__nv_bfloat16 *)at, *k = q + FLASH_BR * hs, *v = k + FLASH_BC * hs;
    at = (unsigned char *)(v + FLASH_BC * hs);
    float *s = (float *)at + warp * FLASH_ROWS * FLASH_BC;
    at += FLASH_WARPS * FLASH_ROWS * FLASH_BC * sizeof(float);
    uint16_t *p = (uint16_t *)at + warp * FLASH_ROWS * FLASH_BC;
    at += FLASH_WARPS * FLASH_ROWS * FLASH_BC * sizeof(uint16_t);
    float *o = (float *)at + warp * FLASH_ROWS * hs;
    at += (size_t)FLASH_WARPS * FLASH_ROWS * hs * sizeof(float);
    float *alpha = (float *)at + warp * FLASH_ROWS;

    flash_load(q, seq, C3, q0, FLASH_BR, T, hs);
    for (int i = lane; i < FLASH_ROWS * hs; i += 32) o[i] = 0.0f;
    OnlineSoftmax run = online_softmax_start();
    const __nv_bfloat16 *qw = q + warp * FLASH_ROWS * hs, *pw = (const __nv_bfloat16 *)p;
    int tiles = flash_key_tiles(q0, T);
    for (int kt = 0; kt < tiles; kt++) {
        __syncthreads();  // every warp is done with the previous tile's k and v
        flash_load(k, seq + C, C3, kt * FLASH_BC, FLASH_BC, T, hs);
        flash_load(v, seq + 2 * (size_t)C, C3, kt * FLASH_BC, FLASH_BC, T, hs);
        __syncthreads();
        // 1. s = q k^T for the warp's 16 rows: k's rows read as the columns of a column-major matrix
        for (int n = 0; n < FLASH_BC / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int kk = 0; kk < hs / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> bk;
                wmma::load_matrix_sync(a, qw + kk * 16, hs);
                wmma::load_matrix_sync(bk, k + n * 16 * hs + kk * 16, hs);
                wmma::mma_sync(acc, a, bk, acc);
            }
            wmma::store_matrix_sync(s + n * 16, acc, FLASH_BC, wmma::mem_row_major);
        }
        __syncwarp();
        // 2. each row's online softmax over the tile
        if (lane < FLASH_ROWS)
            alpha[lane] = flash_row_tile(p + lane * FLASH_BC, s + lane * FLASH_BC, row, kt * FLASH_BC, T, scale, &run);
        __syncwarp();
        // 3. o = alpha o + p v
        for (int i = lane; i < FLASH_ROWS * hs; i += 32) o[i] *= alpha[i / hs];
        __syncwarp();
        for (int cf = 0; cf < hs / 16; cf++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, o + cf * 16, hs, wmma::mem_row_major);
            for (int kk = 0; kk < FLASH_BC / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> bv;
                wmma::load_matrix_sync(a, pw + warp * FLASH_ROWS * FLASH_BC + kk * 16, FLASH_BC);
                wmma::load_matrix_sync(bv, v + kk * 16 * hs + cf * 16, hs);
                wmma::mma_sync(acc, a, bv, acc);
            }
            wmma::store_matrix_sync(o + cf * 16, acc, hs, wmma::mem_row_major);
        }
        __syncwarp();
    }
    if (lane < FLASH_ROWS && row < T)
        lse[(size_t)bh * T + row] =
            attention_finish(out + ((size_t)b * T + row) * C + (size_t)h * hs, o + lane * hs, &run, hs, 0, 1);
#else
    (void)out, (void)lse, (void)qkv, (void)T, (void)C, (void)NH, (void)row_blocks;
#endif
}

// 1 when a tensor-core attention kernel needing `smem` bytes runs at head size hs: switched on,
// a head size it takes, bf16 tensor cores, and the shared memory within the device's limit
static int flash_switched_for(int hs, size_t smem) {
    return (g_switched & KERNEL_FLASH_BF16) && flash_head_size_ok(hs) && ops_bf16_native() &&
           smem <= (size_t)g.smem_optin;
}

// 1 when the tensor-core forward ran (flash_switched_for)
static int flash_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    size_t smem = flash_smem_bytes(hs);
    if (!flash_switched_for(hs, smem)) return 0;
    CUDA_CHECK(cudaFuncSetAttribute(flash_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int row_blocks = (T + FLASH_BR - 1) / FLASH_BR;
    LAUNCH(flash_forward_kernel, (unsigned)((size_t)B * NH * row_blocks), FLASH_WARPS * 32, smem, out, att, qkv, T,
           C, NH, row_blocks);
    return 1;
}

void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH) {
    if (B <= 0 || T <= 0) return;
    ensure_init();
    if (flash_forward(out, att, qkv, B, T, C, NH)) return;
    int hs = C / NH, row_blocks = (T + ATT_ROWS - 1) / ATT_ROWS;
    size_t smem = att_prepare(attention_forward_kernel, ATT_FORWARD_SMEM, hs);
    LAUNCH(attention_forward_kernel, (unsigned)((size_t)B * NH * row_blocks), ATT_WARPS * 32, smem, out, att,
           qkv, T, C, NH, row_blocks);
}

// backward 1: a block of queries against every key tile up to the diagonal, twice: sweep 0 sums
// delta (every key is needed before any ds), sweep 1 adds dq
static __global__ void attention_query_backward_kernel(float *dqkv, float *delta, const float *dout,
                                                       const float *qkv, const float *lse, int T, int C, int NH,
                                                       int row_blocks) {
    extern __shared__ float smem[];
    int hs = C / NH, S = hs + 1, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int bh = blockIdx.x / row_blocks, q0 = (blockIdx.x % row_blocks) * ATT_ROWS, b = bh / NH, h = bh % NH;
    int nq = att_min(ATT_ROWS, T - q0), nkeys = q0 + nq;
    size_t C3 = 3 * (size_t)C;
    const float *seq = qkv + (size_t)b * T * C3 + (size_t)h * hs;
    const float *dseq = dout + (size_t)b * T * C + (size_t)h * hs;
    float *q = smem, *g = q + ATT_ROWS * S, *dq = g + ATT_ROWS * S, *k = dq + ATT_ROWS * S, *v = k + ATT_COLS * S;
    float *ds = v + ATT_COLS * S + warp * ATT_COLS;
    att_load(q, seq + q0 * C3, C3, nq, hs);
    att_load(g, dseq + (size_t)q0 * C, C, nq, hs);
    att_zero(dq, nq, hs);
    float row_lse[ATT_ROWS_PER_WARP], row_delta[ATT_ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ATT_ROWS_PER_WARP; i++) {
        int r = warp + i * ATT_WARPS;
        row_lse[i] = r < nq ? lse[(size_t)bh * T + q0 + r] : 0.0f;
        row_delta[i] = 0.0f;
    }
    for (int sweep = 0; sweep < 2; sweep++) {
        for (int k0 = 0; k0 < nkeys; k0 += ATT_COLS) {
            int nk = att_min(ATT_COLS, nkeys - k0);
            __syncthreads();
            att_load(k, seq + C + k0 * C3, C3, nk, hs);
            att_load(v, seq + 2 * C + k0 * C3, C3, nk, hs);
            __syncthreads();
#pragma unroll
            for (int i = 0; i < ATT_ROWS_PER_WARP; i++) {
                int r = warp + i * ATT_WARPS, n = att_min(nk, q0 + r + 1 - k0);
                if (r >= nq || n <= 0) continue;
                const float *qr = q + r * S, *gr = g + r * S;
                if (sweep == 0) {
                    row_delta[i] += warp_reduce(attention_row_delta(qr, gr, k, v, S, n, hs, row_lse[i], lane, 32),
                                                SumOp());
                    continue;
                }
                attention_row_dscores(ds, qr, gr, k, v, S, n, hs, row_lse[i], row_delta[i], lane, 32);
                __syncwarp();
                attention_add_rows(dq + r * S, ds, k, S, n, hs, lane, 32);
                __syncwarp();
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ATT_ROWS_PER_WARP; i++) {
        int r = warp + i * ATT_WARPS, t = q0 + r;
        if (r >= nq) continue;
        att_add_row(dqkv + ((size_t)b * T + t) * C3 + (size_t)h * hs, dq + r * S, hs, lane);
        if (lane == 0) delta[(size_t)bh * T + t] = row_delta[i];
    }
}

// backward 2: a block of keys against every query tile from the block's first key on (earlier
// queries do not see these keys), after backward 1 has written every row's delta
static __global__ void attention_key_backward_kernel(float *dqkv, const float *dout, const float *qkv,
                                                     const float *lse, const float *delta, int T, int C, int NH,
                                                     int row_blocks) {
    extern __shared__ float smem[];
    int hs = C / NH, S = hs + 1, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int bh = blockIdx.x / row_blocks, k0 = (blockIdx.x % row_blocks) * ATT_ROWS, b = bh / NH, h = bh % NH;
    int nk = att_min(ATT_ROWS, T - k0);
    size_t C3 = 3 * (size_t)C;
    const float *seq = qkv + (size_t)b * T * C3 + (size_t)h * hs;
    const float *dseq = dout + (size_t)b * T * C + (size_t)h * hs;
    float *k = smem, *v = k + ATT_ROWS * S, *dk = v + ATT_ROWS * S, *dv = dk + ATT_ROWS * S;
    float *q = dv + ATT_ROWS * S, *g = q + ATT_COLS * S, *lse_q = g + ATT_COLS * S, *delta_q = lse_q + ATT_COLS;
    float *p = delta_q + ATT_COLS + warp * 2 * ATT_COLS, *ds = p + ATT_COLS;
    att_load(k, seq + C + k0 * C3, C3, nk, hs);
    att_load(v, seq + 2 * C + k0 * C3, C3, nk, hs);
    att_zero(dk, nk, hs);
    att_zero(dv, nk, hs);
    for (int i0 = k0; i0 < T; i0 += ATT_COLS) {
        int nq = att_min(ATT_COLS, T - i0);
        __syncthreads();
        att_load(q, seq + i0 * C3, C3, nq, hs);
        att_load(g, dseq + (size_t)i0 * C, C, nq, hs);
        att_load_vector(lse_q, lse + (size_t)bh * T + i0, nq);
        att_load_vector(delta_q, delta + (size_t)bh * T + i0, nq);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < ATT_ROWS_PER_WARP; i++) {
            int r = warp + i * ATT_WARPS, first = k0 + r - i0;  // causal: queries from the key on
            if (first < 0) first = 0;
            int n = nq - first;
            if (r >= nk || n <= 0) continue;
            const float *qf = q + first * S, *gf = g + first * S;
            attention_column_grads(p, ds, k + r * S, v + r * S, qf, gf, S, lse_q + first, delta_q + first, n, hs,
                                   lane, 32);
            __syncwarp();
            attention_add_rows(dv + r * S, p, gf, S, n, hs, lane, 32);
            attention_add_rows(dk + r * S, ds, qf, S, n, hs, lane, 32);
            __syncwarp();
        }
    }
#pragma unroll
    for (int i = 0; i < ATT_ROWS_PER_WARP; i++) {
        int r = warp + i * ATT_WARPS;
        if (r >= nk) continue;
        float *row = dqkv + ((size_t)b * T + k0 + r) * C3 + (size_t)h * hs;
        att_add_row(row + C, dk + r * S, hs, lane);
        att_add_row(row + 2 * C, dv + r * S, hs, lane);
    }
}

// att holds the forward's log-sum-exps; datt, scratch, gets each row's delta
// ---- attention backward's keys' side on the tensor cores (OPS_CUDA_KERNELS=flash_bf16):
// flash_tiles.h's steps, after the f32 query kernel has left delta in datt and added dq. Shared
// memory: the block's k and v (FLASH_BR x hs) and a tile's q and dout (FLASH_BC x hs) in bf16,
// the tile's lse and delta; per warp s^T and dp^T (16 x FLASH_BC f32 each, side by side: at the
// end they hold the warp's dk or dv rows, 16 x hs f32, on their way out) and p^T and ds^T (bf16).
// dk and dv accumulate in wmma fragments over every tile (FLASH_MAX_HS / 16 of each, the ones
// past hs unused). Lane r < 16 of a warp runs key r's step 2.
static size_t flash_key_smem_bytes(int hs) {
    return (size_t)(FLASH_BR + FLASH_BC) * 2 * hs * sizeof(__nv_bfloat16) + 2 * FLASH_BC * sizeof(float) +
           (size_t)FLASH_WARPS * FLASH_ROWS * FLASH_BC * 2 * (sizeof(float) + sizeof(uint16_t));
}

static __global__ void __launch_bounds__(FLASH_WARPS * 32)
    flash_backward_key_kernel(float *dqkv, const float *dout, const float *qkv, const float *lse, const float *delta,
                              int T, int C, int NH, int key_blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // never launched before sm_80 (attention_backward)
    using namespace nvcuda;
    typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> RowA;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> RowB;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> ColB;
    extern __shared__ __align__(128) unsigned char flash_smem[];
    int hs = C / NH, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int bh = blockIdx.x / key_blocks, k0 = (blockIdx.x % key_blocks) * FLASH_BR, b = bh / NH, h = bh % NH;
    int key = k0 + warp * FLASH_ROWS + lane;  // lanes < 16: the key whose step 2 the lane runs
    size_t C3 = 3 * (size_t)C;
    const float *seq = qkv + (size_t)b * T * C3 + (size_t)h * hs, *dseq = dout + (size_t)b * T * C + (size_t)h * hs;
    float scale = attention_scale(hs);
    __nv_bfloat16 *k = (__nv_bfloat16 *)flash_smem, *v = k + FLASH_BR * hs, *q = v + FLASH_BR * hs, *g = q + FLASH_BC * hs;
    float *tile_lse = (float *)(g + FLASH_BC * hs), *tile_delta = tile_lse + FLASH_BC;
    float *st = tile_delta + FLASH_BC + warp * FLASH_ROWS * FLASH_BC * 2, *dpt = st + FLASH_ROWS * FLASH_BC;
    uint16_t *pt = (uint16_t *)(tile_delta + FLASH_BC + FLASH_WARPS * FLASH_ROWS * FLASH_BC * 2) +
                   warp * FLASH_ROWS * FLASH_BC * 2,
             *dst = pt + FLASH_ROWS * FLASH_BC;
    const __nv_bfloat16 *kw = k + warp * FLASH_ROWS * hs, *vw = v + warp * FLASH_ROWS * hs;

    flash_load(k, seq + C, C3, k0, FLASH_BR, T, hs);
    flash_load(v, seq + 2 * (size_t)C, C3, k0, FLASH_BR, T, hs);
    Acc dk[FLASH_MAX_HS / 16], dv[FLASH_MAX_HS / 16];
#pragma unroll
    for (int cf = 0; cf < FLASH_MAX_HS / 16; cf++) wmma::fill_fragment(dk[cf], 0.0f), wmma::fill_fragment(dv[cf], 0.0f);
    for (int q0 = flash_first_query_tile(k0) * FLASH_BC; q0 < T; q0 += FLASH_BC) {
        __syncthreads();  // every warp is done with the previous tile
        flash_load(q, seq, C3, q0, FLASH_BC, T, hs);
        flash_load(g, dseq, C, q0, FLASH_BC, T, hs);
        for (int i = threadIdx.x; i < FLASH_BC; i += blockDim.x) {
            tile_lse[i] = q0 + i < T ? lse[(size_t)bh * T + q0 + i] : 0.0f;
            tile_delta[i] = q0 + i < T ? delta[(size_t)bh * T + q0 + i] : 0.0f;
        }
        __syncthreads();
        // 1. s^T = k q^T and dp^T = v dout^T for the warp's 16 keys
        for (int n = 0; n < FLASH_BC / 16; n++) {
            Acc s_acc, dp_acc;
            wmma::fill_fragment(s_acc, 0.0f);
            wmma::fill_fragment(dp_acc, 0.0f);
            for (int kk = 0; kk < hs / 16; kk++) {
                RowA a;
                ColB bt;
                wmma::load_matrix_sync(a, kw + kk * 16, hs);
                wmma::load_matrix_sync(bt, q + n * 16 * hs + kk * 16, hs);
                wmma::mma_sync(s_acc, a, bt, s_acc);
                wmma::load_matrix_sync(a, vw + kk * 16, hs);
                wmma::load_matrix_sync(bt, g + n * 16 * hs + kk * 16, hs);
                wmma::mma_sync(dp_acc, a, bt, dp_acc);
            }
            wmma::store_matrix_sync(st + n * 16, s_acc, FLASH_BC, wmma::mem_row_major);
            wmma::store_matrix_sync(dpt + n * 16, dp_acc, FLASH_BC, wmma::mem_row_major);
        }
        __syncwarp();
        // 2. each key's probabilities and scores' gradients over the tile
        if (lane < FLASH_ROWS)
            flash_key_tile(pt + lane * FLASH_BC, dst + lane * FLASH_BC, st + lane * FLASH_BC, dpt + lane * FLASH_BC, key,
                           q0, T, scale, tile_lse, tile_delta);
        __syncwarp();
        // 3. dv += p^T dout, dk += ds^T q
#pragma unroll
        for (int cf = 0; cf < FLASH_MAX_HS / 16; cf++) {
            if (cf >= hs / 16) break;
            for (int kk = 0; kk < FLASH_BC / 16; kk++) {
                RowA a;
                RowB bm;
                wmma::load_matrix_sync(a, (const __nv_bfloat16 *)pt + kk * 16, FLASH_BC);
                wmma::load_matrix_sync(bm, g + kk * 16 * hs + cf * 16, hs);
                wmma::mma_sync(dv[cf], a, bm, dv[cf]);
                wmma::load_matrix_sync(a, (const __nv_bfloat16 *)dst + kk * 16, FLASH_BC);
                wmma::load_matrix_sync(bm, q + kk * 16 * hs + cf * 16, hs);
                wmma::mma_sync(dk[cf], a, bm, dk[cf]);
            }
        }
    }
    // dk, then dv, through the warp's s^T/dp^T space (16 x hs floats) into dqkv: added, as every backward adds
    for (int part = 1; part <= 2; part++) {
        __syncwarp();
#pragma unroll
        for (int cf = 0; cf < FLASH_MAX_HS / 16; cf++)
            if (cf < hs / 16) wmma::store_matrix_sync(st + cf * 16, part == 1 ? dk[cf] : dv[cf], hs, wmma::mem_row_major);
        __syncwarp();
        for (int i = lane; i < FLASH_ROWS * hs; i += 32) {
            int r = k0 + warp * FLASH_ROWS + i / hs;
            if (r < T) dqkv[((size_t)b * T + r) * C3 + (size_t)part * C + (size_t)h * hs + i % hs] += st[i];
        }
    }
#else
    (void)dqkv, (void)dout, (void)qkv, (void)lse, (void)delta, (void)T, (void)C, (void)NH, (void)key_blocks;
#endif
}

void attention_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, int B, int T, int C, int NH) {
    if (B <= 0 || T <= 0) return;
    ensure_init();
    int hs = C / NH, row_blocks = (T + ATT_ROWS - 1) / ATT_ROWS;
    unsigned blocks = (unsigned)((size_t)B * NH * row_blocks);
    size_t smem = att_prepare(attention_query_backward_kernel, ATT_QUERY_BACKWARD_SMEM, hs);
    LAUNCH(attention_query_backward_kernel, blocks, ATT_WARPS * 32, smem, dqkv, datt, dout, qkv, att, T, C, NH,
           row_blocks);
    smem = flash_key_smem_bytes(hs);
    if (flash_switched_for(hs, smem)) {
        CUDA_CHECK(cudaFuncSetAttribute(flash_backward_key_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        int key_blocks = (T + FLASH_BR - 1) / FLASH_BR;
        LAUNCH(flash_backward_key_kernel, (unsigned)((size_t)B * NH * key_blocks), FLASH_WARPS * 32, smem, dqkv, dout,
               qkv, att, datt, T, C, NH, key_blocks);
        return;
    }
    smem = att_prepare(attention_key_backward_kernel, ATT_KEY_BACKWARD_SMEM, hs);
    LAUNCH(attention_key_backward_kernel, blocks, ATT_WARPS * 32, smem, dqkv, dout, qkv, att, datt, T, C, NH,
           row_blocks);
}

// the 16-bit precisions run the kernels above: which ones is OPS_CUDA_KERNELS's choice (flash_bf16)
void attention_forward_16(float *out, float *att, const float *qkv, int B, int T, int C, int NH) {
    attention_forward(out, att, qkv, B, T, C, NH);
}

void attention_backward_16(float *dqkv, float *datt, const float *dout, const float *qkv,
                           const float *att, int B, int T, int C, int NH) {
    attention_backward(dqkv, datt, dout, qkv, att, B, T, C, NH);
}

// ----------------------------------------------------------------------------------------------
// element-wise

static __global__ void gelu_forward_kernel(float *out, const float *inp, size_t n) {
    GRID_STRIDE(i, n) out[i] = gelu_value(inp[i]);
}

static __global__ void gelu_backward_kernel(float *dinp, const float *inp, const float *dout, size_t n) {
    GRID_STRIDE(i, n) dinp[i] = dout[i] * gelu_grad(inp[i]);
}

static __global__ void rotary_kernel(float *qkv, const int *start, size_t pairs, int T, int C_attn, int NH,
                                     int rot_dim, Rope rope, float direction) {
    GRID_STRIDE(p, pairs) rotary_qkv_pair(qkv, start, (long)p, T, C_attn, NH, rot_dim, rope, direction);
}

static __global__ void swiglu_forward_kernel(float *h, const float *gate_up, size_t n, int F) {
    GRID_STRIDE(i, n) h[i] = swiglu_value(gate_up, i, F);
}

static __global__ void swiglu_backward_kernel(float *dgate_up, const float *gate_up, const float *dh, size_t n,
                                              int F) {
    GRID_STRIDE(i, n) swiglu_grad(dgate_up, gate_up, dh, i, F);
}

static __global__ void gqa_expand_kernel(float *qkv, const float *proj, size_t n, int C_attn, int NH, int NKV) {
    int width = C_attn + 2 * (C_attn / NH) * NKV;
    GRID_STRIDE(i, n) qkv[i] = gqa_expanded_value(proj + i / (3 * C_attn) * width, (int)(i % (3 * C_attn)), C_attn,
                                                 NH, NKV);
}

static __global__ void gqa_reduce_kernel(float *dproj, const float *dqkv, size_t n, int C_attn, int NH, int NKV) {
    int width = C_attn + 2 * (C_attn / NH) * NKV;
    GRID_STRIDE(i, n) dproj[i] = gqa_reduced_grad(dqkv + i / width * 3 * C_attn, (int)(i % width), C_attn, NH, NKV);
}

static __global__ void add_kernel(float *out, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

static __global__ void add_inplace_kernel(float *acc, const float *x, size_t n) {
    GRID_STRIDE(i, n) acc[i] += x[i];
}

static __global__ void add_columns_scaled_kernel(float *dst, int dst_stride, const float *src, int src_stride,
                                                 int width, float s, size_t n) {
    GRID_STRIDE(i, n) {
        size_t row = i / (size_t)width, col = i % (size_t)width;
        // rounded twice, as on the CPU (nvcc would fuse an FMA): both backends give the same bits
        float *d = &dst[row * dst_stride + col];
        *d = __fadd_rn(*d, __fmul_rn(s, src[row * src_stride + col]));
    }
}

static __global__ void dropout_kernel(float *out, const float *inp, int N, int width, DropoutMask m, int add) {
    GRID_STRIDE(i, (size_t)N * width) {
        float v = __fmul_rn(inp[i], dropout_factor(&m, N, (int)(i / width), (int)(i % width)));
        out[i] = add ? __fadd_rn(out[i], v) : v;
    }
}

static __global__ void scale_kernel(float *x, float s, size_t n) {
    GRID_STRIDE(i, n) x[i] *= s;
}

void gelu_forward(float *out, const float *inp, size_t n) {
    if (!n) return;
    ensure_init();
    LAUNCH(gelu_forward_kernel, grid_for(n), THREADS, 0, out, inp, n);
}

void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
    if (!n) return;
    ensure_init();
    LAUNCH(gelu_backward_kernel, grid_for(n), THREADS, 0, dinp, inp, dout, n);
}

// The 16-bit copies as a second pass (cast_gradient_to_16's): a GPU's memory makes it a small one
void gelu_backward_16(float *dinp, half16 *dinp16, const float *inp, const float *dout, size_t n) {
    gelu_backward(dinp, inp, dout, n);
    cast_gradient_to_16(dinp16, dinp, n);
}

void swiglu_forward(float *h, const float *gate_up, int N, int F) {
    size_t n = (size_t)N * F;
    if (!n) return;
    ensure_init();
    LAUNCH(swiglu_forward_kernel, grid_for(n), THREADS, 0, h, gate_up, n, F);
}

void swiglu_backward(float *dgate_up, const float *gate_up, const float *dh, int N, int F) {
    size_t n = (size_t)N * F;
    if (!n) return;
    ensure_init();
    LAUNCH(swiglu_backward_kernel, grid_for(n), THREADS, 0, dgate_up, gate_up, dh, n, F);
}

void swiglu_backward_16(float *dgate_up, half16 *dgate_up16, const float *gate_up, const float *dh, int N, int F) {
    swiglu_backward(dgate_up, gate_up, dh, N, F);
    cast_gradient_to_16(dgate_up16, dgate_up, (size_t)N * 2 * F);
}

void gqa_expand(float *qkv, const float *proj, int N, int C_attn, int NH, int NKV) {
    size_t n = (size_t)N * 3 * C_attn;
    if (!n) return;
    ensure_init();
    LAUNCH(gqa_expand_kernel, grid_for(n), THREADS, 0, qkv, proj, n, C_attn, NH, NKV);
}

void gqa_reduce(float *dproj, const float *dqkv, int N, int C_attn, int NH, int NKV) {
    size_t n = (size_t)N * (C_attn + 2 * (C_attn / NH) * NKV);
    if (!n) return;
    ensure_init();
    LAUNCH(gqa_reduce_kernel, grid_for(n), THREADS, 0, dproj, dqkv, n, C_attn, NH, NKV);
}

static void rotary_apply(float *qkv, const int *start, int B, int T, int C_attn, int NH, int rot_dim,
                         Rope rope, float direction) {
    size_t pairs = (size_t)B * T * 2 * NH * (rot_dim / 2);
    if (!pairs) return;
    ensure_init();
    LAUNCH(rotary_kernel, grid_for(pairs), THREADS, 0, qkv, start, pairs, T, C_attn, NH, rot_dim, rope,
           direction);
}

void rotary_forward(float *qkv, const int *start, int B, int T, int C_attn, int NH, int rot_dim, Rope rope) {
    rotary_apply(qkv, start, B, T, C_attn, NH, rot_dim, rope, 1.0f);
}

void rotary_backward(float *dqkv, const int *start, int B, int T, int C_attn, int NH, int rot_dim, Rope rope) {
    rotary_apply(dqkv, start, B, T, C_attn, NH, rot_dim, rope, -1.0f);
}

// ----------------------------------------------------------------------------------------------
// mixture of experts: a warp per token (its rows are its own), lanes over the columns

static __global__ void moe_dispatch_kernel(float *packed, const float *x, const int *slot, int N, int k, int C) {
    int n = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (n < N) moe_dispatch_row(packed, x + (size_t)n * C, slot + (size_t)n * k, k, C, threadIdx.x % 32, 32);
}

static __global__ void moe_dispatch_backward_kernel(float *dx, const float *dpacked, const int *slot, int N, int k,
                                                    int C) {
    int n = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (n < N) moe_dispatch_backward_row(dx + (size_t)n * C, dpacked, slot + (size_t)n * k, k, C, threadIdx.x % 32, 32);
}

static __global__ void moe_combine_kernel(float *out, const float *y, const int *slot, const float *weight, int N,
                                          int k, int C) {
    int n = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (n < N)
        moe_combine_row(out + (size_t)n * C, y, slot + (size_t)n * k, weight + (size_t)n * k, k, C, threadIdx.x % 32, 32);
}

static __global__ void moe_combine_backward_kernel(float *dy, float *dweight, const float *dout, const float *y,
                                                   const int *slot, const float *weight, int N, int k, int C) {
    int lane = threadIdx.x % 32, n = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (n >= N) return;  // the whole warp leaves together, so the shuffles stay full-warp
    const float *d = dout + (size_t)n * C;
    moe_combine_backward_row(dy, d, slot + (size_t)n * k, weight + (size_t)n * k, k, C, lane, 32);
    for (int j = 0; j < k; j++) {
        float g = warp_reduce(moe_weight_grad_partial(d, y, slot[(size_t)n * k + j], C, lane, 32), SumOp());
        if (lane == 0) dweight[(size_t)n * k + j] = g;
    }
}

void moe_dispatch(float *packed, const float *x, const int *slot, int N, int k, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(moe_dispatch_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, packed, x, slot, N, k, C);
}

void moe_dispatch_backward(float *dx, const float *dpacked, const int *slot, int N, int k, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(moe_dispatch_backward_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, dx, dpacked, slot, N, k, C);
}

void moe_combine(float *out, const float *y, const int *slot, const float *weight, int N, int k, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(moe_combine_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, out, y, slot, weight, N, k, C);
}

void moe_combine_backward(float *dy, float *dweight, const float *dout, const float *y, const int *slot,
                          const float *weight, int N, int k, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(moe_combine_backward_kernel, blocks_for((size_t)N, ROWS_PER_BLOCK), THREADS, 0, dy, dweight, dout, y,
           slot, weight, N, k, C);
}

void add_forward(float *out, const float *a, const float *b, size_t n) {
    if (!n) return;
    ensure_init();
    LAUNCH(add_kernel, grid_for(n), THREADS, 0, out, a, b, n);
}

void add_inplace(float *acc, const float *x, size_t n) {
    if (!n) return;
    ensure_init();
    LAUNCH(add_inplace_kernel, grid_for(n), THREADS, 0, acc, x, n);
}

void add_columns_scaled(float *dst, int dst_stride, const float *src, int src_stride, int N, int width, float s) {
    size_t n = (size_t)N * width;
    if (!n) return;
    ensure_init();
    LAUNCH(add_columns_scaled_kernel, grid_for(n), THREADS, 0, dst, dst_stride, src, src_stride, width, s, n);
}

void dropout_apply(float *out, const float *inp, int N, int width, const DropoutMask *m, int add) {
    size_t n = (size_t)N * width;
    if (!n) return;
    ensure_init();
    LAUNCH(dropout_kernel, grid_for(n), THREADS, 0, out, inp, N, width, *m, add);
}

void scale_inplace(float *x, float s, size_t n) {
    if (!n) return;
    ensure_init();
    LAUNCH(scale_kernel, grid_for(n), THREADS, 0, x, s, n);
}

// ----------------------------------------------------------------------------------------------
// softmax + cross-entropy: a block per row; lane = threadIdx.x of nlanes = blockDim.x

#define CE_THREADS 512

static __device__ void record_bad_target(BadTarget *bad, int row, int target, int V) {
    bad->V = V;
    bad->row_target = ((unsigned long long)(row + 1) << 32) | (unsigned)target;
}

// dlogits == NULL: forward only. Otherwise dlogits (which may be logits itself) gets the gradient,
// and dlogits16, where set, its 16-bit copy (counted into counts as cast_gradient_kernel counts).
// Every branch below depends only on the row's target, the same for the whole block, so every
// thread reaches each barrier inside block_reduce.
static __global__ void cross_entropy_kernel(float *losses, const float *logits, float *dlogits,
                                            half16 *dlogits16, int fp16, unsigned long long *counts,
                                            const int *targets, float dloss, int V, int Vp,
                                            BadTarget *bad) {
    int n = blockIdx.x, lane = threadIdx.x, nlanes = blockDim.x;
    const float *x = logits + (size_t)n * Vp;
    float *dx = dlogits ? dlogits + (size_t)n * Vp : NULL;
    half16 *dx16 = dlogits16 ? dlogits16 + (size_t)n * Vp : NULL;
    unsigned long long nonzero = 0, flushed = 0;
    int target = targets[n];
    if (target >= V) {
        if (lane == 0) record_bad_target(bad, n, target, V);
        target = -1;  // read nothing outside the row; the host stops at the next synchronisation
    }
    if (target < 0) {  // no loss, so no gradient either
        if (lane == 0) losses[n] = 0.0f;
        if (dx)
            for (int i = lane; i < Vp; i += nlanes) dx[i] = 0.0f;
        if (dx16)
            for (int i = lane; i < Vp; i += nlanes) dx16[i] = 0;  // +0 in both formats: nothing to count
        return;
    }
    float x_target = x[target];  // read before any thread overwrites the row (barriers follow)
    float max = block_reduce(row_partial_max(x, V, lane, nlanes), -INFINITY, MaxOp());
    float sumexp = block_reduce(row_partial_sumexp(x, max, V, lane, nlanes), 0.0f, SumOp());
    if (lane == 0) losses[n] = cross_entropy_loss(x_target, max, sumexp);
    if (dx) {
        // every read of x above happened before the last barrier, so the row can be overwritten
        float inv_sum = 1.0f / sumexp;
        for (int i = lane; i < V; i += nlanes) {
            dx[i] = cross_entropy_dlogit(softmax_exp(x[i], max) * inv_sum, i == target, dloss);
            if (dx16) dx16[i] = gradient_to_16(dx[i], fp16, &nonzero, &flushed);
        }
        for (int i = V + lane; i < Vp; i += nlanes) dx[i] = 0.0f;  // padded vocabulary
        if (dx16) {
            for (int i = V + lane; i < Vp; i += nlanes) dx16[i] = 0;
            add_half_underflow(counts, nonzero, flushed);
        }
    }
}

void cross_entropy_forward(float *losses, const float *logits, const int *targets, int N, int V,
                           int Vp) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(cross_entropy_kernel, (unsigned)N, CE_THREADS, 0, losses, logits, (float *)NULL, (half16 *)NULL, 0,
           (unsigned long long *)NULL, targets, 0.0f, V, Vp, g.bad_dev);
}

void cross_entropy_forward_backward(float *logits_then_dlogits, half16 *dlogits16, float *losses,
                                    const int *targets, float dloss, int N, int V, int Vp) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(cross_entropy_kernel, (unsigned)N, CE_THREADS, 0, losses, logits_then_dlogits, logits_then_dlogits,
           dlogits16, g_half == HALF_FP16, dlogits16 ? underflow_counts() : (unsigned long long *)NULL, targets,
           dloss, V, Vp, g.bad_dev);
}

// ----------------------------------------------------------------------------------------------
// sums in double, in a fixed order: SUM_BLOCKS blocks of SUM_THREADS whatever the GPU, each
// thread striding over the buffer, each block combining into one partial, one block adding the
// partials. Same bits on every run and every GPU model.

#define SUM_BLOCKS 1024
#define SUM_THREADS 256

static __global__ void sum_partials_kernel(double *partials, const float *x, size_t n, int squares) {
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)x[i];
        acc += squares ? v * v : v;
    }
    acc = block_reduce(acc, 0.0, SumOp());
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

static __global__ void sum_final_kernel(double *total, const double *partials) {
    double acc = block_reduce(partials[threadIdx.x], 0.0, SumOp());  // SUM_BLOCKS threads
    if (threadIdx.x == 0) *total = acc;
}

static double sum_to_host(const float *x, size_t n, int squares) {
    if (!n) return 0.0;
    ensure_init();
    if (!g.dev_sums) g.dev_sums = (double *)device_alloc_or_die((SUM_BLOCKS + 1) * sizeof(double), "sums");
    LAUNCH(sum_partials_kernel, SUM_BLOCKS, SUM_THREADS, 0, g.dev_sums, x, n, squares);
    LAUNCH(sum_final_kernel, 1, SUM_BLOCKS, 0, g.dev_sums + SUM_BLOCKS, g.dev_sums);
    CUDA_CHECK(cudaMemcpyAsync(g.host_result, g.dev_sums + SUM_BLOCKS, sizeof(double),
                               cudaMemcpyDeviceToHost, g.stream));
    sync_stream();
    return *g.host_result;
}

double sum_squares(const float *x, size_t n) { return sum_to_host(x, n, 1); }

// the largest |x[i]|: the same two passes with a max, in floats (the scratch of the sums)
static __global__ void abs_max_partials_kernel(float *partials, const float *x, size_t n) {
    float m = 0.0f;
    GRID_STRIDE(i, n) m = fmaxf(m, fabsf(x[i]));
    m = block_reduce(m, 0.0f, MaxOp());
    if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

static __global__ void max_final_kernel(float *total, const float *partials) {
    float m = block_reduce(partials[threadIdx.x], 0.0f, MaxOp());  // SUM_BLOCKS threads
    if (threadIdx.x == 0) *total = m;
}

double abs_max(const float *x, size_t n) {
    if (!n) return 0.0;
    ensure_init();
    if (!g.dev_sums) g.dev_sums = (double *)device_alloc_or_die((SUM_BLOCKS + 1) * sizeof(double), "sums");
    float *partials = (float *)g.dev_sums;
    LAUNCH(abs_max_partials_kernel, SUM_BLOCKS, SUM_THREADS, 0, partials, x, n);
    LAUNCH(max_final_kernel, 1, SUM_BLOCKS, 0, partials + SUM_BLOCKS, partials);
    CUDA_CHECK(cudaMemcpyAsync(g.host_result, partials + SUM_BLOCKS, sizeof(float), cudaMemcpyDeviceToHost, g.stream));
    sync_stream();
    return *(float *)g.host_result;
}
double sum_values(const float *x, size_t n) { return sum_to_host(x, n, 0); }

// ----------------------------------------------------------------------------------------------
// AdamW: one fused pass, a thread per parameter (grid-stride); the bias corrections are computed
// once on the host, exactly as the CPU backend does

static __global__ void adamw_kernel(float *param, half16 *param16, int fp16, const float *grad, float grad_scale,
                                    float *m, float *v, size_t n, float lr, float beta1, float beta2, float eps,
                                    float weight_decay, float bc1, float bc2) {
    GRID_STRIDE(i, n) {
        adamw_element(&param[i], &m[i], &v[i], grad[i] * grad_scale, lr, beta1, beta2, eps, weight_decay, bc1, bc2);
        if (param16) param16[i] = half_from_float(param[i], fp16);
    }
}

void adamw_update_16(float *param, half16 *param16, const float *grad, float grad_scale, float *m, float *v,
                     size_t n, float lr, float beta1, float beta2, float eps, float weight_decay, int t) {
    if (!n) return;
    ensure_init();
    float bc1 = (float)(1.0 - pow(beta1, t));
    float bc2 = (float)(1.0 - pow(beta2, t));
    LAUNCH(adamw_kernel, grid_for(n), THREADS, 0, param, param16, g_half == HALF_FP16, grad, grad_scale, m, v, n,
           lr, beta1, beta2, eps, weight_decay, bc1, bc2);
}

void adamw_update(float *param, const float *grad, float grad_scale, float *m, float *v, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int t) {
    adamw_update_16(param, NULL, grad, grad_scale, m, v, n, lr, beta1, beta2, eps, weight_decay, t);
}

static __global__ void muon_momentum_kernel(float *grad, float grad_scale, float *momentum, size_t n, float beta,
                                            int nesterov) {
    GRID_STRIDE(i, n)
    grad[i] = muon_momentum_element(&momentum[i], grad[i] * grad_scale, beta, nesterov);
}

void muon_momentum(float *grad, float grad_scale, float *momentum, size_t n, float beta, int nesterov) {
    if (!n) return;
    ensure_init();
    LAUNCH(muon_momentum_kernel, grid_for(n), THREADS, 0, grad, grad_scale, momentum, n, beta, nesterov);
}

// ----------------------------------------------------------------------------------------------
// ---- attention with a KV cache; CUDA graphs
//
//   kv_cache_write         a thread per (row, key/value column): k and v copied side by side into
//                          the pool block the row's position lies in (the sequence's block table)
//   attention_cached       a block of ATT_CACHED_THREADS per (sequence, head, new row): the lanes
//                          share the keys for the scores and the value columns for the output
//                          (kernels.h's three steps), max and sum combined by block_reduce. At
//                          batch 1 a thread per row would leave all but NH threads idle.
//   graphs                 stream capture of the ops stream; cuBLAS gets a workspace of its own
//                          first, since it must not allocate one while being captured

#define ATT_CACHED_THREADS 64

static __global__ void kv_cache_write_kernel(float *k_pool, float *v_pool, const float *qkv, const int *start,
                                             const int *table, int T, size_t n, int C, int NH, int NKV,
                                             int block_size, int max_blocks) {
    int hs = C / NH, Ckv = NKV * hs;
    GRID_STRIDE(i, n) {
        int bt = (int)(i / Ckv), c = (int)(i % Ckv), b = bt / T;
        const int *tab = table + (size_t)b * max_blocks;
        int pos = start[b] + bt % T, from = gqa_expanded_column(c, hs, NH, NKV);
        ((float *)cache_row(k_pool, tab, pos, block_size, Ckv))[c] = qkv[(size_t)bt * 3 * C + C + from];
        ((float *)cache_row(v_pool, tab, pos, block_size, Ckv))[c] = qkv[(size_t)bt * 3 * C + 2 * C + from];
    }
}

void kv_cache_write(float *k_pool, float *v_pool, const float *qkv, const int *start, const int *table,
                    int B, int T, int C, int NH, int NKV, int block_size, int max_blocks) {
    size_t n = (size_t)B * T * (C / NH * NKV);
    if (!n) return;
    ensure_init();
    LAUNCH(kv_cache_write_kernel, grid_for(n), THREADS, 0, k_pool, v_pool, qkv, start, table, T, n, C, NH, NKV,
           block_size, max_blocks);
}

// blockIdx.x = (b * NH + h) * T + t. Every thread reaches both block_reduce barriers: the loop
// bounds depend on the row's position only, the same for the whole block. The keys and values
// are read through the sequence's block table (PagedAttention), a cache block at a time.
static __global__ void attention_cached_kernel(float *out, float *scores, const float *qkv, const float *k_pool,
                                               const float *v_pool, const int *start, const int *table, int T,
                                               int C, int NH, int NKV, int block_size, int max_blocks) {
    int hs = C / NH, Ckv = NKV * hs, lane = threadIdx.x, nlanes = blockDim.x;
    int t = blockIdx.x % T, bh = blockIdx.x / T, b = bh / NH, h = bh % NH;
    int npos = start[b] + t + 1, kv = gqa_kv_column(h, hs, NH, NKV);  // the head's keys and values
    const float *q = qkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
    const int *tab = table + (size_t)b * max_blocks;
    float *s = scores + (size_t)blockIdx.x * max_blocks * block_size;
    float max = block_reduce(attention_cached_scores(s, q, k_pool + kv, tab, block_size, npos, hs, Ckv, lane, nlanes),
                             -INFINITY, MaxOp());
    // the barriers inside block_reduce also make every lane's scores visible to the others
    float sum = block_reduce(attention_exp(s, max, npos, lane, nlanes), 0.0f, SumOp());
    attention_cached_values(out + ((size_t)b * T + t) * C + (size_t)h * hs, s, 1.0f / sum, v_pool + kv, tab,
                            block_size, npos, hs, Ckv, lane, nlanes);
}

void attention_cached_forward(float *out, float *scores, const float *qkv, const float *k_pool,
                              const float *v_pool, const int *start, const int *table, int B, int T, int C,
                              int NH, int NKV, int block_size, int max_blocks) {
    if (B <= 0 || T <= 0) return;
    ensure_init();
    LAUNCH(attention_cached_kernel, (unsigned)((size_t)B * NH * T), ATT_CACHED_THREADS, 0, out, scores, qkv, k_pool,
           v_pool, start, table, T, C, NH, NKV, block_size, max_blocks);
}

static void *g_cublas_workspace = NULL;

int ops_graphs_supported(void) { return 1; }

void ops_graph_begin(void) {
    ensure_init();
    if (!g_cublas_workspace) {
        // cuBLAS otherwise allocates its workspace on first use, which capture forbids
        const size_t bytes = (size_t)32 << 20;
        g_cublas_workspace = device_alloc_or_die(bytes, "the cuBLAS workspace for CUDA graphs");
        CUBLAS_CHECK(cublasSetWorkspace(g.cublas, g_cublas_workspace, bytes));
    }
    sync_stream();  // nothing earlier may still be queued when recording starts
    CUDA_CHECK(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal));
    g_capturing = 1;
}

void *ops_graph_end(void) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamEndCapture(g.stream, &graph));
    g_capturing = 0;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));  // the executable graph keeps what it needs
    g_graphs_alive++;
    return (void *)exec;
}

void ops_graph_replay(void *graph) {
    CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, g.stream));
}

void ops_graph_free(void *graph) {
    if (!graph) return;
    CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)graph));
    // stream-ordered: a replay queued before this point still finishes on the retired blocks
    if (--g_graphs_alive == 0)
        while (g_retired.n) CUDA_CHECK(cudaFreeAsync(g_retired.blocks[--g_retired.n], g.stream));
}

// ----------------------------------------------------------------------------------------------
// ---- LayerNorm and cross-entropy over rows split into shards (the sums between the steps are
// the caller's)
// The row reductions here run a thread per row (lane 0 of 1 in kernels.h's terms): these ops see
// a shard of a row (C / y columns, V / x logits), and there are many rows. No barriers, so no
// uniformity to keep.

static __global__ void layernorm_row_sums_kernel(float *sums, const float *inp, const float *mean, int N, int C) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const float *x = inp + (size_t)n * C;
    sums[n] = mean ? row_partial_sqdev(x, mean[n], C, 0, 1) : row_partial_sum(x, C, 0, 1);
}

void layernorm_row_sums(float *sums, const float *inp, const float *mean, int N, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(layernorm_row_sums_kernel, blocks_for((size_t)N, THREADS), THREADS, 0, sums, inp, mean, N, C);
}

static __global__ void layernorm_rstd_kernel(float *rstd, const float *sum_sqdev, int N, int C_total) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n < N) rstd[n] = layernorm_rstd(sum_sqdev[n], C_total);
}

static __global__ void layernorm_normalize_kernel(float *out, const float *inp, const float *weight,
                                                  const float *bias, const float *mean, const float *rstd,
                                                  int N, int C) {
    GRID_STRIDE(i, (size_t)N * C) {
        int n = (int)(i / C), c = (int)(i % C);
        out[i] = layernorm_value(inp[i], mean[n], rstd[n], weight[c], bias[c]);
    }
}

void layernorm_forward_stats(float *out, float *rstd, const float *inp, const float *weight,
                             const float *bias, const float *mean, const float *sum_sqdev,
                             int N, int C, int C_total) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(layernorm_rstd_kernel, blocks_for((size_t)N, THREADS), THREADS, 0, rstd, sum_sqdev, N, C_total);
    LAUNCH(layernorm_normalize_kernel, grid_for((size_t)N * C), THREADS, 0, out, inp, weight, bias, mean,
           rstd, N, C);
}

static __global__ void layernorm_backward_row_sums_kernel(float *sums, const float *dout, const float *inp,
                                                          const float *weight, const float *mean,
                                                          const float *rstd, int N, int C) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    layernorm_backward_partials(&sums[2 * n], &sums[2 * n + 1], dout + (size_t)n * C, inp + (size_t)n * C,
                                weight, mean[n], rstd[n], C, 0, 1);
}

void layernorm_backward_row_sums(float *sums, const float *dout, const float *inp,
                                 const float *weight, const float *mean, const float *rstd, int N, int C) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(layernorm_backward_row_sums_kernel, blocks_for((size_t)N, THREADS), THREADS, 0, sums, dout, inp,
           weight, mean, rstd, N, C);
}

static __global__ void layernorm_dinp_stats_kernel(float *dinp, const float *dout, const float *inp,
                                                   const float *weight, const float *mean, const float *rstd,
                                                   const float *sums, int N, int C, int C_total) {
    GRID_STRIDE(i, (size_t)N * C) {
        int n = (int)(i / C), c = (int)(i % C);
        dinp[i] += layernorm_dinp(dout[i], inp[i], weight[c], mean[n], rstd[n], sums[2 * n] / (float)C_total,
                                  sums[2 * n + 1] / (float)C_total);
    }
}

void layernorm_backward_stats(float *dinp, float *dweight, float *dbias, const float *dout,
                              const float *inp, const float *weight, const float *mean,
                              const float *rstd, const float *sums, int N, int C, int C_total) {
    if (N <= 0 || C <= 0) return;
    ensure_init();
    LAUNCH(layernorm_dinp_stats_kernel, grid_for((size_t)N * C), THREADS, 0, dinp, dout, inp, weight, mean,
           rstd, sums, N, C, C_total);
    layernorm_param_grads(dweight, dbias, dout, inp, mean, rstd, N, C);
}

static __global__ void cross_entropy_shard_max_kernel(float *max, const float *logits, int N, int v_count, int Vl) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n < N) max[n] = row_partial_max(logits + (size_t)n * Vl, v_count, 0, 1);
}

void cross_entropy_shard_max(float *max, const float *logits, int N, int v_count, int Vl) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(cross_entropy_shard_max_kernel, blocks_for((size_t)N, THREADS), THREADS, 0, max, logits, N, v_count, Vl);
}

static __global__ void cross_entropy_shard_sums_kernel(float *sums, const float *logits, const float *maxes,
                                                       int nmax, const int *targets, int v_lo, int v_count,
                                                       int N, int Vl) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const float *x = logits + (size_t)n * Vl;
    int local = vocab_shard_index(targets[n], v_lo, v_count);
    sums[2 * n] = row_partial_sumexp(x, max_over_shards(maxes, nmax, N, n), v_count, 0, 1);
    sums[2 * n + 1] = local >= 0 ? x[local] : 0.0f;
}

void cross_entropy_shard_sums(float *sums, const float *logits, const float *maxes, int nmax,
                              const int *targets, int v_lo, int v_count, int N, int Vl) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(cross_entropy_shard_sums_kernel, blocks_for((size_t)N, THREADS), THREADS, 0, sums, logits, maxes,
           nmax, targets, v_lo, v_count, N, Vl);
}

static __global__ void cross_entropy_shard_loss_kernel(float *losses, const float *maxes, int nmax,
                                                       const float *sums, const int *targets, int N) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    losses[n] = targets[n] < 0 ? 0.0f
                               : cross_entropy_loss(sums[2 * n + 1], max_over_shards(maxes, nmax, N, n), sums[2 * n]);
}

// a thread per logit; in place is safe (each reads and writes only its own element)
static __global__ void cross_entropy_shard_grad_kernel(float *dlogits, const float *logits, const float *maxes,
                                                       int nmax, const float *sums, const int *targets,
                                                       float dloss, int v_lo, int v_count, int N, int Vl) {
    GRID_STRIDE(i, (size_t)N * Vl) {
        int n = (int)(i / Vl), v = (int)(i % Vl), target = targets[n];
        if (target < 0 || v >= v_count) {
            dlogits[i] = 0.0f;
            continue;
        }
        float p = softmax_exp(logits[i], max_over_shards(maxes, nmax, N, n)) / sums[2 * n];
        dlogits[i] = cross_entropy_dlogit(p, v == vocab_shard_index(target, v_lo, v_count), dloss);
    }
}

void cross_entropy_shard_finish(float *losses, float *dlogits, const float *logits,
                                const float *maxes, int nmax, const float *sums, const int *targets,
                                float dloss, int v_lo, int v_count, int N, int Vl) {
    if (N <= 0) return;
    ensure_init();
    LAUNCH(cross_entropy_shard_loss_kernel, blocks_for((size_t)N, THREADS), THREADS, 0, losses, maxes, nmax,
           sums, targets, N);
    if (dlogits)
        LAUNCH(cross_entropy_shard_grad_kernel, grid_for((size_t)N * Vl), THREADS, 0, dlogits, logits, maxes,
               nmax, sums, targets, dloss, v_lo, v_count, N, Vl);
}
