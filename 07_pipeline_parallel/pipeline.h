// pipeline.h: stage 07's pipeline. The ranks form a pp x dp grid; each pipeline stage holds a
// contiguous range of blocks (the embedding on the first stage, the head and loss on the last),
// runs its share of every micro-batch, and passes activations forward and their gradients back
// to its neighbours. The schedule (GPipe, 1F1B, interleaved 1F1B or ZB-H1: schedules.c) says in
// which order a stage runs its forwards and backwards; train.c reads like stage 03 with this step
// in place of forward + backward.
#ifndef PIPELINE_H
#define PIPELINE_H

#include <stdbool.h>

#include "comm/comm.h"
#include "config/config.h"
#include "data/alpaca.h"
#include "model/activations.h"
#include "model/gpt.h"
#include "run/trainable.h"

// Where this rank sits. Rank = replica * pp + stage: a pipeline's stages are consecutive ranks,
// so its point-to-point traffic, which every micro-batch waits on, stays on one node.
typedef struct {
    int pp, dp;                // stages per pipeline, pipelines (data-parallel replicas)
    int stage, replica;
    int first_block, n_blocks; // the blocks this stage holds: [first_block, first_block + n_blocks)
                               // (interleaved: of its first chunk; pipe_chunk_blocks for each)
    int chunks;                // virtual stages this stage holds (interleaved: virtual_stages; else 1)
    bool is_first, is_last;    // holds the embedding / the head and the loss
    Comm *pipe;                // this replica's stages, ranked by stage: the activations' path
    Comm *dp_group;            // this stage in every replica: the gradient all-reduce
    Comm *tied;                // this replica's first and last stage: the tied wte (NULL: pp 1, or
                               // an untied head such as phi's lm_head)
} PipeGrid;

// Checks the grid against the ranks, the model and the batch (fatal() on every rank alike), then
// makes the groups. world: the ranks the pipelines are made of (stage 10: those of one tensor-parallel rank).
void pipe_grid_init(PipeGrid *g, Comm *world, const Config *cfg, const GPTConfig *mc);
// the same check as a question: false, with the message in why, when cfg's grid does not fit
bool pipe_grid_fits(const Config *cfg, int ranks, int n_layer, char *why, size_t why_size);
// blocks [*first, *first + *n) of stage `stage`: L / pp each, the first L % pp stages one more
void stage_blocks(int n_layer, int pp, int stage, int *first, int *n);
// chunks of blocks each stage holds: virtual_stages under pp_schedule interleaved, else 1
int pipe_chunks(const Config *cfg);
// blocks of chunk c of a stage: virtual stage c * pp + stage of the pp * chunks the blocks are split over
void pipe_chunk_blocks(const PipeGrid *g, int n_layer, int chunk, int *first, int *n);
// this stage's layout: its blocks (every chunk's, one after another), the embedding on the first
// stage, the head on the last
void pipe_stage_layout(ParamLayout *layout, const GPTConfig *mc, const PipeGrid *g);

// Prints the grid and which blocks each stage holds.
void print_pipeline_plan(const PipeGrid *g, const Config *cfg, const GPTConfig *mc, size_t stage_params, int slots);
// this stage's part of the squared gradient norm: the last stage leaves out its copy of the tied
// wte, which the first stage counts
double stage_sum_squares(const PipeGrid *g, const ParamLayout *layout, const float *grads);
// whether this stage's tensor t is the one counted in the norm and saved (a TensorFilter; grid: a
// PipeGrid): every tensor but the last stage's copy of the tied wte
bool pipe_tensor_counted(const TensorInfo *t, const void *grid);

// One step of the schedule: the forward or the backward of one micro-batch through one chunk of
// the stage's blocks (chunk 0 but for interleaved). Zero-bubble schedules split the backward in
// two: the backward (weights false) computes the gradient the previous stage waits for, the
// weight pass (weights true, W) later the weight gradients it left for then.
typedef struct {
    bool backward;
    int micro;
    int chunk;
    bool weights;
} PipeOp;

// the schedules of schedules.c, each into ops (room for pipe_max_ops), returning how many
int interleaved_schedule(PipeOp *ops, int m, int pp, int chunks, int stage);
int zb_h1_schedule(PipeOp *ops, int m, int pp, int stage);
// whether the schedule splits the backward into B and W (zb-h1); whether it interleaves chunks
bool pipe_zero_bubble(PipeSchedule schedule);
bool pipe_interleaved(PipeSchedule schedule);
// the stages an op receives its input from and sends its output to (-1: none): the neighbours in
// the ring of pp * chunks virtual stages (chunk c of stage s is virtual stage c * pp + s)
void pipe_op_peers(const PipeOp *op, int pp, int chunks, int stage, int *recv_from, int *send_to);
// the most ops a stage runs per step: m forwards, m backwards and m weight passes per chunk
int pipe_max_ops(int m, int chunks);
// the ops of a stage, in order (ops has room for pipe_max_ops); returns how many
int pipe_schedule(PipeOp *ops, PipeSchedule schedule, int m, int pp, int chunks, int stage);
// micro-batches whose activations a stage holds at once, over all its chunks (from a forward to
// the end of its backward, or of its weight pass): m for GPipe, min(m, pp - stage) for 1F1B; per
// chunk into per_chunk[chunks] unless NULL
int pipe_slots(PipeSchedule schedule, int m, int pp, int chunks, int stage, int *per_chunk);
// the bubble fraction of the schedule when every forward takes one unit of time and a backward two
// (zero-bubble: a backward one and a weight pass one): (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1),
// zb-h1 (p-1)/(3m+p-1)
double pipe_bubble_theory(PipeSchedule schedule, int m, int pp, int chunks);
// the formula behind it, as text
const char *pipe_bubble_formula(PipeSchedule schedule);

// The schedule of every stage replayed on one clock: each op starts when the stage's previous op
// ended and its input was produced (the messages taking no time). secs[s] holds stage s's op
// times (NULL: the unit times above). Fills busy[s] and returns the time the last op ends; fatal()
// if the orders would deadlock, or if a stage would receive its messages from a neighbour in
// another order than the neighbour sends them (one tag: they would land in the wrong buffers).
double pipe_replay(PipeSchedule schedule, int m, int pp, int chunks, double *const *secs, double *busy);

#define PIPE_TRACE_CHARS 2048

// How a stage runs its layers over one slot's activations: on one rank (pipe_serial_layers, stage
// 07), or with another technique's layers inside each stage (stage 10: 05's tensor-parallel ones).
typedef struct PipeLayers PipeLayers;
struct PipeLayers {
    // a slot's activations: spec holds the chunk's blocks at the whole model's sizes; the layers
    // set this rank's sizes and their ops
    void (*adapt)(PipeLayers *l, ActsSpec *spec);
    void (*forward)(PipeLayers *l, Activations *a, const Weights *w, const int *inputs, int B, int T);
    // the summed loss of a's logits (backward: they become dlogits, scaled by dloss)
    double (*loss)(PipeLayers *l, Activations *a, const GPTConfig *mc, const int *targets, int B, int T, float dloss,
                   bool backward);
    void (*backward)(PipeLayers *l, Activations *a, const Weights *w, Weights *g, int B, int T);
    // zb-h1's weight pass over a's blocks: run(notes) computes the weight gradients the backward
    // left (zero_bubble.c) through a's layer ops, the layers around it setting up what those read
    // (05's: the weights in the backward's order again). NULL: run(notes) alone (the serial layers)
    void (*weight_pass)(PipeLayers *l, Activations *a, const Weights *w, void (*run)(void *notes), void *notes);
};
PipeLayers *pipe_serial_layers(void);

typedef struct {
    const PipeGrid *grid;
    const GPTConfig *mc;
    const Weights *w;
    PipeSchedule schedule;
    int m;                       // micro-batches per step
    PipeOp *ops;                 // this stage's schedule: [n_ops]
    int n_ops;
    Activations *slots;          // [n_slots]: micro-batch i of chunk c uses slot chunk_first[c] + i % chunk_slots[c]
    int n_slots;
    int *chunk_slots, *chunk_first;  // [grid->chunks]
    struct DeferredWeights **deferred;  // zb-h1: [n_slots], each slot's weight gradients left for W; else NULL
    CommRequest **fwd_sends, **bwd_sends;  // [n_slots]: the sends still reading a slot's buffers
    long steps;                  // pipeline_step calls so far: the first is traced
    bool tracing;                // record the op sequence (the first step)
    char trace[PIPE_TRACE_CHARS];
    double compute_s, schedule_s;  // summed over the steps measured: busy time and schedule time
    double *op_s;                // [n_ops]: each op's device seconds in the traced step (dev_busy_seconds)
    Trainable *trained;          // the tensors that train beside a frozen base (run/trainable.h), or NULL
    PipeLayers *layers;          // how the slots' micro-batches run through this stage's blocks
} Pipeline;

// one slot per micro-batch in flight, each the activations of one micro-batch of the longest
// sequences for this stage's blocks (cfg's sizes and precision); w: the stage's weights
void pipeline_init(Pipeline *p, const PipeGrid *g, const GPTConfig *mc, const Config *cfg, const Weights *w);
// the same with the stage's blocks run by `layers` (zb-h1's split backward wraps their layer ops)
void pipeline_init_layers(Pipeline *p, const PipeGrid *g, const GPTConfig *mc, const Config *cfg, const Weights *w,
                          PipeLayers *layers);
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
// bubble beside its theory, and the bubble of that step's timeline replayed with its measured
// compute times (pipe_replay; stats.json bubble_theory, bubble_unit_times, bubble_first_step and
// bubble_first_step_balanced); the run's bubble is then measured from step 2 on.
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
