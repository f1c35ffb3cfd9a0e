// evaluate.c: see evaluate.h.
#include "evaluate.h"

#include "base/device.h"
#include "model/activations.h"
#include "run_setup.h"

static void whole_model_forward(void *weights, Activations *a, const int *inputs, int B, int T) {
    gpt_forward(a, weights, inputs, B, T);
}

void evaluate_sums(Activations *a, const Weights *w, const GPTConfig *mc, const Dataset *data,
                   const Config *cfg, int rank, int world, double sums[2]) {
    evaluate_sums_with(a, whole_model_forward, (void *)w, mc, data, cfg, rank, world, sums);
}

void evaluate_batches(BatchLossFn loss, void *ctx, const Dataset *data, const Config *cfg, int rank,
                      int world, double sums[2]) {
    long batches = dataset_batches_per_epoch(data, 1, cfg->global_batch_size);
    if (batches > cfg->eval_batches) batches = cfg->eval_batches;
    int acc = micro_batches_per_step(cfg);
    Batch batch = {0};
    sums[0] = sums[1] = 0;
    for (long b = 0; b < batches; b++)
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 1, (uint64_t)cfg->seed, 0, b, cfg->global_batch_size,
                              rank * acc + micro, world * acc, &batch);
            sums[0] += loss(ctx, &batch);
            sums[1] += batch.n_targets_local;
        }
    batch_free(&batch);
}

typedef struct {
    Activations *a;
    ForwardFn forward;
    void *ctx;
    const GPTConfig *mc;
} ForwardThenLoss;

static double forward_then_loss(void *ctx, const Batch *batch) {
    ForwardThenLoss *f = ctx;
    f->forward(f->ctx, f->a, batch->inputs, batch->rows, batch->T);
    copy_to_device(f->a->targets, batch->targets, (size_t)batch->rows * batch->T * sizeof(int));
    return gpt_loss_forward(f->a, f->mc, batch->rows, batch->T);
}

void evaluate_sums_with(Activations *a, ForwardFn forward, void *ctx, const GPTConfig *mc,
                        const Dataset *data, const Config *cfg, int rank, int world, double sums[2]) {
    ForwardThenLoss f = {a, forward, ctx, mc};
    evaluate_batches(forward_then_loss, &f, data, cfg, rank, world, sums);
}
