// optimizer.c: see optimizer.h.
#include "optimizer.h"

#include <math.h>

#include "base/trace.h"
#include "ops/ops.h"

double learning_rate(const Config *cfg, long step, long total_steps) {
    if (step < cfg->warmup_steps) return cfg->lr * (double)(step + 1) / cfg->warmup_steps;
    long decay_steps = total_steps - cfg->warmup_steps;
    if (decay_steps <= 1) return cfg->lr;
    double progress = (double)(step - cfg->warmup_steps) / (double)(decay_steps - 1);
    if (progress > 1) progress = 1;
    double cosine = 0.5 * (1.0 + cos(3.14159265358979323846 * progress));
    return cfg->min_lr + cosine * (cfg->lr - cfg->min_lr);
}

bool muon_updates(const TensorInfo *ti) { return ti->block >= 0 && ti->ndim == 2 && ti->role != ROLE_MOE_MLP; }

size_t tensor_in_range(const TensorInfo *ti, size_t first, size_t n, size_t *at) {
    size_t lo = ti->offset > first ? ti->offset : first;
    size_t hi = ti->offset + ti->numel < first + n ? ti->offset + ti->numel : first + n;
    if (lo >= hi) return 0;
    *at = lo - first;
    return hi - lo;
}

void adamw_step_16(const ParamLayout *layout, float *params, half16 *params16, const float *grads, float *m,
                   float *v, size_t first, size_t n, const Config *cfg, double lr, long t, float clip) {
    int m0 = trace_mark();
    // One call per tensor (or per part of one inside [first, first + n)), because the weight
    // decay differs between tensors; the pointers are to the range's first element.
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *ti = &layout->tensors[i];
        size_t at, len = tensor_in_range(ti, first, n, &at);
        if (!len || (cfg->muon && muon_updates(ti))) continue;
        adamw_update_16(params + at, params16 ? params16 + at : NULL, grads + at, clip, m + at, v + at, len,
                        (float)lr, (float)cfg->beta1, (float)cfg->beta2, (float)cfg->eps,
                        ti->decay ? (float)cfg->weight_decay : 0.0f, (int)t);
    }
    trace_span("optimizer", TRACK_COMPUTE, m0, trace_mark(), NULL);
}

void adamw_step(const ParamLayout *layout, float *params, const float *grads, float *m, float *v,
                size_t first, size_t n, const Config *cfg, double lr, long t, float clip) {
    adamw_step_16(layout, params, NULL, grads, m, v, first, n, cfg, lr, t, clip);
}

float clip_factor(double norm, double max_norm) {
    return max_norm > 0 && norm > max_norm ? (float)(max_norm / (norm + 1e-6)) : 1.0f;
}
