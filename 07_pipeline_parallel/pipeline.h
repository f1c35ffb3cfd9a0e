// pipeline.h: stage 07's pipeline. The ranks form a pp x dp grid; each pipeline stage holds a
// contiguous range of blocks (the embedding on the first stage, the head and loss on the last),
// runs its share of every micro-batch, and passes activations forward and their gradients back
// to its neighbours. The schedule (GPipe or 1F1B) says in which order a stage runs its forwards
// and backwards; train.c reads like stage 03 with this step in place of forward + backward.
#ifndef PIPELINE_H
#define PIPELINE_H

#include <stdbool.h>

#include "alpaca.h"
#include "comm.h"
#include "config.h"
#include "gpt.h"

// Where this rank sits. Rank = replica * pp + stage: a pipeline's stages are consecutive ranks,
// so its point-to-point traffic, which every micro-batch waits on, stays on one node.
typedef struct {
    int pp, dp;                // stages per pipeline, pipelines (data-parallel replicas)
    int stage, replica;
    int first_block, n_blocks; // the blocks this stage holds: [first_block, first_block + n_blocks)
    bool is_first, is_last;    // holds the embedding / the head and the loss
    Comm *pipe;                // this replica's stages, ranked by stage: the activations' path
    Comm *dp_group;            // this stage in every replica: the gradient all-reduce
    Comm *tied;                // this replica's first and last stage: the tied wte (NULL: pp 1, or
                               // an untied head such as phi's lm_head)
} PipeGrid;

// Checks the grid against the ranks, the model and the batch (fatal() on every rank alike), then
// makes the groups.
void pipe_grid_init(PipeGrid *g, Comm *world, const Config *cfg, const GPTConfig *mc);
// the same check as a question: false, with the message in why, when cfg's grid does not fit
bool pipe_grid_fits(const Config *cfg, int ranks, int n_layer, char *why, size_t why_size);
// blocks [*first, *first + *n) of stage `stage`: L / pp each, the first L % pp stages one more
void stage_blocks(int n_layer, int pp, int stage, int *first, int *n);

// Prints the grid and which blocks each stage holds.
void print_pipeline_plan(const PipeGrid *g, const Config *cfg, const GPTConfig *mc, size_t stage_params, int slots);
// this stage's part of the squared gradient norm: the last stage leaves out its copy of the tied
// wte, which the first stage counts
double stage_sum_squares(const PipeGrid *g, const ParamLayout *layout, const float *grads);

// One step of the schedule: the forward or the backward of one micro-batch.
typedef struct {
    bool backward;
    int micro;
} PipeOp;

// the 2m ops of a stage, in order (ops has room for 2m); returns how many (2m)
int pipe_schedule(PipeOp *ops, const char *schedule, int m, int pp, int stage);
// micro-batches whose activations a stage holds at once: m for GPipe, min(m, pp - stage) for 1F1B
int pipe_slots(const char *schedule, int m, int pp, int stage);

#define PIPE_TRACE_CHARS 2048

typedef struct {
    const PipeGrid *grid;
    const GPTConfig *mc;
    const Weights *w;
    const char *schedule;
    int m;                       // micro-batches per step
    Activations *slots;          // [n_slots]: micro-batch i uses slot i % n_slots
    int n_slots;
    CommRequest **fwd_sends, **bwd_sends;  // [n_slots]: the sends still reading a slot's buffers
    long steps;                  // pipeline_step calls so far: the first is traced
    bool tracing;                // record the op sequence (the first step)
    char trace[PIPE_TRACE_CHARS];
    double compute_s, schedule_s;  // summed over the steps measured: busy time and schedule time
} Pipeline;

// one slot per micro-batch in flight, each the activations of one micro-batch of the longest
// sequences for this stage's blocks (cfg's sizes and precision); w: the stage's weights
void pipeline_init(Pipeline *p, const PipeGrid *g, const GPTConfig *mc, const Config *cfg, const Weights *w);
void pipeline_free(Pipeline *p);
// the memory report of this rank (n: its parameters), with the slots' activations
void pipeline_print_memory(const Pipeline *p, const Config *cfg, size_t n);

// Runs the schedule over this replica's m micro-batches, adding the gradients into g. A send
// followed by a receive from the same neighbour travels as one send-recv (pipeline.c). Returns the
// summed loss (the last stage's; 0 elsewhere); dloss = 1 / target tokens of the global batch.
double pipeline_step(Pipeline *p, Weights *g, const Batch *batches, float dloss);

// Summed loss of one micro-batch through the stages, forward only (a BatchLossFn for evaluation;
// ctx is a Pipeline). Non-zero on the last stage only.
double pipeline_eval_loss(void *ctx, const Batch *batch);

// After the first step only: rank 0 prints every rank's op sequence of that traced step and the
// bubble beside its theory; the run's bubble is then measured from step 2 on.
void print_first_schedule(Comm *world, Pipeline *p);
// Rank 0 prints each rank's measured bubble fraction (idle / schedule time) over steps 2 on, if any.
void print_bubble(Comm *world, const Pipeline *p);

// Checkpoints hold the whole model whatever the grid: replica 0's stages assemble it by tensor
// name (the tied wte from the first stage), rank 0 writes it. Loading reads the whole model and
// takes this stage's tensors by name.
void pipe_save_checkpoint(const Config *cfg, const PipeGrid *g, const ParamLayout *local,
                          const ParamLayout *full, const float *params, const float *m,
                          const float *v, long step);
#endif
