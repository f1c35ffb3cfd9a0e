// composed_ep.c: see composed_ep.h.
#include "composed_ep.h"

#include <stdio.h>
#include <string.h>

#include "../08_mixture_of_experts/moe.h"
#include "base/device.h"
#include "base/log.h"
#include "run/run_checkpoint.h"

// ---- the grid ---------------------------------------------------------------------------------

static void refuse_what_experts_do_not_run(const Config *cfg, const PipeGrid *pg, int ranks) {
    // an expert's capacity is counted per sequence (moe.h): a piece of one would drop other pairs
    if (cfg->cp_size > 1)
        fatal("%s: key 'cp_size' is %d but num_experts is %d: stage 10 does not yet route a mixture of experts' "
              "tokens from chunks of sequences (an expert's capacity is counted per whole sequence); set cp_size 1",
              config_source("cp_size"), cfg->cp_size, cfg->num_experts);
    if (cfg->sequence_parallel)
        fatal("%s: key 'sequence_parallel' is true but num_experts is %d: its residual rows are a slice of a "
              "micro-batch's tokens, which cuts the sequences whose capacity an expert counts; set it to false",
              config_source("sequence_parallel"), cfg->num_experts);
    // 08's MoE MLP is plugged into the slots' layer ops once, for the stage's one range of blocks
    if (pg->chunks > 1)
        fatal("%s: key 'pp_schedule' is 'interleaved' but num_experts is %d: stage 10 plugs 08's MoE MLP into a "
              "stage's one range of blocks, not into each of its %d chunks; use gpipe, 1f1b or zb-h1",
              config_source("pp_schedule"), cfg->num_experts, pg->chunks);
    if (pg->dp % cfg->ep_size != 0)
        fatal("%s: key 'ep_size' is %d but stage 10 spreads the experts over the data replicas of each pipeline "
              "stage, and there are %d (dp = %d ranks / (tp %d x pp %d)): expected a divisor of %d",
              config_source("ep_size"), cfg->ep_size, pg->dp, ranks, cfg->tp_dimensions[0], pg->pp, pg->dp);
}

static void print_experts_plan(const ComposedExperts *e, const GPTConfig *mc, int replicas) {
    const ExpertGrid *g = &e->grid;
    printf("experts: %d per MoE block, top-%d, over ep %d: each stage's %d data replicas are %d expert groups of %d "
           "(Megatron's ep inside dp); replica r holds experts [(r %% %d) x %d, + %d), whole on each x rank; "
           "all-to-alls over \"experts\", their gradients summed over \"expert-replicas\"\n",
           mc->moe->n_experts, mc->moe->experts_per_token, g->ep, replicas, g->dp, g->ep, g->ep, g->n_local,
           g->n_local);
}

void composed_ep_init(ComposedExperts *e, const Config *cfg, ComposedGroups *g, const PipeGrid *pg, GPTConfig *mc) {
    memset(e, 0, sizeof *e);
    e->ep = 1;
    if (!gpt_moe_blocks(mc, 0, mc->n_layer)) return;
    refuse_what_experts_do_not_run(cfg, pg, comm_size(g->mesh.world));
    moe_model(mc);  // the MoE blocks' MLP is 08's moe.c
    e->moe = true;
    e->ep = cfg->ep_size;
    e->global_sequences = cfg->global_batch_size;
    expert_grid_init(&e->grid, pg->dp_group, cfg);
    if (g->mesh.coord[MESH_TP] == 0 && pg->stage == 0 && pg->replica == 0) print_experts_plan(e, mc, pg->dp);
    if (e->ep == 1) return;
    // the first expert group of each stage (of each t: only t = 0's saves): a rank per stage and share
    e->savers = comm_split(g->slice, e->grid.replica == 0 ? 0 : 1, pg->stage * e->ep + e->grid.ep_rank, "savers");
    g->experts = e;
}

void composed_ep_stage_layout(const ComposedExperts *e, ParamLayout *layout, const GPTConfig *mc,
                              const PipeGrid *pg) {
    if (e->ep == 1) return;
    gpt_layout_free(layout);
    gpt_layout_range_repeats(layout, mc, pg->first_block, pg->n_blocks, pg->is_first, pg->is_last,
                             e->grid.first_expert, e->grid.n_local);
}

// ---- 08's MoE MLP in 05's layers --------------------------------------------------------------

// The stage's experts: 05's ops table, which the block hands the MLP, has no room for them, and a
// process runs one stage (one set of layers)
static ComposedExperts *plugged;

// a MoE block's MLP is 08's (the all-to-alls when ep > 1), a dense block's 05's
static void composed_mlp_forward(LayerOps *ops, Activations *a, int l, const BlockWeights *w, int B, int T) {
    ComposedExperts *e = plugged;
    if (!gpt_block_is_moe(&a->spec.model, l)) {
        e->tp_ops.mlp_forward(ops, a, l, w, B, T);
        return;
    }
    // the load-balancing loss's weight, in every micro-batch slot's activations
    moe_set_global_batch(a, &a->spec.model, e->global_sequences);
    e->layers.base.mlp_forward(&e->layers.base, a, l, w, B, T);
}

static void composed_mlp_backward(LayerOps *ops, Activations *a, int l, float *dinp, const BlockWeights *w,
                                  BlockWeights *g, const float *dout, int B, int T) {
    ComposedExperts *e = plugged;
    if (!gpt_block_is_moe(&a->spec.model, l)) e->tp_ops.mlp_backward(ops, a, l, dinp, w, g, dout, B, T);
    else e->layers.base.mlp_backward(&e->layers.base, a, l, dinp, w, g, dout, B, T);
}

void composed_ep_plug(ComposedExperts *e, TPModel *m, CPStageLayers *l, const Config *cfg, const GPTConfig *mc,
                      const PipeGrid *pg) {
    if (!e->moe) return;
    ModelShape experts = expert_shape(&e->grid, mc);
    m->shape.first_repeat = experts.first_repeat;
    m->shape.n_repeats = experts.n_repeats;
    m->shape.repeat_ranks = experts.repeat_ranks;
    int B = cfg->global_batch_size / pg->dp / cfg->num_microbatches;
    int T = mc->max_seq_len < cfg->max_seq_len ? mc->max_seq_len : cfg->max_seq_len;
    expert_layers_init(&e->layers, &e->grid, mc, B, T);
    LayerOps *ops = &l->tp.scratch.layers.base;
    e->tp_ops = *ops;
    ops->mlp_forward = composed_mlp_forward;
    ops->mlp_backward = composed_mlp_backward;
    plugged = e;
}

// ---- gradients and their norm -----------------------------------------------------------------

void composed_ep_reduce_gradients(const ComposedExperts *e, Comm *replicas, const ParamLayout *layout,
                                  float *grads, size_t n) {
    if (e->moe) all_reduce_gradients(&e->grid, layout, grads);  // grid.world: the stage's replicas
    else if (comm_size(replicas) > 1) comm_all_reduce(replicas, grads, n);
}

typedef struct {
    const PipeGrid *pg;
    bool experts;
} CountedPart;

// the tensors composed_norm_squares counts, the experts' or the rest
static bool counted_part(const TensorInfo *t, const void *ctx) {
    const CountedPart *c = ctx;
    return (t->repeat >= 0) == c->experts && pipe_tensor_counted(t, c->pg);
}

double composed_ep_norm_squares(const ComposedExperts *e, const TPModel *m, const PipeGrid *pg, const float *grads) {
    if (!e->moe) return composed_norm_squares(m, pg, grads);
    CountedPart rest = {pg, false}, experts = {pg, true};
    double held = tp_norm_squares_of(m, grads, counted_part, &experts);
    // the ranks of an expert group hold the other experts (and the same rest)
    return tp_norm_squares_of(m, grads, counted_part, &rest) + comm_sum_double(e->grid.ep_group, held);
}

// ---- checkpoints ------------------------------------------------------------------------------

static bool is_expert(const TensorInfo *t, const void *ctx) {
    (void)ctx;
    return t->repeat >= 0;
}

// what a saver gives: its experts, and (the first of its group) the rest of its stage's part
static bool saver_share(const TensorInfo *t, const void *ctx) {
    const ComposedExperts *e = ctx;
    return t->repeat >= 0 || e->grid.ep_rank == 0;
}

typedef struct {
    const ComposedExperts *e;
    const PipeGrid *pg;
} SaverCtx;

static bool saver_tensor(const TensorInfo *t, const void *ctx) {
    const SaverCtx *s = ctx;
    return saver_share(t, s->e) && pipe_tensor_counted(t, s->pg);
}

static void sum_over_savers(float *buf, size_t n, void *savers) {
    if (comm_size(savers) > 1) comm_all_reduce(savers, buf, n);
}

void composed_ep_save_checkpoint(const ComposedExperts *e, const Config *cfg, const ComposedGroups *groups,
                                 const PipeGrid *pg, const TPModel *m, const ParamLayout *full, const float *params,
                                 const float *adam_m, const float *adam_v, long step) {
    size_t bytes = m->full.num_params * sizeof(float);
    const float *mine[3] = {params, adam_m, adam_v};
    float *part[3];
    for (int i = 0; i < 3; i++) {
        part[i] = dev_malloc(bytes);
        // the stage's part as replica 0 holds it, then this rank's own experts in place of replica 0's
        // (each x rank holds them whole)
        tp_assemble(m, part[i], mine[i], groups->checkpoint);
        layout_copy_tensors(&m->layout, (float *)mine[i], &m->full, part[i], true, is_expert, NULL);
    }
    SaverCtx ctx = {e, pg};
    if (groups->mesh.coord[MESH_TP] == 0 && e->grid.replica == 0)
        save_checkpoint_from_parts(cfg, &m->full, full, part[0], part[1], part[2], step, saver_tensor, &ctx,
                                   sum_over_savers, e->savers, pg->is_first && e->grid.ep_rank == 0);
    for (int i = 0; i < 3; i++) dev_free(part[i]);
}

// ---- after training ---------------------------------------------------------------------------

void composed_ep_finish(const ComposedExperts *e, Comm *replicas, const float *params, size_t n) {
    // with ep > 1 a stage's replicas hold other experts: those holding the same ones are identical
    Comm *same = e->ep > 1 ? e->grid.expert_dp : replicas;
    if (comm_size(same) > 1) comm_check_replicas_identical(same, params, n);
    if (e->moe) expert_run_stats(&e->layers);
}

void composed_ep_free(ComposedExperts *e) {
    if (e->moe) expert_layers_free(&e->layers);
}
