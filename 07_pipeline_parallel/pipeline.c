// pipeline.c: the grid, the schedules, the step that runs them, and the checkpoints of a
// pipeline (pipeline.h).
#include "pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "log.h"
#include "ops.h"
#include "run_checkpoint.h"
#include "run_setup.h"
#include "stage_run.h"

// ---- the grid ---------------------------------------------------------------------------------

void stage_blocks(int n_layer, int pp, int stage, int *first, int *n) {
    // the extra blocks of an uneven split go to the first stages: the last one also runs the
    // head, the widest matmul of the model
    int base = n_layer / pp, extra = n_layer % pp;
    *n = base + (stage < extra);
    *first = stage * base + (stage < extra ? stage : extra);
}

bool pipe_grid_fits(const Config *cfg, int ranks, int n_layer, char *why, size_t why_size) {
    int pp = cfg->pp_size, m = cfg->num_microbatches;
    if (ranks % pp != 0)
        snprintf(why, why_size, "key 'pp_size': %d stages do not divide the %d ranks into whole pipelines", pp, ranks);
    else if (pp > n_layer)
        snprintf(why, why_size, "key 'pp_size': %d stages for %d blocks (n_layer): a stage would hold no block", pp,
                 n_layer);
    else if (cfg->global_batch_size % (ranks / pp * m) != 0)
        snprintf(why, why_size, "key 'num_microbatches': %d micro-batches do not divide a replica's share of the "
                 "batch (global_batch_size %d over %d replicas)", m, cfg->global_batch_size, ranks / pp);
    else
        return true;
    return false;
}

static void check_grid(const Config *cfg, int ranks, int n_layer) {
    char why[320];
    if (!pipe_grid_fits(cfg, ranks, n_layer, why, sizeof why)) fatal("%s", why);
}

void pipe_grid_init(PipeGrid *g, Comm *world, const Config *cfg, const GPTConfig *mc) {
    int rank = comm_rank(world), ranks = comm_size(world), n_layer = mc->n_layer;
    check_grid(cfg, ranks, n_layer);
    memset(g, 0, sizeof *g);
    g->pp = cfg->pp_size;
    g->dp = ranks / g->pp;
    g->stage = rank % g->pp;
    g->replica = rank / g->pp;
    g->is_first = g->stage == 0;
    g->is_last = g->stage == g->pp - 1;
    stage_blocks(n_layer, g->pp, g->stage, &g->first_block, &g->n_blocks);
    g->pipe = comm_split(world, g->replica, g->stage, "pipeline");
    g->dp_group = comm_split(world, g->stage, g->replica, "replicas");
    if (g->pp > 1 && gpt_arch(mc)->tied_head) {  // phi's lm_head is a tensor of its own
        // the middle stages take a colour of their own: a group of one they never use
        bool holds_wte = g->is_first || g->is_last;
        g->tied = comm_split(world, holds_wte ? g->replica : g->dp + rank, g->stage, "tied-wte");
    }
}

void print_pipeline_plan(const PipeGrid *g, const Config *cfg, const GPTConfig *mc, size_t stage_params, int slots) {
    int n_layer = mc->n_layer;
    const char *head = gpt_arch(mc)->tied_head ? " + final LayerNorm, head (tied wte) and loss"
                                               : " + final LayerNorm, head (lm_head) and loss";
    printf("pipeline: %d stages x %d data-parallel replicas (rank = replica * %d + stage), schedule %s, "
           "%d micro-batches\n", g->pp, g->dp, g->pp, cfg->pp_schedule, cfg->num_microbatches);
    for (int s = 0; s < g->pp; s++) {
        int first, n;
        stage_blocks(n_layer, g->pp, s, &first, &n);
        printf("  stage %d: blocks %d-%d%s%s\n", s, first, first + n - 1, s == 0 ? " + embedding" : "",
               s == g->pp - 1 ? head : "");
    }
    printf("  rank 0 holds %.2fM parameters and activations for %d micro-batches\n", stage_params / 1e6, slots);
}

// the last stage's wte is a copy of the first's (the tied lm_head): counted and saved once, there
static bool holds_wte_copy(const PipeGrid *g) { return g->is_last && !g->is_first; }

double stage_sum_squares(const PipeGrid *g, const ParamLayout *layout, const float *grads) {
    double sum = 0;
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *t = &layout->tensors[i];
        if (t->role == ROLE_WTE && holds_wte_copy(g)) continue;
        sum += sum_squares(grads + t->offset, t->numel);
    }
    return sum;
}

// ---- the schedules ----------------------------------------------------------------------------

static bool is_gpipe(const char *schedule) { return strcmp(schedule, "gpipe") == 0; }

// 1F1B: stage s first runs the forwards that fill the pipeline behind it (pp - s - 1 of them),
// then alternates one forward with one backward, then drains the backwards left.
static int warmup_forwards(int m, int pp, int stage) {
    int w = pp - stage - 1;
    return w < m ? w : m;
}

int pipe_schedule(PipeOp *ops, const char *schedule, int m, int pp, int stage) {
    int n = 0;
    if (is_gpipe(schedule)) {
        for (int i = 0; i < m; i++) ops[n++] = (PipeOp){false, i};
        for (int i = 0; i < m; i++) ops[n++] = (PipeOp){true, i};
        return n;
    }
    // exercise one-f-one-b: begin
    int warm = warmup_forwards(m, pp, stage);
    for (int i = 0; i < warm; i++) ops[n++] = (PipeOp){false, i};
    for (int k = 0; k < m - warm; k++) {
        ops[n++] = (PipeOp){false, warm + k};
        ops[n++] = (PipeOp){true, k};
    }
    for (int k = m - warm; k < m; k++) ops[n++] = (PipeOp){true, k};
    // exercise one-f-one-b: end
    return n;
}

int pipe_slots(const char *schedule, int m, int pp, int stage) {
    if (is_gpipe(schedule)) return m;
    int in_flight = pp - stage;
    return in_flight < m ? in_flight : m;
}

// ---- the step ---------------------------------------------------------------------------------

void pipeline_init(Pipeline *p, const PipeGrid *g, const GPTConfig *mc, const Config *cfg, const Weights *w) {
    memset(p, 0, sizeof *p);
    p->grid = g;
    p->w = w;
    p->mc = mc;
    p->schedule = cfg->pp_schedule;
    p->m = cfg->num_microbatches;
    p->n_slots = pipe_slots(p->schedule, p->m, g->pp, g->stage);
    p->slots = calloc_or_die((size_t)p->n_slots, sizeof *p->slots);
    p->fwd_sends = calloc_or_die((size_t)p->n_slots, sizeof *p->fwd_sends);
    p->bwd_sends = calloc_or_die((size_t)p->n_slots, sizeof *p->bwd_sends);
    int flags = acts_flags(cfg), T = mc->max_seq_len < cfg->max_seq_len ? mc->max_seq_len : cfg->max_seq_len;
    ActsSpec spec = whole_model_acts(mc, cfg->global_batch_size / g->dp / p->m, T, flags & ACTS_16BIT,
                                     flags & ACTS_RECOMPUTE);
    spec.first_layer = g->first_block, spec.n_layers = g->n_blocks;
    spec.embed = g->is_first, spec.head = g->is_last;
    for (int i = 0; i < p->n_slots; i++) acts_alloc_spec(&p->slots[i], &spec);
}

void pipeline_free(Pipeline *p) {
    for (int i = 0; i < p->n_slots; i++) acts_free(&p->slots[i]);
    free(p->slots), free(p->fwd_sends), free(p->bwd_sends);
}

void pipeline_print_memory(const Pipeline *p, const Config *cfg, size_t n) {
    MemoryItem memory[MODEL_MEMORY_ITEMS];
    model_memory_items(memory, cfg, n, p->n_slots * p->slots[0].bytes);
    print_memory_report("device memory (rank 0: stage 0):", memory, MODEL_MEMORY_ITEMS);
    printf("  activations: %d micro-batches in flight x %.2f MB (%s keeps %s)\n", p->n_slots,
           p->slots[0].bytes / 1e6, p->schedule, strcmp(p->schedule, "gpipe") == 0 ? "all m" : "min(m, p - stage)");
    run_stats_number("activation_slots", p->n_slots);
    print_16bit_activation_saving(&p->slots[0]);
}

static void wait_send(CommRequest **r) {
    if (*r) comm_wait(*r);
    *r = NULL;
}

// One op's messages: what it receives before its compute and sends after (count 0: none).
typedef struct {
    float *buf;
    size_t count;
    int peer;       // the stage
    int slot;
    bool backward;  // the gradient going back (else the activation going forward)
} Message;

static void trace(Pipeline *p, const PipeOp *op, bool received, bool sent) {
    if (!p->tracing) return;
    size_t len = strlen(p->trace);
    snprintf(p->trace + len, sizeof p->trace - len, "%s%s%d%s ", received ? "r" : "", op->backward ? "B" : "F",
             op->micro, sent ? "s" : "");
}

// A forward receives the previous stage's output into `encoded` (the first stage embeds tokens
// instead) and sends its own output on; a backward receives the gradient of its output into
// `dres` (the last stage starts from its dlogits instead) and sends back what backward leaves
// there, the gradient of its input.
static Message op_recv(const Pipeline *p, const PipeOp *op, const Batch *b) {
    const PipeGrid *g = p->grid;
    int slot = op->micro % p->n_slots;
    size_t count = (size_t)b->rows * b->T * p->mc->n_embd;
    if (!op->backward && !g->is_first) return (Message){p->slots[slot].encoded, count, g->stage - 1, slot, false};
    if (op->backward && !g->is_last) return (Message){p->slots[slot].dres, count, g->stage + 1, slot, true};
    return (Message){0};
}

static Message op_send(const Pipeline *p, const PipeOp *op, const Batch *b) {
    const PipeGrid *g = p->grid;
    int slot = op->micro % p->n_slots;
    size_t count = (size_t)b->rows * b->T * p->mc->n_embd;
    if (!op->backward && !g->is_last)
        return (Message){(float *)head_input(&p->slots[slot]), count, g->stage + 1, slot, false};
    if (op->backward && !g->is_first) return (Message){p->slots[slot].dres, count, g->stage - 1, slot, true};
    return (Message){0};
}

// Starts a send; its slot's buffer is not touched again before the send is waited for.
static void start_send(Pipeline *p, Message *m) {
    if (!m->count) return;
    CommRequest **r = m->backward ? &p->bwd_sends[m->slot] : &p->fwd_sends[m->slot];
    wait_send(r);
    *r = comm_send_start(p->grid->pipe, m->buf, m->count, m->peer);
    m->count = 0;
}

// The messages between two ops: the previous op's send, then this op's receive. When both go
// to the same neighbour (1F1B's steady state: an activation out, a gradient in) they travel as
// one send-recv, as the neighbour's matching pair does: on NCCL, where a rank's operations run
// in the order started, two neighbours each sending first would wait on each other for ever.
static void exchange(Pipeline *p, Message *pending, const Message *recv) {
    if (pending->count && recv->count && pending->peer == recv->peer) {
        comm_send_recv(p->grid->pipe, pending->buf, pending->count, pending->peer, recv->buf, recv->count, recv->peer);
        pending->count = 0;
        return;
    }
    start_send(p, pending);
    if (recv->count) comm_recv(p->grid->pipe, recv->buf, recv->count, recv->peer);
}

// The compute of one op. The last stage's forward computes the loss and its gradient at once
// (dlogits wait in the slot for the backward); evaluation (with_grad false) only the loss.
static double compute(Pipeline *p, const PipeOp *op, const Batch *b, Weights *grads, float dloss, bool with_grad) {
    const PipeGrid *g = p->grid;
    Activations *a = &p->slots[op->micro % p->n_slots];
    double t0 = wall_seconds(), loss = 0;
    if (op->backward) {
        gpt_backward(a, p->w, grads, b->rows, b->T, NULL, NULL);
    } else {
        gpt_forward(a, p->w, g->is_first ? b->inputs : NULL, b->rows, b->T);
        if (g->is_last) {
            copy_to_device(a->targets, b->targets, (size_t)b->rows * b->T * sizeof(int));
            loss = with_grad ? gpt_loss_forward_backward(a, p->mc, b->rows, b->T, dloss)
                             : gpt_loss_forward(a, p->mc, b->rows, b->T);
        }
    }
    dev_synchronize();
    p->compute_s += wall_seconds() - t0;
    return loss;
}

// The sends still reading a slot's buffers finish before the slot is written again: before a
// new micro-batch takes it, and before a backward (recomputation rewrites the block outputs,
// the activation sent forward among them).
static void claim_slot(Pipeline *p, const PipeOp *op) {
    int slot = op->micro % p->n_slots;
    wait_send(&p->fwd_sends[slot]);
    if (!op->backward) wait_send(&p->bwd_sends[slot]);
}

static double run_ops(Pipeline *p, const PipeOp *ops, int n, const Batch *batches, Weights *grads, float dloss,
                      bool with_grad) {
    double loss = 0;
    Message pending = {0};
    for (int k = 0; k < n; k++) {
        const Batch *b = &batches[ops[k].micro];
        claim_slot(p, &ops[k]);
        Message recv = op_recv(p, &ops[k], b);
        exchange(p, &pending, &recv);
        loss += compute(p, &ops[k], b, grads, dloss, with_grad);
        pending = op_send(p, &ops[k], b);
        trace(p, &ops[k], recv.count > 0, pending.count > 0);
    }
    start_send(p, &pending);
    for (int s = 0; s < p->n_slots; s++) wait_send(&p->fwd_sends[s]), wait_send(&p->bwd_sends[s]);
    return loss;
}

double pipeline_step(Pipeline *p, Weights *g, const Batch *batches, float dloss) {
    PipeOp *ops = malloc_or_die(2 * (size_t)p->m * sizeof *ops);
    int n = pipe_schedule(ops, p->schedule, p->m, p->grid->pp, p->grid->stage);
    p->tracing = p->steps++ == 0;
    double t0 = wall_seconds();
    double loss = run_ops(p, ops, n, batches, g, dloss, true);
    p->schedule_s += wall_seconds() - t0;
    p->tracing = false;
    free(ops);
    return loss;
}

double pipeline_eval_loss(void *ctx, const Batch *batch) {
    Pipeline *p = ctx;
    bool tracing = p->tracing;
    double compute_s = p->compute_s;  // evaluation is not part of the measured bubble
    p->tracing = false;
    PipeOp forward = {false, 0};
    double loss = run_ops(p, &forward, 1, batch, NULL, 0, false);
    p->tracing = tracing, p->compute_s = compute_s;
    return loss;
}

// ---- the schedule made visible ----------------------------------------------------------------

// Every rank's trace and figures, gathered to every rank: the text travels as floats (each
// character exactly), followed by the busy and the schedule seconds.
static float *gather_traces(Comm *world, const Pipeline *p, size_t *stride) {
    *stride = PIPE_TRACE_CHARS + 2;
    float *mine = malloc_or_die(*stride * sizeof(float));
    for (size_t i = 0; i < PIPE_TRACE_CHARS; i++) mine[i] = (float)(unsigned char)p->trace[i];
    mine[PIPE_TRACE_CHARS] = (float)p->compute_s;
    mine[PIPE_TRACE_CHARS + 1] = (float)p->schedule_s;
    size_t n = *stride * (size_t)comm_size(world);
    float *dev_mine = dev_malloc(*stride * sizeof(float)), *dev_all = dev_malloc(n * sizeof(float));
    copy_to_device(dev_mine, mine, *stride * sizeof(float));
    comm_all_gather(world, dev_all, dev_mine, *stride);
    float *all = malloc_or_die(n * sizeof(float));
    copy_to_host(all, dev_all, n * sizeof(float));
    dev_free(dev_mine), dev_free(dev_all), free(mine);
    return all;
}

static double bubble_theory(const Pipeline *p) {
    int pp = p->grid->pp;
    return (double)(pp - 1) / (p->m + pp - 1);
}

static void print_bubble_rows(const float *all, size_t stride, int ranks, const Pipeline *p, bool with_trace) {
    double sum = 0;
    for (int r = 0; r < ranks; r++) {
        const float *row = all + (size_t)r * stride;
        double busy = row[PIPE_TRACE_CHARS], total = row[PIPE_TRACE_CHARS + 1];
        double bubble = total > 0 ? 1 - busy / total : 0;
        sum += bubble;
        printf("  rank %d (stage %d, replica %d): bubble %4.1f%%", r, r % p->grid->pp, r / p->grid->pp, 100 * bubble);
        if (with_trace) {
            char text[PIPE_TRACE_CHARS];
            for (size_t i = 0; i < PIPE_TRACE_CHARS; i++) text[i] = (char)row[i];
            text[PIPE_TRACE_CHARS - 1] = '\0';
            printf(" | %s", text);
        }
        printf("\n");
    }
    printf("  bubble: measured %.1f%% (mean over ranks), theory (p-1)/(m+p-1) = %d/%d = %.1f%%\n",
           100 * sum / ranks, p->grid->pp - 1, p->m + p->grid->pp - 1, 100 * bubble_theory(p));
}

void print_first_schedule(Comm *world, Pipeline *p) {
    if (p->steps != 1) return;
    size_t stride;
    float *all = gather_traces(world, p, &stride);
    printf("schedule %s, step 1 (F3/B3: forward/backward of micro-batch 3; r: its input received "
           "first, s: its output sent after; bubble = idle / schedule time):\n", p->schedule);
    print_bubble_rows(all, stride, comm_size(world), p, true);
    free(all);
    p->compute_s = p->schedule_s = 0;
}

void print_bubble(Comm *world, const Pipeline *p) {
    if (p->steps < 2) return;
    size_t stride;
    float *all = gather_traces(world, p, &stride);
    printf("bubble over steps 2 on:\n");
    print_bubble_rows(all, stride, comm_size(world), p, false);
    free(all);
}

// ---- checkpoints ------------------------------------------------------------------------------

// every tensor but the last stage's copy of the tied wte (the first stage's is the one)
static bool not_wte_copy(const TensorInfo *t, const void *grid) {
    return t->role != ROLE_WTE || !holds_wte_copy(grid);
}

static void sum_over_pipeline(float *buf, size_t n, void *pipe) { comm_all_reduce(pipe, buf, n); }

void pipe_save_checkpoint(const Config *cfg, const PipeGrid *g, const ParamLayout *local,
                          const ParamLayout *full, const float *params, const float *m,
                          const float *v, long step) {
    if (g->replica != 0) return;  // the replicas are identical
    save_checkpoint_from_parts(cfg, local, full, params, m, v, step, not_wte_copy, g, sum_over_pipeline, g->pipe,
                               g->is_first);
}
