// plan: plan before you launch. Given a training config and a cluster description, lists every
// layout the workbook can run on that many ranks -- DDP (stage 03), FSDP (04), every
// tensor-parallel grid [x, y, z] x data (05), every pipeline pp x data (07) -- and predicts for
// each: rank 0's memory report row for row, whether it fits, the communication of a step per
// group and collective (bytes exactly as the stages count them; time by the alpha-beta model of
// plan_cluster.h), what overlaps, the step time and tokens/s. Sorted by step time, with why the
// best layout wins. Usage and the model: docs/PLANNER.md (and --help).
//
// Memory and bytes come from the stages' own arithmetic (fsdp_plan, tp_model_layout,
// tp_acts_bytes, stage_blocks, pipe_slots, acts_bytes, the memory reports' rows), so they equal
// the runs' stats.json and metrics.jsonl exactly when every sequence of a batch is T tokens long
// (a batch is padded to its longest sequence: shorter batches move fewer activation bytes over
// x, y and the pipeline). A mixture of experts is planned on stage 08's layouts alone (stage 10's
// dp x tp x pp x ep is not planned yet): ep x dp, with
// memory exact and the all-to-all bytes those of balanced routing without drops (the real ones
// depend on where the router sends the tokens).
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "base/log.h"
#include "context.h"
#include "data/tokenizer.h"
#include "experts.h"
#include "fsdp.h"
#include "model/gpt.h"
#include "moe.h"
#include "ops/ops.h"
#include "pipeline.h"
#include "plan.h"
#include "run/run_checkpoint.h"
#include "run/run_setup.h"
#include "run/run_stats.h"
#include "run/stage_run.h"
#include "tp_model.h"
#include "tp_sequence.h"
#include "zero_bubble.h"

typedef struct {
    const Config *cfg;
    const GPTConfig *mc;
    const Cluster *cluster;
    int P, T;          // ranks; tokens per sequence
    int flags;         // ACTS_* of the config
    bool half;
    int microbatches;  // pipelines: --microbatches (0: 4 per stage, or the most below that fit)
    bool composed_zero;  // a stage-10 config's zero_stage 1: its meshes shard AdamW over the replicas
} Setup;

// ---- memory: the stages' own rows -------------------------------------------------------------

// one key the layout's run adds to the config
static void add_arg(Plan *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_arg(Plan *p, const char *fmt, ...) {
    if (p->n_args == (int)(sizeof p->args / sizeof p->args[0])) fatal("internal: too many keys for %s", p->name);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->args[p->n_args++], sizeof p->args[0], fmt, ap);
    va_end(ap);
}

// The run's strategy, and the other strategies' layout keys set back to none, so that any config
// (configs/axonn.json names axonn and [2, 2, 1]) runs every layout
static void add_strategy(Plan *p, const char *strategy) {
    add_arg(p, "--strategy=%s", strategy);
    if (p->stage != 5 && p->stage != 10) add_arg(p, "--tp_dimensions=1,1,1");
    if (p->stage != 7 && p->stage != 10) add_arg(p, "--pp_size=1"), add_arg(p, "--num_microbatches=1");
    if (p->stage == 8) add_arg(p, "--ep_size=%d", p->ep);
    if (p->stage != 4 && p->stage != 10) add_arg(p, "--zero_stage=3"), add_arg(p, "--hsdp_replicas=1");
}

static void add_memory(Plan *p, const char *what, size_t bytes) {
    p->memory[p->n_memory++] = (MemoryItem){what, bytes};
    p->memory_total += bytes;
}

// the memory report of a rank holding n parameters whole with their state (stage_run.h's)
static void add_model_memory(Plan *p, const Config *cfg, size_t n, size_t activation_bytes) {
    MemoryItem items[MODEL_MEMORY_ITEMS];
    model_memory_items(items, cfg, n, activation_bytes);
    for (int i = 0; i < MODEL_MEMORY_ITEMS; i++) add_memory(p, items[i].what, items[i].bytes);
}

// stage 03: every rank a whole replica (03_ddp/train.c's report)
static size_t ddp_memory(const Setup *s, Plan *p, const ParamLayout *layout) {
    size_t n = layout->num_params;
    int micro_batch = s->cfg->global_batch_size / s->cfg->gradient_acc_steps / s->P;
    ActsSpec spec = whole_model_acts(s->mc, micro_batch, s->T, s->flags & ACTS_16BIT, s->flags & ACTS_RECOMPUTE);
    add_model_memory(p, s->cfg, n, acts_bytes(&spec));
    return n;
}

// the category of a memory report row, for the table
typedef enum { CAT_PARAMS, CAT_GRADS, CAT_OPTIM, CAT_ACTS, CAT_GATHERED, CATS } Category;
static const char *const CATEGORY_NAMES[CATS] = {"parameters", "gradients", "optimizer", "activations", "gathered"};

static Category category_of(const char *what) {
    if (strncmp(what, "parameters", 10) == 0) return CAT_PARAMS;
    if (strncmp(what, "gradients", 9) == 0) return CAT_GRADS;
    if (strncmp(what, "AdamW", 5) == 0) return CAT_OPTIM;
    if (strncmp(what, "activations", 11) == 0) return CAT_ACTS;
    return CAT_GATHERED;  // FSDP's gathered units and weight copies, stage 05's z buffers
}

// ---- communication per step -------------------------------------------------------------------

static void add_comm(Plan *p, const char *group, const char *kind, double bytes, long calls, int n, int stride,
                     bool hideable) {
    if (n < 2 || bytes <= 0) return;  // a group of one rank communicates nothing (and is not called)
    bool p2p = strncmp(kind, "send", 4) == 0 || strcmp(kind, "recv") == 0;
    CostKind cost = p2p ? COST_POINT_TO_POINT : strcmp(kind, "all-reduce") == 0 ? COST_ALL_REDUCE : COST_GATHER_SCATTER;
    p->comm[p->n_comm++] = (Collective){.group = group, .kind = kind, .bytes = bytes, .calls = calls, .n = n,
                                        .stride = stride, .cost = cost, .hideable = hideable};
    p->comm_bytes += bytes;
}

static void plan_ddp(const Setup *s, Plan *p, const ParamLayout *layout) {
    snprintf(p->name, sizeof p->name, "DDP");
    p->stage = 3;
    add_strategy(p, "ddp");
    p->dp = s->P;
    size_t n = ddp_memory(s, p, layout);
    // one all-reduce of the flat gradient, or the same bytes as buckets of whole blocks launched
    // during backward (03_ddp/buckets.c); calls only set the latency term
    double bytes = (double)n * sizeof(float), bucket = s->cfg->bucket_size_mb * 1e6;
    bool overlap = s->cfg->overlap_communication;
    long calls = overlap ? (long)(bytes / bucket) + 1 : 1;
    add_comm(p, "world", "all-reduce", bytes, calls, s->P, 1, overlap);
}

// Stage 04's ladder (04_fsdp/fsdp.h): zero_stage 1, 2 or 3 (FSDP), over R replica groups (HSDP).
// The sharding collectives run in the group of S = P / R ranks ("world" when R = 1, else
// "shard"); HSDP adds one all-reduce of the gradient shards per step over "replicas" (R ranks S
// apart), ZeRO-1's per unit.
static void plan_fsdp(const Setup *s, Plan *p, const ParamLayout *layout, int zero_stage, int R) {
    int S = s->P / R;
    if (R > 1) snprintf(p->name, sizeof p->name, "%sHSDP %dx%d", zero_stage == 3 ? "" : zero_stage == 2 ? "ZeRO-2 " : "ZeRO-1 ", R, S);
    else snprintf(p->name, sizeof p->name, zero_stage == 3 ? "FSDP" : "ZeRO-%d", zero_stage);
    p->stage = 4;
    p->zero_stage = zero_stage;
    p->replicas = R;
    add_strategy(p, "fsdp");  // the ladder's keys: the rung's own
    add_arg(p, "--zero_stage=%d", zero_stage);
    add_arg(p, "--hsdp_replicas=%d", R);
    p->dp = s->P;
    Fsdp f;
    fsdp_plan(&f, layout, 0, s->P, s->cfg->overlap_communication, s->half, zero_stage, R);
    if (s->cfg->muon) fsdp_plan_muon(&f, s->cfg->muon_redundant, s->cfg->muon_ns_steps);
    int micro_batch = s->cfg->global_batch_size / s->cfg->gradient_acc_steps / s->P;
    ActsSpec spec = whole_model_acts(s->mc, micro_batch, s->T, s->flags & ACTS_16BIT, s->flags & ACTS_RECOMPUTE);
    MemoryItem rows[FSDP_MEMORY_ITEMS];
    int n_rows = fsdp_memory_items(&f, parameters_label(s->cfg), acts_bytes(&spec), rows, NULL);
    for (int i = 0; i < n_rows; i++) add_memory(p, rows[i].what, rows[i].bytes);
    const char *group = R > 1 ? "shard" : "world";
    int L = s->mc->n_layer, acc = s->cfg->gradient_acc_steps;
    double fl = sizeof(float), whole = (double)f.whole_numel * fl;
    // Muon (fsdp_muon_step): every block's updates all-gathered once a step, and with owners the
    // orthogonalized blocks reduce-scattered back
    double muon_block = f.muon_on && L ? (double)f.units[1].shard * S * fl : 0;
    long muon_calls = f.muon_on ? L : 0, muon_scatters = f.muon_on && !f.muon_redundant ? L : 0;
    if (R > 1) add_comm(p, "replicas", "all-reduce", (double)f.shard_numel * fl, zero_stage == 1 ? 1L + L : 1, R, S, false);
    if (zero_stage < 3) {
        // ZeRO-1 reduce-scatters each unit's gradient once a step, ZeRO-2 once a micro-batch (as it
        // finishes: under backward with overlap_communication); both all-gather the updated units
        int scatters = zero_stage == 1 ? 1 : acc;
        add_comm(p, group, "all-gather", whole + muon_calls * muon_block, 1L + L + muon_calls, S, 1, false);
        add_comm(p, group, "reduce-scatter", scatters * whole + muon_scatters * muon_block,
                 scatters * (1L + L) + muon_scatters, S, 1, zero_stage == 2 && f.prefetch);
        fsdp_free(&f);
        return;
    }
    // each micro-batch gathers the root once and every block twice (forward, then again for
    // backward), and reduce-scatters every unit's gradient once; sizes are the padded units
    // (comm.h: all-gather = the output, reduce-scatter = the input). In 16 bits a block's gather
    // moves its 2-byte copy plus every rank's packed fp32 part (biases, LayerNorms): two calls.
    double root = (double)f.units[0].shard * S, block = L ? (double)f.units[1].shard * S : 0;
    double block_gather = s->half ? block * sizeof(half16) + (double)S * f.fp32_pack * fl : block * fl;
    add_comm(p, group, "all-gather", acc * (root * fl + 2 * L * block_gather) + muon_calls * muon_block,
             acc * (1 + 2L * L * (s->half ? 2 : 1)) + muon_calls, S, 1, f.prefetch);
    add_comm(p, group, "reduce-scatter", acc * (root + L * block) * fl + muon_scatters * muon_block,
             acc * (1L + L) + muon_scatters, S, 1, f.prefetch);
    fsdp_free(&f);
}

// Stage 05 on [x, y, z] x data: rank 0's share (x = y = z = data = 0) of the model, sized by the
// stage's own tp_model_layout. The collectives, per micro-batch of N = rows x T tokens (the
// formulas of 05_tensor_parallel/README.md, written with the layers' local sizes):
//   y all-reduce  the outputs of the layers whose input is split over y (qkv, fc, lm_head) and
//                 the input gradients of the transposed ones (proj, MLP proj), plus LayerNorm's
//                 row statistics (2 forward + 2 backward floats per row, 2L + 1 LayerNorms)
//   x all-reduce  the transposed layers' outputs and the normal layers' input gradients, the
//                 embedding's output and the lm_head's input gradient, and 2 loss sums per row
//   x all-gather  each row's logit maximum from every x rank (the gathered loss: all logits)
//   z all-gather  every weight block before each use (wte 3 uses, each block's matrices 2); in
//                 16 bits the matmuls' gathers move the 2-byte copies, the embedding's stays fp32
//   z reduce-scatter  every weight block's gradient; per step: the small tensors' gradients
//                 all-reduced over z and every local gradient over data
// With sequence_parallel on [x, 1, 1] (tp_sequence.h) the x all-reduces of activations become
// all-gathers before and reduce-scatters after the regions (plan_sequence_parallel).
// The part of the model a tensor-parallel rank runs: on stage 05 every block, the embedding and the
// head; on stage 10 its pipeline stage's blocks, the embedding on the first stage, the head on the last.
typedef struct {
    int blocks;
    bool embed, head;
} ModelPart;

static void plan_sequence_parallel(const Setup *s, Plan *p, const TPModel *m, ModelPart part, int acc, double N);

// The activations' collectives over y and x (or sequence parallelism's over x) of the rank's
// part, per micro-batch of N tokens; x's ranks are x_stride apart
static void add_tp_activation_comm(const Setup *s, Plan *p, const TPModel *m, ModelPart part, int acc, double N,
                                   int x_stride) {
    double L = part.blocks, fl = sizeof(float), head = part.head, embed = part.embed;
    int X = m->grid.X, Y = m->grid.Y;
    // phi's parallel block has one LayerNorm, GPT-2's two
    double block_norms = gpt_arch(s->mc)->parallel_block ? 1 : 2;
    // a LayerNorm all-reduces 2 row statistics forward (2 calls) and 2 backward (1 call); Llama's
    // RMSNorm one forward and one backward
    bool rms = gpt_arch(s->mc)->rms_norm;
    double norm_fwd = rms ? 1 : 2, norm_floats = rms ? 2 : 4;
    bool vp = s->cfg->vocab_parallel_loss;
    double y_rows = L * (m->qkv.out_local + m->fc.out_local + m->proj.in_local + m->fcproj.in_local) +
                    head * m->head.out_local + norm_floats * (block_norms * L + head);
    double x_rows = L * (m->proj.out_local + m->fcproj.out_local + m->qkv.in_local + m->fc.in_local) +
                    embed * m->Cy + head * (m->head.in_local + (vp ? 2 : 0));
    double x_gather = vp ? X : (double)X * m->Vl;
    // calls per block: y 4 for the linears and 3 per LayerNorm (2 per RMSNorm), x 4
    double y_calls = 4 + (norm_fwd + 1) * block_norms, x_calls = 4;
    // recomputation runs every block's forward again in backward: its y all-reduces (qkv and fc
    // outputs, each LayerNorm's 2 statistics) and x all-reduces (both projections)
    if (s->flags & ACTS_RECOMPUTE) {
        y_rows += L * (m->qkv.out_local + m->fc.out_local + norm_fwd * block_norms);
        x_rows += L * (m->proj.out_local + m->fcproj.out_local);
        y_calls += 2 + norm_fwd * block_norms, x_calls += 2;
    }
    // ranks: y fastest, then x, z, data (tp_linear.h); calls: the stage's, for the latency term
    add_comm(p, "y", "all-reduce", acc * N * y_rows * fl, acc * (long)(y_calls * L + head * (norm_fwd + 2)), Y, 1,
             false);
    if (m->seq_shards) {
        add_comm(p, "x", "all-reduce", acc * N * head * (vp ? 2 : 0) * fl, acc, X, x_stride, false);
        plan_sequence_parallel(s, p, m, part, acc, N);
    } else {
        add_comm(p, "x", "all-reduce", acc * N * x_rows * fl, acc * (long)(x_calls * L + embed + 2 * head), X,
                 x_stride, false);
        add_comm(p, "x", "all-gather", acc * N * head * x_gather * fl, acc, X, x_stride, false);
    }
}

static void plan_tp(const Setup *s, Plan *p, const int dims[3]) {
    int X = dims[0], Y = dims[1], Z = dims[2], D = s->P / (X * Y * Z);
    snprintf(p->name, sizeof p->name, "TP [%d,%d,%d] x %d", X, Y, Z, D);
    p->stage = 5;
    add_strategy(p, "axonn");
    add_arg(p, "--tp_dimensions=%d,%d,%d", X, Y, Z);
    memcpy(p->dims, dims, sizeof p->dims);
    p->dp = D;
    TPGrid grid = {.X = X, .Y = Y, .Z = Z, .D = D};
    TPModel m;
    tp_model_layout(&m, s->mc, &grid, s->cfg->vocab_parallel_loss);
    bool sp = s->cfg->sequence_parallel && Y == 1 && Z == 1;
    if (sp) tp_sequence_apply(&m, s->cfg);  // the residual rows 1/x: the activations' size
    int acc = s->cfg->gradient_acc_steps, rows = s->cfg->global_batch_size / acc / (Z * D);
    MemoryItem items[TP_MEMORY_ITEMS];
    tp_memory_items(&m, s->cfg, tp_acts_bytes(&m, rows, s->T, s->flags), items);
    for (int i = 0; i < TP_MEMORY_ITEMS; i++) add_memory(p, items[i].what, items[i].bytes);

    double N = (double)rows * s->T, L = s->mc->n_layer, fl = sizeof(float);
    add_tp_activation_comm(s, p, &m, (ModelPart){s->mc->n_layer, true, true}, acc, N, Y);
    // phi's lm_head is not wte, so its gradient is reduce-scattered apart from the embedding's
    // (two head gradients, not one)
    double head_grads = gpt_arch(s->mc)->tied_head ? 1 : 2;
    bool overlap = s->cfg->overlap_communication;
    double blocks = (double)(m.qkv.block + m.proj.block + m.fc.block + m.fcproj.block), wte = (double)m.head.block;
    double gathers = wte * fl + (2 * wte + 2 * L * blocks) * (s->half ? sizeof(half16) : fl);
    double z_gathers = 8;  // per block; recomputation gathers each block's weights again
    if (s->flags & ACTS_RECOMPUTE) gathers += L * blocks * (s->half ? sizeof(half16) : fl), z_gathers += 4;
    add_comm(p, "z", "all-gather", acc * gathers, acc * (long)(3 + z_gathers * L), Z, X * Y, overlap);
    add_comm(p, "z", "reduce-scatter", acc * (head_grads * wte + L * blocks) * fl, acc * (long)(head_grads + 4 * L),
             Z, X * Y, overlap);
    add_comm(p, "z", "all-reduce", (double)m.small_numel * fl, 1, Z, X * Y, false);
    add_comm(p, "data", "all-reduce", (double)m.layout.num_params * fl, 1, D, X * Y * Z, false);
    tp_model_free(&m);
}

// Per micro-batch of N tokens, each of N x C elements (05_tensor_parallel/README.md): an
// all-gather before each norm's region (ln1, ln2, ln_f) and of the residual's gradient before each
// region's backward, a reduce-scatter after each region's output (attention's and the MLP's
// projections, the embedding) and of each norm's input gradient. phi's parallel block gathers
// ln1(x) once for both branches and sums their input gradients before one reduce-scatter.
// Recomputation repeats a block's forward ones. Per step the norms' gradients, summed over "tp".
// Of these, ln_f's gather, its input gradient's reduce-scatter and the loss's gather belong to the
// head, the embedding's reduce-scatter and its output gradient's gather to the embedding (a
// pipeline stage runs its part's).
static void plan_sequence_parallel(const Setup *s, Plan *p, const TPModel *m, ModelPart part, int acc, double N) {
    const Arch *arch = gpt_arch(s->mc);
    double L = part.blocks, norms = arch->parallel_block ? 1 : 2, C = m->Cy, fl = sizeof(float);
    double gathers = 2 * L * norms + part.embed + part.head, scatters = L * (2 + norms) + part.embed + part.head;
    if (s->flags & ACTS_RECOMPUTE) gathers += L * norms, scatters += 2 * L;
    int X = m->grid.X;
    double loss_gather = part.head ? m->vocab_parallel_loss ? X : (double)X * m->Vl : 0;
    add_comm(p, "x", "all-gather", acc * N * (gathers * C + loss_gather) * fl, acc * (long)(gathers + part.head), X, 1,
             false);
    add_comm(p, "x", "reduce-scatter", acc * N * scatters * C * fl, acc * (long)scatters, X, 1, false);
    double norm_tensors = (norms * L + part.head) * (arch->rms_norm ? 1 : 2);
    add_comm(p, "tp", "all-reduce", norm_tensors * C * fl, (long)norm_tensors, X, 1, false);
}

// Stage 0's messages to its neighbours in the ring of virtual stages (pipe_op_peers), A bytes
// each, as pipeline.c's exchange sends them: a send followed by a receive from the same neighbour
// travels as one send-recv, counted as the message sent (comm.h), under gpipe and 1f1b only (the
// exchange's rule: interleaved's and zb-h1's stay a send and a receive); the op order is the stage's
// pipe_schedule. Per step also: GPT-2's tied wte (vocab_rows of it on this rank) all-reduced
// between the first and the last stage. Neighbouring stages are `stride` ranks apart.
static void add_pipeline_comm(const Setup *s, Plan *p, int pp, int m, int chunks, double A, double vocab_rows,
                              int stride) {
    PipeOp *ops = calloc_or_die((size_t)pipe_max_ops(m, chunks), sizeof *ops);
    int n_ops = pipe_schedule(ops, s->cfg->pp_sched, m, pp, chunks, 0), pending = -1;
    bool pairs = chunks == 1 && !pipe_zero_bubble(s->cfg->pp_sched);
    long sends = 0, send_recvs = 0, recvs = 0;
    for (int k = 0; k < n_ops && pp > 1; k++) {
        int from, to;
        pipe_op_peers(&ops[k], pp, chunks, 0, &from, &to);
        if (pairs && pending >= 0 && from == pending) send_recvs++;
        else sends += pending >= 0, recvs += from >= 0;
        pending = to;
    }
    sends += pending >= 0 && pp > 1;
    free(ops);
    add_comm(p, "pipeline", "send", sends * A, sends, 2, stride, false);
    add_comm(p, "pipeline", "send-recv", send_recvs * A, send_recvs, 2, stride, false);
    add_comm(p, "pipeline", "recv", recvs * A, recvs, 2, stride, false);
    bool tied = pp > 1 && gpt_arch(s->mc)->tied_head;  // phi's lm_head is the last stage's own
    add_comm(p, "tied-wte", "all-reduce", tied ? vocab_rows * s->mc->n_embd * sizeof(float) : 0, 1, 2,
             (pp - 1) * stride, false);
}

// 07_pipeline_parallel's report of pipeline stage g->stage (pipeline_init_layers' slots): each
// chunk's slots of its activations, and zb-h1's deferred output gradients (zero_bubble.c: a
// block's linear output widths x N floats a block and slot). whole: a micro-batch's activations
// at the sizes the stage's layers adapt them to (07's as they are; stage 10's tp share, cp chunks).
static void pipe_stage_acts(const Setup *s, const PipeGrid *g, int m, ActsSpec whole, size_t *acts,
                            size_t *deferred) {
    int *slots = calloc_or_die((size_t)g->chunks, sizeof *slots);
    pipe_slots(s->cfg->pp_sched, m, g->pp, g->chunks, g->stage, slots);
    *acts = *deferred = 0;
    for (int c = 0; c < g->chunks; c++) {
        ActsSpec spec = whole;
        pipe_chunk_blocks(g, s->mc->n_layer, c, &spec.first_layer, &spec.n_layers);
        spec.embed = g->is_first && c == 0, spec.head = g->is_last && c == g->chunks - 1;
        *acts += (size_t)slots[c] * acts_bytes(&spec);
        *deferred += (size_t)slots[c] * deferred_weights_floats(&spec) * sizeof(float);
    }
    free(slots);
}

// Stage 07 on pp stages x dp replicas (rank = replica * pp + stage), m micro-batches per step:
// rank 0 is stage 0 of replica 0, sized by the stage's own pipe_chunk_blocks, pipe_stage_layout
// and pipe_slots (pp_schedule and virtual_stages from the config). Its messages: an activation
// after each forward, a gradient before each backward, A = rows x T x C floats each, and the tied
// wte (add_pipeline_comm); per step also the stage's gradients over the replicas.
static void plan_pipeline(const Setup *s, Plan *p, int pp, int m) {
    int dp = s->P / pp;
    snprintf(p->name, sizeof p->name, "PP %d x %d, %.5s m%d", pp, dp, s->cfg->pp_schedule, m);
    p->stage = 7, p->pp = pp, p->microbatches = m, p->dp = dp;
    add_strategy(p, "pipeline");
    add_arg(p, "--pp_size=%d", pp);
    add_arg(p, "--num_microbatches=%d", m);
    add_arg(p, "--gradient_acc_steps=1");
    // rank 0: stage 0, with every chunk of it (interleaved), as pipe_grid_init makes it
    PipeGrid g = {.pp = pp, .dp = dp, .is_first = true, .is_last = pp == 1, .chunks = pipe_chunks(s->cfg)};
    pipe_chunk_blocks(&g, s->mc->n_layer, 0, &g.first_block, &g.n_blocks);
    ParamLayout layout;
    pipe_stage_layout(&layout, s->mc, &g);
    size_t n = layout.num_params;
    int rows = s->cfg->global_batch_size / dp / m;
    size_t acts, deferred;
    pipe_stage_acts(s, &g, m, whole_model_acts(s->mc, rows, s->T, s->flags & ACTS_16BIT, s->flags & ACTS_RECOMPUTE),
                    &acts, &deferred);
    add_model_memory(p, s->cfg, n, acts);
    if (pipe_zero_bubble(s->cfg->pp_sched)) add_memory(p, "deferred weight gradients", deferred);
    gpt_layout_free(&layout);

    double A = (double)rows * s->T * s->mc->n_embd * sizeof(float);
    add_pipeline_comm(s, p, pp, m, g.chunks, A, s->mc->padded_vocab_size, 1);
    add_comm(p, "replicas", "all-reduce", (double)n * sizeof(float), 1, dp, pp, false);
}

// Stage 08 on ep expert ranks x dp replicas: rank 0 holds every non-expert tensor and E / ep of
// each MoE block's experts (the stage's moe_layout_experts, expert_shape, acts_bytes). Per step:
// the non-expert gradients all-reduced over every rank and the experts' over the replicas (one
// call per run of tensors of one kind, all_reduce_gradients); with ep > 1, per MoE block and
// micro-batch, the routed rows' counts all-gathered (E floats a rank) and four all-to-alls of C
// floats a row (the rows out and back, forward and backward: 8 C (routed + ran) bytes). Balanced
// routing without drops sends k N rows out and runs k N rows here, N the rank's tokens.
static void plan_experts(const Setup *s, Plan *p, int ep) {
    int dp = s->P / ep, E = s->mc->moe->n_experts, acc = s->cfg->gradient_acc_steps;
    snprintf(p->name, sizeof p->name, "EP %d x %d", ep, dp);
    p->stage = 8, p->ep = ep, p->dp = dp;
    add_strategy(p, "expert_parallel");
    ExpertGrid grid = {.ep = ep, .dp = dp, .n_local = E / ep};
    ParamLayout layout;
    moe_layout_experts(&layout, s->mc, 0, grid.n_local);
    int rows = s->cfg->global_batch_size / acc / s->P;
    ActsSpec spec = whole_model_acts(s->mc, rows, s->T, false, false);
    spec.shape = expert_shape(&grid, s->mc);
    size_t n = layout.num_params, numel[2];
    long runs[2];
    count_gradient_runs(&layout, runs, numel);
    add_model_memory(p, s->cfg, n, acts_bytes(&spec));
    gpt_layout_free(&layout);
    double fl = sizeof(float), moe = gpt_moe_blocks(s->mc, 0, s->mc->n_layer);
    double routed = (double)s->mc->moe->experts_per_token * rows * s->T;
    add_comm(p, "world", "all-reduce", (double)numel[0] * fl, runs[0], s->P, 1, false);
    add_comm(p, "expert-replicas", "all-reduce", (double)numel[1] * fl, runs[1], dp, ep, false);
    add_comm(p, "experts", "all-gather", acc * moe * E * ep * fl, (long)(acc * moe), ep, 1, false);
    add_comm(p, "experts", "all-to-all", acc * moe * 2 * (routed + routed) * s->mc->n_embd * fl, (long)(4 * acc * moe),
             ep, 1, false);
}

// 09's ring, per block and micro-batch: (cp - 1) key/value blocks forward, (cp - 1) again and cp
// gradient blocks backward, each N rows of `width` floats, over cp ranks `stride` apart
static void add_ring_comm(Plan *p, double blocks, int acc, double N, double width, int cp, int stride, bool overlap) {
    add_comm(p, "cp", "send-recv", acc * blocks * (3.0 * cp - 2) * N * width * sizeof(float),
             (long)(acc * blocks * (3 * cp - 2)), cp, stride, overlap);
}

// Stage 09 on cp ranks a sequence x dp replicas: every rank the whole model, activations for 2 x
// its replica's rows of chunks of c = T / 2cp tokens (rounded up) with the attention's own buffers
// (context.c's cp_layers_bytes). Per step: the gradient all-reduced over every rank; per block and
// micro-batch, the ring's (cp - 1) key/value blocks forward, (cp - 1) again and cp gradient blocks
// backward (N x 2C floats each, N = 2 rows c), or Ulysses' four all-to-alls (q|k|v and the output
// forward, their gradients backward: 8 N C floats).
static void plan_context(const Setup *s, Plan *p, int cp, bool ulysses) {
    int dp = s->P / cp, acc = s->cfg->gradient_acc_steps, L = s->mc->n_layer;
    snprintf(p->name, sizeof p->name, "CP %d x %d, %s", cp, dp, ulysses ? "ulysses" : "ring");
    p->stage = 9, p->dp = dp;
    add_strategy(p, "context_parallel");
    add_arg(p, "--cp_size=%d", cp);
    add_arg(p, "--cp_impl=%s", ulysses ? "ulysses" : "ring");
    CPGrid grid = {.cp = cp, .dp = dp, .ulysses = ulysses};
    int rows = s->cfg->global_batch_size / acc / dp, c = cp_chunk_len(&grid, s->T);
    ActsSpec spec = whole_model_acts(s->mc, 2 * rows, c, s->flags & ACTS_16BIT, s->flags & ACTS_RECOMPUTE);
    spec.keys = 1;  // as 09_context_parallel/train.c
    ParamLayout layout;
    gpt_layout(&layout, s->mc);
    size_t n = layout.num_params;
    gpt_layout_free(&layout);
    add_model_memory(p, s->cfg, n, acts_bytes(&spec) + cp_layers_bytes(&grid, s->mc, rows, c, s->half));
    double fl = sizeof(float), N = 2.0 * rows * c, C = s->mc->n_embd;
    add_comm(p, "world", "all-reduce", (double)n * fl, 1, s->P, 1, false);
    if (ulysses) add_comm(p, "cp", "all-to-all", acc * L * 8 * N * C * fl, 4L * acc * L, cp, 1, false);
    else add_ring_comm(p, L, acc, N, 2 * C, cp, 1, s->cfg->overlap_communication);
}

// ---- stage 10: the pieces composed on one mesh ---------------------------------------------------

// A mesh of stage 10 (10_composed/composed.h): pp x dp x cp x tp, tensor parallelism innermost,
// m micro-batches a step; zero: zero_stage 1, AdamW's state sharded over the replicas
// (10_composed/composed_zero.h). More dimensions (experts) would be one more field here and one
// more term in each of composed_stage_memory and plan_composed.
typedef struct {
    int tp, pp, cp, dp, m;
    bool zero;
} ComposedMesh;

// rank 0's memory rows of stage 10: 07's report, zb-h1's deferred row, ZeRO-1's two
enum { COMPOSED_MEMORY_ITEMS = MODEL_MEMORY_ITEMS + 2 };

// ZeRO-1 over the R replicas holding a share of n elements: shards of ceil(n / R) (composed_zero.c)
static size_t composed_zero_shard(const ComposedMesh *mesh, size_t n) {
    size_t R = (size_t)mesh->dp * (size_t)mesh->cp;
    return (n + R - 1) / R;
}

// The memory report of t = 0 of pipeline stage `stage` (10_composed/train.c's, which rank 0 prints
// for stage 0): its tp share of the stage's blocks (05's tp_model_layout_part of 07's
// pipe_stage_layout, every chunk's) whole with gradients and AdamW state (ZeRO-1: the shard's, and
// a scratch shard), and the activations of the micro-batches it keeps in flight, with zb-h1's
// deferred weight gradients (07's pipe_stage_acts), at 05's sizes, of 09's two chunks of c = T /
// 2cp tokens a row when cp > 1. m, part: the rank's model and the blocks it runs, for its
// collectives; the caller frees m. Returns the rows.
static int composed_stage_memory(const Setup *s, const ComposedMesh *mesh, int stage, TPModel *m, ModelPart *part,
                                 MemoryItem items[COMPOSED_MEMORY_ITEMS]) {
    PipeGrid g = {.pp = mesh->pp, .dp = mesh->dp, .stage = stage, .is_first = stage == 0,
                  .is_last = stage == mesh->pp - 1, .chunks = pipe_chunks(s->cfg)};
    pipe_chunk_blocks(&g, s->mc->n_layer, 0, &g.first_block, &g.n_blocks);
    ParamLayout layout;
    pipe_stage_layout(&layout, s->mc, &g);
    TPGrid grid = {.X = mesh->tp, .Y = 1, .Z = 1, .D = mesh->dp};
    tp_model_layout_part(m, s->mc, &grid, s->cfg->vocab_parallel_loss, layout);
    tp_sequence_apply(m, s->cfg);
    int rows = s->cfg->global_batch_size / mesh->dp / mesh->m;
    ActsSpec spec = whole_model_acts(s->mc, rows, s->T, s->flags & ACTS_16BIT, s->flags & ACTS_RECOMPUTE);
    spec.shape = m->shape, spec.seq_shards = m->seq_shards;  // composed.c's tp_adapt
    if (mesh->cp > 1) {  // composed_cp.c's chunk_adapt
        CPGrid cp = {.cp = mesh->cp, .dp = mesh->dp};
        spec.B *= 2, spec.T = cp_chunk_len(&cp, s->T), spec.keys = 1;
    }
    size_t acts, deferred, n = m->layout.num_params;
    pipe_stage_acts(s, &g, mesh->m, spec, &acts, &deferred);
    model_memory_items(items, s->cfg, n, acts);
    int rows_out = MODEL_MEMORY_ITEMS;
    if (pipe_zero_bubble(s->cfg->pp_sched)) items[rows_out++] = (MemoryItem){"deferred weight gradients", deferred};
    if (mesh->zero) {  // composed_zero_print_memory's rows
        size_t shard = composed_zero_shard(mesh, n) * sizeof(float);
        items[3].bytes = 2 * shard;  // "AdamW m and v (fp32)": the shard's
        items[rows_out++] = (MemoryItem){"ZeRO scratch shard", shard};
    }
    *part = (ModelPart){.embed = g.is_first, .head = g.is_last};
    for (int c = 0; c < g.chunks; c++) {
        int first, blocks;
        pipe_chunk_blocks(&g, s->mc->n_layer, c, &first, &blocks);
        part->blocks += blocks;
    }
    return rows_out;
}

static size_t memory_items_total(const MemoryItem *items, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += items[i].bytes;
    return total;
}

// --layout's name of a mesh: its dimensions above 1, "tp2-pp2", "pp2-cp3"
static void composed_layout_name(char *name, size_t size, int tp, int pp, int cp) {
    const int dims[3] = {tp, pp, cp};
    const char *names[3] = {"tp", "pp", "cp"};
    size_t used = 0;
    name[0] = '\0';
    for (int d = 0; d < 3; d++)
        if (dims[d] > 1) used += (size_t)snprintf(name + used, size - used, "%s%s%d", used ? "-" : "", names[d], dims[d]);
}

// Stage 10 on the mesh: rank 0 (t = 0 of replica 0, c = 0 of stage 0) reports its memory row for
// row; the stage that needs the most (the last, with the head and the loss, or the first, with
// the embedding and the most micro-batches in flight) decides whether the mesh fits. Rank 0's
// collectives per step (10_composed/README.md's table), each piece's own term: 05's activation
// collectives over x on the stage's blocks and embedding (a micro-batch of r x T / cp tokens),
// 07's messages of r x T / cp x C / (tp when sequence parallel) floats and the tied wte's
// vocabulary shard, 09's ring of the tp rank's heads, and the stage's share of the gradients over
// the replicas (dp, or dp x cp: "context").
static void plan_composed(const Setup *s, Plan *p, const ComposedMesh *mesh) {
    int tp = mesh->tp, pp = mesh->pp, cp = mesh->cp, dp = mesh->dp, m = mesh->m;
    char mesh_name[24];
    composed_layout_name(mesh_name, sizeof mesh_name, tp, pp, cp);
    snprintf(p->name, sizeof p->name, "%s x %d, %.5s m%d%s", mesh_name, dp, s->cfg->pp_schedule, m,
             mesh->zero ? ", ZeRO-1" : "");
    p->stage = 10, p->pp = pp, p->microbatches = m, p->dp = dp, p->cp = cp;
    p->dims[0] = tp, p->dims[1] = p->dims[2] = 1;
    add_strategy(p, "composed");
    add_arg(p, "--tp_dimensions=%d,1,1", tp);
    add_arg(p, "--pp_size=%d", pp);
    add_arg(p, "--num_microbatches=%d", m);
    add_arg(p, "--cp_size=%d", cp);
    add_arg(p, "--gradient_acc_steps=1");
    if (mesh->zero) add_arg(p, "--zero_stage=1");
    TPModel model;
    ModelPart part;
    MemoryItem items[COMPOSED_MEMORY_ITEMS];
    int n_items = 0;
    for (int stage = pp - 1; stage >= 0; stage--) {  // stage 0 last: its model is rank 0's
        if (stage < pp - 1) tp_model_free(&model);
        n_items = composed_stage_memory(s, mesh, stage, &model, &part, items);
        size_t total = memory_items_total(items, n_items);
        if (stage == pp - 1 || total > p->heaviest_total) p->heaviest_total = total, p->heaviest_stage = stage;
    }
    for (int i = 0; i < n_items; i++) add_memory(p, items[i].what, items[i].bytes);

    int rows = s->cfg->global_batch_size / dp / m;
    double N = cp > 1 ? 2.0 * rows * cp_chunk_len(&(CPGrid){.cp = cp, .dp = dp}, s->T) : (double)rows * s->T;
    add_tp_activation_comm(s, p, &model, part, m, N, 1);
    double A = N * s->mc->n_embd / (model.seq_shards ? model.seq_shards : 1) * sizeof(float);
    add_pipeline_comm(s, p, pp, m, pipe_chunks(s->cfg), A, model.Vl, dp * cp * tp);
    if (cp > 1) add_ring_comm(p, part.blocks, m, N, 2.0 * model.Cx, cp, tp, false);
    // the stage's share over the replicas: all-reduced, or (ZeRO-1) reduce-scattered and the
    // updated shards all-gathered, R shards each
    const char *replicas = cp > 1 ? "context" : "replicas";
    size_t n = model.layout.num_params;
    if (mesh->zero) {
        double padded = (double)composed_zero_shard(mesh, n) * dp * cp * sizeof(float);
        add_comm(p, replicas, "reduce-scatter", padded, 1, dp * cp, tp, false);
        add_comm(p, replicas, "all-gather", padded, 1, dp * cp, tp, false);
    } else {
        add_comm(p, replicas, "all-reduce", (double)n * sizeof(float), 1, dp * cp, tp, false);
    }
    tp_model_free(&model);
}

// ---- time: compute, communication, what hides under what ---------------------------------------

// Compute: the model's FLOPs (run_setup.h's flops_per_token, plus one more forward of the blocks
// when they recompute). A one-rank step takes FLOPs / (peak x the efficiency it reaches): its
// matmuls, at the peak, and the work between them (attention, GELU, LayerNorm, the loss), the
// rest. Layouts that split rows (data, FSDP, z, pipeline stages, experts) split both evenly over
// the ranks. Tensor parallelism splits the matmuls over x and y but the work between them over
// one axis only (tensor_parallel_share); CPU ranks beyond the cores share them.
// Communication: each collective's alpha-beta time on the link its group crosses. Hidden: a
// collective the stage runs under compute (DDP's buckets under backward, FSDP's prefetched
// gathers and overlapped reduce-scatters, stage 05's depth prefetch), on a machine whose
// communication progresses during compute; at least one call's worth always shows (the last
// bucket, the first gather).

// The share of the work between the matmuls that one [x, y, z] x data rank does. Attention,
// GELU, the qkv and fc biases and the vocabulary's softmax act on tensors split over x (heads,
// MLP width, vocabulary), with copies on every y rank; LayerNorm and the residual adds act on
// the residual stream split over y, with copies on every x rank. Counted in element passes per
// token and block: x-side 3 T C (causal attention, forward and backward) + 21 C (GELU and
// biases on 7C, three passes), y-side 20 C (two LayerNorms, two residual adds).
static double tensor_parallel_share(const Plan *p, int T, int P) {
    double x_side = 3.0 * T + 21, y_side = 20, rows = (double)P / (p->dims[0] * p->dims[1]);  // z x data (x pp x cp)
    return (x_side / p->dims[0] + y_side / p->dims[1]) / (x_side + y_side) / rows;
}

static void predict_time(const Setup *s, Plan *p) {
    const Cluster *c = s->cluster;
    double tokens = (double)s->cfg->global_batch_size * s->T;
    double flops = flops_per_token(s->mc, s->T) * tokens;
    if (s->flags & ACTS_RECOMPUTE) flops *= 8.0 / 6.0;
    double share = c->cores && s->P > c->cores ? (double)c->cores / s->P : 1.0;
    double peak = s->half ? c->peak_flops_16 : c->peak_flops_f32;
    double efficiency = c->stage_efficiency[p->stage] ? c->stage_efficiency[p->stage] : c->efficiency;
    double matmuls = flops / peak, between = flops / (peak * efficiency) - matmuls;
    bool tp = p->stage == 5 || p->stage == 10;
    double own = tp ? matmuls / s->P + between * tensor_parallel_share(p, s->T, s->P)
                    : (matmuls + between) / s->P;  // a rank's work, on a core of its own
    p->compute_s = own / share;
    // a pipeline's bubble: filling and draining pp stages idles (pp - 1) / m of a rank's work.
    // Where ranks share cores, an idle rank's core runs the others: the bubble costs only what
    // the critical path (own work plus idling) exceeds the shared compute by.
    bool pipeline = p->pp > 1;
    double bubble = pipeline ? pipe_bubble_theory(s->cfg->pp_sched, p->microbatches, p->pp, pipe_chunks(s->cfg)) : 0;
    double critical = pipeline ? own * (1.0 + bubble / (1.0 - bubble)) : 0;  // idle per unit of work
    p->bubble_s = critical > p->compute_s ? critical - p->compute_s : 0;
    double backward = p->compute_s * 2.0 / 3.0, hideable = 0, shown_anyway = 0;
    p->comm_s = p->exposed_s = 0;
    for (int i = 0; i < p->n_comm; i++) {
        Collective *k = &p->comm[i];
        k->intra = group_is_intra_node(c, k->n, k->stride);
        k->seconds = collective_seconds(k->cost, k->bytes, k->calls, k->n, k->intra ? c->intra : c->inter,
                                        &k->algorithm);
        p->comm_s += k->seconds;
        if (k->hideable && c->overlaps) {
            hideable += k->seconds;
            shown_anyway += k->seconds / k->calls;
        } else {
            p->exposed_s += k->seconds;
        }
    }
    double cover = p->stage == 3 ? backward : p->compute_s;  // DDP's buckets fill during backward only
    double hidden_exposed = hideable - cover > shown_anyway ? hideable - cover : shown_anyway;
    p->exposed_s += hideable > 0 ? hidden_exposed : 0;
    p->step_s = p->compute_s + p->bubble_s + p->exposed_s;
    p->tokens_per_s = tokens / p->step_s;
    // stage 10: the stage holding the most decides
    p->fits = (double)(p->heaviest_total > p->memory_total ? p->heaviest_total : p->memory_total) <= c->memory_bytes;
}

// ---- the layouts ------------------------------------------------------------------------------

// whether `name` is one of the '+'-separated layouts of `only` ("ddp+2,2,1"; "": every layout)
static bool wanted(const char *only, const char *name) {
    if (!only[0]) return true;
    size_t n = strlen(name);
    for (const char *p = only; p; p = strchr(p, '+') ? strchr(p, '+') + 1 : NULL)
        if (strncmp(p, name, n) == 0 && (p[n] == '+' || p[n] == '\0')) return true;
    return false;
}

// Whether stage 10 runs the mesh, as its train.c and composed_cp.c check it (why: the first
// reason not): 07's pipeline over the pp x dp ranks of a t (zb-h1 without sequence parallelism),
// 05's [tp, 1, 1] over a stage's dp x tp, cp's chunks as a ring, without sequence parallelism,
// filling the longest sequence; ZeRO-1 over the mesh's one data group
static bool composed_mesh_fits(const Setup *s, const ComposedMesh *mesh, char *why, size_t why_size) {
    const Config *cfg = s->cfg;
    Config pipe = *cfg;
    pipe.pp_size = mesh->pp, pipe.num_microbatches = mesh->m;
    int dims[3] = {mesh->tp, 1, 1};
    if (pipe_zero_bubble(cfg->pp_sched) && cfg->sequence_parallel)
        snprintf(why, why_size, "stage 10: key 'pp_schedule' is 'zb-h1', whose weight pass reads inputs that "
                 "sequence_parallel keeps only until the next layer's");
    else if (mesh->zero && cfg->hsdp_replicas != 1)
        snprintf(why, why_size, "stage 10: key 'hsdp_replicas' is %d: ZeRO-1 shards over the mesh's one data group",
                 cfg->hsdp_replicas);
    else if (!pipe_grid_fits(&pipe, mesh->pp * mesh->dp, s->mc->n_layer, why, why_size) ||
             !tp_grid_fits(s->mc, dims, mesh->dp * mesh->tp, cfg->global_batch_size, mesh->m, why, why_size))
        return false;
    else if (mesh->cp > 1 && (cfg->sequence_parallel || strcmp(cfg->cp_impl, "ring") != 0))
        snprintf(why, why_size, "stage 10: cp_size %d runs as a ring without sequence_parallel", mesh->cp);
    else if (mesh->cp > 1 && s->T % (2 * mesh->cp) != 0)
        snprintf(why, why_size, "stage 10: cp_size %d cuts sequences of %d tokens into 2 x %d chunks", mesh->cp, s->T,
                 mesh->cp);
    else
        return true;
    return false;
}

// Stage 10's meshes: two or more of tp, pp and cp (one alone is stage 05's, 07's or 09's layout),
// dp the ranks left; m the planner's --microbatches, else 4 per stage or the most below that fit.
// Named for --layout by their dimensions: tp2-pp2, tp2-pp2-cp2, pp2-cp3.
static int enumerate_composed(const Setup *s, Plan *plans, int n, int max, const char *only, char *why_not,
                              size_t why_size) {
    for (int tp = 1; tp <= s->P; tp++)
        for (int pp = 1; tp * pp <= s->P; pp++)
            for (int cp = 1; tp * pp * cp <= s->P; cp++) {
                if (s->P % (tp * pp * cp) || (tp > 1) + (pp > 1) + (cp > 1) < 2) continue;
                char name[48], why[320];
                composed_layout_name(name, sizeof name, tp, pp, cp);
                if (!wanted(only, name)) continue;
                ComposedMesh mesh = {tp, pp, cp, s->P / (tp * pp * cp), s->microbatches ? s->microbatches : 4 * pp,
                                     s->composed_zero};
                while (!s->microbatches && mesh.m > 1 && s->cfg->global_batch_size % (mesh.dp * mesh.m) != 0) mesh.m--;
                if (!composed_mesh_fits(s, &mesh, why, sizeof why)) {
                    if (!why_not[0] || only[0]) snprintf(why_not, why_size, "%s", why);
                    continue;
                }
                if (n == max) fatal("internal: more than %d layouts", max);
                plan_composed(s, &plans[n++], &mesh);
            }
    return n;
}

// every layout the stages can run on P ranks with this config; why_not: the first reason one did
// not fit, for the error when none does
static int enumerate(const Setup *s, const ParamLayout *layout, Plan *plans, int max, const char *only,
                     char *why_not, size_t why_size) {
    int n = 0;
    const Config *cfg = s->cfg;
    bool batch_splits = cfg->global_batch_size % (s->P * cfg->gradient_acc_steps) == 0;
    if (!batch_splits)
        snprintf(why_not, why_size, "DDP and FSDP: global_batch_size %d does not split into %d ranks x %d "
                 "micro-batches", cfg->global_batch_size, s->P, cfg->gradient_acc_steps);
    bool any = !only[0];
    if (s->mc->moe) {  // experts are planned on stage 08's layouts alone
        for (int ep = 1; ep <= s->P; ep++) {
            char name[16];
            snprintf(name, sizeof name, "ep%d", ep);
            if (s->P % ep || s->mc->moe->n_experts % ep || !batch_splits || !wanted(only, name)) continue;
            plan_experts(s, &plans[n++], ep);
        }
        if (!n && !why_not[0])
            snprintf(why_not, why_size, "a mixture of experts runs on stage 08: ep must divide the %d ranks and the %d "
                     "experts", s->P, s->mc->moe->n_experts);
        for (int i = 0; i < n; i++) predict_time(s, &plans[i]);
        return n;
    }
    if (batch_splits && wanted(only, "ddp")) plan_ddp(s, &plans[n++], layout);
    if (batch_splits && wanted(only, "fsdp")) plan_fsdp(s, &plans[n++], layout, 3, 1);
    // the ladder's lower rungs, and hybrid sharding over R groups (ZeRO-3: hsdpR; zeroN-hsdpR)
    for (int zero = 1; batch_splits && zero <= 3; zero++)
        for (int R = 1; R < s->P; R++) {
            char name[32];
            if (R == 1) snprintf(name, sizeof name, "zero%d", zero);
            else if (zero == 3) snprintf(name, sizeof name, "hsdp%d", R);
            else snprintf(name, sizeof name, "zero%d-hsdp%d", zero, R);
            bool listed = (R == 1 && zero < 3) || (R > 1 && zero == 3);  // what a plan of every layout shows
            if (s->P % R || !((!only[0] && listed) || (only[0] && wanted(only, name)))) continue;
            if (n == max) fatal("internal: more than %d layouts", max);
            plan_fsdp(s, &plans[n++], layout, zero, R);
        }
    for (int X = 1; X <= s->P; X++)
        for (int Y = 1; X * Y <= s->P; Y++)
            for (int Z = 1; X * Y * Z <= s->P; Z++) {
                int dims[3] = {X, Y, Z};
                char name[48], why[320];
                snprintf(name, sizeof name, "%d,%d,%d", X, Y, Z);
                if (!wanted(only, name)) continue;
                if (!tp_grid_fits(s->mc, dims, s->P, cfg->global_batch_size, cfg->gradient_acc_steps, why, sizeof why)) {
                    if (!why_not[0] || !any) snprintf(why_not, why_size, "%s", why);
                    continue;
                }
                if (n == max) fatal("internal: more than %d layouts", max);
                plan_tp(s, &plans[n++], dims);
            }
    for (int pp = 2; pp <= s->P; pp++) {
        char name[16], why[320];
        snprintf(name, sizeof name, "pp%d", pp);
        if (!wanted(only, name)) continue;
        // the config's micro-batches when the planner is given them, else 4 per stage where they fit
        Config pipe = *cfg;
        pipe.pp_size = pp;
        pipe.num_microbatches = s->microbatches ? s->microbatches : 4 * pp;
        while (!s->microbatches && pipe.num_microbatches > 1 && s->P % pp == 0 &&
               cfg->global_batch_size % (s->P / pp * pipe.num_microbatches) != 0)
            pipe.num_microbatches--;
        if (!pipe_grid_fits(&pipe, s->P, s->mc->n_layer, why, sizeof why)) {
            if (!why_not[0] || !any) snprintf(why_not, why_size, "%s", why);
            continue;
        }
        if (n == max) fatal("internal: more than %d layouts", max);
        plan_pipeline(s, &plans[n++], pp, pipe.num_microbatches);
    }
    for (int cp = 2; cp <= s->P; cp++)
        for (int u = 0; u < 2; u++) {
            char name[16];
            snprintf(name, sizeof name, "cp%d%s", cp, u ? "u" : "");
            bool fits = s->P % cp == 0 && s->T >= 2 * cp && (!u || s->mc->n_head % cp == 0) &&
                        cfg->global_batch_size % (s->P / cp * cfg->gradient_acc_steps) == 0;
            if (!fits || !wanted(only, name)) continue;
            if (n == max) fatal("internal: more than %d layouts", max);
            plan_context(s, &plans[n++], cp, u);
        }
    n = enumerate_composed(s, plans, n, max, only, why_not, why_size);
    for (int i = 0; i < n; i++) predict_time(s, &plans[i]);
    return n;
}

static int by_step_time(const void *a, const void *b) {
    const Plan *x = a, *y = b;
    if (x->fits != y->fits) return x->fits ? -1 : 1;
    return (x->step_s > y->step_s) - (x->step_s < y->step_s);
}

// ---- output -----------------------------------------------------------------------------------

static double mib(double bytes) { return bytes / 1048576.0; }

static void print_plan(const Setup *s, const Plan *plans, int n) {
    const Cluster *c = s->cluster;
    printf("plan | %s | %d ranks (%d per node) | %s L=%d H=%d C=%d V=%d | batch %d x %d tokens, %d micro-batch%s | "
           "precision %s\n", c->name, s->P, c->gpus_per_node, gpt_arch(s->mc)->name, s->mc->n_layer, s->mc->n_head,
           s->mc->n_embd, s->mc->vocab_size, s->cfg->global_batch_size, s->T, s->cfg->gradient_acc_steps,
           s->cfg->gradient_acc_steps > 1 ? "es" : "", s->cfg->precision);
    printf("machine: %.3g TFLOP/s %s x %.2f efficiency per rank%s; links: intra %.3g GB/s %.3g us, inter %.3g GB/s "
           "%.3g us; %s\n", 1e-12 * (s->half ? c->peak_flops_16 : c->peak_flops_f32), s->half ? "16-bit" : "fp32",
           c->efficiency, c->cores && s->P > c->cores ? " (ranks share the cores)" : "", c->intra.bandwidth / 1e9,
           c->intra.latency * 1e6, c->inter.bandwidth / 1e9, c->inter.latency * 1e6,
           c->overlaps ? "communication overlaps compute" : "communication does not overlap compute");
    printf("\nmemory per rank (MiB) and step time, fastest first:\n");
    printf("  %-17s %8s %8s %8s %8s %8s %9s %4s %10s %10s %10s %10s %11s\n", "layout", "params", "grads", "optim",
           "acts", "gathered", "total", "fits", "compute ms", "comm MB", "exposed ms", "step ms", "tokens/s");
    for (int i = 0; i < n; i++) {
        const Plan *p = &plans[i];
        double cat[CATS] = {0};
        for (int k = 0; k < p->n_memory; k++) cat[category_of(p->memory[k].what)] += (double)p->memory[k].bytes;
        printf("  %-17s", p->name);
        for (int k = 0; k < CATS; k++) printf(" %8.2f", mib(cat[k]));
        printf(" %9.2f %4s %10.2f %10.3f %10.2f %10.2f %11.0f\n", mib((double)p->memory_total), p->fits ? "yes" : "NO",
               1e3 * p->compute_s, p->comm_bytes / 1e6, 1e3 * p->exposed_s, 1e3 * p->step_s, p->tokens_per_s);
    }
    for (int i = 0; i < n; i++)  // stage 10: where rank 0 (stage 0) is not the fullest rank
        if (plans[i].stage == 10 && plans[i].heaviest_stage != 0)
            printf("  %s: stage %d holds the most, %.2f MiB a rank (what fits reads)\n", plans[i].name,
                   plans[i].heaviest_stage, mib((double)plans[i].heaviest_total));
    printf("\ncommunication per step (rank 0; alpha-beta on the link each group crosses):\n");
    for (int i = 0; i < n; i++) {
        const Plan *p = &plans[i];
        printf("  %s:%s\n", p->name, p->n_comm ? "" : " none");
        for (int k = 0; k < p->n_comm; k++) {
            const Collective *q = &p->comm[k];
            printf("    %-5s %-15s %10.3f MB %6ld calls %2d ranks %-5s %-4s %9.3f ms%s\n", q->group, q->kind,
                   q->bytes / 1e6, q->calls, q->n, q->intra ? "intra" : "inter", q->algorithm, 1e3 * q->seconds,
                   q->hideable && s->cluster->overlaps ? "  overlaps compute" : "");
        }
    }
}

// the one sentence: what the best layout does better than the runner-up
static void why_best(const Plan *plans, int n, char *out, size_t size) {
    if (n == 0 || !plans[0].fits) {
        snprintf(out, size, "no layout fits in memory");
        return;
    }
    if (n == 1 || !plans[1].fits) {
        snprintf(out, size, "%s is the only layout that fits", plans[0].name);
        return;
    }
    const Plan *a = &plans[0], *b = &plans[1];
    double dc = b->compute_s - a->compute_s, de = b->exposed_s - a->exposed_s, db = b->bubble_s - a->bubble_s;
    if (b->step_s - a->step_s < 0.01 * a->step_s)
        snprintf(out, size, "%s and %s tie (%.2f and %.2f ms per step): %s moves %.2f MB per step, %s %.2f MB",
                 a->name, b->name, 1e3 * a->step_s, 1e3 * b->step_s, a->name, a->comm_bytes / 1e6, b->name,
                 b->comm_bytes / 1e6);
    else if (db > dc && db > de)  // a pipeline's idle time: fewer stages, or more micro-batches to fill them
        snprintf(out, size, "%s wins: its pipeline idles %.2f ms less per step than %s's (%.2f vs %.2f ms of bubble; "
                 "its compute %+.2f ms and its exposed communication %+.2f ms against it)", a->name, 1e3 * db, b->name,
                 1e3 * a->bubble_s, 1e3 * b->bubble_s, -1e3 * dc, -1e3 * de);
    else if (de >= dc && a->comm_bytes < b->comm_bytes)
        snprintf(out, size, "%s wins: it moves %.1fx fewer bytes per step than %s at this batch (%.2f vs %.2f MB), "
                 "%.2f ms less exposed communication", a->name, b->comm_bytes / a->comm_bytes, b->name,
                 a->comm_bytes / 1e6, b->comm_bytes / 1e6, 1e3 * de);
    else if (de >= dc)
        snprintf(out, size, "%s wins: its communication shows %.2f ms less than %s's (%.2f vs %.2f MB per step, "
                 "on faster links or under compute)", a->name, 1e3 * de, b->name, a->comm_bytes / 1e6,
                 b->comm_bytes / 1e6);
    else
        snprintf(out, size, "%s wins: %.2f ms less compute per step than %s", a->name, 1e3 * dc, b->name);
}

// root written to path as indented JSON, then freed (the training plan's and the serving plan's)
void write_plan_json(const char *path, cJSON *root) {
    char *text = cJSON_Print(root);
    if (!text) fatal("out of memory writing %s", path);
    FILE *f = fopen_or_die(path, "w");
    if (fputs(text, f) == EOF || fclose(f) != 0) fatal("%s: cannot write the plan", path);
    free(text);
    cJSON_Delete(root);
}

static void write_json(const char *path, const Setup *s, const Plan *plans, int n, const char *why) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "cluster", s->cluster->path);
    cJSON_AddNumberToObject(root, "ranks", s->P);
    cJSON_AddNumberToObject(root, "seq_len", s->T);
    cJSON_AddStringToObject(root, "why", why);
    cJSON *list = cJSON_AddArrayToObject(root, "layouts");
    for (int i = 0; i < n; i++) {
        const Plan *p = &plans[i];
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "name", p->name);
        cJSON_AddNumberToObject(j, "stage", p->stage);
        cJSON *args = cJSON_AddArrayToObject(j, "args");
        for (int k = 0; k < p->n_args; k++) cJSON_AddItemToArray(args, cJSON_CreateString(p->args[k]));
        cJSON_AddNumberToObject(j, "dp", p->dp);
        if (p->stage == 5 || p->stage == 10) cJSON_AddItemToObject(j, "tp_dimensions", cJSON_CreateIntArray(p->dims, 3));
        if (p->pp) cJSON_AddNumberToObject(j, "pp", p->pp), cJSON_AddNumberToObject(j, "microbatches", p->microbatches);
        if (p->stage == 10) {
            cJSON_AddNumberToObject(j, "cp", p->cp);
            cJSON_AddNumberToObject(j, "heaviest_stage", p->heaviest_stage);
            cJSON_AddNumberToObject(j, "heaviest_memory_total", (double)p->heaviest_total);
        }
        cJSON *mem = cJSON_AddObjectToObject(j, "memory");
        cJSON *cats = cJSON_AddObjectToObject(j, "memory_by_category");
        double cat[CATS] = {0};
        for (int k = 0; k < p->n_memory; k++) {
            cJSON_AddNumberToObject(mem, p->memory[k].what, (double)p->memory[k].bytes);
            cat[category_of(p->memory[k].what)] += (double)p->memory[k].bytes;
        }
        for (int k = 0; k < CATS; k++) cJSON_AddNumberToObject(cats, CATEGORY_NAMES[k], cat[k]);
        cJSON_AddNumberToObject(j, "memory_total", (double)p->memory_total);
        cJSON_AddBoolToObject(j, "fits", p->fits);
        cJSON *comm = cJSON_AddArrayToObject(j, "communication");
        for (int k = 0; k < p->n_comm; k++) {
            const Collective *q = &p->comm[k];
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "group", q->group);
            cJSON_AddStringToObject(e, "kind", q->kind);
            cJSON_AddNumberToObject(e, "bytes", q->bytes);
            cJSON_AddNumberToObject(e, "calls", (double)q->calls);
            cJSON_AddNumberToObject(e, "ranks", q->n);
            cJSON_AddStringToObject(e, "link", q->intra ? "intra" : "inter");
            cJSON_AddStringToObject(e, "algorithm", q->algorithm);
            cJSON_AddNumberToObject(e, "seconds", q->seconds);
            cJSON_AddBoolToObject(e, "overlaps_compute", q->hideable && s->cluster->overlaps);
            cJSON_AddItemToArray(comm, e);
        }
        cJSON_AddNumberToObject(j, "comm_bytes", p->comm_bytes);
        cJSON_AddNumberToObject(j, "compute_s", p->compute_s);
        cJSON_AddNumberToObject(j, "bubble_s", p->bubble_s);
        cJSON_AddNumberToObject(j, "comm_s", p->comm_s);
        cJSON_AddNumberToObject(j, "exposed_comm_s", p->exposed_s);
        cJSON_AddNumberToObject(j, "step_s", p->step_s);
        cJSON_AddNumberToObject(j, "tokens_per_s", p->tokens_per_s);
        if (p->measured) {
            cJSON *m = cJSON_AddObjectToObject(j, "measured");
            cJSON_AddNumberToObject(m, "step_s", p->measured_step_s);
            cJSON_AddNumberToObject(m, "slowest_step_s", p->measured_slowest_s);
            cJSON_AddItemToObject(m, "passes_step_s", cJSON_CreateDoubleArray(p->pass_step_s, p->n_passes));
            cJSON_AddItemToObject(m, "passes_others_cores", cJSON_CreateDoubleArray(p->pass_others_cores, p->n_passes));
            cJSON_AddNumberToObject(m, "comm_bytes", p->measured_comm_bytes);
            cJSON_AddNumberToObject(m, "memory_total", (double)p->measured_memory_total);
            cJSON_AddBoolToObject(m, "memory_agrees", p->memory_agrees);
        }
        cJSON_AddItemToArray(list, j);
    }
    write_plan_json(path, root);
}

// the most cores other jobs kept busy during one of a layout's passes (-1: unknown)
static double most_others_cores(const Plan *p) {
    double most = -1;
    for (int k = 0; k < p->n_passes; k++) most = p->pass_others_cores[k] > most ? p->pass_others_cores[k] : most;
    return most;
}

static void print_measured(const Plan *plans, int n) {
    printf("\npredicted and measured here (a pass: the median of its steps after the first; measured: the fastest "
           "of %d pass%s, slowest: the slowest; others: the most cores other jobs kept busy during one):\n",
           plans[0].n_passes, plans[0].n_passes > 1 ? "es" : "");
    printf("  %-17s %10s %10s %10s %7s %7s %12s %12s %11s %11s\n", "layout", "step ms", "measured", "slowest", "others",
           "ratio", "comm MB", "measured", "memory MiB", "measured");
    for (int i = 0; i < n; i++) {
        const Plan *p = &plans[i];
        if (!p->measured) continue;
        printf("  %-17s %10.2f %10.2f %10.2f %7.2f %7.2f %12.4f %12.4f %11.2f %11.2f%s\n", p->name, 1e3 * p->step_s,
               1e3 * p->measured_step_s, 1e3 * p->measured_slowest_s, most_others_cores(p),
               p->measured_step_s / p->step_s, p->comm_bytes / 1e6, p->measured_comm_bytes / 1e6,
               mib((double)p->memory_total), mib((double)p->measured_memory_total),
               p->memory_agrees ? "" : "  (memory rows differ)");
    }
}

// ---- the command line -------------------------------------------------------------------------

typedef struct {
    const char *cluster, *layout, *json, *calibrate;
    int ranks, nodes, gpus_per_node, measure_steps, passes, seq_len, microbatches;
    bool help;
    bool inference;  // --inference: stage 06's memory per rank (plan_serve.c)
    char **config_args;  // argv[0], then what is not the planner's: --config, --key=value
    int n_config_args;
} Options;

static int positive_option(const char *arg, const char *name) {
    char *end;
    long v = strtol(arg, &end, 10);
    if (*end || v < 1 || v > 1 << 20) fatal("command line: option '%s': expected a positive integer, found '%s'", name, arg);
    return (int)v;
}

// the planner's own options; the rest is the config's, passed to config_load (and to the runs)
static void parse_options(Options *o, int argc, char **argv) {
    memset(o, 0, sizeof *o);
    o->layout = "";
    o->config_args = calloc_or_die((size_t)argc + 1, sizeof(char *));
    o->config_args[o->n_config_args++] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)
            o->help = true, printf("usage: build/plan --cluster=FILE [--ranks=P] [--nodes=N] [--gpus_per_node=G] [--layout=L[+L...]]\n"
                   "                  [--microbatches=M] [--seq_len=T] [--json=FILE] [--measure[=STEPS] [--passes=N]] [--config FILE] [--key=value ...]\n"
                   "       build/plan --calibrate=FILE [--ranks=P] [--passes=N] [--config FILE] [--key=value ...]\n"
                   "       build/plan --inference --cluster=FILE [--ranks=P] [--layout=X,Y,1] [--json=FILE] [--config FILE] [--key=value ...]\n"
                   "layouts: ddp, fsdp, zero1, zero2, hsdpR, zeroN-hsdpR (FSDP's ladder), X,Y,Z (a tensor-parallel grid), "
                   "ppN (N pipeline stages), tpX-ppN[-cpC] (stage 10's meshes); docs/PLANNER.md\n"
                   "the training config's keys follow (the planner reads them as the stages do)\n\n");
        if (strncmp(a, "--cluster=", 10) == 0) o->cluster = a + 10;
        else if (strncmp(a, "--layout=", 9) == 0) o->layout = a + 9;
        else if (strncmp(a, "--json=", 7) == 0) o->json = a + 7;
        else if (strncmp(a, "--calibrate=", 12) == 0) o->calibrate = a + 12;
        else if (strncmp(a, "--ranks=", 8) == 0) o->ranks = positive_option(a + 8, "--ranks");
        else if (strncmp(a, "--nodes=", 8) == 0) o->nodes = positive_option(a + 8, "--nodes");
        else if (strncmp(a, "--gpus_per_node=", 16) == 0) o->gpus_per_node = positive_option(a + 16, "--gpus_per_node");
        else if (strncmp(a, "--seq_len=", 10) == 0) o->seq_len = positive_option(a + 10, "--seq_len");
        else if (strncmp(a, "--microbatches=", 15) == 0) o->microbatches = positive_option(a + 15, "--microbatches");
        else if (strcmp(a, "--inference") == 0) o->inference = true;
        else if (strcmp(a, "--measure") == 0) o->measure_steps = 6;
        else if (strncmp(a, "--measure=", 10) == 0) o->measure_steps = positive_option(a + 10, "--measure");
        else if (strncmp(a, "--passes=", 9) == 0) o->passes = positive_option(a + 9, "--passes");
        else o->config_args[o->n_config_args++] = argv[i];
    }
}

// The stage to load the config as: the one whose strategy it names (configs/axonn.json names
// axonn, stage 05's), so that its own keys are accepted; stage 08's when it has experts; stage
// 03's otherwise. The file is read again by config_load, which reports whatever is wrong in it.
static bool has_experts(const cJSON *json) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(json, "num_experts");
    return cJSON_IsNumber(e) && e->valuedouble > 0;
}

static bool experts_on_command_line(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (strncmp(argv[i], "--num_experts=", 14) == 0 && atoi(argv[i] + 14) > 0) return true;
    return false;
}

static Stage stage_of_config(int argc, char **argv) {
    const char *path = getenv("CONFIG_FILE"), *strategy = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) path = argv[i + 1];
        else if (strncmp(argv[i], "--config=", 9) == 0) path = argv[i] + 9;
        else if (strncmp(argv[i], "--strategy=", 11) == 0) strategy = argv[i] + 11;
    }
    char *text = !strategy && path && *path ? read_file_or_die(path, NULL) : NULL;
    cJSON *json = text ? cJSON_Parse(text) : NULL;
    const cJSON *named = cJSON_GetObjectItemCaseSensitive(json, "strategy");
    if (!strategy && cJSON_IsString(named)) strategy = named->valuestring;
    Stage stage = !strategy ? STAGE_DDP
                  : strcmp(strategy, "single_device") == 0 ? STAGE_MIXED_PRECISION
                  : strcmp(strategy, "fsdp") == 0 ? STAGE_FSDP
                  : strcmp(strategy, "axonn") == 0 ? STAGE_TENSOR_PARALLEL
                  : strcmp(strategy, "pipeline") == 0 ? STAGE_PIPELINE_PARALLEL
                  : strcmp(strategy, "expert_parallel") == 0 ? STAGE_MIXTURE_OF_EXPERTS
                  : strcmp(strategy, "context_parallel") == 0 ? STAGE_CONTEXT_PARALLEL
                  : strcmp(strategy, "composed") == 0 ? STAGE_COMPOSED : STAGE_DDP;
    if (!strategy && (has_experts(json) || experts_on_command_line(argc, argv))) stage = STAGE_MIXTURE_OF_EXPERTS;
    cJSON_Delete(json);
    free(text);
    return stage;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--pingpong") == 0) {
        pingpong(&argc, &argv);
        return 0;
    }
    Options o;
    parse_options(&o, argc, argv);
    if (o.calibrate) {
        bool experts = stage_of_config(o.n_config_args, o.config_args) == STAGE_MIXTURE_OF_EXPERTS;
        calibrate_machine(o.calibrate, o.ranks ? o.ranks : 4, o.config_args, o.n_config_args, experts,
                          o.passes ? o.passes : 1);
        return 0;
    }
    if (o.inference && o.cluster) {
        Cluster serving;
        cluster_load(&serving, o.cluster);
        plan_inference(&serving, o.ranks, o.layout, o.json, o.n_config_args, o.config_args);
        return 0;
    }
    Config cfg;
    Stage stage = stage_of_config(o.n_config_args, o.config_args);
    if (!o.cluster && o.help) config_load(&cfg, o.n_config_args, o.config_args, stage);  // prints the keys, exits
    if (!o.cluster) fatal("command line: option '--cluster': expected a cluster description (configs/clusters/*.json "
                          "or one --calibrate wrote), found none");
    Cluster cluster;
    cluster_load(&cluster, o.cluster);
    if (o.nodes) cluster.nodes = o.nodes;
    if (o.gpus_per_node) cluster.gpus_per_node = o.gpus_per_node;  // nodes of the same GPUs, fewer of them
    config_load(&cfg, o.n_config_args, o.config_args, stage);
    resolve_resume(&cfg);  // a run to resume takes its model shape from out_dir
    ops_set_half_format(config_half_format(&cfg));  // the memory report names fp16 or bf16 copies
    Tokenizer *tok = tokenizer_load(cfg.tokenizer_path);
    GPTConfig mc = model_shape(&cfg, tok);
    moe_model(&mc);  // experts train on stage 08 alone: its MoE MLP
    ParamLayout layout;
    gpt_layout(&layout, &mc);
    int T = mc.max_seq_len < cfg.max_seq_len ? mc.max_seq_len : cfg.max_seq_len;
    if (o.seq_len && o.seq_len > T) fatal("command line: option '--seq_len': expected at most max_seq_len %d, found %d", T, o.seq_len);
    Setup s = {.cfg = &cfg, .mc = &mc, .cluster = &cluster, .P = o.ranks ? o.ranks : cluster.nodes * cluster.gpus_per_node,
               .T = o.seq_len ? o.seq_len : T, .flags = acts_flags(&cfg), .half = config_is_half(&cfg),
               .microbatches = o.microbatches ? o.microbatches : cfg.num_microbatches > 1 ? cfg.num_microbatches : 0,
               .composed_zero = stage == STAGE_COMPOSED && cfg.zero_stage == 1};

    enum { MAX_PLANS = 512 };
    Plan *plans = calloc_or_die(MAX_PLANS, sizeof(Plan));
    char why_not[400] = "";
    int n = enumerate(&s, &layout, plans, MAX_PLANS, o.layout, why_not, sizeof why_not);
    int named = 0;  // layouts --layout names: each must run
    for (const char *c = o.layout; *c; c++) named += *c == '+';
    named += o.layout[0] != '\0';
    if (n < named)
        fatal("command line: option '--layout': %s cannot run on %d ranks: %s", o.layout, s.P,
              why_not[0] ? why_not : "expected ddp, fsdp, zero1, zero2, hsdpR or zeroN-hsdpR (FSDP's ladder, R replica "
              "groups), x,y,z (a tensor-parallel grid), ppN (N pipeline stages), "
              "epN (experts over N ranks) or tpX-ppN-cpC (stage 10's mesh: two or more of them above 1)");
    if (n == 0) fatal("%d ranks: no layout can run this config on them (%s)", s.P, why_not);
    qsort(plans, (size_t)n, sizeof(Plan), by_step_time);
    if (o.measure_steps)
        measure_plans(plans, n, s.P, o.config_args + 1, o.n_config_args - 1, o.measure_steps, o.passes ? o.passes : 1);
    char why[400];
    why_best(plans, n, why, sizeof why);
    print_plan(&s, plans, n);
    if (o.measure_steps) print_measured(plans, n);
    printf("\n%s.\n", why);
    if (o.json) write_json(o.json, &s, plans, n, why);
    size_t smallest = plans[0].memory_total;
    for (int i = 0; i < n; i++) smallest = plans[i].memory_total < smallest ? plans[i].memory_total : smallest;
    if (!plans[0].fits)  // sorted: a layout that fits comes first
        fatal("%s: no layout fits in %.1f GiB per GPU on %d ranks (the smallest needs %.2f GiB): add ranks, "
              "shard (FSDP, z) or lower the batch", o.cluster, cluster.memory_bytes / 1073741824.0, s.P,
              smallest / 1073741824.0);
    free(plans);
    gpt_layout_free(&layout);
    tokenizer_free(tok);
    free(o.config_args);
    return 0;
}
