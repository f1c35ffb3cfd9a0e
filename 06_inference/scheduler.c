// scheduler.c: continuous batching over the KV cache's slots (the server's engine; the HTTP side
// is server.c, what the two share scheduler.h).
//
// The cache has max_batch_size slots, one sequence each. Rank 0's main thread loops:
//   1. wait for work, and admit waiting jobs into free slots;
//   2. each new job: its prefill into its own slot (kv_prefill_slot), and its first token;
//   3. one decode step over every busy slot (kv_decode), a token each; finished jobs leave and
//      their slots are free for the next.
// So a request joins the running batch at any step and leaves it at any step, with its own
// sampling settings and stop conditions. The loop never waits for a client: it appends tokens to
// the job under the lock and wakes the connection threads, which write them at their client's
// pace.
//
// Tensor parallelism: each step is a plan (which slots, their tokens and positions) that rank 0
// broadcasts and every rank of the [x, y, 1] grid runs; the logits are whole on every rank after
// the head's all-gather, and rank 0 alone samples: its tokens reach the others in the next plan.
// When idle, rank 0 still sends an empty plan every second, so that the others' broadcast waits
// stay within the communicator's timeout.
#include "scheduler.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "device.h"
#include "preemption.h"

// A step as floats (token ids and positions are exact in a float: below 2^24), broadcast by rank 0.
enum { PLAN_IDLE, PLAN_PREFILL, PLAN_DECODE, PLAN_STOP };
typedef struct {
    KVModel *m;
    Comm *world;
    bool use_graph;
    size_t len;          // floats in a plan: 3 + the larger of a prefill's maxT and a decode's 2 B
    float *plan, *plan_dev;
    int *tokens, *start; // a step's inputs (maxT)
    float *logits;       // (B, Vp) host, rank 0
} Engine;

// the loop's parts, in the order they come below
static bool wait_and_admit(Server *s, Engine *g, int *admitted, int *n_new);
static void prefill(Server *s, Engine *g, Sampler *sampler, int slot);
static void decode(Server *s, Engine *g, Sampler *sampler);
static int sample(Sampler *sampler, const float *logits, const Job *j);
static void accept_token(Server *s, Job *j, int token);
static void engine_init(Engine *g, KVModel *m, Comm *world, bool use_graph);
static void engine_free(Engine *g);
static void send_plan(Engine *g, int kind, int n, int slot);

// ---- the loop (rank 0) -------------------------------------------------------------------------

void scheduler_run(Server *s, KVModel *m, Sampler *sampler, Comm *world, bool use_graph) {
    Engine g;
    engine_init(&g, m, world, use_graph);
    int *admitted = malloc_or_die((size_t)s->n_slots * sizeof(int)), n_new;
    while (wait_and_admit(s, &g, admitted, &n_new)) {
        for (int i = 0; i < n_new; i++) prefill(s, &g, sampler, admitted[i]);
        decode(s, &g, sampler);
    }
    free(admitted);
    send_plan(&g, PLAN_STOP, 0, 0);
    engine_free(&g);
}

// ---- 1. admission --------------------------------------------------------------------------------

static void free_slot(Server *s, int slot) {  // the lock held
    job_release(s, s->slots[slot]);
    s->slots[slot] = NULL;
    s->busy--;
}

// Waits for work (a job in the queue or a busy slot), sending an idle plan every second; moves
// waiting jobs into free slots. Returns the slots admitted (n_new of them); false once stopped.
static bool wait_and_admit(Server *s, Engine *g, int *admitted, int *n_new) {
    *n_new = 0;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        if (preemption_signalled() && !s->stopping) {
            s->stopping = true;
            printf("server: SIGTERM: finishing %d running and %d waiting requests, refusing new ones\n",
                   s->busy, s->queue_len);
            fflush(stdout);
        }
        for (int b = 0; b < s->n_slots; b++)  // their clients went away
            if (s->slots[b] && s->slots[b]->cancelled) free_slot(s, b);
        while (s->queue_len && s->queue[s->queue_head]->cancelled) {
            job_release(s, s->queue[s->queue_head]);
            s->queue_head = (s->queue_head + 1) % s->cfg->max_queue, s->queue_len--;
        }
        if (s->busy || s->queue_len) break;
        if (s->stopping) {
            pthread_mutex_unlock(&s->lock);
            return false;
        }
        struct timespec until = deadline_in(1);
        if (pthread_cond_timedwait(&s->work, &s->lock, &until) == ETIMEDOUT) {
            pthread_mutex_unlock(&s->lock);
            send_plan(g, PLAN_IDLE, 0, 0);
            pthread_mutex_lock(&s->lock);
        }
    }
    for (int b = 0; b < s->n_slots && s->queue_len; b++) {
        if (s->slots[b]) continue;
        Job *j = s->queue[s->queue_head];
        s->queue_head = (s->queue_head + 1) % s->cfg->max_queue, s->queue_len--;
        s->slots[b] = j;
        s->busy++;
        admitted[(*n_new)++] = b;
    }
    pthread_mutex_unlock(&s->lock);
    return true;
}

// ---- 2. prefill and 3. decode ------------------------------------------------------------------

// a new job's prefill in its slot, and its first token
static void prefill(Server *s, Engine *g, Sampler *sampler, int slot) {
    Job *j = s->slots[slot];  // only the scheduler moves jobs in and out of slots
    for (int t = 0; t < j->n_ids; t++) g->plan[3 + t] = (float)j->ids[t];
    send_plan(g, PLAN_PREFILL, j->n_ids, slot);
    int token = sample(sampler, g->logits, j);
    pthread_mutex_lock(&s->lock);
    s->metrics.prompt_tokens += j->n_ids;
    accept_token(s, j, token);
    if (j->finish != FINISH_NONE) free_slot(s, slot);
    pthread_cond_broadcast(&s->progress);
    pthread_mutex_unlock(&s->lock);
}

// One decode step over slots 0 .. the last busy one: a free slot in between takes part with
// token 0 at position 0 (its cache row 0 is rewritten before a new job could read it), so the
// batch is a prefix of the slots and its shape changes only when the last busy slot does.
// Every busy slot has its first token here: the prefill gave it.
static void decode(Server *s, Engine *g, Sampler *sampler) {
    int B = 0;
    for (int b = 0; b < s->n_slots; b++)
        if (s->slots[b]) B = b + 1;
    if (B == 0) return;
    for (int b = 0; b < B; b++) {
        const Job *j = s->slots[b];
        g->plan[3 + b] = j ? (float)j->last_token : 0.0f;
        g->plan[3 + B + b] = j ? (float)(j->n_ids + j->n_out - 1) : 0.0f;
    }
    send_plan(g, PLAN_DECODE, B, 0);
    size_t Vp = (size_t)g->m->cfg.padded_vocab_size;
    pthread_mutex_lock(&s->lock);
    for (int b = 0; b < B; b++) {
        Job *j = s->slots[b];
        if (!j) continue;
        pthread_mutex_unlock(&s->lock);  // sampling reads only the scheduler's own fields
        int token = sample(sampler, g->logits + b * Vp, j);
        pthread_mutex_lock(&s->lock);
        accept_token(s, j, token);
        if (j->finish != FINISH_NONE) free_slot(s, b);
    }
    pthread_cond_broadcast(&s->progress);
    pthread_mutex_unlock(&s->lock);
}

// ---- a token for a job -------------------------------------------------------------------------

static int sample(Sampler *sampler, const float *logits, const Job *j) {
    sampler->temperature = j->temperature;
    sampler->top_k = j->top_k;
    sampler->top_p = j->top_p;
    sampler->seed = j->seed;
    return sampler_next(sampler, logits, j->key, j->n_out);
}

static void histogram_observe(Histogram *h, double x) {
    int i = 0;
    while (i < N_BUCKETS && x > h->le[i]) i++;
    if (i < N_BUCKETS) h->counts[i]++;
    h->count++;
    h->sum += x;
}

// The bytes at the end of j's text that could still begin one of its stop strings (a proper
// prefix of one): held back from the stream until the next token says whether they do, so that a
// stop string spanning tokens never leaks into a streamed answer.
static size_t stop_prefix_at_end(const Job *j) {
    size_t held = 0;
    for (int i = 0; i < j->n_stops; i++)
        for (size_t k = strlen(j->stops[i]); k-- > held + 1;)  // proper prefixes, longest first
            if (k <= j->text.len && memcmp(j->text.p + j->text.len - k, j->stops[i], k) == 0) {
                held = k;
                break;
            }
    return held;
}

// Takes token `token` for job j (the lock held): its text, stop conditions and timings.
static void accept_token(Server *s, Job *j, int token) {
    double now = wall_seconds();
    if (j->n_out == 0) histogram_observe(&s->metrics.ttft, now - j->t_arrival);
    else histogram_observe(&s->metrics.tpot, now - j->t_last);
    j->t_last = now;
    j->last_token = token;
    s->metrics.generated_tokens++;
    if (token == tokenizer_eot(s->tok)) {
        j->finish = FINISH_STOP;
        j->visible = j->text.len;  // what was held back for a stop string is the answer's end
        return;
    }
    int len;
    const char *bytes = tokenizer_token_bytes(s->tok, token, &len);
    size_t before = j->text.len;
    buf_append(&j->text, bytes, (size_t)len);
    j->ends[j->n_out++] = j->visible = j->text.len;
    for (int i = 0; i < j->n_stops; i++) {  // a stop string ends the answer before it
        size_t n = strlen(j->stops[i]), from = before + 1 > n ? before + 1 - n : 0;
        char *hit = strstr(j->text.p + from, j->stops[i]);
        if (hit && (size_t)(hit - j->text.p) < j->visible) j->visible = (size_t)(hit - j->text.p), j->finish = FINISH_STOP;
    }
    if (j->finish == FINISH_NONE && j->n_out >= j->max_tokens) j->finish = FINISH_LENGTH;
    if (j->finish == FINISH_NONE) j->visible -= stop_prefix_at_end(j);
}

// ---- the steps every rank runs -------------------------------------------------------------------

static void engine_init(Engine *g, KVModel *m, Comm *world, bool use_graph) {
    *g = (Engine){.m = m, .world = world, .use_graph = use_graph};
    int most = m->maxT > 2 * m->B ? m->maxT : 2 * m->B;
    g->len = 3 + (size_t)most;
    g->plan = calloc_or_die(g->len, sizeof(float));
    g->plan_dev = dev_malloc(g->len * sizeof(float));  // NCCL broadcasts device memory
    g->tokens = calloc_or_die((size_t)most, sizeof(int));
    g->start = calloc_or_die((size_t)most, sizeof(int));
    g->logits = calloc_or_die((size_t)m->B * m->cfg.padded_vocab_size, sizeof(float));
}

static void engine_free(Engine *g) {
    free(g->plan);
    dev_free(g->plan_dev);
    free(g->tokens);
    free(g->start);
    free(g->logits);
}

static void broadcast_plan(Engine *g) {
    if (comm_size(g->world) == 1) return;
    copy_to_device(g->plan_dev, g->plan, g->len * sizeof(float));
    comm_broadcast(g->world, g->plan_dev, g->len, 0);
    copy_to_host(g->plan, g->plan_dev, g->len * sizeof(float));
}

// runs the plan in g->plan (on every rank); returns its kind
static int run_plan(Engine *g) {
    int kind = (int)g->plan[0], n = (int)g->plan[1];
    if (kind == PLAN_PREFILL) {
        int slot = (int)g->plan[2];
        for (int t = 0; t < n; t++) g->tokens[t] = (int)g->plan[3 + t];
        kv_prefill_slot(g->m, slot, g->tokens, n);
        copy_to_host(g->logits, g->m->logits, (size_t)g->m->cfg.padded_vocab_size * sizeof(float));
    } else if (kind == PLAN_DECODE) {
        for (int b = 0; b < n; b++) g->tokens[b] = (int)g->plan[3 + b], g->start[b] = (int)g->plan[3 + n + b];
        kv_decode(g->m, g->tokens, g->start, n, g->use_graph);
        copy_to_host(g->logits, g->m->logits, (size_t)n * g->m->cfg.padded_vocab_size * sizeof(float));
    }
    return kind;
}

// rank 0: the plan (its tokens already in g->plan[3...]) to every rank, then its own run of it
static void send_plan(Engine *g, int kind, int n, int slot) {
    g->plan[0] = (float)kind;
    g->plan[1] = (float)n;
    g->plan[2] = (float)slot;
    broadcast_plan(g);
    run_plan(g);
}

void scheduler_follow(KVModel *m, Comm *world, bool use_graph) {
    Engine g;
    engine_init(&g, m, world, use_graph);
    do broadcast_plan(&g);
    while (run_plan(&g) != PLAN_STOP);
    engine_free(&g);
}
