// tp_sequence.c: sequence parallelism's collectives for the block (tp_sequence.h)
#include "tp_sequence.h"

#include "base/log.h"
#include "comm/comm.h"
#include "run/run_stats.h"

// the elements of this rank's rows of N
static size_t shard_floats(const TPModel *m, int N) { return (size_t)(N / m->seq_shards) * m->shape.C; }

static void seq_gather(LayerOps *ops, float *full, const float *shard, int N) {
    const TPModel *m = ((TPLayers *)ops)->m;
    comm_all_gather(m->grid.gx, full, shard, shard_floats(m, N));
}

static void seq_reduce_scatter(LayerOps *ops, float *shard, const float *full, int N) {
    const TPModel *m = ((TPLayers *)ops)->m;
    comm_reduce_scatter(m->grid.gx, shard, full, shard_floats(m, N));
}

void tp_sequence_apply(TPModel *m, const Config *cfg) {
    if (!cfg->sequence_parallel) return;
    const int *d = cfg->tp_dimensions;
    // y splits the hidden dimension, so a norm's statistics already need a sum over y, and z
    // splits the rows the z ranks hold: a sequence split over x would cut a third way through
    // AxoNN's grid, whose x regions are not the only ones (Megatron's SP is for the 1-D split)
    if (d[1] != 1 || d[2] != 1)
        fatal("%s: key 'sequence_parallel' is true but tp_dimensions is [%d, %d, %d]: sequence parallelism "
              "splits the tokens between 1-D (Megatron) tensor-parallel regions, expected [x, 1, 1]; y splits "
              "the hidden dimension the norms work on and z the rows already",
              config_source("sequence_parallel"), d[0], d[1], d[2]);
    m->seq_shards = m->grid.X;
    m->seq_gather = seq_gather;
    m->seq_reduce_scatter = seq_reduce_scatter;
    TPLinear *layers[] = {&m->qkv, &m->proj, &m->fc, &m->fcproj, &m->head};
    for (int i = 0; i < 5; i++) layers[i]->partial_sums = true;
}

void tp_sequence_report(const TPModel *m, const Activations *a) {
    printf("residual-stream activations: %.2f MB (the residual, its gradient, the norms' statistics%s)\n",
           a->residual_bytes / 1e6, m->seq_shards > 1 ? "; sequence parallel: 1/x of the tokens" : "");
    run_stats_number("residual_activation_bytes", (double)a->residual_bytes);
}

static bool is_norm(TensorRole r) {
    return r == ROLE_LN1_W || r == ROLE_LN1_B || r == ROLE_LN2_W || r == ROLE_LN2_B || r == ROLE_LNF_W ||
           r == ROLE_LNF_B;
}

void tp_sequence_reduce_norm_grads(const TPModel *m, float *grads) {
    if (m->seq_shards <= 1) return;
    for (int i = 0; i < m->layout.num_tensors; i++) {
        const TensorInfo *t = &m->layout.tensors[i];
        if (is_norm(t->role)) comm_all_reduce(m->grid.tp, grads + t->offset, t->numel);
    }
}
