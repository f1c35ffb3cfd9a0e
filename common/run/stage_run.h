// stage_run.h: the parts of a stage's main that are not its technique, written once so that
// `diff -u` between two stages shows the technique alone: the first lines a run prints, the flat
// buffers an optimizer step works on, and the timing of a step.
#ifndef STAGE_RUN_H
#define STAGE_RUN_H

#include <stdbool.h>
#include <stddef.h>

#include "config/config.h"
#include "metrics.h"
#include "model/gpt.h"
#include "run_stats.h"

// The model a rank trains, as flat buffers laid out like `layout`: the parameters, their
// gradients and AdamW's two moments (fp32), and with a 16-bit precision the 16-bit copy of the
// parameters that every matmul reads. w and g name the tensors in params and grads.
typedef struct {
    size_t n, bytes;  // elements, and the bytes of one fp32 buffer
    float *params, *grads, *adam_m, *adam_v;
    half16 *params16;   // NULL in fp32
    Weights w, g;
} ModelBuffers;

void model_buffers_alloc(ModelBuffers *mb, const ParamLayout *layout, bool with_16bit_copy);
void model_buffers_free(ModelBuffers *mb);

// The memory report of a rank holding the whole of `n` parameters and their state: parameters, the
// 16-bit copy (0 in fp32), gradients, AdamW's moments, activations (what the planner predicts too)
#define MODEL_MEMORY_ITEMS 5
void model_memory_items(MemoryItem items[MODEL_MEMORY_ITEMS], const Config *cfg, size_t n, size_t activation_bytes);

// "stage 03 | 4 ranks | cpu backend (<matmul engine>) | precision bf16-mixed | gpt2 L=.. | 1.23M
// parameters", then where the MFU peak comes from. Stages 01 and 02 run on one device: no rank count.
void print_stage_banner(int stage, int ranks, const Config *cfg, const GPTConfig *mc, double num_params);

// Fills s's timing figures for the step that began at t0: ms, tokens/s, device memory in use, and
// MFU against the peak of `ranks` devices (flops_per_token at the step's sequence length) in the
// run's precision.
void step_stats_measure(StepStats *s, const Config *cfg, double t0, long tokens, double flops_per_token, int ranks);

// Refuses a global batch that does not split evenly into `ranks` x gradient_acc_steps micro-batches.
void check_batch_splits(const Config *cfg, int ranks);

// Whether step (1-based) ends with a validation pass, or with a checkpoint of the run.
bool evaluation_due(const Config *cfg, long step, bool last);
bool checkpoint_due(const Config *cfg, long step, bool last);

#endif
