// tp_muon.h: Muon (optimizer muon, common/run/muon.h) on a tensor-parallel grid.
//
// A rank holds a block of each matrix (AxoNN's: rows over one grid dimension, columns over
// another, the rest over z), and Muon orthogonalizes whole matrices. The choice made here is the
// simplest: every rank puts the whole model's updates together (tp_assemble: one all-reduce of
// the model's size over the "muon" group, each element contributed by the one rank that holds
// it), orthogonalizes every matrix itself, and keeps its blocks (tp_extract). No rank waits for
// another's orthogonalization, at the price of the whole model's bytes each step and every
// matrix's flops on every rank; stage 04's fsdp_muon_step shows the other choice, one owner per
// matrix. The per-element halves (momentum, the step) run on the rank's own blocks.
#ifndef TP_MUON_H
#define TP_MUON_H

#include <stddef.h>

#include "comm/comm.h"
#include "config/config.h"
#include "run/muon.h"
#include "tp_model.h"

typedef struct {
    Comm *group;    // every rank: the updates' all-reduce, counted apart as "muon"
    float *full;    // the whole model's updates, in the full layout
    Muon muon;      // the orthogonalization's scratch
    size_t bytes;   // what the two take on a rank
} TPMuon;

// the bytes tp_muon_create allocates on a rank of m's grid with optimizer muon
size_t tp_muon_bytes(const TPModel *m);
// with optimizer muon, the group (every rank calls it) and the buffers; with adamw nothing
TPMuon tp_muon_create(const Config *cfg, const TPModel *m, Comm *world);
void tp_muon_free(TPMuon *tm);
// The run's optimizer on this rank's share (`layout`: m->layout, or the trained set beside a frozen base), reading the
// gradients times clip: adamw_step, or with optimizer muon Muon's step, whose tensors' gradients
// become their orthogonalized updates
void tp_optimizer_step(TPMuon *tm, const TPModel *m, const ParamLayout *layout, float *params, float *grads,
                       float *adam_m, float *adam_v, const Config *cfg, double lr, long t, float clip);

#endif
