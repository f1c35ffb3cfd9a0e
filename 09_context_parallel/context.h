// context.h: stage 09's context parallelism. The ranks form a cp x dp grid: a replica's cp ranks
// split each of its sequences, and each holds the whole model. A sequence of T tokens is cut into
// 2 cp chunks; rank r holds chunks r and 2 cp - 1 - r (one early, one late: under the causal mask
// the early chunks have little to attend to and the late ones much, so the pairs even out the
// work). Every op but attention runs on the rank's chunks as if they were sequences of their own,
// at their global positions; attention needs every earlier token's key and value, which travel
// around the cp ranks (ring) or arrive by all-to-all with the heads split instead (ulysses).
// train.c reads like stage 03 with these layers plugged in and its batch cut into chunks.
#ifndef CONTEXT_H
#define CONTEXT_H

#include <stdbool.h>

#include "comm/comm.h"
#include "config/config.h"
#include "data/alpaca.h"
#include "model/gpt.h"

// Where this rank sits. Rank = replica * cp + cp_rank: a replica's ranks, which pass keys and values
// in every block, are consecutive, so that traffic stays on one node.
typedef struct {
    int cp, dp;             // ranks a sequence is split over, replicas
    int cp_rank, replica;
    bool ulysses;           // cp_impl: all-to-all to the heads (else: the ring)
    bool overlap;           // the ring's next block travels while this one is computed
    Comm *world;
    Comm *cp_group;         // this replica's ranks: the ring, the all-to-alls
} CPGrid;

// Checks the grid against the ranks, the sequence length and the heads (fatal() on every rank
// alike), then makes the group.
void cp_grid_init(CPGrid *g, Comm *world, const Config *cfg, const GPTConfig *mc);
// Prints the grid and each rank's chunks, and the most and the fewest query-key scores any rank's
// attention computes for a sequence of 2 cp chunks of c tokens, every head, under the causal mask
// (stats.json: attention_scores_per_rank_max and _min). The chunk pairs (r, 2 cp - 1 - r) make
// them equal. Every rank calls it (the figures are a reduction); rank 0 prints.
void print_context_plan(const CPGrid *g, const Config *cfg, const ModelShape *s, int c);

// The chunks' length for sequences of T tokens: T padded to a multiple of 2 cp (the pads are past
// the sequence's end, seen by no real token, and have no target), divided into 2 cp
int cp_chunk_len(const CPGrid *g, int T);
// this rank's part of a replica's batch (rows x T): its two chunks of every row, as 2 x rows
// sequences of cp_chunk_len(T) tokens, the early chunks' rows first
void cp_local_batch(const CPGrid *g, const Batch *full, Batch *local);
// where this rank's chunk `half` (0 early, 1 late) of a T-token sequence starts (a dropout mask
// drawn by place in the global batch is drawn at the tokens' positions in the whole sequence)
int cp_chunk_start(const CPGrid *g, int half, int T);

// The LayerOps of this grid: serial_layer_ops() with the embedding at the chunks' positions and
// the context-parallel attention. Sized for 2 * B chunks of c tokens and the model's layers. The
// activations' start must be x->start, which the embedding fills with the rows' positions.
typedef struct {
    LayerOps base;          // what the block calls (first: the block sees a LayerOps *)
    const CPGrid *grid;
    int max_positions;      // rows of the position table (GPT-2's wpe)
    int *start, *start_host;  // [2 B] each row's first position, on the device (Activations.start:
                              // phi's rotary embedding turns by it) and its host copy
    float *kv[2], *dkv[2];  // the block in hand and the one arriving: (N, 2C) k | v, and gradients
                            // (ulysses: kv[0], dkv[0], a block of its heads, (N, 2C / cp))
    float *o, *run_max, *run_sum, *scratch, *delta;  // the online softmax's state; backward's
    float **kept_out;       // [layer] (N, C): attention's output for backward where the block keeps
                            // none in fp32 (bf16); NULL in fp32
    int n_layers;
    float *send, *recv;     // ulysses: the all-to-alls' buffers, and its attention's temporaries
    size_t bytes;           // the device bytes of all of the above
    bool counting;          // cp_layers_bytes: nothing allocated, bytes counted
} CPLayers;

void cp_layers_init(CPLayers *x, const CPGrid *g, const GPTConfig *mc, int B, int c, bool half);
// start (and start_host) = each of the B rows' first position in its whole sequence: rows of
// chunks of T tokens, the early chunks' rows first (the embedding calls it; stage 10's later
// pipeline stages too, whose rotary embedding turns by it without an embedding of their own)
void cp_layers_set_positions(CPLayers *x, int B, int T);
void cp_layers_free(CPLayers *x);
// the device bytes cp_layers_init allocates (activations: the planner counts them too)
size_t cp_layers_bytes(const CPGrid *g, const GPTConfig *mc, int B, int c, bool half);

// the validation loss summed over this rank's tokens and the replica's targets counted once
void cp_evaluate_sums(Activations *a, const Weights *w, const GPTConfig *mc, const Dataset *data,
                      const Config *cfg, const CPGrid *g, double sums[2]);

#endif
