// numbers.h: the bit-exact number helpers that host code and the kernels share, each written
// once: a float32's bits, the 16-bit formats (bf16, fp16) to and from float32, and the random
// numbers (splitmix64, and the counter-based hash and normal built on it). kernels.h includes it
// for the ops; checkpoint.c reads F16 and BF16 tensors with it, the data loaders shuffle with it,
// the sampler draws with it.
#ifndef NUMBERS_H
#define NUMBERS_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define KERNEL_FN __host__ __device__ static inline
#else
#define KERNEL_FN static inline
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
