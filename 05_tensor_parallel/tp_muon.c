// tp_muon.c: see tp_muon.h.
#include "tp_muon.h"

#include "base/device.h"
#include "run/optimizer.h"

size_t tp_muon_bytes(const TPModel *m) { return m->full.num_params * sizeof(float) + muon_scratch_bytes(&m->full); }

TPMuon tp_muon_create(const Config *cfg, const TPModel *m, Comm *world) {
    TPMuon tm = {0};
    if (!cfg->muon) return tm;
    tm.group = comm_split(world, 0, comm_rank(world), "muon");
    tm.full = dev_malloc(m->full.num_params * sizeof(float));
    tm.muon = muon_create(cfg, &m->full);
    tm.bytes = tp_muon_bytes(m);
    return tm;
}

void tp_muon_free(TPMuon *tm) {
    dev_free(tm->full);
    muon_free(&tm->muon);
}

static void tp_muon_step(TPMuon *tm, const TPModel *m, float *params, float *grads, float *adam_m, float *adam_v,
                         const Config *cfg, double lr, long t, float clip) {
    const ParamLayout *local = &m->layout, *full = &m->full;
    muon_momentum_step(local, params, grads, adam_m, adam_v, 0, local->num_params, cfg, lr, t, clip);
    tp_assemble(m, tm->full, grads, tm->group);
    for (int i = 0; i < full->num_tensors; i++) {
        const TensorInfo *ti = &full->tensors[i];
        if (muon_updates(ti))
            muon_orthogonalize(&tm->muon, tm->full + ti->offset, ti->shape[0], ti->shape[1], cfg->muon_ns_steps);
    }
    tp_extract(m, grads, tm->full);
    muon_apply(local, params, grads, 0, local->num_params, cfg, lr);
}

void tp_optimizer_step(TPMuon *tm, const TPModel *m, const ParamLayout *layout, float *params, float *grads,
                       float *adam_m, float *adam_v, const Config *cfg, double lr, long t, float clip) {
    if (cfg->muon) tp_muon_step(tm, m, params, grads, adam_m, adam_v, cfg, lr, t, clip);
    else adamw_step(layout, params, grads, adam_m, adam_v, 0, layout->num_params, cfg, lr, t, clip);
}
