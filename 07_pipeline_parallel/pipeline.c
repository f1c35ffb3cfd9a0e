// pipeline.c: the grid, the schedules, the step that runs them, and the checkpoints of a
// pipeline (pipeline.h).
#include "pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "model/activations.h"
#include "ops/ops.h"
#include "run/run_checkpoint.h"
#include "run/run_setup.h"
#include "run/stage_run.h"
#include "zero_bubble.h"

// ---- the grid ---------------------------------------------------------------------------------

void stage_blocks(int n_layer, int pp, int stage, int *first, int *n) {
    // the extra blocks of an uneven split go to the first stages: the last one also runs the
    // head, the widest matmul of the model
    int base = n_layer / pp, extra = n_layer % pp;
    *n = base + (stage < extra);
    *first = stage * base + (stage < extra ? stage : extra);
}

int pipe_chunks(const Config *cfg) { return pipe_interleaved(cfg->pp_sched) ? cfg->virtual_stages : 1; }

bool pipe_grid_fits(const Config *cfg, int ranks, int n_layer, char *why, size_t why_size) {
    int pp = cfg->pp_size, m = cfg->num_microbatches, v = pipe_chunks(cfg);
    if (ranks % pp != 0)
        snprintf(why, why_size, "key 'pp_size': %d stages do not divide the %d ranks into whole pipelines", pp, ranks);
    else if (pp > n_layer)
        snprintf(why, why_size, "key 'pp_size': %d stages for %d blocks (n_layer): a stage would hold no block", pp,
                 n_layer);
    else if (v > 1 && pp == 1)
        snprintf(why, why_size, "key 'virtual_stages': %d chunks on one stage: interleaving needs pp_size 2 or "
                 "more (the chunks of a stage take turns with the other stages')", v);
    else if (pp * v > n_layer)
        snprintf(why, why_size, "key 'virtual_stages': %d chunks on each of %d stages need at least %d blocks, "
                 "n_layer is %d", v, pp, pp * v, n_layer);
    else if (pipe_interleaved(cfg->pp_sched) && m % pp != 0)
        snprintf(why, why_size, "key 'num_microbatches': the interleaved schedule sends micro-batches round the "
                 "stages in groups of pp_size (%d): %d is not a multiple of it", pp, m);
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
    g->chunks = pipe_chunks(cfg);
    pipe_chunk_blocks(g, n_layer, 0, &g->first_block, &g->n_blocks);
    g->pipe = comm_split(world, g->replica, g->stage, "pipeline");
    g->dp_group = comm_split(world, g->stage, g->replica, "replicas");
    if (g->pp > 1 && gpt_arch(mc)->tied_head) {  // phi's lm_head is a tensor of its own
        // the middle stages take a colour of their own: a group of one they never use
        bool holds_wte = g->is_first || g->is_last;
        g->tied = comm_split(world, holds_wte ? g->replica : g->dp + rank, g->stage, "tied-wte");
    }
}

void pipe_chunk_blocks(const PipeGrid *g, int n_layer, int chunk, int *first, int *n) {
    stage_blocks(n_layer, g->pp * g->chunks, chunk * g->pp + g->stage, first, n);
}

// Interleaved: one range layout per chunk, merged into one buffer, the root tensors first (the
// embedding's of the first stage's chunk 0, the head's of the last stage's last chunk), then each
// chunk's blocks. Its blocks are no one range: first_block and n_blocks stay 0, and
// layout_block_start (FSDP's units) does not apply.
void pipe_stage_layout(ParamLayout *l, const GPTConfig *mc, const PipeGrid *g) {
    if (g->chunks == 1) {
        gpt_layout_range(l, mc, g->first_block, g->n_blocks, g->is_first, g->is_last);
        return;
    }
    ParamLayout *parts = calloc_or_die((size_t)g->chunks, sizeof *parts);
    int n_tensors = 0;
    for (int c = 0; c < g->chunks; c++) {
        int first, n;
        pipe_chunk_blocks(g, mc->n_layer, c, &first, &n);
        gpt_layout_range(&parts[c], mc, first, n, g->is_first && c == 0, g->is_last && c == g->chunks - 1);
        n_tensors += parts[c].num_tensors;
    }
    *l = parts[0];
    l->tensors = calloc_or_die((size_t)n_tensors, sizeof *l->tensors);
    l->block_first = calloc_or_die(1, sizeof *l->block_first);
    l->num_tensors = 0, l->num_params = 0, l->first_block = 0, l->n_blocks = 0;
    l->has_embed = g->is_first, l->has_head = g->is_last;
    for (int root = 1; root >= 0; root--) {
        for (int c = 0; c < g->chunks; c++)
            for (int i = 0; i < parts[c].num_tensors; i++) {
                TensorInfo t = parts[c].tensors[i];
                if ((t.block < 0) != root) continue;
                t.offset = l->num_params;
                l->num_params += t.numel;
                l->tensors[l->num_tensors++] = t;
            }
        if (root) l->root_numel = l->num_params;
    }
    for (int c = 0; c < g->chunks; c++) gpt_layout_free(&parts[c]);
    free(parts);
}

void print_pipeline_plan(const PipeGrid *g, const Config *cfg, const GPTConfig *mc, size_t stage_params, int slots) {
    int n_layer = mc->n_layer;
    const char *head = gpt_arch(mc)->tied_head ? " + final LayerNorm, head (tied wte) and loss"
                                               : " + final LayerNorm, head (lm_head) and loss";
    printf("pipeline: %d stages x %d data-parallel replicas (rank = replica * %d + stage), schedule %s, "
           "%d micro-batches", g->pp, g->dp, g->pp, cfg->pp_schedule, cfg->num_microbatches);
    if (g->chunks > 1) printf(", %d chunks a stage (chunk c of stage s: virtual stage c * %d + s)", g->chunks, g->pp);
    printf("\n");
    for (int s = 0; s < g->pp; s++) {
        PipeGrid at = *g;
        at.stage = s;
        printf("  stage %d:", s);
        for (int c = 0; c < g->chunks; c++) {
            int first, n;
            pipe_chunk_blocks(&at, n_layer, c, &first, &n);
            if (g->chunks > 1) printf("%s chunk %d:", c ? " |" : "", c);
            printf(" blocks %d-%d%s%s", first, first + n - 1, s == 0 && c == 0 ? " + embedding" : "",
                   s == g->pp - 1 && c == g->chunks - 1 ? head : "");
        }
        printf("\n");
    }
    printf("  rank 0 holds %.2fM parameters and activations for %d micro-batches\n", stage_params / 1e6, slots);
}

// the last stage's wte is a copy of the first's (the tied lm_head): counted and saved once, there
static bool holds_wte_copy(const PipeGrid *g) { return g->is_last && !g->is_first; }

bool pipe_tensor_counted(const TensorInfo *t, const void *grid) {
    return t->role != ROLE_WTE || !holds_wte_copy(grid);
}

double stage_sum_squares(const PipeGrid *g, const ParamLayout *layout, const float *grads) {
    double sum = 0;
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *t = &layout->tensors[i];
        if (pipe_tensor_counted(t, g)) sum += sum_squares(grads + t->offset, t->numel);
    }
    return sum;
}

// ---- the schedules ----------------------------------------------------------------------------

static bool is_gpipe(PipeSchedule schedule) { return schedule == SCHED_GPIPE; }

// 1F1B: stage s first runs the forwards that fill the pipeline behind it (pp - s - 1 of them),
// then alternates one forward with one backward, then drains the backwards left.
static int warmup_forwards(int m, int pp, int stage) {
    int w = pp - stage - 1;
    return w < m ? w : m;
}

int pipe_schedule(PipeOp *ops, PipeSchedule schedule, int m, int pp, int chunks, int stage) {
    int n = 0;
    if (pipe_interleaved(schedule)) return interleaved_schedule(ops, m, pp, chunks, stage);
    if (pipe_zero_bubble(schedule)) return zb_h1_schedule(ops, m, pp, stage);
    if (is_gpipe(schedule)) {
        for (int i = 0; i < m; i++) ops[n++] = (PipeOp){.micro = i};
        for (int i = 0; i < m; i++) ops[n++] = (PipeOp){.backward = true, .micro = i};
        return n;
    }
    // exercise one-f-one-b: begin
    int warm = warmup_forwards(m, pp, stage);
    for (int i = 0; i < warm; i++) ops[n++] = (PipeOp){.micro = i};
    for (int k = 0; k < m - warm; k++) {
        ops[n++] = (PipeOp){.micro = warm + k};
        ops[n++] = (PipeOp){.backward = true, .micro = k};
    }
    for (int k = m - warm; k < m; k++) ops[n++] = (PipeOp){.backward = true, .micro = k};
    // exercise one-f-one-b: end
    return n;
}

// ---- the step ---------------------------------------------------------------------------------

// the stage's blocks on this rank alone
static void serial_adapt(PipeLayers *l, ActsSpec *spec) { (void)l, (void)spec; }

static void serial_forward(PipeLayers *l, Activations *a, const Weights *w, const int *inputs, int B, int T) {
    (void)l;
    gpt_forward(a, w, inputs, B, T);
}

static double serial_loss(PipeLayers *l, Activations *a, const GPTConfig *mc, const int *targets, int B, int T,
                          float dloss, bool backward) {
    (void)l;
    copy_to_device(a->targets, targets, (size_t)B * T * sizeof(int));
    return backward ? gpt_loss_forward_backward(a, mc, B, T, dloss) : gpt_loss_forward(a, mc, B, T);
}

static void serial_backward(PipeLayers *l, Activations *a, const Weights *w, Weights *g, int B, int T) {
    (void)l;
    gpt_backward(a, w, g, B, T, NULL, NULL);
}

PipeLayers *pipe_serial_layers(void) {
    static PipeLayers serial = {serial_adapt, serial_forward, serial_loss, serial_backward, NULL};
    return &serial;
}

void pipeline_init(Pipeline *p, const PipeGrid *g, const GPTConfig *mc, const Config *cfg, const Weights *w) {
    pipeline_init_layers(p, g, mc, cfg, w, pipe_serial_layers());
}

void pipeline_init_layers(Pipeline *p, const PipeGrid *g, const GPTConfig *mc, const Config *cfg, const Weights *w,
                          PipeLayers *layers) {
    memset(p, 0, sizeof *p);
    p->layers = layers;
    p->grid = g;
    p->w = w;
    p->mc = mc;
    p->schedule = cfg->pp_sched;
    p->m = cfg->num_microbatches;
    // their sends and receives are started one by one and, around the ring, form cycles, which
    // NCCL (running a rank's operations in order) would deadlock; MPI progresses them all at once
    if ((pipe_interleaved(p->schedule) || pipe_zero_bubble(p->schedule)) && comm_p2p_in_order())
        fatal("key 'pp_schedule' is '%s', which this stage runs over MPI only: set comm_backend to mpi "
              "(NCCL would run its separately started sends one after another and deadlock)",
              pipe_schedule_name(p->schedule));
    p->ops = malloc_or_die((size_t)pipe_max_ops(p->m, g->chunks) * sizeof *p->ops);
    p->n_ops = pipe_schedule(p->ops, p->schedule, p->m, g->pp, g->chunks, g->stage);
    p->op_s = calloc_or_die((size_t)p->n_ops, sizeof *p->op_s);
    double *busy = malloc_or_die((size_t)g->pp * sizeof *busy);
    pipe_replay(p->schedule, p->m, g->pp, g->chunks, NULL, busy);  // the orders fit together, or fatal()
    free(busy);
    p->chunk_slots = calloc_or_die((size_t)g->chunks * 2, sizeof *p->chunk_slots);
    p->chunk_first = p->chunk_slots + g->chunks;
    p->n_slots = pipe_slots(p->schedule, p->m, g->pp, g->chunks, g->stage, p->chunk_slots);
    p->slots = calloc_or_die((size_t)p->n_slots, sizeof *p->slots);
    p->fwd_sends = calloc_or_die((size_t)p->n_slots, sizeof *p->fwd_sends);
    p->bwd_sends = calloc_or_die((size_t)p->n_slots, sizeof *p->bwd_sends);
    if (pipe_zero_bubble(p->schedule)) p->deferred = calloc_or_die((size_t)p->n_slots, sizeof *p->deferred);
    int flags = acts_flags(cfg), T = mc->max_seq_len < cfg->max_seq_len ? mc->max_seq_len : cfg->max_seq_len;
    ActsSpec whole = whole_model_acts(mc, cfg->global_batch_size / g->dp / p->m, T, flags & ACTS_16BIT,
                                      flags & ACTS_RECOMPUTE);
    for (int c = 0, i = 0; c < g->chunks; c++) {
        p->chunk_first[c] = i;
        ActsSpec spec = whole;  // each chunk's adapted from the whole model's (adapt may rescale B and T)
        pipe_chunk_blocks(g, mc->n_layer, c, &spec.first_layer, &spec.n_layers);
        spec.embed = g->is_first && c == 0, spec.head = g->is_last && c == g->chunks - 1;
        layers->adapt(layers, &spec);
        for (int k = 0; k < p->chunk_slots[c]; k++, i++) {
            acts_alloc_spec(&p->slots[i], &spec);
            if (p->deferred) p->deferred[i] = deferred_weights_new(&p->slots[i]);
        }
    }
}

void pipeline_free(Pipeline *p) {
    for (int i = 0; i < p->n_slots; i++) {
        if (p->deferred) deferred_weights_free(p->deferred[i]);
        acts_free(&p->slots[i]);
    }
    free(p->slots), free(p->fwd_sends), free(p->bwd_sends), free(p->deferred);
    free(p->ops), free(p->op_s), free(p->chunk_slots);
}

// what each schedule keeps on a stage, from a micro-batch's forward to the end of its backward
static const char *slots_rule(PipeSchedule schedule) {
    if (is_gpipe(schedule)) return "all m";
    if (pipe_zero_bubble(schedule)) return "up to p + 1 on stage 0, p on the others, each until its W";
    if (pipe_interleaved(schedule)) return "per chunk, from the ring's warm-up";
    return "min(m, p - stage)";
}

void pipeline_print_memory(const Pipeline *p, const Config *cfg, size_t n) {
    MemoryItem memory[MODEL_MEMORY_ITEMS];
    size_t acts = 0, deferred = 0;
    for (int i = 0; i < p->n_slots; i++) {
        acts += p->slots[i].bytes;
        if (p->deferred) deferred += deferred_weights_bytes(p->deferred[i]);
    }
    model_memory_items(memory, cfg, n, acts);
    if (p->trained) trainable_add_memory(p->trained, memory);  // the frozen base, its 16-bit copy, what it keeps
    print_memory_report("device memory (rank 0: stage 0):", memory, MODEL_MEMORY_ITEMS);
    printf("  activations: %d micro-batches in flight x %.2f MB (%s keeps %s)\n", p->n_slots,
           acts / 1e6 / p->n_slots, pipe_schedule_name(p->schedule), slots_rule(p->schedule));
    if (p->grid->chunks > 1) {
        printf("  per chunk:");
        for (int c = 0; c < p->grid->chunks; c++) printf(" %d", p->chunk_slots[c]);
        printf(" micro-batches\n");
    }
    if (p->deferred) {
        // zero bubble's price: the output gradients each linear layer's W will read
        printf("  deferred weight gradients: %.2f MB (%d slots x %zu N floats a block: the output gradients W reads)\n",
               deferred / 1e6, p->n_slots, deferred_floats_per_row(&p->slots[0].spec.shape));
        run_stats_memory("deferred weight gradients", deferred);
    }
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

// F3, B3, W3: micro-batch 3's forward, backward, weight pass; F3c1: through chunk 1 (interleaved)
static void op_name(const Pipeline *p, const PipeOp *op, char *name, size_t size) {
    char chunk[16] = "";
    if (p->grid->chunks > 1) snprintf(chunk, sizeof chunk, "c%d", op->chunk);
    snprintf(name, size, "%s%d%s", op->weights ? "W" : op->backward ? "B" : "F", op->micro, chunk);
}

static void trace(Pipeline *p, const PipeOp *op, bool received, bool sent) {
    if (!p->tracing) return;
    size_t len = strlen(p->trace);
    char name[32];
    op_name(p, op, name, sizeof name);
    snprintf(p->trace + len, sizeof p->trace - len, "%s%s%s ", received ? "r" : "", name, sent ? "s" : "");
}

// the slot of an op's micro-batch in its chunk
static int slot_of(const Pipeline *p, const PipeOp *op) {
    return p->chunk_first[op->chunk] + op->micro % p->chunk_slots[op->chunk];
}



// A forward receives the previous virtual stage's output into `encoded` (the first embeds tokens
// instead) and sends its own output on; a backward receives the gradient of its output into
// `dres` (the last virtual stage starts from its dlogits instead) and sends back what backward
// leaves there, the gradient of its input. A weight pass talks to no one (pipe_op_peers).
static Message op_recv(const Pipeline *p, const PipeOp *op, const Batch *b) {
    int from, to, slot = slot_of(p, op);
    pipe_op_peers(op, p->grid->pp, p->grid->chunks, p->grid->stage, &from, &to);
    if (from < 0) return (Message){0};
    Activations *a = &p->slots[slot];
    size_t count = (size_t)residual_rows(&a->spec, b->rows * b->T) * p->mc->n_embd;
    return (Message){op->backward ? a->dres : a->encoded, count, from, slot, op->backward};
}

static Message op_send(const Pipeline *p, const PipeOp *op, const Batch *b) {
    int from, to, slot = slot_of(p, op);
    pipe_op_peers(op, p->grid->pp, p->grid->chunks, p->grid->stage, &from, &to);
    if (to < 0) return (Message){0};
    Activations *a = &p->slots[slot];
    size_t count = (size_t)residual_rows(&a->spec, b->rows * b->T) * p->mc->n_embd;
    return (Message){op->backward ? a->dres : (float *)head_input(a), count, to, slot, op->backward};
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
    if (pending->count && recv->count && pending->peer == recv->peer && p->grid->chunks == 1 && !p->deferred) {
        comm_send_recv(p->grid->pipe, pending->buf, pending->count, pending->peer, recv->buf, recv->count, recv->peer);
        pending->count = 0;
        return;
    }
    start_send(p, pending);
    if (recv->count) comm_recv(p->grid->pipe, recv->buf, recv->count, recv->peer);
}

// The compute of one op. The last stage's forward computes the loss and its gradient at once
// (dlogits wait in the slot for the backward); evaluation (with_grad false) only the loss. Under
// zb-h1 a backward leaves its linear layers' weight gradients to the weight pass (zero_bubble.c).
// Its wall time counts as busy in the measured bubble (compute_s); its device time
// (dev_busy_seconds: on a CPU shared with other processes, only the time it ran) goes into *secs.
static double compute(Pipeline *p, const PipeOp *op, const Batch *b, Weights *grads, float dloss, bool with_grad,
                      double *secs) {
    int slot = slot_of(p, op);
    Activations *a = &p->slots[slot];
    double t0 = wall_seconds(), busy0 = dev_busy_seconds(), loss = 0;
    int m0 = trace_mark();
    trainable_run_micro(p->trained, op->micro * b->rows);  // where its rows lie in the step's
    if (op->weights) {
        if (p->layers->weight_pass) p->layers->weight_pass(p->layers, a, p->w, deferred_weight_pass, p->deferred[slot]);
        else deferred_weight_pass(p->deferred[slot]);
    } else if (op->backward) {
        if (p->deferred) deferred_begin(p->deferred[slot]);
        p->layers->backward(p->layers, a, p->w, grads, b->rows, b->T);
        if (p->deferred) deferred_end(p->deferred[slot]);
    } else {
        p->layers->forward(p->layers, a, p->w, a->spec.embed ? b->inputs : NULL, b->rows, b->T);
        if (a->spec.head) loss = p->layers->loss(p->layers, a, p->mc, b->targets, b->rows, b->T, dloss, with_grad);
    }
    char name[32];  // the op on the trace's compute track, around its layers' spans
    op_name(p, op, name, sizeof name);
    trace_span(name, TRACK_COMPUTE, m0, trace_mark(), NULL);
    dev_synchronize();
    *secs = dev_busy_seconds() - busy0;
    p->compute_s += wall_seconds() - t0;
    return loss;
}

// The sends still reading a slot's buffers finish before the slot is written again: before a
// new micro-batch takes it, and before a backward (recomputation rewrites the block outputs, the
// activation sent forward among them; its gradient lands in dres, which the slot's last backward
// may still be sending when a new micro-batch's forward took the slot right after it, as in the
// interleaved order, before that send had started).
static void claim_slot(Pipeline *p, const PipeOp *op) {
    int slot = slot_of(p, op);
    wait_send(&p->fwd_sends[slot]);
    wait_send(&p->bwd_sends[slot]);
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
        double secs;
        loss += compute(p, &ops[k], b, grads, dloss, with_grad, &secs);
        if (p->tracing) p->op_s[k] = secs;
        pending = op_send(p, &ops[k], b);
        trace(p, &ops[k], recv.count > 0, pending.count > 0);
    }
    start_send(p, &pending);
    for (int s = 0; s < p->n_slots; s++) wait_send(&p->fwd_sends[s]), wait_send(&p->bwd_sends[s]);
    return loss;
}

double pipeline_step(Pipeline *p, Weights *g, const Batch *batches, float dloss) {
    p->tracing = p->steps++ == 0;
    double t0 = wall_seconds();
    double loss = run_ops(p, p->ops, p->n_ops, batches, g, dloss, true);
    p->schedule_s += wall_seconds() - t0;
    p->tracing = false;
    return loss;
}

double pipeline_eval_loss(void *ctx, const Batch *batch) {
    Pipeline *p = ctx;
    bool tracing = p->tracing;
    double compute_s = p->compute_s;  // evaluation is not part of the measured bubble
    p->tracing = false;
    // the batch as micro-batch 0, forward through each chunk in turn
    int chunks = p->grid->chunks;
    PipeOp *forwards = malloc_or_die((size_t)chunks * sizeof *forwards);
    for (int c = 0; c < chunks; c++) forwards[c] = (PipeOp){false, 0, c, false};
    double loss = run_ops(p, forwards, chunks, batch, NULL, 0, false);
    free(forwards);
    p->tracing = tracing, p->compute_s = compute_s;
    return loss;
}

// ---- the schedule made visible ----------------------------------------------------------------

// Every rank's trace and figures, gathered to every rank: the text travels as floats (each
// character exactly), followed by the busy and the schedule seconds and each op's seconds in the
// traced step.
enum { BUSY_AT = PIPE_TRACE_CHARS, TOTAL_AT, OPS_AT };

static float *gather_traces(Comm *world, const Pipeline *p, size_t *stride) {
    *stride = OPS_AT + (size_t)p->n_ops;
    float *mine = malloc_or_die(*stride * sizeof(float));
    for (size_t i = 0; i < PIPE_TRACE_CHARS; i++) mine[i] = (float)(unsigned char)p->trace[i];
    mine[BUSY_AT] = (float)p->compute_s;
    mine[TOTAL_AT] = (float)p->schedule_s;
    for (int k = 0; k < p->n_ops; k++) mine[OPS_AT + k] = (float)p->op_s[k];
    size_t n = *stride * (size_t)comm_size(world);
    float *dev_mine = dev_malloc(*stride * sizeof(float)), *dev_all = dev_malloc(n * sizeof(float));
    copy_to_device(dev_mine, mine, *stride * sizeof(float));
    comm_all_gather(world, dev_all, dev_mine, *stride);
    float *all = malloc_or_die(n * sizeof(float));
    copy_to_host(all, dev_all, n * sizeof(float));
    dev_free(dev_mine), dev_free(dev_all), free(mine);
    return all;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, by_value);
    return n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

// How the replay times each op: the theory's unit times; each op its kind's (forward, backward,
// weight pass; chunk) median on its stage in the first step (imbalance between the stages shows,
// and so does a core shared with other work); or its kind's median over all the stages (balanced
// stages, as the theory assumes, with the measured costs of F, B and W).
typedef enum { UNIT_TIMES, STAGE_MEDIANS, PIPELINE_MEDIANS } ReplayTimes;

static bool same_kind(const PipeOp *a, const PipeOp *b) {
    return a->chunk == b->chunk && a->backward == b->backward && a->weights == b->weights;
}

// The first step's ops of replica 0's stages replayed on one clock (pipe_replay): the schedule's
// bubble where compute times are known and messages are free, without the noise of one op (a
// page fault) that a median leaves out.
static double replayed_bubble(const float *all, size_t stride, const Pipeline *p, ReplayTimes times) {
    int pp = p->grid->pp, n = p->n_ops;
    double **secs = calloc_or_die((size_t)pp, sizeof *secs), *busy = calloc_or_die((size_t)pp, sizeof *busy);
    double *same = malloc_or_die((size_t)pp * n * sizeof *same);
    PipeOp *ops = malloc_or_die((size_t)pp * n * sizeof *ops);
    for (int s = 0; s < pp; s++) pipe_schedule(ops + (size_t)s * n, p->schedule, p->m, pp, p->grid->chunks, s);
    for (int s = 0; s < pp; s++) {
        secs[s] = malloc_or_die((size_t)n * sizeof **secs);
        for (int k = 0; k < n; k++) {
            int count = 0;
            for (int r = times == PIPELINE_MEDIANS ? 0 : s; r < (times == PIPELINE_MEDIANS ? pp : s + 1); r++)
                for (int j = 0; j < n; j++)
                    if (same_kind(&ops[(size_t)r * n + j], &ops[(size_t)s * n + k]))
                        same[count++] = all[(size_t)r * stride + OPS_AT + j];
            secs[s][k] = median(same, count);
        }
    }
    double end = pipe_replay(p->schedule, p->m, pp, p->grid->chunks, times == UNIT_TIMES ? NULL : secs, busy);
    double idle = 0;
    for (int s = 0; s < pp; s++) idle += 1 - busy[s] / end, free(secs[s]);
    free(secs), free(busy), free(same), free(ops);
    return idle / pp;
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
    int pp = p->grid->pp, den = (pipe_zero_bubble(p->schedule) ? 3 * p->m : p->grid->chunks * p->m) + pp - 1;
    printf("  bubble: measured %.1f%% (mean over ranks), theory %s = %d/%d = %.1f%%\n", 100 * sum / ranks,
           pipe_bubble_formula(p->schedule), pp - 1, den,
           100 * pipe_bubble_theory(p->schedule, p->m, pp, p->grid->chunks));
}

void print_first_schedule(Comm *world, Pipeline *p) {
    if (p->steps != 1) return;
    size_t stride;
    float *all = gather_traces(world, p, &stride);
    printf("schedule %s, step 1 (F3/B3/W3: forward/backward/weight pass of micro-batch 3%s; r: its input received "
           "first, s: its output sent after; bubble = idle / schedule time):\n", pipe_schedule_name(p->schedule),
           p->grid->chunks > 1 ? ", c1: through chunk 1" : "");
    print_bubble_rows(all, stride, comm_size(world), p, true);
    double stages = replayed_bubble(all, stride, p, STAGE_MEDIANS);
    double balanced = replayed_bubble(all, stride, p, PIPELINE_MEDIANS);
    double unit = replayed_bubble(all, stride, p, UNIT_TIMES);
    printf("  step 1 replayed on one clock, messages free, each op its kind's median time: on its stage %.1f%%, "
           "over the stages (balanced) %.1f%%; with the theory's unit times %.1f%%\n", 100 * stages, 100 * balanced,
           100 * unit);
    run_stats_number("bubble_theory", pipe_bubble_theory(p->schedule, p->m, p->grid->pp, p->grid->chunks));
    run_stats_number("bubble_first_step", stages);
    run_stats_number("bubble_first_step_balanced", balanced);
    run_stats_number("bubble_unit_times", unit);
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

static void sum_over_pipeline(float *buf, size_t n, void *pipe) { comm_all_reduce(pipe, buf, n); }

void pipe_save_checkpoint(const Config *cfg, const PipeGrid *g, const ParamLayout *local,
                          const ParamLayout *full, const float *params, const float *m,
                          const float *v, long step) {
    if (g->replica != 0) return;  // the replicas are identical
    save_checkpoint_from_parts(cfg, local, full, params, m, v, step, pipe_tensor_counted, g, sum_over_pipeline, g->pipe,
                               g->is_first);
}
