// metrics.h: one step's numbers, printed as the progress line and appended to
// <out_dir>/metrics.jsonl.
#ifndef METRICS_H
#define METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "loss_scale.h"

// what the experts did in a step, over every rank
typedef struct {
    double aux_loss;      // the load-balancing loss: its mean over sequences and MoE blocks
    long dropped;         // token-expert pairs over capacity
    const long *load;     // [blocks x experts] rows each expert ran
    int blocks, experts;
} MoEStepStats;

// FP8 training (stage 02's fp8-* precisions): of the values its casts onto the FP8 grid saw since
// the last record, the share that saturated at the format's largest finite and the share that
// underflowed (nonzero, cast to 0), per operand of the block's linears: FP8_OPERANDS below
enum { FP8_INPUT, FP8_WEIGHT, FP8_OUTPUT_GRAD, FP8_OPERANDS };
typedef struct {
    double saturated[FP8_OPERANDS], underflow[FP8_OPERANDS];
} Fp8StepStats;

typedef struct {
    long step, total_steps;
    double loss, lr, grad_norm;
    double ms, tokens_per_sec, mfu;
    size_t mem_bytes;             // device memory in use
    double val_loss;              // < 0: not evaluated this step
    // parallel stages fill these (has_comm / has_state say so)
    bool has_comm, has_state;
    double comm_bytes, comm_ms;
    double state_bytes;
    const LossScaler *scaler;     // 16-mixed: the scale, skipped steps, fp16 underflow (else NULL)
    const MoEStepStats *moe;      // mixture of experts (stage 08), else NULL
    const Fp8StepStats *fp8;      // the fp8-* precisions: what their casts clipped (else NULL)
} StepStats;

typedef struct {
    FILE *f;
    double start_time;
    long start_step;
} Metrics;

// opens <out_dir>/metrics.jsonl (truncated, or appended to when resuming, which it says); rank 0 only
void metrics_open(Metrics *m, const char *out_dir, bool resume, long start_step);
void metrics_log(Metrics *m, const StepStats *s, bool print_line);
void metrics_close(Metrics *m);

#endif
