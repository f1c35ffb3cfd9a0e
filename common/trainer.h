// trainer.h: the parts of a training run that every stage shares and no stage teaches: the
// learning-rate schedule, AdamW over the parameter table, gradient clipping, the progress line
// and metrics.jsonl, the memory report, evaluation and checkpoints. The loop itself is written
// out in each stage's train.c, where the learner reads it.
#ifndef TRAINER_H
#define TRAINER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include <cjson/cJSON.h>

#include "alpaca.h"
#include "config.h"
#include "gpt.h"
#include "tokenizer.h"

// The model's shape: from the checkpoint's config.json when starting from one, else from the
// config keys; the vocabulary comes from the tokenizer (and must agree with a checkpoint's).
GPTConfig model_shape(const Config *cfg, const Tokenizer *tok);
// true when the run starts from init_from (not random_init, not resume)
bool starts_from_checkpoint(const Config *cfg);

// ACTS_* flags for acts_alloc: bf16 matmul inputs for a bf16 precision, recomputation for
// activation_checkpointing
int acts_flags(const Config *cfg);

// The dataset the config names (data_path, max_seq_len, template, validation share).
Dataset *load_dataset(const Config *cfg, const Tokenizer *tok);
// How long a run is: batches per epoch (an error if the training split makes none), the steps
// the learning-rate schedule spans (every epoch), and the steps the run takes. stop_iteration
// only ends the run early (as in the tutorial), so a run stopped and resumed follows the same
// schedule.
void plan_steps(const Config *cfg, const Dataset *data, long *batches_per_epoch, long *schedule_steps,
                long *total_steps);

// Prints the data line: records, and how a global batch is cut, e.g. "global batch 16 = 4 ranks x
// 2 micro-batches of 2 sequences" (row_groups: how many take different rows, named by `what`,
// e.g. "ranks"; 1: one process)
// the micro-batches a replica cuts its share of the global batch into: gradient_acc_steps, or
// in a pipeline num_microbatches (each stage refuses the other key's values other than 1)
int micro_batches_per_step(const Config *cfg);
void print_batch_plan(const Config *cfg, const Dataset *data, int row_groups, const char *what, long total_steps);

// Linear warm-up from lr/warmup to lr over warmup_steps, then cosine decay to min_lr at the last
// step. `step` counts from 0.
double learning_rate(const Config *cfg, long step, long total_steps);

// AdamW over the flat range [first, first + n) of the parameter table: weight decay only where
// the table says so (matrices and embeddings). Works on a whole model or on any shard of it.
// It reads each gradient times `clip` (clip_factor): clipping costs no pass of its own.
void adamw_step(const ParamLayout *layout, float *params, const float *grads, float *m, float *v,
                size_t first, size_t n, const Config *cfg, double lr, long t, float clip);

// The factor that brings gradients of global norm `norm` down to max_norm (1 when they are
// within it, or max_norm is 0: no clipping).
float clip_factor(double norm, double max_norm);

// ---- fp16's dynamic loss scaling (precision 16-mixed) ------------------------------------------
// fp16 has 5 exponent bits: its smallest subnormal is 2^-24, and smaller gradients round to zero
// in the 16-bit copies the backward matmuls read. Multiplying the loss by a large scale (2^16)
// multiplies every gradient by it, lifting them into fp16's range; the gradients are divided by it
// again before clipping and the update, so the step is the one fp32 would take. A scale too large
// makes some gradient overflow to inf: that step is skipped (no update) and the scale halved;
// after loss_scale_window good steps it doubles again. bf16 has float32's exponent and needs none
// of this: in every other precision the scale is 1 and no step is skipped.
typedef struct {
    bool on;            // precision 16-mixed
    double scale;
    int window, good;   // window 0: a fixed scale; good: steps since the scale last changed
    long skipped;       // steps skipped so far
    bool skipped_now;   // the last step was skipped
    double underflow;   // the last step: share of the nonzero gradients cast to fp16 that became 0
    long inject_inf_at; // test hook WORKBOOK_INJECT_INF_STEP=N: step N's gradients are inf
} LossScaler;

// s starts at loss_scale; save_checkpoint saves its state from now on, in the optimizer file's
// metadata beside the step (checkpoint.h, TrainState)
void loss_scaler_init(LossScaler *s, const Config *cfg);
// the backward's dloss for a step with n_targets target tokens: 1 / n_targets, times the scale
float loss_scaler_dloss(const LossScaler *s, long n_targets, long step);
// After the gradients are complete (summed over ranks), with norm their global norm (scaled):
// false when the step must be skipped (an inf or NaN; every rank sees the same global norm, so
// all skip the same steps), updating the scale; else divides grads[0..n) by the scale, sets
// *norm to the unscaled norm and returns true.
bool loss_scaler_unscale(LossScaler *s, float *grads, size_t n, double *norm);
// the state save_checkpoint saved, read back when resuming (on every rank); a checkpoint from before
// the state moved into the optimizer file has it in <out_dir>/loss_scale.json
void loss_scaler_resume(LossScaler *s, const Config *cfg);

// Model FLOPs per token for forward + backward (6 per parameter per token for the matmuls a
// token runs through, plus attention's 12 * L * C * T), for MFU.
double flops_per_token(const GPTConfig *cfg, int T);

// ---- one step's numbers, printed as a line and appended to metrics.jsonl ----------------------
// what the experts did in a step, over every rank
typedef struct {
    double aux_loss;      // the load-balancing loss: its mean over sequences and MoE blocks
    long dropped;         // token-expert pairs over capacity
    const long *load;     // [blocks x experts] rows each expert ran
    int blocks, experts;
} MoEStepStats;

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

// ---- memory -----------------------------------------------------------------------------------
typedef struct { const char *what; size_t bytes; } MemoryItem;
// prints the items and their total, and records each item for stats.json (run_stats_memory)
void print_memory_report(const char *title, const MemoryItem *items, int n);
// the memory report's name for the fp32 parameters: "(fp32)", the "(fp32 master)" of bf16-mixed,
// or pure bf16's "(bf16, no master)" (its weights are rounded to bf16 after each update)
const char *parameters_label(const Config *cfg);
// and for the 16-bit copies, naming the run's format: "parameters (bf16 copy)" or "(fp16 copy)";
// "activations (bf16 matmul inputs)", "(fp16 matmul inputs)", or "activations (fp32)"
const char *copy_label(const Config *cfg);
const char *activations_label(const Config *cfg);
// bf16 modes: what the same activations would take in fp32, and what stays fp32 and why
void print_bf16_activation_saving(const Activations *acts);

// ---- the whole run's figures: <out_dir>/stats.json --------------------------------------------
// metrics.jsonl holds each step; stats.json holds what describes the run as a whole: the stage,
// its parallel layout, the memory report's items, the communication per group and kind, and the
// figures a stage adds (fields: docs/ARCHITECTURE.md, Outputs). Tests read their numbers here;
// the printed reports and tables are for people. Figures are recorded as the run reports them
// (print_memory_report records its items) and rank 0 writes the file once, at the end.
typedef struct {
    int dp;                // data-parallel replicas (1: none)
    bool sharded;          // parameters, gradients and optimizer state sharded over them (FSDP)
    int tp_dimensions[3];  // the tensor-parallel grid [x, y, z]; all 0: no tensor parallelism
    int pp;                // pipeline stages; 0: no pipeline parallelism
    int ep;                // ranks the experts are spread over; 0: no expert parallelism
} RunLayout;
// records one category of this rank's memory, in bytes, under "memory"
void run_stats_memory(const char *what, size_t bytes);
// records a figure of the run under `key` (e.g. "state_bytes")
void run_stats_number(const char *key, double value);
// writes <out_dir>/stats.json atomically: stage, world_size, layout, precision, what was
// recorded, and `communication` (comm_stats_json(), whose ownership it takes; NULL: a single
// process, an empty list). Call it on rank 0 only.
void run_stats_write(const Config *cfg, int stage, int world_size, RunLayout layout, cJSON *communication);

// ---- evaluation and checkpoints (single process) ----------------------------------------------
// Validation loss over up to cfg->eval_batches global batches of the validation split, cut as
// training cuts them: this process takes micro-batches [rank * acc, (rank + 1) * acc) of
// world * acc slices (acc: micro_batches_per_step). Fills sums with the summed loss and the target
// count of its slices; add them up over ranks, then divide (count 0: no validation split).
void evaluate_sums(Activations *a, const Weights *w, const GPTConfig *mc, const Dataset *data,
                   const Config *cfg, int rank, int world, double sums[2]);
// The loop itself, for a model that is not a gpt.h one (stage 05's): loss(ctx, batch) returns
// the summed loss of one micro-batch however the stage computes it.
typedef double (*BatchLossFn)(void *ctx, const Batch *batch);
void evaluate_batches(BatchLossFn loss, void *ctx, const Dataset *data, const Config *cfg, int rank,
                      int world, double sums[2]);
// the same with the forward pass supplied by the stage (FSDP gathers its units inside it):
// forward(ctx, a, inputs, B, T) must leave the logits in a->logits
typedef void (*ForwardFn)(void *ctx, Activations *a, const int *inputs, int B, int T);
void evaluate_sums_with(Activations *a, ForwardFn forward, void *ctx, const GPTConfig *mc,
                        const Dataset *data, const Config *cfg, int rank, int world, double sums[2]);

// copies the device buffers to the host and writes model + optimizer state to out_dir
void save_checkpoint(const Config *cfg, const ParamLayout *layout, const float *params,
                     const float *m, const float *v, long step);
// loads model + optimizer state from out_dir; returns the step to continue from
long resume_checkpoint(const Config *cfg, const ParamLayout *layout, float *params, float *m, float *v);
// fills the device buffer params from init_from
void load_initial_weights(const Config *cfg, const ParamLayout *layout, float *params);
// A rank holding part of the model (a pipeline stage's blocks, an expert range) starts from a
// whole-model checkpoint laid out as `whole`, taking its own tensors by name: resuming (out_dir,
// with AdamW's moments; returns the step) or from init_from.
long load_checkpoint_part(const Config *cfg, const ParamLayout *part, const ParamLayout *whole, float *params,
                          float *m, float *v);
// And the other way: the ranks holding the parts of the model put the whole together. Each lays
// out its share of params, m and v (the tensors take accepts, all when NULL) in a whole-model
// buffer of zeros; sum(buf, n, sum_ctx) adds the buffers of the ranks holding the other parts (an
// all-reduce over them); the rank with `saves` writes the checkpoint.
typedef void (*PartsSum)(float *buf, size_t n, void *ctx);
void save_checkpoint_from_parts(const Config *cfg, const ParamLayout *part, const ParamLayout *whole,
                                const float *params, const float *m, const float *v, long step, TensorFilter take,
                                const void *take_ctx, PartsSum sum, void *sum_ctx, bool saves);

// ---- preemption: stop at a step boundary, save, exit to be resumed ----------------------------
// Slurm warns a job before its time limit or a preemption with SIGUSR1 (--signal=B:USR1@N) and
// cancels it with SIGTERM. Neither kills the run: the handler only sets a flag, and the stage's
// step loop looks at it after a whole step, where the weights and optimizer agree.

// sysexits.h's EX_TEMPFAIL, "try again later": the run saved its state and should be resumed
#define EXIT_TO_BE_RESUMED 75

// installs the SIGTERM and SIGUSR1 handlers; call once, before the step loop
void preemption_watch(void);
// 1 if this process has been signalled (a long, ready for comm_sum_long: the ranks agree when
// any one of them was signalled, since mpirun or srun may deliver it to only some)
long preemption_signalled(void);
// prints where the checkpoint of `step` is, for a run a signal stopped; the stage then exits with
// EXIT_TO_BE_RESUMED. MPI stages print before comm_finalize: once one rank has exited non-zero,
// the launcher may kill the others, so nothing may be left to do after it
void print_stopped_to_be_resumed(const Config *cfg, long step);

#endif
