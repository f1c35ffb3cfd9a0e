// tp_model.h: GPT-2 laid out over the [x, y, z] grid, built from tp_linear.h's layers and the
// shared ops. Which rank holds what (x: heads, MLP columns and vocabulary; y: the hidden dim):
//   wte (Vp, C)        rows = vocabulary over x, columns = hidden over y, depth-sharded over z
//                      (it is the embedding and the tied lm_head, a normal layer: logits over x)
//   qkv (3C, C)        normal layer: out = heads over x, taken from q, k and v separately, so
//                      rank x gets whole heads; in = hidden over y
//   attn proj (C, C)   transposed: in = heads over x, out = hidden over y
//   fc (4C, C)         normal: out over x, in over y;    mlp proj (C, 4C): transposed
//   LayerNorms, wpe, the projections' biases: the hidden over y (copies on every x, z rank)
//   qkv and fc biases: out over x (copies on every y, z rank)
// Between blocks the residual stream is (rows, C / Y): hidden over y, the same on every x rank.
// Rows (sequences) are split over z and over the data dimension.
#ifndef TP_MODEL_H
#define TP_MODEL_H

#include <stdbool.h>

#include "config/config.h"
#include "data/alpaca.h"
#include "model/activations.h"
#include "model/gpt.h"
#include "run/run_stats.h"
#include "tp_linear.h"

// TP_COPY: whole on every rank of the grid (a mixture of experts' tensors: stage 10 runs each
// expert whole on every x rank)
typedef enum { TP_WEIGHT, TP_SPLIT_X, TP_SPLIT_Y, TP_COPY } TPKind;

// one tensor of the full model as this rank stores it: a block (rows from up to three ranges of
// the full tensor, one range of columns; vectors count as one column), of which this rank keeps
// the elements [first, first + numel) (a weight's 1/z depth shard; the whole block otherwise)
typedef struct {
    TPKind kind;
    int nranges, row0[3], rows[3], col0, cols;  // range r: rows[r] rows from row0[r]; columns [col0, col0 + cols)
    size_t block, first, numel;
    size_t offset;  // in this rank's flat buffer
} LocalTensor;

// A set of tensors that trains beside a frozen base, laid out on the grid by code of its own (a
// model transform's stage-05 glue sets it): the replica's gradient norm and the checkpoint
// are its, and tp_model_free frees it. owner is what the three functions are given.
typedef struct {
    void *owner;
    double (*norm_squares)(const void *owner, const float *grads);  // as tp_norm_squares
    void (*save)(const void *owner, const Config *cfg, Comm *group, const float *params);  // its whole, by group's rank 0
    void (*free)(void *owner);
} TPTrained;

typedef struct {
    TPGrid grid;
    GPTConfig cfg;
    ParamLayout full;       // the serial model's layout (checkpoints, init), or the part of it a
                            // pipeline stage holds (stage 10: tp_model_layout_part)
    LocalTensor *local;     // [full.num_tensors], indexed like full.tensors
    ParamLayout layout;     // this rank's flat buffer: small tensors first, then the weight shards
    size_t small_numel;     // [0, small_numel): tensors with copies on other ranks (norms, biases, wpe)
    size_t weight_numel;    // per-rank weight shards
    size_t full_weight_numel;  // the same weights in the full model: x*y*z times weight_numel
    int Cy, Cx, C4x, NHx, Vl, v_lo, v_count;  // local sizes; this rank's vocabulary shard
    TPLinear qkv, proj, fc, fcproj, head;
    size_t max_block;
    bool vocab_parallel_loss;
    ModelShape shape;       // this rank's share of a block, for the common block code
    TPTrained trained;      // the trained set beside a frozen base, or all NULL: the base trains
    // sequence parallelism (tp_sequence_apply sets them): x, the residual rows' split, and the
    // block's gather before and reduce-scatter after each region; 0 and NULL without
    int seq_shards;
    void (*seq_gather)(LayerOps *ops, float *full, const float *shard, int N);
    void (*seq_reduce_scatter)(LayerOps *ops, float *shard, const float *full, int N);
} TPModel;

// Refuses a grid that does not fit the model or the batch (fatal, naming the constraint).
void tp_check_grid(const GPTConfig *mc, const int dims[3], int world, int global_batch, int acc);
// the same test as a question: false, with the message in why, when the grid does not fit
bool tp_grid_fits(const GPTConfig *mc, const int dims[3], int world, int global_batch, int acc, char *why,
                  size_t why_size);
void tp_model_init(TPModel *m, Comm *world, const GPTConfig *mc, const int dims[3], bool vocab_parallel_loss);
// the same on a grid already made, or one with only sizes and coordinates (no groups: the
// planner, tools/plan.c, sizes a rank's share without running it)
void tp_model_layout(TPModel *m, const GPTConfig *mc, const TPGrid *grid, bool vocab_parallel_loss);
// the same for a part of the model, a range of blocks with or without the embedding and the head
// (gpt_layout_range: a pipeline stage's, stage 10); m takes `part` over and frees it
void tp_model_layout_part(TPModel *m, const GPTConfig *mc, const TPGrid *grid, bool vocab_parallel_loss,
                          ParamLayout part);
void tp_model_free(TPModel *m);
// (this rank's tensors are named with weights_point(&w, &m->layout, flat), as any model's)

// ---- moving between the full model and this rank's share -------------------------------------
// random init of this rank's share, element for element the serial model's values
void tp_init_params(const TPModel *m, float *local, uint64_t seed);
// local = this rank's share of `full` (a device buffer in the full layout)
void tp_extract(const TPModel *m, float *local, const float *full);
// full (device, full layout) = every rank's share put together, on every rank (all-reduce over
// `group`, the whole world; the owner of each element is the one copy with x, y or z = 0)
void tp_assemble(const TPModel *m, float *full, const float *local, Comm *group);
// sum of squares of the gradient over this rank's tensors, each element counted on one rank of
// the replica only: add over the tp group for the model's norm (a frozen base: its trained set's)
double tp_norm_squares(const TPModel *m, const float *grads);
// the same over the tensors take(t, ctx) accepts (t: m->full's): a pipeline stage leaves out its
// copy of the tied wte (stage 10); with a trained set beside a frozen base, that set's norm
double tp_norm_squares_of(const TPModel *m, const float *grads, TensorFilter take, const void *ctx);
// the same over the elements [first, first + count) of this rank's flat buffer only: a data-parallel
// shard of it (stage 10's ZeRO), whose squares the shard's group then adds
double tp_norm_squares_in(const TPModel *m, const float *grads, TensorFilter take, const void *ctx, size_t first,
                          size_t count);

// ---- the layers, plugged into the common block ------------------------------------------------
// the layer that runs a linear of kind k
const TPLinear *tp_layer_of(const TPModel *m, LinearKind k);
// Where weight gradients go when z > 1: one slot for wte (head and embedding add into it), two
// alternating ones for the blocks' matrices.
typedef struct {
    TPGradSlot wte, mat[2];
    int next;
} TPGradSlots;

// The LayerOps of gpt.h for this grid: every linear layer is tp_linear_forward/backward with its
// weight from the stream, LayerNorm all-reduces its statistics over y, the embedding and the
// head hold a vocabulary shard over x. Attention is the serial op on this rank's heads.
typedef struct {
    LayerOps base;           // what the block calls (first: the block sees a LayerOps *)
    const TPModel *m;
    TPWeightStream *stream;  // hands out the gathered weights in the pass's order
    TPGradSlots *slots;      // where weight gradients go when z > 1
    bool overlap;            // backward collectives overlapped with compute
    float *stats;            // (2N) LayerNorm's row sums
    float *dwte;             // during backward: where wte's gradient collects (head, then embedding)
    float *seq_full;         // sequence parallelism: (N, C) the embedding's partial sums, its gathered gradient
} TPLayers;

// m's layers; stats: 2 * (rows of the largest pass) floats of scratch
void tp_layers_init(TPLayers *t, const TPModel *m, TPWeightStream *stream, TPGradSlots *slots, bool overlap,
                    float *stats);

// LayerNorm of N rows whose hidden dimension is split over y: the row sums are all-reduced over
// y (stats: N floats of scratch). With y = 1 it is the serial LayerNorm.
void tp_layernorm_forward(const TPModel *m, float *stats, float *out, float *mean, float *rstd,
                          const float *inp, const float *w, const float *b, int N);
// full (N, Vp) = the x ranks' logit shards local (N, Vp/x) side by side, on every x rank (an
// all-gather over x into gathered, (x, N, Vp/x) scratch, then a reordering)
void tp_gather_vocab(const TPModel *m, float *full, float *gathered, const float *local, int N);

// Weight streams: which weights forward and backward use, in order (the depth prefetch follows
// it); w: this rank's weights (with their bf16 copies in bf16 mode). Forward: the layers m holds;
// backward: the blocks, head and recomputation of `pass` (the activations it runs on: m's layers,
// or one chunk of a pipeline stage's). With recomputation every block's backward first runs its
// forward again: its forward weights come first.
void tp_stream_forward(const TPModel *m, TPWeightStream *s, const Weights *w);
void tp_stream_backward(const TPModel *m, TPWeightStream *s, const Weights *w, const ActsSpec *pass);

// ---- activations and the passes ---------------------------------------------------------------
typedef struct {
    Activations acts;                    // the block's, at this rank's sizes
    TPLayers layers;
    TPWeightStream stream;               // the gathered weights, in the passes' order
    TPGradSlots slots;                   // with z > 1: where the weights' gradients are reduce-scattered
    float *stats;
    float *ce_max, *ce_maxes, *ce_sums;  // vocab-parallel loss
    float *gathered, *full_logits;       // gathered loss (the lesson's version)
    float *seq_full;                     // sequence parallelism: TPLayers.seq_full
    size_t bytes;
} TPActs;

void tp_acts_alloc(TPActs *a, const TPModel *m, int B, int T, int flags, bool overlap);
// all of it but a->acts, for callers that keep several micro-batches' activations (a pipeline's
// slots, stage 10): each allocated with a->layers.base as its ops and m->shape as its shape, and
// passed to the _on passes below
void tp_scratch_alloc(TPActs *a, const TPModel *m, int B, int T, int flags, bool overlap);
void tp_acts_free(TPActs *a);
// the bytes tp_acts_alloc allocates, allocating nothing
size_t tp_acts_bytes(const TPModel *m, int B, int T, int flags);
// the memory report's rows for this rank: its share of the model, its buffers, its activations
enum { TP_MEMORY_ITEMS = 7 };
void tp_memory_items(const TPModel *m, const Config *cfg, size_t acts_bytes, MemoryItem items[TP_MEMORY_ITEMS]);

// inputs/targets: host (B, T) token arrays of this rank's rows
void tp_forward(const TPModel *m, TPActs *a, const Weights *w, const int *inputs, int B, int T);
// the loss of the forward's logits (summed, not divided); backward: also dlogits, scaled by dloss
double tp_loss(const TPModel *m, TPActs *a, const int *targets, int B, int T, float dloss, bool backward);
// adds this micro-batch's gradients into g (weights: already summed over z)
void tp_backward(const TPModel *m, TPActs *a, const Weights *w, Weights *g, int B, int T);
// the three on activations k of the blocks its spec names (the layers m holds, or one chunk of
// them), with a's weight stream, layers and loss scratch
void tp_forward_on(const TPModel *m, TPActs *a, Activations *k, const Weights *w, const int *inputs, int B, int T);
double tp_loss_on(const TPModel *m, TPActs *a, Activations *k, const int *targets, int B, int T, float dloss,
                  bool backward);
void tp_backward_on(const TPModel *m, TPActs *a, Activations *k, const Weights *w, Weights *g, int B, int T);
// A weight pass after a backward on k whose linear layers computed their input gradients only (a
// zero-bubble pipeline's W, stage 07's zero_bubble.c): run(notes) computes the weight gradients
// through these layers, which read the weights in the backward's order again
void tp_weight_pass_on(const TPModel *m, TPActs *a, Activations *k, const Weights *w, void (*run)(void *notes),
                       void *notes);

// ---- around the training loop -----------------------------------------------------------------
// Checkpoints hold the full model, whatever the grid. Saving puts every rank's share together (an
// all-reduce over `group`, a "checkpoint" group, so that it is not counted with the training's
// x, y, z, data traffic) and its rank 0 writes the same files as every stage; loading reads the
// full model and keeps this rank's share: any grid loads any checkpoint.
void tp_save_checkpoint(const Config *cfg, const TPModel *m, Comm *group, const float *params,
                        const float *adam_m, const float *adam_v, long step);
// init_from or (resume) out_dir; returns the step to continue from (0 unless resuming)
long tp_load_checkpoint(const Config *cfg, const TPModel *m, float *params, float *adam_m, float *adam_v);
// validation loss of this row group's slices (row_rank of row_ranks), the forward of the
// training's layout; counts: this rank is the one of its row group whose sums count
void tp_evaluate(const TPModel *m, TPActs *a, const Weights *w, const Dataset *data, const Config *cfg,
                 int row_rank, int row_ranks, bool counts, double sums[2]);
// the grid, what each coordinate splits, the loss's form, what overlaps, and the parallel
// weights' share on this rank (also into stats.json)
void tp_print_grid(const TPModel *m, int P, bool overlap);

#endif
