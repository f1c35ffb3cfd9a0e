// scheduler.c: continuous batching over the paged KV cache (the server's engine; the HTTP side
// is http.c, what the two share scheduler.h).
//
// The cache is a pool of blocks (kv_cache.h, block_pool.h); each running job holds the blocks its
// positions lie in, listed in its block table. Rank 0's main thread loops over steps:
//   1. wait for work; admit waiting jobs while a row of the batch (max_batch_size) is free and
//      the pool has the blocks of the job's text so far; with prefix caching a job first takes
//      the cached blocks its text begins with (another job computed them: a shared system prompt)
//      and computes only the rest;
//   2. a running job at its last position that starts a new block takes one; when the pool is
//      empty the newest running job is preempted: its blocks are freed and it waits again, first
//      in line, to be recomputed from its text (prompt and tokens so far) when blocks free up;
//   3. one forward pass over rows of several jobs (kv_forward_rows): every decoding job's next
//      token, and the prompts' rows (whole, or max_prefill_tokens of them a step: chunked
//      prefill); each job whose last position was in the pass gets a token; each block a job
//      filled becomes cached (prefix caching); finished jobs leave and their blocks are free for
//      the next.
// So a request joins the running batch at any step and leaves it at any step, with its own
// sampling settings and stop conditions; a request is admitted when the blocks of its text fit,
// not when a whole context's slot is free, and never fails for blocks that will free up (the
// pool holds a whole context at least: kv_model.c). The loop never waits for a client: it
// appends tokens to the job under the lock and wakes http.c's waker thread, which has the
// polling thread write them to the job's connection at the client's pace.
//
// Tensor parallelism: each step is a plan (its rows' tokens and positions, the rows' block
// tables) that rank 0 broadcasts and every rank of the [x, y, 1] grid runs; the logits are whole
// on every rank after the head's all-gather, and rank 0 alone samples: its tokens reach the
// others in the next plan. When idle, rank 0 still sends an empty plan every second, so that the
// others' broadcast waits stay within the communicator's timeout.
#include "scheduler.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "block_pool.h"
#include "base/log.h"
#include "base/device.h"
#include "run/preemption.h"
#include "request_logits.h"

// A step as floats (token ids, positions and block numbers are exact in a float: below 2^24),
// broadcast by rank 0: [kind, R rows, S sequences, L logit rows, N block copies], then the rows'
// tokens (R), positions (R) and sequences (R), the rows whose logits are taken (L), the
// sequences' block tables (S x max_blocks), and the blocks to copy before the pass (N pairs
// source, destination: copy-on-write).
enum { PLAN_IDLE, PLAN_STEP, PLAN_STOP };
enum { PLAN_HEAD = 5 };
typedef struct {
    KVModel *m;
    Comm *world;
    bool use_graph;
    int max_rows;        // rows in a pass at most: the model's B x T
    size_t len;          // floats in a plan
    float *plan, *plan_dev;
    int *tokens, *pos, *seq, *logit_rows;  // a step's inputs (max_rows)
    float *logits;       // (logit_rows, Vp) host: a step's logits
    int logits_cap;      // ... rows it holds (grown when a step takes more)
} Engine;

// a running job's place in the cache (rank 0)
typedef struct {
    int *blocks, n_blocks;  // its block table (max_blocks)
    uint64_t *keys;         // (max_blocks) its full blocks' prefix keys (prefix caching)
    int n_keyed;            // ... the blocks whose key is known
    int n_cached;           // positions whose keys and values are in the cache
    long order;             // when it was admitted: the newest is preempted first
    int rows, logit;        // this step: rows fed, and its first logit row (-1: none)
    // speculative decoding
    int draft_cached;       // positions the draft model has in its cache
    int n_spec, *proposals; // this step: the draft's proposals (num_speculative_tokens)
} Seq;

typedef struct {
    Seq *seq;               // (n_slots) by batch row, as s->slots
    BlockPool pool;
    int block_size;
    Job **preempted;        // waiting to run again, before the queue; oldest first
    int n_preempted;
    long admissions;
    int *copies, n_copies;  // block pairs (source, destination) the next pass copies first
    // speculative decoding (rank 0): the draft model, its proposals a step, their distributions
    KVModel *draft;
    Sampler *sampler;
    int k, maxT;
    int *tokens, *pos, *logit_rows, *logit_seq;  // a draft pass's rows (the draft's B x T)
    float *q_probs;         // (n_slots, k, V) each proposal's draft distribution (sampling)
    float *p_probs;         // (V) the model's, scratch
    float *draft_logits;    // (rows, Vp) host
    int *rows_seq;          // (rows) the job (batch row) of each of the draft's rows
    int *counts;            // (V) zeros: scratch of request_adjust_logits
    float *logprobs;        // (V) a token's distribution, for a job that asks for logprobs
} RunningBatch;

static void speculation_init(Server *s, RunningBatch *q, KVModel *m, const Sampler *sampler);
static void speculation_free(RunningBatch *q);
static int spec_tokens(const RunningBatch *q, const Job *j);
static void propose(Server *s, RunningBatch *q);
static int accept_proposals(Server *s, RunningBatch *q, Sampler *sampler, int b, const float *logits, size_t Vp);

// the loop's parts, in the order they come below
static bool wait_and_admit(Server *s, Engine *g, RunningBatch *q);
static void grow_or_preempt(Server *s, RunningBatch *q);
static void step(Server *s, Engine *g, RunningBatch *q, Sampler *sampler);
static int sample(Sampler *sampler, const float *logits, const Job *j);
static void accept_token(Server *s, Job *j, int token);
static void engine_init(Engine *g, KVModel *m, Comm *world, bool use_graph);
static void engine_free(Engine *g);
static void send_plan(Engine *g, int kind, int R, int S, int L, int N);

// ---- the loop (rank 0) -------------------------------------------------------------------------

void scheduler_run(Server *s, KVModel *m, Sampler *sampler, Comm *world, bool use_graph) {
    Engine g;
    engine_init(&g, m, world, use_graph);
    RunningBatch q = {.block_size = m->cache.block_size};
    block_pool_init(&q.pool, m->cache.n_blocks, m->cache.block_size, s->cfg->prefix_caching);
    q.seq = calloc_or_die((size_t)s->n_slots, sizeof(Seq));
    for (int b = 0; b < s->n_slots; b++) {
        q.seq[b].blocks = malloc_or_die((size_t)m->cache.max_blocks * sizeof(int));
        q.seq[b].keys = malloc_or_die((size_t)m->cache.max_blocks * sizeof(uint64_t));
    }
    q.preempted = malloc_or_die((size_t)s->n_slots * sizeof(Job *));
    q.copies = malloc_or_die(2 * (size_t)s->n_slots * sizeof(int));
    q.sampler = sampler;
    q.counts = calloc_or_die((size_t)sampler->V, sizeof(int));
    q.logprobs = malloc_or_die((size_t)sampler->V * sizeof(float));
    speculation_init(s, &q, m, sampler);
    s->metrics.cache_blocks = m->cache.n_blocks;
    s->metrics.cache_bytes = kv_cache_bytes(&m->cache);
    s->metrics.cache_free_bytes = m->pool_free_bytes;
    while (wait_and_admit(s, &g, &q)) {
        grow_or_preempt(s, &q);
        step(s, &g, &q, sampler);
    }
    speculation_free(&q);  // before the rows it reads are freed
    for (int b = 0; b < s->n_slots; b++) free(q.seq[b].blocks), free(q.seq[b].keys);
    free(q.seq);
    free(q.preempted);
    free(q.copies);
    free(q.counts);
    free(q.logprobs);
    block_pool_free(&q.pool);
    send_plan(&g, PLAN_STOP, 0, 0, 0, 0);
    engine_free(&g);
}

// ---- 1. admission --------------------------------------------------------------------------------

// the tokens of j's text so far: its prompt, then what it generated
static int job_length(const Job *j) { return j->n_ids + j->n_out; }
static int job_token(const Job *j, int i) { return i < j->n_ids ? j->ids[i] : j->out_ids[i - j->n_ids]; }

static void release_blocks(RunningBatch *q, Seq *sq) {
    for (int i = 0; i < sq->n_blocks; i++) block_pool_release(&q->pool, sq->blocks[i]);
    sq->n_blocks = 0;
}

static void set_blocks_in_use(Server *s, const RunningBatch *q) {  // the lock held
    s->metrics.cache_blocks_used = q->pool.n_blocks - block_pool_available(&q->pool);
}

static void free_slot(Server *s, RunningBatch *q, int slot) {  // the lock held
    release_blocks(q, &q->seq[slot]);
    job_release(s, s->slots[slot]);
    s->slots[slot] = NULL;
    s->busy--;
    set_blocks_in_use(s, q);
}

// the next job to admit: a preempted one first (it came earlier), else the queue's head
static Job *next_waiting(Server *s, RunningBatch *q, bool take) {  // the lock held
    if (q->n_preempted) {
        Job *j = q->preempted[0];
        if (take) memmove(q->preempted, q->preempted + 1, (size_t)--q->n_preempted * sizeof(Job *));
        return j;
    }
    if (!s->queue_len) return NULL;
    Job *j = s->queue[s->queue_head];
    if (take) s->queue_head = (s->queue_head + 1) % s->cfg->max_queue, s->queue_len--;
    return j;
}

static void drop_cancelled(Server *s, RunningBatch *q) {  // the lock held
    for (int b = 0; b < s->n_slots; b++)  // their clients went away
        if (s->slots[b] && s->slots[b]->cancelled) free_slot(s, q, b);
    for (Job *j; (j = next_waiting(s, q, false)) && j->cancelled;) job_release(s, next_waiting(s, q, true));
}

// the tokens of j's block i
static void block_tokens(const Job *j, int i, int block_size, int *tokens) {
    for (int t = 0; t < block_size; t++) tokens[t] = job_token(j, i * block_size + t);
}

// The cached blocks j's text begins with (prefix caching): their number, the blocks in found and
// their keys in keys; *unheld counts those nobody holds now (taking them makes them unavailable).
static int match_prefix(const RunningBatch *q, const Job *j, int *found, uint64_t *keys, int *unheld) {
    int bs = q->block_size, n = 0, tokens[bs];
    *unheld = 0;
    if (!q->pool.caching) return 0;
    for (uint64_t parent = 0; (n + 1) * bs <= job_length(j); parent = keys[n++]) {
        block_tokens(j, n, bs, tokens);
        keys[n] = prefix_key(parent, tokens, bs);
        if ((found[n] = prefix_lookup(&q->pool, keys[n], parent, tokens)) < 0) break;
        *unheld += q->pool.refs[found[n]] == 0;
    }
    return n;
}

// Job j into batch row b with the cached blocks of its prefix (n of them) and new ones for the
// rest. When the cache holds the whole text, its last position is computed again (its logits
// give the next token) into a copy of the last block: a shared block is never written
// (copy-on-write).
static void place(Server *s, RunningBatch *q, int b, Job *j, int n) {  // the lock held
    Seq *sq = &q->seq[b];
    int len = job_length(j), bs = q->block_size;
    *sq = (Seq){.blocks = sq->blocks, .keys = sq->keys, .proposals = sq->proposals, .order = q->admissions++,
                .n_blocks = n, .n_keyed = n, .n_cached = n * bs};
    for (int i = 0; i < n; i++) block_pool_hold(&q->pool, sq->blocks[i]);
    if (n * bs == len) {
        int copy = block_pool_take(&q->pool);
        q->copies[2 * q->n_copies] = sq->blocks[n - 1], q->copies[2 * q->n_copies++ + 1] = copy;
        s->metrics.block_copies++;
        block_pool_release(&q->pool, sq->blocks[n - 1]);
        sq->blocks[n - 1] = copy;
        sq->n_keyed = n - 1;
        sq->n_cached = len - 1;
        if (q->draft) kv_cache_copy_block(&q->draft->cache, copy, q->copies[2 * q->n_copies - 2]);
    }
    while (sq->n_blocks < blocks_for(len, bs)) sq->blocks[sq->n_blocks++] = block_pool_take(&q->pool);
    sq->draft_cached = sq->n_cached;  // the draft's blocks mirror the model's (same tables)
    if (sq->n_cached) s->metrics.prefix_hits++, s->metrics.prefix_tokens_saved += sq->n_cached;
    if (j->n_out == 0) j->cached_tokens = sq->n_cached;  // its usage's prompt_tokens_details
    s->slots[b] = j;
    s->busy++;
}

// With prefix caching, a request's later choices (n > 1) wait for its first one's prompt: then
// they find its blocks cached instead of each computing the prompt again. (A cancelled job's
// first may be gone: all of a request's jobs are cancelled together.)
static bool waits_for_first(const RunningBatch *q, const Job *j) {  // the lock held
    return q->pool.caching && j->first && !j->cancelled && j->first->n_out == 0 && j->first->finish == FINISH_NONE;
}

// Admits waiting jobs, in order, while a batch row is free and the pool holds the blocks of the
// job's text so far (its prompt; after a preemption, its tokens too) that are not cached.
static void admit(Server *s, RunningBatch *q) {  // the lock held
    for (int b = 0; b < s->n_slots; b++) {
        if (s->slots[b]) continue;
        Job *j = next_waiting(s, q, false);
        if (!j || waits_for_first(q, j)) break;
        Seq *sq = &q->seq[b];
        int unheld, n = match_prefix(q, j, sq->blocks, sq->keys, &unheld);
        int needed = blocks_for(job_length(j), q->block_size) - n + (n * q->block_size == job_length(j));
        if (needed > block_pool_available(&q->pool) - unheld) break;
        next_waiting(s, q, true);
        place(s, q, b, j, n);
    }
    set_blocks_in_use(s, q);
}

// Waits for work (a waiting or running job), sending an idle plan every second, and admits what
// fits. False once stopped.
static bool wait_and_admit(Server *s, Engine *g, RunningBatch *q) {
    pthread_mutex_lock(&s->lock);
    for (;;) {
        if (preemption_signalled() && !s->stopping) {
            s->stopping = true;
            printf("server: SIGTERM: finishing %d running and %d waiting requests, refusing new ones\n",
                   s->busy, s->queue_len + q->n_preempted);
            fflush(stdout);
        }
        drop_cancelled(s, q);
        if (s->busy || s->queue_len || q->n_preempted) break;
        if (s->stopping) {
            pthread_mutex_unlock(&s->lock);
            return false;
        }
        struct timespec until = deadline_in(1);
        if (pthread_cond_timedwait(&s->work, &s->lock, &until) == ETIMEDOUT) {
            pthread_mutex_unlock(&s->lock);
            send_plan(g, PLAN_IDLE, 0, 0, 0, 0);
            pthread_mutex_lock(&s->lock);
        }
    }
    admit(s, q);
    pthread_mutex_unlock(&s->lock);
    return true;
}

// ---- 2. blocks for the next positions ------------------------------------------------------------

static int newest_running(const Server *s, const RunningBatch *q) {
    int newest = -1;
    for (int b = 0; b < s->n_slots; b++)
        if (s->slots[b] && (newest < 0 || q->seq[b].order > q->seq[newest].order)) newest = b;
    return newest;
}

// Frees the blocks of the job in batch row b and puts it first in line: it runs again from its
// text when blocks free up (recomputing its cache costs one prefill; holding the pool would stall
// every other job). Its tokens so far stand: sampling is keyed by the token's index.
static void preempt(Server *s, RunningBatch *q, int b) {  // the lock held
    Job *j = s->slots[b];
    release_blocks(q, &q->seq[b]);
    memmove(q->preempted + 1, q->preempted, (size_t)q->n_preempted++ * sizeof(Job *));
    q->preempted[0] = j;
    s->slots[b] = NULL;
    s->busy--;
    s->metrics.preemptions++;
    set_blocks_in_use(s, q);
}

// Every running job needs blocks for its text so far (the next step feeds its last token); a
// decoding job whose text just entered a new block takes one, preempting the newest job while
// the pool is empty (itself, when it is the newest).
static void grow_or_preempt(Server *s, RunningBatch *q) {
    pthread_mutex_lock(&s->lock);
    for (int b = 0; b < s->n_slots; b++) {
        Seq *sq = &q->seq[b];
        while (s->slots[b] && sq->n_blocks < blocks_for(job_length(s->slots[b]) + spec_tokens(q, s->slots[b]) *
                                                            (job_length(s->slots[b]) - sq->n_cached == 1),
                                                        q->block_size)) {
            int block = block_pool_take(&q->pool);
            if (block >= 0) sq->blocks[sq->n_blocks++] = block;
            else preempt(s, q, newest_running(s, q));
        }
    }
    set_blocks_in_use(s, q);
    pthread_mutex_unlock(&s->lock);
}

// ---- 3. the step ---------------------------------------------------------------------------------

// The rows of one step: each decoding job's last token; then the prompts' rows in the order
// their jobs came, max_prefill_tokens of them at most (0: all). A job's rows are positions
// n_cached .. of its text; its logits are taken when its last position is among them.
static int plan_rows(Server *s, Engine *g, RunningBatch *q, int *n_seqs, int *n_logits) {
    float *p = g->plan + PLAN_HEAD;
    int R = 0, S = 0, L = 0;
    long budget = s->cfg->max_prefill_tokens ? s->cfg->max_prefill_tokens : LONG_MAX;
    int order[s->n_slots], n = 0;  // decoding jobs first, then by admission
    for (int b = 0; b < s->n_slots; b++)
        if (s->slots[b] && job_length(s->slots[b]) - q->seq[b].n_cached == 1) order[n++] = b;
    int first_prefill = n;
    for (int b = 0; b < s->n_slots; b++)
        if (s->slots[b] && job_length(s->slots[b]) - q->seq[b].n_cached > 1) order[n++] = b;
    for (int i = first_prefill + 1; i < n; i++)  // insertion sort by admission: few rows
        for (int k = i; k > first_prefill && q->seq[order[k]].order < q->seq[order[k - 1]].order; k--) {
            int t = order[k];
            order[k] = order[k - 1], order[k - 1] = t;
        }
    for (int i = 0; i < n; i++) {  // how many rows each job gets
        int b = order[i];
        Seq *sq = &q->seq[b];
        const Job *j = s->slots[b];
        int len = job_length(j), rows = len - sq->n_cached;
        sq->rows = 0, sq->logit = -1, sq->n_spec = 0;
        if (rows == 1) sq->n_spec = spec_tokens(q, j);  // decoding: the draft's proposals too
        if (rows == 1 && 1 + sq->n_spec > g->max_rows - R) sq->n_spec = g->max_rows - R - 1;
        if (rows > 1 && rows > budget) rows = (int)budget;
        if (rows > g->max_rows - R) rows = g->max_rows - R;
        if (rows <= 0) {
            sq->n_spec = 0;
            continue;
        }
        if (rows > 1) budget -= rows;
        sq->rows = rows + sq->n_spec;
        R += sq->rows;
    }
    if (q->draft) propose(s, q);
    R = 0;
    for (int i = 0; i < n; i++) {  // their tokens: the text's next ones, then the proposals
        int b = order[i];
        Seq *sq = &q->seq[b];
        const Job *j = s->slots[b];
        if (!sq->rows) continue;
        for (int r = 0; r < sq->rows; r++) {
            int at = sq->n_cached + r;
            g->tokens[R + r] = at < job_length(j) ? job_token(j, at) : sq->proposals[at - job_length(j)];
            g->pos[R + r] = at;
            g->seq[R + r] = S;
        }
        R += sq->rows;
        if (sq->n_cached + sq->rows >= job_length(j)) {  // every row from the last position on
            sq->logit = L;
            for (int r = sq->rows - 1 - sq->n_spec; r < sq->rows; r++) g->logit_rows[L++] = R - sq->rows + r;
        }
        S++;
    }
    // the plan: rows, logit rows, tables (in the order the jobs' rows came)
    for (int r = 0; r < R; r++) p[r] = (float)g->tokens[r], p[R + r] = (float)g->pos[r], p[2 * R + r] = (float)g->seq[r];
    for (int l = 0; l < L; l++) p[3 * R + l] = (float)g->logit_rows[l];
    float *tables = p + 3 * R + L;
    int mb = g->m->cache.max_blocks, k = 0;
    for (int i = 0; i < n; i++) {
        Seq *sq = &q->seq[order[i]];
        if (!sq->rows) continue;
        for (int c = 0; c < mb; c++) tables[(size_t)k * mb + c] = c < sq->n_blocks ? (float)sq->blocks[c] : 0.0f;
        k++;
    }
    *n_seqs = S, *n_logits = L;
    return R;
}

// the blocks sq filled are cached from now on, known by their prefix; with a draft model, those
// the draft has filled too (it lags the model by a position or two): a job that begins with a
// cached block finds the draft's keys and values there as well, not what the block held before,
// so the draft proposes the same tokens to it whichever job computed the block
static void key_full_blocks(RunningBatch *q, Seq *sq, const Job *j) {
    int bs = q->block_size, tokens[bs];
    int filled = q->draft && sq->draft_cached < sq->n_cached ? sq->draft_cached : sq->n_cached;
    for (; sq->n_keyed < filled / bs; sq->n_keyed++) {
        int i = sq->n_keyed;
        uint64_t parent = i ? sq->keys[i - 1] : 0;
        block_tokens(j, i, bs, tokens);
        sq->keys[i] = prefix_key(parent, tokens, bs);
        prefix_register(&q->pool, sq->blocks[i], sq->keys[i], parent, tokens);
    }
}

// one step over the running jobs: their rows through the model, a token for each job whose
// last position was among them
static void step(Server *s, Engine *g, RunningBatch *q, Sampler *sampler) {
    int S, L, R = plan_rows(s, g, q, &S, &L), N = q->n_copies;
    if (R == 0) return;
    float *copies = g->plan + PLAN_HEAD + 3 * R + L + (size_t)S * g->m->cache.max_blocks;
    for (int i = 0; i < 2 * N; i++) copies[i] = (float)q->copies[i];
    q->n_copies = 0;
    send_plan(g, PLAN_STEP, R, S, L, N);
    size_t Vp = (size_t)g->m->cfg.padded_vocab_size;
    pthread_mutex_lock(&s->lock);
    for (int b = 0; b < s->n_slots; b++) {
        Job *j = s->slots[b];
        Seq *sq = &q->seq[b];
        if (!j || !sq->rows) continue;
        int len = job_length(j);
        sq->n_cached += sq->rows - sq->n_spec;
        if (sq->logit >= 0 && j->n_out == 0) s->metrics.prompt_tokens += j->n_ids;
        if (sq->n_spec) {  // the proposals the model agrees with are in its cache now
            int accepted = accept_proposals(s, q, sampler, b, g->logits + sq->logit * Vp, Vp);
            sq->n_cached += accepted;
            sq->draft_cached = sq->n_cached < len + sq->n_spec - 1 ? sq->n_cached : len + sq->n_spec - 1;
        } else if (sq->logit >= 0) {
            pthread_mutex_unlock(&s->lock);  // sampling reads only the scheduler's own fields
            float *row = g->logits + sq->logit * Vp;
            if (request_changes_logits(j)) request_adjust_logits(j, row, q->counts);
            int token = sample(sampler, row, j);
            if (j->logprobs >= 0) {  // tokens below n_out are the connection's to read: n_out's is not yet
                sampler_logprobs(sampler, row, q->logprobs);
                request_record_logprobs(j, q->logprobs, sampler->V, token);
            }
            pthread_mutex_lock(&s->lock);
            accept_token(s, j, token);
        }
        if (q->pool.caching) key_full_blocks(q, sq, j);
        if (j->finish != FINISH_NONE) free_slot(s, q, b);
    }
    pthread_cond_broadcast(&s->progress);
    pthread_mutex_unlock(&s->lock);
}

// ---- a token for a job -------------------------------------------------------------------------

static void use_job_settings(Sampler *sampler, const Job *j) {
    sampler->temperature = j->temperature;
    sampler->top_k = j->top_k;
    sampler->top_p = j->top_p;
    sampler->min_p = j->min_p;
    sampler->seed = j->seed;
}

static int sample(Sampler *sampler, const float *logits, const Job *j) {
    use_job_settings(sampler, j);
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
    if (token == tokenizer_eot(s->tok) && !j->ignore_eos) {
        j->finish = FINISH_STOP;
        j->visible = j->text.len;  // what was held back for a stop string is the answer's end
        return;
    }
    j->out_ids[j->n_out] = token;  // a preempted job's text is fed again from these
    int len;
    const char *bytes = tokenizer_token_bytes(s->tok, token, &len);
    size_t before = j->text.len;
    buf_append(&j->text, bytes, (size_t)len);
    j->ends[j->n_out++] = j->visible = j->text.len;
    for (int i = 0; i < j->n_stop_ids; i++)  // a stop token ends the answer after it
        if (token == j->stop_ids[i]) j->finish = FINISH_STOP;
    for (int i = 0; i < j->n_stops; i++) {  // a stop string ends the answer before it
        size_t n = strlen(j->stops[i]), from = before + 1 > n ? before + 1 - n : 0;
        char *hit = strstr(j->text.p + from, j->stops[i]);
        if (hit && (size_t)(hit - j->text.p) < j->visible) j->visible = (size_t)(hit - j->text.p), j->finish = FINISH_STOP;
    }
    if (j->finish == FINISH_NONE && j->n_out >= j->max_tokens) j->finish = FINISH_LENGTH;
    if (j->finish == FINISH_NONE) j->visible -= stop_prefix_at_end(j);
}

// ---- speculative decoding (rank 0) ------------------------------------------------------------------
// A small draft model (draft_model: the same tokenizer, fewer layers) proposes
// num_speculative_tokens tokens one at a time, and the model checks them all in one pass: rows
// [last token, proposal 1, ..., proposal k] give its own distribution after each. A proposal the
// model would have chosen is accepted (greedy); sampling, proposal d drawn from the draft's q is
// accepted with probability min(1, p(d) / q(d)), else the token is drawn from max(0, p - q)
// renormalised: either way the token has the model's distribution p (Leviathan et al., 2023).
// After the first refusal the model's token stands and the rest are dropped; when all are
// accepted the last row's distribution gives one token more. The draft's cache uses the model's
// block tables (its own pool of as many blocks), and it runs every row the model runs.

static void speculation_init(Server *s, RunningBatch *q, KVModel *m, const Sampler *sampler) {
    q->draft = m->draft;
    if (!q->draft) return;
    q->k = s->cfg->num_speculative_tokens;
    q->maxT = m->maxT;
    size_t rows = (size_t)q->draft->B * q->draft->T, Vp = (size_t)q->draft->cfg.padded_vocab_size;
    for (int b = 0; b < s->n_slots; b++) q->seq[b].proposals = malloc_or_die((size_t)q->k * sizeof(int));
    q->q_probs = malloc_or_die((size_t)s->n_slots * q->k * sampler->V * sizeof(float));
    q->p_probs = malloc_or_die((size_t)sampler->V * sizeof(float));
    q->draft_logits = malloc_or_die((size_t)s->n_slots * Vp * sizeof(float));
    q->tokens = malloc_or_die(rows * sizeof(int));
    q->pos = malloc_or_die(rows * sizeof(int));
    q->logit_rows = malloc_or_die((size_t)s->n_slots * sizeof(int));
    q->logit_seq = malloc_or_die((size_t)s->n_slots * sizeof(int));
}

static void speculation_free(RunningBatch *q) {
    if (!q->draft) return;
    for (int b = 0; b < q->draft->B; b++) free(q->seq[b].proposals);
    free(q->q_probs);
    free(q->p_probs);
    free(q->draft_logits);
    free(q->tokens);
    free(q->pos);
    free(q->logit_rows);
    free(q->logit_seq);
}

// the proposals a decoding job takes this step: num_speculative_tokens, as far as the context
// and its max_tokens leave room. None for its first token: that one is the sampler's, whether
// its prompt's last position is computed alone (the rest was cached) or with the others, so that
// the tokens drawn on the speculative path are the same ones, and a seed's answer with them, in
// any batch and with any cache hit. None for a request that changes its logits or asks for their
// log-probabilities: the proposals are drawn and checked without either.
static int spec_tokens(const RunningBatch *q, const Job *j) {
    if (!q->draft || j->n_out == 0 || request_changes_logits(j) || j->logprobs >= 0) return 0;
    int k = q->k, room = q->maxT - job_length(j), left = j->max_tokens - j->n_out - 1;
    k = k < room ? k : room;
    k = k < left ? k : left;
    return k > 0 ? k : 0;
}

// one of the draft's passes over q->tokens/pos (R rows, each row r of job q->rows_seq... the
// table of the job it belongs to) and its proposal number i for each job with a logit row
static void draft_pass(Server *s, RunningBatch *q, int R, int L, int i) {
    KVModel *d = q->draft;
    size_t Vp = (size_t)d->cfg.padded_vocab_size;
    kv_forward_rows(d, q->tokens, q->pos, R, q->logit_rows, L);
    copy_to_host(q->draft_logits, d->logits, (size_t)L * Vp * sizeof(float));
    for (int l = 0; l < L; l++) {
        int b = q->logit_seq[l];
        Seq *sq = &q->seq[b];
        const Job *j = s->slots[b];
        const float *row = q->draft_logits + l * Vp;
        if (j->temperature <= 0) {
            sq->proposals[i] = sample(q->sampler, row, j);
            continue;
        }
        float *qp = q->q_probs + ((size_t)b * q->k + i) * q->sampler->V;
        use_job_settings(q->sampler, j);
        sampler_probs(q->sampler, row, qp);
        sq->proposals[i] = sampler_draw(q->sampler, qp, j->key, j->n_out + i, 1);
    }
}

// the row r of a draft pass: job b's token at position at
static void draft_row(RunningBatch *q, int r, int b, int token, int at) {
    Seq *sq = &q->seq[b];
    q->tokens[r] = token, q->pos[r] = at;
    memcpy(kv_cache_table(&q->draft->cache, r), sq->blocks, (size_t)sq->n_blocks * sizeof(int));
}

// The draft's proposals for this step's decoding jobs. Its first pass runs the rows the model
// runs this step that the draft has not (a prompt's chunk, a decoding job's last token or two),
// its logits at each decoding job's last position; each later pass one row a job: its last
// proposal. Only the scheduler's fields are read: no lock.
static void propose(Server *s, RunningBatch *q) {
    int R = 0, L = 0;
    for (int b = 0; b < s->n_slots; b++) {
        Seq *sq = &q->seq[b];
        const Job *j = s->slots[b];
        if (!j || !sq->rows) continue;
        int end = sq->n_cached + sq->rows - sq->n_spec;
        for (; sq->draft_cached < end; sq->draft_cached++)
            draft_row(q, R++, b, job_token(j, sq->draft_cached), sq->draft_cached);
        if (sq->n_spec) q->logit_rows[L] = R - 1, q->logit_seq[L++] = b;
    }
    if (!R) return;
    draft_pass(s, q, R, L, 0);
    for (int i = 1; i < q->k; i++) {
        R = 0, L = 0;
        for (int b = 0; b < s->n_slots; b++) {
            Seq *sq = &q->seq[b];
            if (!s->slots[b] || sq->n_spec <= i) continue;
            draft_row(q, R, b, sq->proposals[i - 1], job_length(s->slots[b]) - 1 + i);
            q->logit_rows[L] = R++, q->logit_seq[L++] = b;
        }
        if (!R) break;
        draft_pass(s, q, R, L, i);
    }
}

// The model's verdict on job b's proposals (its logits after the last token and after each
// proposal, n_spec + 1 rows); returns how many it accepted. The lock held.
static int accept_proposals(Server *s, RunningBatch *q, Sampler *sampler, int b, const float *logits, size_t Vp) {
    Job *j = s->slots[b];
    Seq *sq = &q->seq[b];
    int accepted = 0;
    for (int i = 0; i <= sq->n_spec && j->finish == FINISH_NONE; i++) {
        const float *row = logits + i * Vp;
        bool proposal = i < sq->n_spec;
        int token, d = proposal ? sq->proposals[i] : -1;
        pthread_mutex_unlock(&s->lock);  // sampling reads only the scheduler's own fields
        if (!proposal || j->temperature <= 0) token = sample(sampler, row, j);
        else {
            const float *qp = q->q_probs + ((size_t)b * q->k + i) * sampler->V;
            float *p = q->p_probs, rest = 0.0f;
            use_job_settings(sampler, j);
            sampler_probs(sampler, row, p);
            if (sampler_uniform(sampler, j->key, j->n_out, 2) * qp[d] < p[d]) token = d;
            else {  // refused: the rest of p that q does not cover
                for (int v = 0; v < sampler->V; v++) rest += p[v] = p[v] > qp[v] ? p[v] - qp[v] : 0.0f;
                for (int v = 0; v < sampler->V; v++) p[v] /= rest;
                token = rest > 0.0f ? sampler_draw(sampler, p, j->key, j->n_out, 3) : d;
            }
        }
        pthread_mutex_lock(&s->lock);
        accept_token(s, j, token);
        if (!proposal) break;
        s->metrics.spec_proposed++;
        if (token != d) break;
        s->metrics.spec_accepted++;
        accepted++;
    }
    return accepted;
}

// ---- metrics ------------------------------------------------------------------------------------

void scheduler_metrics_text(const Server *s, Buf *out) {
    const ServerMetrics *m = &s->metrics;
    char text[4096];
    int n = snprintf(text, sizeof text,
                     "# HELP workbook_kv_cache_blocks blocks of the paged KV cache's pool\n"
                     "# TYPE workbook_kv_cache_blocks gauge\nworkbook_kv_cache_blocks %d\n"
                     "# HELP workbook_kv_cache_bytes device bytes of the pool on each rank\n"
                     "# TYPE workbook_kv_cache_bytes gauge\nworkbook_kv_cache_bytes %zu\n"
                     "# HELP workbook_kv_cache_free_memory_bytes the device's free memory (the least of the "
                     "ranks') that kv_cache_memory_fraction sized the pool from; 0: sized otherwise\n"
                     "# TYPE workbook_kv_cache_free_memory_bytes gauge\nworkbook_kv_cache_free_memory_bytes %zu\n"
                     "# HELP workbook_kv_cache_blocks_used blocks held by running requests\n"
                     "# TYPE workbook_kv_cache_blocks_used gauge\nworkbook_kv_cache_blocks_used %d\n"
                     "# HELP workbook_preemptions_total running requests whose blocks were freed, to be "
                     "recomputed later\n"
                     "# TYPE workbook_preemptions_total counter\nworkbook_preemptions_total %ld\n"
                     "# HELP workbook_prefix_cache_hits_total requests that began with cached blocks\n"
                     "# TYPE workbook_prefix_cache_hits_total counter\nworkbook_prefix_cache_hits_total %ld\n"
                     "# HELP workbook_prefix_cache_tokens_saved_total prompt positions not computed: their "
                     "keys and values were cached\n"
                     "# TYPE workbook_prefix_cache_tokens_saved_total counter\n"
                     "workbook_prefix_cache_tokens_saved_total %ld\n"
                     "# HELP workbook_kv_cache_block_copies_total shared blocks copied before a write "
                     "(copy-on-write)\n"
                     "# TYPE workbook_kv_cache_block_copies_total counter\nworkbook_kv_cache_block_copies_total %ld\n"
                     "# HELP workbook_spec_proposed_tokens_total the draft model's proposals the model checked\n"
                     "# TYPE workbook_spec_proposed_tokens_total counter\nworkbook_spec_proposed_tokens_total %ld\n"
                     "# HELP workbook_spec_accepted_tokens_total ... and accepted\n"
                     "# TYPE workbook_spec_accepted_tokens_total counter\nworkbook_spec_accepted_tokens_total %ld\n"
                     "# HELP workbook_spec_acceptance_rate accepted / proposed\n"
                     "# TYPE workbook_spec_acceptance_rate gauge\nworkbook_spec_acceptance_rate %.4f\n",
                     m->cache_blocks, m->cache_bytes, m->cache_free_bytes, m->cache_blocks_used, m->preemptions, m->prefix_hits, m->prefix_tokens_saved,
                     m->block_copies, m->spec_proposed, m->spec_accepted,
                     m->spec_proposed ? (double)m->spec_accepted / (double)m->spec_proposed : 0.0);
    buf_append(out, text, (size_t)n);
}

// ---- the steps every rank runs -------------------------------------------------------------------

static void engine_init(Engine *g, KVModel *m, Comm *world, bool use_graph) {
    *g = (Engine){.m = m, .world = world, .use_graph = use_graph, .max_rows = m->B * m->T};
    g->len = PLAN_HEAD + 4 * (size_t)g->max_rows + 2 * (size_t)m->B + (size_t)m->B * m->cache.max_blocks;
    g->plan = calloc_or_die(g->len, sizeof(float));
    g->plan_dev = dev_malloc(g->len * sizeof(float));  // NCCL broadcasts device memory
    g->tokens = calloc_or_die((size_t)g->max_rows, sizeof(int));
    g->pos = calloc_or_die((size_t)g->max_rows, sizeof(int));
    g->seq = calloc_or_die((size_t)g->max_rows, sizeof(int));
    g->logit_rows = calloc_or_die((size_t)g->max_rows, sizeof(int));
    g->logits_cap = m->B;
    g->logits = calloc_or_die((size_t)m->B * m->cfg.padded_vocab_size, sizeof(float));
}

static void engine_free(Engine *g) {
    free(g->plan);
    dev_free(g->plan_dev);
    free(g->tokens);
    free(g->pos);
    free(g->seq);
    free(g->logit_rows);
    free(g->logits);
}

static void broadcast_plan(Engine *g) {
    if (comm_size(g->world) == 1) return;
    copy_to_device(g->plan_dev, g->plan, g->len * sizeof(float));
    comm_broadcast(g->world, g->plan_dev, g->len, 0);
    copy_to_host(g->plan, g->plan_dev, g->len * sizeof(float));
}

// Runs the plan in g->plan (on every rank); returns its kind. A step of decoding rows alone (one
// row and one logit row per job) is kv_decode's, which a CUDA graph can replay.
static int run_plan(Engine *g) {
    int kind = (int)g->plan[0], R = (int)g->plan[1], S = (int)g->plan[2], L = (int)g->plan[3];
    int N = (int)g->plan[4];
    if (kind != PLAN_STEP) return kind;
    const float *p = g->plan + PLAN_HEAD, *tables = p + 3 * R + L, *copies = tables + (size_t)S * g->m->cache.max_blocks;
    KVCache *c = &g->m->cache;
    for (int i = 0; i < N; i++) kv_cache_copy_block(c, (int)copies[2 * i + 1], (int)copies[2 * i]);
    for (int r = 0; r < R; r++) {
        g->tokens[r] = (int)p[r], g->pos[r] = (int)p[R + r];
        int *row = kv_cache_table(c, r);
        const float *t = tables + (size_t)(int)p[2 * R + r] * c->max_blocks;
        for (int i = 0; i < c->max_blocks; i++) row[i] = (int)t[i];
    }
    for (int l = 0; l < L; l++) g->logit_rows[l] = (int)p[3 * R + l];
    if (L > g->logits_cap) {  // speculative decoding: a logit row per proposal
        free(g->logits);
        g->logits_cap = L;
        g->logits = malloc_or_die((size_t)L * g->m->cfg.padded_vocab_size * sizeof(float));
    }
    if (R == S && L == R) kv_decode(g->m, g->tokens, g->pos, R, g->use_graph);
    else kv_forward_rows(g->m, g->tokens, g->pos, R, g->logit_rows, L);
    copy_to_host(g->logits, g->m->logits, (size_t)L * g->m->cfg.padded_vocab_size * sizeof(float));
    return kind;
}

// rank 0: the plan (its rows already in g->plan[PLAN_HEAD...]) to every rank, then its own run of it
static void send_plan(Engine *g, int kind, int R, int S, int L, int N) {
    g->plan[0] = (float)kind;
    g->plan[1] = (float)R;
    g->plan[2] = (float)S;
    g->plan[3] = (float)L;
    g->plan[4] = (float)N;
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
