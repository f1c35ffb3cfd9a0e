// muon.c: see muon.h.
#include "muon.h"

#include <math.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "ops/ops.h"
#include "optimizer.h"

// the published quintic's coefficients: the steepest rise of small singular values toward 1 that
// still keeps every one of them in [0.7, 1.2] after five iterations
static const float NS_A = 3.4445f, NS_B = -4.7750f, NS_C = 2.0315f;

static size_t gram_side(const TensorInfo *ti) {
    return (size_t)(ti->shape[0] < ti->shape[1] ? ti->shape[0] : ti->shape[1]);
}

// the elements of the largest Muon matrix and of the largest Gram matrix
static void largest_matrix(const ParamLayout *layout, size_t *numel, size_t *gram) {
    *numel = *gram = 0;
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *ti = &layout->tensors[i];
        if (!muon_updates(ti)) continue;
        size_t k = gram_side(ti);
        if (ti->numel > *numel) *numel = ti->numel;
        if (k * k > *gram) *gram = k * k;
    }
}

size_t muon_scratch_bytes(const ParamLayout *layout) {
    size_t numel, gram;
    largest_matrix(layout, &numel, &gram);
    return (numel + 2 * gram) * sizeof(float);
}

Muon muon_create(const Config *cfg, const ParamLayout *layout) {
    Muon mu = {0};
    if (!cfg->muon) return mu;
    size_t numel, gram;
    largest_matrix(layout, &numel, &gram);
    mu.next = dev_malloc(numel * sizeof(float));
    mu.gram = dev_malloc(gram * sizeof(float));
    mu.gram2 = dev_malloc(gram * sizeof(float));
    mu.bytes = muon_scratch_bytes(layout);
    return mu;
}

void muon_free(Muon *mu) {
    dev_free(mu->next);
    dev_free(mu->gram);
    dev_free(mu->gram2);
}

double muon_flops(int rows, int cols, int steps) {
    double k = rows < cols ? rows : cols, n = rows < cols ? cols : rows;
    return steps * (4 * k * k * n + 2 * k * k * k);
}

double muon_learning_rate(const Config *cfg, double lr) { return cfg->muon_lr * lr / cfg->lr; }

void muon_momentum_step(const ParamLayout *layout, float *params, float *grads, float *m, float *v, size_t first,
                        size_t n, const Config *cfg, double lr, long t, float clip) {
    adamw_step(layout, params, grads, m, v, first, n, cfg, lr, t, clip);  // the tensors Muon does not update
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *ti = &layout->tensors[i];
        size_t at, len = tensor_in_range(ti, first, n, &at);
        if (len && muon_updates(ti))
            muon_momentum(grads + at, clip, m + at, len, (float)cfg->muon_momentum, cfg->muon_nesterov);
    }
}

// One iteration, next = a X + (b A + c A²) X with A = X Xᵀ. The Gram matrix is taken on the
// matrix's shorter side (k = min(rows, cols)): for a tall X, A = Xᵀ X and next = a X + X (b A +
// c A²), which is the same iteration on Xᵀ, transposed back. A is symmetric, so A² = A Aᵀ and
// (b A + c A²)ᵀ is itself: the matmuls below need no transposed copies.
static void newton_schulz_iteration(Muon *mu, float *next, const float *x, int rows, int cols) {
    size_t n = (size_t)rows * cols;
    bool wide = rows <= cols;
    int k = wide ? rows : cols;
    if (wide) {
        matmul_forward(mu->gram, x, x, NULL, rows, cols, rows);  // X Xᵀ
    } else {
        dev_zero(mu->gram, (size_t)k * k * sizeof(float));
        matmul_backward(NULL, mu->gram, NULL, x, x, NULL, rows, cols, cols);  // Xᵀ X
    }
    matmul_forward(mu->gram2, mu->gram, mu->gram, NULL, k, k, k);  // A²
    scale_inplace(mu->gram2, NS_C, (size_t)k * k);
    add_columns_scaled(mu->gram2, k, mu->gram, k, k, k, NS_B);  // B = b A + c A²
    if (wide) {
        dev_copy(next, x, n * sizeof(float));
        scale_inplace(next, NS_A, n);
        matmul_backward(next, NULL, NULL, mu->gram2, NULL, x, rows, cols, rows);  // + B X
    } else {
        matmul_forward(next, x, mu->gram2, NULL, rows, cols, cols);  // X B
        add_columns_scaled(next, cols, x, cols, rows, cols, NS_A);
    }
}

void muon_orthogonalize(Muon *mu, float *x, int rows, int cols, int steps) {
    size_t n = (size_t)rows * cols;
    // the Frobenius norm bounds the spectral norm: singular values in [0, 1], where the iteration converges
    double norm = sqrt(sum_squares(x, n));
    scale_inplace(x, (float)(1.0 / (norm + 1e-7)), n);
    float *cur = x, *next = mu->next;
    for (int s = 0; s < steps; s++) {
        newton_schulz_iteration(mu, next, cur, rows, cols);
        float *done = cur;
        cur = next;
        next = done;
    }
    if (cur != x) dev_copy(x, cur, n * sizeof(float));
    scale_inplace(x, sqrtf(fmaxf(1.0f, (float)rows / (float)cols)), n);
}

void muon_apply(const ParamLayout *layout, float *params, const float *updates, size_t first, size_t n,
                const Config *cfg, double lr) {
    float muon_lr = (float)muon_learning_rate(cfg, lr);
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *ti = &layout->tensors[i];
        size_t at, len = tensor_in_range(ti, first, n, &at);
        if (!len || !muon_updates(ti)) continue;
        float decay = ti->decay ? (float)cfg->weight_decay : 0.0f;
        if (decay) scale_inplace(params + at, 1.0f - muon_lr * decay, len);
        add_columns_scaled(params + at, (int)len, updates + at, (int)len, 1, (int)len, -muon_lr);
    }
}

void muon_step(Muon *mu, const ParamLayout *layout, float *params, float *grads, float *m, float *v, size_t first,
               size_t n, const Config *cfg, double lr, long t, float clip) {
    muon_momentum_step(layout, params, grads, m, v, first, n, cfg, lr, t, clip);
    int m0 = trace_mark();
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *ti = &layout->tensors[i];
        size_t at, len = tensor_in_range(ti, first, n, &at);
        if (!len || !muon_updates(ti)) continue;
        if (len != ti->numel) fatal("muon_step: %s lies partly outside the range it updates", ti->name);
        muon_orthogonalize(mu, grads + at, ti->shape[0], ti->shape[1], cfg->muon_ns_steps);
    }
    muon_apply(layout, params, grads, first, n, cfg, lr);
    trace_span("muon orthogonalize + apply", TRACK_COMPUTE, m0, trace_mark(), NULL);
}

void optimizer_step(Muon *mu, const ParamLayout *layout, float *params, half16 *params16, float *grads, float *m,
                    float *v, size_t first, size_t n, const Config *cfg, double lr, long t, float clip) {
    if (!cfg->muon) {
        adamw_step_16(layout, params, params16, grads, m, v, first, n, cfg, lr, t, clip);
        return;
    }
    muon_step(mu, layout, params, grads, m, v, first, n, cfg, lr, t, clip);
    if (params16) cast_to_16(params16, params, n);  // Muon's updates come whole: one cast after them
}
