// numbers.h: the bit-exact number helpers that host code and the kernels share, each written
// once: a float32's bits, the 16-bit formats (bf16, fp16) and the 8-bit ones (FP8's e4m3 and
// e5m2, with their tensorwise and MX scales) to and from float32, and the random
// numbers (splitmix64, and the counter-based hash and normal built on it). kernels.h includes it
// for the ops; checkpoint.c reads F16 and BF16 tensors with it, the data loaders shuffle with it,
// the sampler draws with it.
#ifndef NUMBERS_H
#define NUMBERS_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define KERNEL_FN __host__ __device__ static inline
#define SIMD_LOOP
#else
#define KERNEL_FN static inline
// before a loop whose iterations are independent: the CPU runs it as vector instructions where
// GCC's own analysis gives up (a loop the same across backends: a GPU thread runs it as written)
#define SIMD_LOOP _Pragma("omp simd")
#endif

// ----------------------------------------------------------------------------------------------
// a float32's bits, and back

KERNEL_FN uint32_t float_bits(float x) {
    union { float f; uint32_t u; } v;
    v.f = x;
    return v.u;
}

KERNEL_FN float float_from_bits(uint32_t u) {
    union { float f; uint32_t u; } v;
    v.u = u;
    return v.f;
}

// ----------------------------------------------------------------------------------------------
// bf16: the top 16 bits of a float32 (sign, the same 8 exponent bits, 7 stored mantissa bits)

// Rounds to the nearest bf16, ties to the even one, as GPUs do. Adding 0x7FFF plus the lowest
// kept bit before cutting off the low 16 bits does exactly that: a remainder above half carries
// into the kept part, one below half does not, and exactly half carries only when the kept part
// is odd. A NaN must stay a NaN (the carry could turn it into infinity), so it is kept quiet.
KERNEL_FN uint16_t bf16_from_float(float x) {
    uint32_t u = float_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);  // NaN
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

KERNEL_FN float bf16_to_float(uint16_t h) { return float_from_bits((uint32_t)h << 16); }

// ----------------------------------------------------------------------------------------------
// fp16, IEEE binary16 (precision 16-mixed): sign, 5 exponent bits (bias 15), 10 mantissa bits.
// Largest finite 65504; smallest normal 2^-14; subnormals down to 2^-24. Far less range than bf16
// (whose exponent is float32's), three more mantissa bits: what loss scaling is about.

// Rounds to the nearest fp16, ties to the even one, as the hardware does: overflow becomes
// infinity, tiny values become subnormals or zero.
KERNEL_FN uint16_t fp16_from_float(float x) {
    uint32_t u = float_bits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x1FFu));  // NaN, quiet
    // 65520 is halfway between 65504 and the next step (65536, which does not exist): from there
    // on, ties included (65504 is odd), everything rounds to infinity
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
    if (a >= 0x38800000u) {  // a normal fp16: re-bias the exponent (127 -> 15) and round at bit 13
        uint32_t r = a + 0x0FFFu + ((a >> 13) & 1u);
        return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
    }
    // below 2^-14: a multiple m of 2^-24. Adding 0.5 (whose float ulp is 2^-24) makes the FPU round
    // |x| to that multiple, to nearest even; m is then the low bits (m = 1024 is 2^-14, the
    // smallest normal, which the bits also read correctly)
    float f = float_from_bits(a) + 0.5f;
    return (uint16_t)(sign | (float_bits(f) - 0x3F000000u));
}

KERNEL_FN float fp16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return float_from_bits(sign | 0x7F800000u | (m << 13));  // infinity, NaN
    if (e == 0) return float_from_bits(sign | float_bits((float)m * 5.9604644775390625e-8f));  // m 2^-24
    return float_from_bits(sign | ((e + 112) << 23) | (m << 13));
}

// ----------------------------------------------------------------------------------------------
// FP8 (OCP's 8-bit floating point, the formats of FP8 training and of MX): sign, E exponent bits,
// M mantissa bits.
//   e4m3 (E4M3FN): bias 7, largest finite 448, smallest normal 2^-6, subnormals down to 2^-9. No
//         infinity: only S.1111.111 is NaN, so the top exponent still holds seven numbers.
//   e5m2: bias 15, IEEE-like: infinities and NaNs, largest finite 57344, subnormals down to 2^-16.
// e4m3 has the precision (weights, activations), e5m2 the range (gradients). So few values fit
// that a tensor is multiplied by a scale first (fp8 = cast(x x scale), x ~ fp8 / scale).
typedef enum { FP8_E4M3, FP8_E5M2 } Fp8Format;

KERNEL_FN int fp8_mantissa_bits(Fp8Format f) { return f == FP8_E5M2 ? 2 : 3; }
KERNEL_FN int fp8_bias(Fp8Format f) { return f == FP8_E5M2 ? 15 : 7; }
KERNEL_FN uint8_t fp8_max_bits(Fp8Format f) { return f == FP8_E5M2 ? 0x7B : 0x7E; }
KERNEL_FN float fp8_max(Fp8Format f) { return f == FP8_E5M2 ? 57344.0f : 448.0f; }

// Rounds to the nearest, ties to the even one. A NaN stays NaN, its sign kept. Beyond the largest
// finite after rounding: infinity (e5m2) or NaN (e4m3 has no infinity), as a plain cast does; or,
// with `saturate`, the largest finite of that sign (infinity too), as the scaled casts of FP8
// training do, so that an outlier clips instead of poisoning the tensor.
KERNEL_FN uint8_t fp8_from_float(float x, Fp8Format f, int saturate) {
    uint32_t u = float_bits(x), a = u & 0x7FFFFFFFu;
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u), max = fp8_max_bits(f);
    int M = fp8_mantissa_bits(f), bias = fp8_bias(f);
    if (a > 0x7F800000u) return (uint8_t)(sign | (f == FP8_E5M2 ? 0x7E : 0x7F));  // NaN
    uint32_t r;
    if ((int)(a >> 23) - 127 >= 1 - bias) {
        // a normal of the format, or beyond: round at bit 23 - M as bf16_from_float rounds at bit
        // 16 (a carry runs into the exponent, as it should), then re-bias the exponent
        int shift = 23 - M;
        uint32_t t = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);
        r = (t >> shift) - ((uint32_t)(127 - bias) << M);
    } else {
        // below the smallest normal: a multiple of 2^(1 - bias - M), which the FPU's rounding (to
        // nearest even) finds after an exact scaling; 1 << M is the smallest normal, whose bits
        // read the same
        r = (uint32_t)rintf(ldexpf(float_from_bits(a), M + bias - 1));
    }
    if (r > max) return (uint8_t)(sign | (saturate ? max : max + 1));  // 0x7C: infinity; 0x7F: NaN
    return (uint8_t)(sign | r);
}

KERNEL_FN float fp8_to_float(uint8_t b, Fp8Format f) {
    int M = fp8_mantissa_bits(f), bias = fp8_bias(f);
    uint32_t e = (uint32_t)(b & 0x7F) >> M, m = b & ((1u << M) - 1u);
    float v;
    if ((b & 0x7F) > fp8_max_bits(f)) v = f == FP8_E5M2 && m == 0 ? INFINITY : NAN;
    else if (e == 0) v = ldexpf((float)m, 1 - bias - M);
    else v = ldexpf((float)((1u << M) | m), (int)e - bias - M);
    return b & 0x80 ? -v : v;
}

// Tensorwise or rowwise scaling: the factor that maps amax (the largest |x| of the tensor, or of
// the row) onto the format's largest finite, computed and rounded in fp32; 1 for an amax of 0 or
// one not finite. Current scaling takes this step's amax; delayed scaling the largest of the
// last steps' (an amax history), known before the tensor is.
KERNEL_FN float fp8_scale(float amax, Fp8Format f) { return amax > 0 && amax <= 3.4028235e38f ? fp8_max(f) / amax : 1.0f; }
// the same rounded down to a power of two (torchao's round_scales_to_power_of_2): x scale and
// fp8 / scale then only move exponents, so a scaled FP8 value divided back is a bf16 value exactly
KERNEL_FN float fp8_scale_pow2(float amax, Fp8Format f) {
    int e;
    frexpf(fp8_scale(amax, f), &e);  // scale = m 2^e, m in [0.5, 1): 2^(e - 1) is the power below
    return ldexpf(1.0f, e - 1);
}

// MX (OCP Microscaling): each block of 32 elements shares a scale 2^(floor(log2 amax) - emax),
// emax the exponent of the format's largest finite (8 for e4m3, 15 for e5m2); an element is
// cast(x / scale), saturated. The scale is stored as E8M0: a biased exponent alone (127 is 2^0,
// clamped to [2^-127, 2^127]), 0xFF NaN (an amax not finite). An amax of 0 gives 2^-127.
KERNEL_FN uint8_t mx_scale_e8m0(float amax, Fp8Format f) {
    if (!(amax <= 3.4028235e38f)) return 0xFF;
    if (amax == 0) return 0;
    int e;
    frexpf(amax, &e);  // amax = m 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    int shared = e - 1 - (f == FP8_E5M2 ? 15 : 8);
    return (uint8_t)((shared < -127 ? -127 : shared > 127 ? 127 : shared) + 127);
}

KERNEL_FN float e8m0_to_float(uint8_t s) { return s == 0xFF ? NAN : ldexpf(1.0f, (int)s - 127); }

// the run's 16-bit format (ops.h: HalfFormat): 0 bf16, 1 fp16
KERNEL_FN uint16_t half_from_float(float x, int fp16) { return fp16 ? fp16_from_float(x) : bf16_from_float(x); }
KERNEL_FN float half_to_float(uint16_t h, int fp16) { return fp16 ? fp16_to_float(h) : bf16_to_float(h); }

// ----------------------------------------------------------------------------------------------
// counter-based normal random numbers: element `index` of tensor `stream` under `seed`.
//
// There is no generator state to carry along: the value is a pure function of its coordinates,
// so any rank can initialise any slice of any tensor and get exactly the values a single
// process would have produced. That is what lets a sharded model initialise its shard alone.
//
// rng_mix64 is the splitmix64 finaliser: a bijection on 64 bits in which every input bit flips
// about half of the output bits. Hashing (seed, stream) gives a key; element i then takes the
// i-th step of splitmix64's sequence from that key (key + (i+1) * golden ratio, then mix).
KERNEL_FN uint64_t rng_mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

// splitmix64 itself, for a generator that carries its state (the data loaders' shuffles): the
// next number of the sequence whose whole state is *state
KERNEL_FN uint64_t rng_next(uint64_t *state) { return rng_mix64(*state += 0x9e3779b97f4a7c15ULL); }

KERNEL_FN uint64_t rng_hash(uint64_t seed, uint64_t stream, uint64_t index) {
    const uint64_t golden = 0x9e3779b97f4a7c15ULL;
    uint64_t key = rng_mix64(seed ^ rng_mix64(stream * golden + 1));
    return rng_mix64(key + (index + 1) * golden);
}

// Box-Muller: two independent uniforms u1 in (0, 1] and u2 in [0, 1) (the high and low 32 bits
// of the hash) give sqrt(-2 ln u1) cos(2 pi u2), a standard normal. u1 is never 0, so the log
// is finite and |result| <= sqrt(2 ln 2^32) ~ 6.7.
//
// What is guaranteed: the integer hash is exact everywhere, so on one backend the same
// (seed, stream, index) gives the same float bit for bit, whichever thread, rank or slice
// computes it. The log/cos/sqrt run in double and the result is rounded once to float; the CPU's
// libm and CUDA's device math differ by at most an ulp or two *of a double*, which changes the
// float only when a value lies within that distance of a float rounding boundary (about one
// value in 10^8). Where CPU and GPU must agree exactly, run this on the host and copy.
KERNEL_FN float rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
    uint64_t h = rng_hash(seed, stream, index);
    double u1 = ((double)(h >> 32) + 1.0) * (1.0 / 4294967296.0);
    double u2 = (double)(h & 0xffffffffULL) * (1.0 / 4294967296.0);
    const double two_pi = 6.283185307179586;
    return (float)(sqrt(-2.0 * log(u1)) * cos(two_pi * u2));
}

#endif
