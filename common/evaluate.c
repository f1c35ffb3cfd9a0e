// evaluate.c: see evaluate.h.
#include "evaluate.h"

#include "device.h"

static void whole_model_forward(void *weights, Activations *a, const int *inputs, int B, int T) {
    gpt_forward(a, weights, inputs, B, T);
}

void evaluate_sums(Activations *a, const Weights *w, const GPTConfig *mc, const Dataset *data,
                   const Config *cfg, int rank, int world, double *loss_sum, long *count) {
    evaluate_sums_with(a, whole_model_forward, (void *)w, mc, data, cfg, rank, world, loss_sum, count);
}

void evaluate_batches(BatchLossFn loss, void *ctx, const Dataset *data, const Config *cfg, int rank,
                      int world, double *loss_sum, long *count) {
    long batches = dataset_batches_per_epoch(data, 1, cfg->global_batch_size);
    if (batches > cfg->eval_batches) batches = cfg->eval_batches;
    int acc = cfg->gradient_acc_steps;
    Batch batch = {0};
    *loss_sum = 0;
    *count = 0;
    for (long b = 0; b < batches; b++)
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 1, (uint64_t)cfg->seed, 0, b, cfg->global_batch_size,
                              rank * acc + micro, world * acc, &batch);
            *loss_sum += loss(ctx, &batch);
            *count += batch.n_targets_local;
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
                        const Dataset *data, const Config *cfg, int rank, int world, double *loss_sum,
                        long *count) {
    ForwardThenLoss f = {a, forward, ctx, mc};
    evaluate_batches(forward_then_loss, &f, data, cfg, rank, world, loss_sum, count);
}
