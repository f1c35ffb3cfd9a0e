// composed_cp.h: context parallelism inside stage 10's pipeline stages (the mesh's cp dimension).
// Each cp rank holds two chunks of every micro-batch's sequences, 09's load-balanced pair (chunks
// r and 2 cp - 1 - r of 2 cp); inside a stage, 05's tensor-parallel layers run every op on them as
// on short sequences at their global positions (learned wpe rows, rotary angles), and attention is
// 09's ring over the cp ranks of the same stage, replica and t: the heads a tp rank holds attend
// independently of the others', so each tp rank passes the keys and values of its heads around
// its own ring. The weights are copies over cp: their gradients are summed over dp x cp.
#ifndef COMPOSED_CP_H
#define COMPOSED_CP_H

#include "../09_context_parallel/context.h"
#include "composed.h"

// The stage's PipeLayers: 05's (TPStageLayers), with the embedding at the chunks' positions and
// 09's ring attention plugged into its LayerOps when cp > 1; cp = 1 leaves them as 05 made them.
typedef struct {
    TPStageLayers tp;   // first: the pipeline sees tp.base, 05's block sees tp.scratch.layers.base
    int cp;
    CPGrid grid;        // 09's, over the context group: cp x dp, rank = replica * cp + cp_rank
    CPLayers ring;      // 09's: the rows' positions and ring attention
    LayerOps tp_ops;    // 05's layers as 05 made them, which the chunked embedding calls
    PipeLayers tp_stage;  // composed.c's PipeLayers, which the positioned ones call
    Batch *chunks;      // [micro-batches] this rank's two chunks of each of the step's
    int n_chunks;
    bool half;          // 16-bit runs: 09's ring keeps each block's attention output for backward
    struct SlotOutputs *kept;  // [n_kept] those of each pipeline slot (activations) run so far
    int n_kept;
} CPStageLayers;

// B x T: a micro-batch's rows and longest sequence. Refuses (fatal() on every rank alike) what
// stage 10's cp does not run: Ulysses, a longest sequence 2 cp does not divide.
void cp_stage_layers_init(CPStageLayers *l, const TPModel *m, const Config *cfg, const ComposedGroups *g,
                          const GPTConfig *mc, int B, int T);
void cp_stage_layers_free(CPStageLayers *l);
// 09's plan (the chunks each rank holds, attention's balance) when cp > 1; every rank calls it
void print_cp_stage_plan(const CPStageLayers *l, const Config *cfg);
// what the pipeline runs for the step's m micro-batches: this rank's chunks of each (cp > 1), or
// the micro-batches themselves. Every chunk keeps the global batch's target count.
const Batch *cp_stage_batches(CPStageLayers *l, const Batch *batches, int m);
// the validation loss summed over this rank's tokens and the targets counted once per cp group
void cp_stage_evaluate(CPStageLayers *l, Pipeline *p, const Dataset *data, const Config *cfg, int replica,
                       int dp, double sums[2]);
// the ranks holding the same tensors as this one, whose gradients are summed: the stage's
// replicas (07's group), and with cp > 1 the context group (dp x cp)
Comm *composed_replicas(const CPStageLayers *l, const PipeGrid *pg);

#endif
