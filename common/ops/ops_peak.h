// ops_peak.h: what both backends (ops_cpu.c, ops_cuda.cu) share about MFU's peak
// (ops_peak_flops): a figure found once per process and kept, the sentence that says where it
// came from, and the environment variables that replace it. How the figure is found is each
// backend's own: the CPU measures it, the CUDA backend derives it from the device.
//
// Written once here, as static inline functions that gcc and nvcc both compile; tools/peak_flops.c
// includes it for the variables' names.
#ifndef OPS_PEAK_H
#define OPS_PEAK_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/log.h"

// The replacements, in FLOP/s (e.g. 2.5e11). `make bench` measures the peak once
// (build/peak_flops) and exports both, so every run it starts divides by the same figure instead
// of measuring its own (a few percent apart from run to run on a shared machine).
#define PEAK_ENV_F32 "OPS_PEAK_FLOPS_F32"
#define PEAK_ENV_BF16 "OPS_PEAK_FLOPS_BF16"

typedef struct {
    int known;
    double flops;       // FLOP/s
    char source[400];   // "812 GFLOP/s bf16, measured: ..."
} PeakFlops;

// A backend's way of finding the peak for f32 (bf16 == 0) or bf16 matmul inputs: fills flops
// and the part of source after the figure ("measured: ...", "derived: ...").
typedef void (*PeakFinder)(PeakFlops *peak, int bf16);

// snprintf for the sentences (the peak's, the engines'): they are for people, so one too long for
// its buffer is cut short, not an error (and gcc's truncation warning, which cannot know the
// lengths, is not raised)
static inline void sentence_printf(char *out, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline void sentence_printf(char *out, size_t size, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(out, size, fmt, args);
    va_end(args);
}

// "812 GFLOP/s bf16" or "989.4 TFLOP/s bf16": GFLOP/s for CPUs, TFLOP/s from 10 TFLOP/s on
static inline void peak_figure(char *out, size_t size, double flops, int bf16) {
    const char *type = !bf16 ? "f32" : ops_half_format() == HALF_FP16 ? "fp16" : "bf16";
    if (flops >= 1e13) snprintf(out, size, "%.1f TFLOP/s %s", flops / 1e12, type);
    else snprintf(out, size, "%.0f GFLOP/s %s", flops / 1e9, type);
}

// Prefixes the figure to what a finder wrote: "<figure>, <how>".
static inline void peak_prefix_figure(PeakFlops *peak, int bf16) {
    char figure[64], how[sizeof peak->source];
    peak_figure(figure, sizeof figure, peak->flops, bf16);
    sentence_printf(how, sizeof how, "%s", peak->source);
    sentence_printf(peak->source, sizeof peak->source, "%s, %s", figure, how);
}

// 1 and the figure when the environment gives one; a malformed value is an error, not ignored
static inline int peak_from_environment(PeakFlops *peak, int bf16) {
    const char *name = bf16 ? PEAK_ENV_BF16 : PEAK_ENV_F32;
    const char *text = getenv(name);
    if (!text || !*text) return 0;
    char *end;
    double flops = strtod(text, &end);
    if (*end || !(flops > 0) || !isfinite(flops))
        fatal("environment variable %s is '%s': expected MFU's peak in FLOP/s, a number > 0 "
              "(e.g. 2.5e11)", name, text);
    peak->flops = flops;
    snprintf(peak->source, sizeof peak->source, "given by %s", name);
    return 1;
}

// Where bf16 matmuls are widened to f32 (ops_bf16_native() == 0) they run at the f32 rate, so
// the f32 peak is their peak too; the sentence says so and carries the f32 one.
static inline void peak_of_widened_bf16(PeakFlops *peak, const PeakFlops *f32, const char *why) {
    peak->flops = f32->flops;
    sentence_printf(peak->source, sizeof peak->source, "the f32 peak, as %s (%s)", why,
                    f32->source);
}

// The backend's peak, found on the first call for each precision and kept: the environment's
// if it gives one, else the finder's.
static inline const PeakFlops *peak_flops_once(PeakFlops cache[2], int bf16, PeakFinder find) {
    PeakFlops *peak = &cache[bf16 != 0];
    if (!peak->known) {
        if (!peak_from_environment(peak, bf16 != 0)) find(peak, bf16 != 0);
        peak_prefix_figure(peak, bf16 != 0);
        peak->known = 1;
    }
    return peak;
}

#endif
