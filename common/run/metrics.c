// metrics.c: see metrics.h.
#define _POSIX_C_SOURCE 200809L
#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "base/files.h"
#include "base/log.h"

// A run stopped after its last checkpoint (killed, or a save that failed) logged steps that the
// resumed run will log again: keep the first `steps` lines only, so every step appears once.
static void keep_first_steps(const char *path, long steps) {
    FILE *f = fopen(path, "rb");
    if (!f) return;  // nothing logged yet
    long lines = 0, offset = 0;
    for (int c; lines < steps && (c = getc(f)) != EOF; offset++)
        if (c == '\n') lines++;
    fclose(f);
    if (truncate(path, offset) != 0) fatal("cannot truncate %s: %s", path, strerror(errno));
}

void metrics_open(Metrics *m, const char *out_dir, bool resume, long start_step) {
    char path[1100];
    make_directories(out_dir);
    snprintf(path, sizeof path, "%s/metrics.jsonl", out_dir);
    if (resume) {
        keep_first_steps(path, start_step);
        printf("resuming the run saved in %s after step %ld\n", out_dir, start_step);
    }
    m->f = fopen_or_die(path, resume ? "a" : "w");
    m->start_time = wall_seconds();
    m->start_step = start_step;
}

static void format_duration(char *buf, size_t size, double seconds) {
    long s = (long)(seconds + 0.5);
    if (s >= 3600) snprintf(buf, size, "%ldh%02ldm", s / 3600, s / 60 % 60);
    else snprintf(buf, size, "%ldm%02lds", s / 60, s % 60);
}

// the load-balancing loss, the dropped pairs, and the rows each expert ran, summed over the blocks
static void print_expert_load(const MoEStepStats *moe) {
    printf(" | aux %.4f | dropped %ld | experts", moe->aux_loss, moe->dropped);
    for (int e = 0; e < moe->experts; e++) {
        long rows = 0;
        for (int b = 0; b < moe->blocks; b++) rows += moe->load[b * moe->experts + e];
        printf(" %ld", rows);
    }
}

static void write_expert_load(FILE *f, const MoEStepStats *moe) {
    fprintf(f, ", \"aux_loss\": %.17g, \"dropped\": %ld, \"expert_load\": [", moe->aux_loss, moe->dropped);
    for (int b = 0; b < moe->blocks; b++) {
        fprintf(f, "%s[", b ? ", " : "");
        for (int e = 0; e < moe->experts; e++) fprintf(f, "%s%ld", e ? ", " : "", moe->load[b * moe->experts + e]);
        fprintf(f, "]");
    }
    fprintf(f, "]");
}

// "fp8_saturated" and "fp8_underflow": [input, weight, output gradient] shares (Fp8StepStats)
static void write_fp8_clips(FILE *f, const Fp8StepStats *s) {
    fprintf(f, ", \"fp8_saturated\": [%.6g, %.6g, %.6g], \"fp8_underflow\": [%.6g, %.6g, %.6g]", s->saturated[0],
            s->saturated[1], s->saturated[2], s->underflow[0], s->underflow[1], s->underflow[2]);
}

static void print_progress(const Metrics *m, const StepStats *s) {
    double elapsed = wall_seconds() - m->start_time;
    long done = s->step - m->start_step;
    char eta[32];
    format_duration(eta, sizeof eta, done > 0 ? elapsed / done * (s->total_steps - s->step) : 0);
    printf("step %5ld/%ld | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s | mfu %.1f%% | mem %.0f MiB",
           s->step, s->total_steps, s->loss, s->lr, s->grad_norm, s->ms, s->tokens_per_sec,
           100 * s->mfu, s->mem_bytes / 1048576.0);
    if (s->has_comm) printf(" | comm %.2f MB %.1f ms", s->comm_bytes / 1e6, s->comm_ms);
    if (s->val_loss >= 0) printf(" | val %.4f", s->val_loss);
    if (s->scaler && s->scaler->on)
        printf(" | scale %.0f%s, %ld skipped", s->scaler->scale, s->scaler->skipped_now ? " (skipped: inf)" : "",
               s->scaler->skipped);
    if (s->moe) print_expert_load(s->moe);
    printf(" | eta %s\n", eta);
    fflush(stdout);
}

void metrics_log(Metrics *m, const StepStats *s, bool print_line) {
    if (print_line) print_progress(m, s);
    // a skipped fp16 step's norm is inf or NaN, which JSON cannot hold: null
    char norm[32] = "null";
    if (isfinite(s->grad_norm)) snprintf(norm, sizeof norm, "%.9g", s->grad_norm);
    fprintf(m->f, "{\"step\": %ld, \"loss\": %.17g, \"lr\": %.9g, \"grad_norm\": %s, \"ms\": %.3f, "
                  "\"tokens_per_sec\": %.1f, \"mfu\": %.5f, \"mem_bytes\": %zu",
            s->step, s->loss, s->lr, norm, s->ms, s->tokens_per_sec, s->mfu, s->mem_bytes);
    if (s->val_loss >= 0) fprintf(m->f, ", \"val_loss\": %.9g", s->val_loss);
    if (s->has_comm) fprintf(m->f, ", \"comm_bytes\": %.0f, \"comm_ms\": %.3f", s->comm_bytes, s->comm_ms);
    if (s->has_state) fprintf(m->f, ", \"state_bytes\": %.0f", s->state_bytes);
    if (s->scaler && s->scaler->on)
        fprintf(m->f, ", \"loss_scale\": %.17g, \"skipped\": %s, \"skipped_steps\": %ld, \"grad_underflow\": %.9g",
                s->scaler->scale, s->scaler->skipped_now ? "true" : "false", s->scaler->skipped,
                s->scaler->underflow);
    if (s->moe) write_expert_load(m->f, s->moe);
    if (s->fp8) write_fp8_clips(m->f, s->fp8);
    fprintf(m->f, "}\n");
    fflush(m->f);
}

void metrics_close(Metrics *m) {
    if (m->f) fclose(m->f);
    m->f = NULL;
}
