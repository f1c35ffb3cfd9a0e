// composed_zero.c: see composed_zero.h.
#include "composed_zero.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "run/optimizer.h"
#include "run/run_stats.h"

// zero_stage's default (3) is stage 04's, FSDP: stage 10 reads the key only where it is given
static bool zero_stage_given(void) { return strcmp(config_source("zero_stage"), "defaults") != 0; }

static void refuse_what_stage10_does_not_shard(const Config *cfg) {
    if (cfg->hsdp_replicas != 1)
        fatal("%s: key 'hsdp_replicas' is %d but stage 10's data dimension is one group (the mesh's dp): expected 1",
              config_source("hsdp_replicas"), cfg->hsdp_replicas);
    if (zero_stage_given() && cfg->zero_stage != 1)
        fatal("%s: key 'zero_stage' is %d but stage 10 runs zero_stage 1 (or none): a pipeline stage adds every "
              "micro-batch's gradient into one buffer until its last backward, so 2 would shard nothing, and 3 would "
              "gather every block around every micro-batch (10_composed/README.md, Refused)",
              config_source("zero_stage"), cfg->zero_stage);
    // the experts are summed over replicas of their own, not one flat share of the replicas
    if (zero_stage_given() && cfg->num_experts > 0)
        fatal("%s: key 'zero_stage' is %d but num_experts is %d: stage 10 shards a dense model's replicas only "
              "(expected no zero_stage)", config_source("zero_stage"), cfg->zero_stage, cfg->num_experts);
}

// a buffer of n elements grown to `to`, the tail zero
static float *grown(float *old, size_t n, size_t to) {
    float *buf = dev_malloc(to * sizeof(float));
    dev_copy(buf, old, n * sizeof(float));
    dev_free(old);
    return buf;
}

// the [first, first + real) slice of a whole buffer of moments, in a buffer of its own
static float *slice(float *whole, size_t first, size_t real, size_t shard) {
    float *mine = dev_malloc(shard * sizeof(float));
    dev_copy(mine, whole + first, real * sizeof(float));
    dev_free(whole);
    return mine;
}

void composed_zero_init(ComposedZero *z, Comm *replicas, const Config *cfg, ModelBuffers *mb,
                        const ParamLayout *layout) {
    refuse_what_stage10_does_not_shard(cfg);
    *z = (ComposedZero){.on = zero_stage_given(), .group = replicas, .rank = comm_rank(replicas),
                        .R = comm_size(replicas), .n = mb->n};
    if (!z->on) return;
    z->shard = (z->n + (size_t)z->R - 1) / (size_t)z->R;
    z->first = (size_t)z->rank * z->shard;
    z->real = z->first >= z->n ? 0 : (z->n - z->first < z->shard ? z->n - z->first : z->shard);
    z->io = comm_split(replicas, 0, z->rank, "zero-ckpt");
    z->scratch = dev_malloc(z->shard * sizeof(float));
    size_t padded = z->shard * (size_t)z->R;
    mb->params = grown(mb->params, z->n, padded);
    mb->grads = grown(mb->grads, z->n, padded);
    weights_free(&mb->w);
    weights_free(&mb->g);
    weights_point(&mb->w, layout, mb->params);
    weights_point(&mb->g, layout, mb->grads);
    if (mb->params16) weights_point_16(&mb->w, layout, mb->params16);
    mb->adam_m = slice(mb->adam_m, z->first, z->real, z->shard);
    mb->adam_v = slice(mb->adam_v, z->first, z->real, z->shard);
}

void composed_zero_print_memory(const ComposedZero *z) {
    if (!z->on) return;
    size_t moments = 2 * z->shard * sizeof(float), padded = z->shard * (size_t)z->R;
    printf("ZeRO-1 over %d replicas: AdamW m and v %.2f MiB a rank (2 x 4 x ceil(%zu / %d) bytes; DDP %.2f MiB), "
           "parameters and gradients whole (4 x %zu bytes each, padded to %d shards), a shard of scratch\n",
           z->R, moments / 1048576.0, z->n, z->R, 2.0 * z->n * sizeof(float) / 1048576.0, padded, z->R);
    run_stats_memory("AdamW m and v (fp32)", moments);
    run_stats_memory("ZeRO scratch shard", z->shard * sizeof(float));
    run_stats_number("zero_stage", 1);
    run_stats_number("state_bytes", (double)((2 * padded + 3 * z->shard) * sizeof(float)));
}

void composed_zero_reduce_gradients(ComposedZero *z, ModelBuffers *mb) {
    comm_reduce_scatter(z->group, z->scratch, mb->grads, z->shard);
    dev_copy(mb->grads + z->first, z->scratch, z->real * sizeof(float));
}

double composed_zero_grad_norm(const ComposedZero *z, const ComposedGroups *g, const TPModel *m, const PipeGrid *pg,
                               const float *grads) {
    double mine = tp_norm_squares_in(m, grads, pipe_tensor_counted, pg, z->first, z->real);
    return sqrt(comm_sum_double(z->group, comm_sum_double(g->replica_ranks, mine)));
}

void composed_zero_step(ComposedZero *z, const ParamLayout *layout, ModelBuffers *mb, const Config *cfg, double lr,
                        long t, float clip) {
    if (!z->on) {
        adamw_step(layout, mb->params, mb->grads, mb->adam_m, mb->adam_v, 0, mb->n, cfg, lr, t, clip);
        return;
    }
    adamw_step(layout, mb->params + z->first, mb->grads + z->first, mb->adam_m, mb->adam_v, z->first, z->real, cfg,
               lr, t, clip);
    // a collective's input may not lie inside its output: the shard goes through scratch
    dev_copy(z->scratch, mb->params + z->first, z->shard * sizeof(float));
    comm_all_gather(z->group, mb->params, z->scratch, z->shard);
}

// every rank's shard of a moment, whole (on every rank of the group: each saves its stage's part)
static float *gathered(const ComposedZero *z, const float *shard) {
    float *whole = dev_malloc(z->shard * (size_t)z->R * sizeof(float));
    comm_all_gather(z->io, whole, shard, z->shard);
    return whole;
}

void composed_zero_save(ComposedZero *z, const Config *cfg, const ComposedGroups *groups, const PipeGrid *pg,
                        const TPModel *m, const ParamLayout *full, const float *params, const float *adam_m,
                        const float *adam_v, long step) {
    if (!z->on) {
        composed_save_checkpoint(cfg, groups, pg, m, full, params, adam_m, adam_v, step);
        return;
    }
    float *whole_m = gathered(z, adam_m), *whole_v = gathered(z, adam_v);
    composed_save_checkpoint(cfg, groups, pg, m, full, params, whole_m, whole_v, step);
    dev_free(whole_m);
    dev_free(whole_v);
}

void composed_zero_free(ComposedZero *z) { dev_free(z->scratch); }
