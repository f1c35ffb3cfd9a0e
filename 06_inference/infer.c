// Stage 06: generate text with a trained GPT-2 — KV cache, batching, sampling, CUDA graphs.
//
//   read the config -> load a checkpoint (any stage's, or Hugging Face's GPT-2) -> read prompts ->
//   for each batch of prompts {Alpaca template -> prefill (the prompts' rows, one pass) -> decode
//   (one token per sequence per step, against the KV cache) -> stream the text} -> timings.
// With eval_accuracy: true the prompts are the held-out records of the instruction set and the
// answers are checked against theirs.
//
// The model with the cache is kv_model.c (on a tensor-parallel grid [x, y, 1]: kv_grid.c, with
// stage 05's layers); the sampler is sampler.c. Run (see README.md):
//   build/stage-6 --config configs/inference.json --init_from=out/demo-stage-1
//   mpirun -np 4 build/stage-6 --config configs/inference.json --tp_dimensions=2,2,1
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "comm/comm.h"
#include "config/config.h"
#include "data/alpaca.h"
#include "data/tokenizer.h"
#include "kv_grid.h"
#include "kv_model.h"
#include "moe.h"  // stage 08's mixture-of-experts MLP, for its checkpoints
#include "ops/ops.h"
#include "run/run_checkpoint.h"
#include "run/run_setup.h"
#include "run/run_stats.h"
#include "sampler.h"
#include "serving/server.h"

// ---- prompts ----------------------------------------------------------------------------------

// One prompt per line (the tutorial's data/inference/prompts.txt). A tab splits a line into the
// two fields of an Alpaca record, instruction and input ("Sort the digits.<TAB>52913"). Empty
// lines separate prompts and are skipped; a line of only spaces is an empty prompt, which is an
// error, as are an input with no instruction, invalid UTF-8, a NUL byte and a file with no prompt
// at all. "-" reads standard input.
static char *read_all_stdin(size_t *len) {
    size_t cap = 4096, n = 0, got;
    char *buf = malloc_or_die(cap);
    while ((got = fread(buf + n, 1, cap - n - 1, stdin)) > 0) {
        n += got;
        if (cap - n - 1 == 0) {
            cap *= 2;
            char *grown = realloc(buf, cap);
            if (!grown) fatal("out of memory reading the prompts from standard input");
            buf = grown;
        }
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

static bool is_blank(const char *s) {
    for (; *s; s++)
        if (*s != ' ' && *s != '\t') return false;
    return true;
}

static char **read_prompts(const char *path, int *n_prompts) {
    size_t len;
    bool from_stdin = strcmp(path, "-") == 0;
    const char *name = from_stdin ? "standard input" : path;
    char *text = from_stdin ? read_all_stdin(&len) : read_file_or_die(path, &len);
    size_t bad;
    if (strlen(text) != len) fatal("%s: not a text file (a NUL byte at offset %zu)", name, strlen(text));
    if (!utf8_is_valid(text, len, &bad)) fatal("%s: not valid UTF-8 (byte %zu)", name, bad);
    char **prompts = NULL;
    int n = 0, line = 0;
    for (char *p = text, *next; p && *p; p = next) {
        line++;
        next = strchr(p, '\n');
        if (next) *next++ = '\0';
        size_t l = strlen(p);
        if (l && p[l - 1] == '\r') p[--l] = '\0';  // a file written on Windows
        if (l == 0) continue;
        if (is_blank(p)) fatal("%s: line %d is an empty prompt (only spaces)", name, line);
        if (p[strspn(p, " ")] == '\t')
            fatal("%s: line %d has an input but no instruction before the tab", name, line);
        prompts = realloc(prompts, (size_t)(n + 1) * sizeof *prompts);
        if (!prompts) fatal("out of memory reading %s", name);
        prompts[n] = malloc_or_die(l + 1);
        memcpy(prompts[n++], p, l + 1);
    }
    free(text);
    if (n == 0) fatal("%s: no prompts (expected one prompt per line)", name);
    *n_prompts = n;
    return prompts;
}

// ---- one generation request and a batch of them ------------------------------------------------

enum { STOP_NONE, STOP_EOT, STOP_LIMIT, STOP_CONTEXT };
static const char *STOP_NAMES[] = {"", "end-of-text", "token limit", "context full"};

typedef struct {
    long index;              // the prompt's number: names it and keys its random numbers
    const char *shown;       // what to print as the question
    int *ids, n_ids;         // the prompt in the Alpaca template, as tokens
    int *out, n_out;         // the generated tokens (end-of-text not included)
    int limit;               // the most it may generate
    int stop;                // why it stopped (STOP_*)
    double t_first, t_last;  // seconds from the start of its batch to its first and last token
} Request;

typedef struct {
    const Config *cfg;
    KVModel *m;
    NoCacheModel *nocache;   // kv_cache: false
    const Tokenizer *tok;
    Sampler sampler;
    float *logits;           // (B, Vp) host
    bool stream;             // print text as it comes
    bool use_graph;          // compile: true on the CUDA backend
    // totals over every batch
    long prefill_tokens, decode_tokens;
    long decode_steps, cache_rows_read;  // the steps with a KV cache, and the rows they attended over
    double prefill_seconds, decode_seconds;
} Generator;

// Streams a batch's text in prompt order: the first unfinished prompt prints each token as it
// arrives; what later prompts generate meanwhile is printed when their turn comes.
typedef struct {
    int current, printed;
} Printer;

static void print_header(const Request *r) {
    printf("\n\033[1mUser:\033[0m %s\n\033[1mAI Assistant:\033[0m ", r->shown);
}

static void print_ids(const char *what, const int *ids, int n) {
    printf("  %s:", what);
    for (int i = 0; i < n; i++) printf(" %d", ids[i]);
    printf("\n");
}

static void printer_update(Printer *p, const Generator *g, const Request *r, int B) {
    if (!g->stream) return;
    while (p->current < B) {
        const Request *q = &r[p->current];
        for (; p->printed < q->n_out; p->printed++) {
            int len;
            const char *bytes = tokenizer_token_bytes(g->tok, q->out[p->printed], &len);
            fwrite(bytes, 1, (size_t)len, stdout);
        }
        if (q->stop == STOP_NONE) break;
        printf("\n  [%d tokens, %s]\n", q->n_out, STOP_NAMES[q->stop]);
        if (g->cfg->show_token_ids) {
            print_ids("prompt ids", q->ids, q->n_ids);
            print_ids("answer ids", q->out, q->n_out);
        }
        p->current++;
        p->printed = 0;
        if (p->current < B) print_header(&r[p->current]);
    }
    fflush(stdout);
}

// Takes the sampled token of request r (called only while r is unfinished); returns whether r
// goes on. Its first token, end-of-text included, ends its time to first token.
static bool accept_token(Generator *g, Request *r, int token, double now) {
    if (r->n_out == 0) r->t_first = now;
    if (token == tokenizer_eot(g->tok)) {
        r->stop = STOP_EOT;
        return false;
    }
    r->out[r->n_out++] = token;
    r->t_last = now;
    if (r->n_out >= r->limit) r->stop = STOP_LIMIT;
    // the next step would feed this token at position n_ids + n_out - 1, past the last one
    else if (r->n_ids + r->n_out > g->m->maxT) r->stop = STOP_CONTEXT;
    return r->stop == STOP_NONE;
}

// Runs the model on every sequence's text so far without the cache (the reference path).
static void nocache_step(Generator *g, Request *r, int B, int *seq, int *len) {
    int T = 0, maxT = g->m->maxT;
    for (int b = 0; b < B; b++) {
        len[b] = r[b].n_ids + r[b].n_out;
        if (len[b] > maxT) len[b] = maxT;  // a finished row: its logits are not used
        memcpy(seq + (size_t)b * maxT, r[b].ids, (size_t)r[b].n_ids * sizeof(int));
        memcpy(seq + (size_t)b * maxT + r[b].n_ids, r[b].out, (size_t)(len[b] - r[b].n_ids) * sizeof(int));
        if (len[b] > T) T = len[b];
    }
    // gpt_forward wants a (B, T) block, right-padded with token 0 (causal attention: the pads
    // change nothing before them). T is rounded up to a multiple of 64 so that the CPU backend
    // sees a few matmul shapes, not one per step.
    T = (T + 63) / 64 * 64 < maxT ? (T + 63) / 64 * 64 : maxT;
    int *block = calloc_or_die((size_t)B * T, sizeof(int));
    for (int b = 0; b < B; b++) memcpy(block + (size_t)b * T, seq + (size_t)b * maxT, (size_t)len[b] * sizeof(int));
    nocache_forward(g->nocache, g->m, block, len, B, T, g->logits);
    free(block);
}

// Samples one token for every active request from g->logits; returns how many remain active.
static int sample_all(Generator *g, Request *r, int B, int step, double t0) {
    size_t Vp = (size_t)g->m->cfg.padded_vocab_size;
    double now = wall_seconds() - t0;
    int active = 0;
    for (int b = 0; b < B; b++) {
        if (r[b].stop != STOP_NONE) continue;
        int token = sampler_next(&g->sampler, g->logits + b * Vp, r[b].index, step);
        active += accept_token(g, &r[b], token, now);
    }
    return active;
}

// Prefill: the prompts, right-padded to the longest, through the model in one pass.
static void prefill(Generator *g, Request *r, int B) {
    int T = 0;
    for (int b = 0; b < B; b++) T = r[b].n_ids > T ? r[b].n_ids : T;
    if (!g->cfg->kv_cache) {
        int *seq = malloc_or_die((size_t)B * g->m->maxT * sizeof(int)), *len = malloc_or_die((size_t)B * sizeof(int));
        nocache_step(g, r, B, seq, len);
        free(seq);
        free(len);
        return;
    }
    int *tokens = calloc_or_die((size_t)B * T, sizeof(int)), *start = calloc_or_die((size_t)B, sizeof(int));
    int *last = malloc_or_die((size_t)B * sizeof(int));
    for (int b = 0; b < B; b++) {
        memcpy(tokens + (size_t)b * T, r[b].ids, (size_t)r[b].n_ids * sizeof(int));
        last[b] = r[b].n_ids - 1;
    }
    // the pads write cache rows past a prompt's end; its first decode step overwrites the first
    // of them before any query can see it, and so on: a query never reads past its own position
    kv_forward(g->m, tokens, start, B, T, last);
    copy_to_host(g->logits, g->m->logits, (size_t)B * g->m->cfg.padded_vocab_size * sizeof(float));
    free(tokens);
    free(start);
    free(last);
}

// One decode step: every sequence's newest token at its own position.
static void decode_step(Generator *g, Request *r, int B, int *tokens, int *start, int *seq, int *len) {
    if (!g->cfg->kv_cache) {
        nocache_step(g, r, B, seq, len);
        return;
    }
    for (int b = 0; b < B; b++) {
        bool done = r[b].stop != STOP_NONE;
        // a finished sequence still takes part (the batch keeps its shape, which a CUDA graph
        // needs): it rewrites its own cache row 0 and its logits are ignored
        tokens[b] = done ? 0 : r[b].out[r[b].n_out - 1];
        start[b] = done ? 0 : r[b].n_ids + r[b].n_out - 1;
    }
    kv_decode(g->m, tokens, start, B, g->use_graph);
    g->decode_steps++;
    for (int b = 0; b < B; b++) g->cache_rows_read += start[b] + 1;
    copy_to_host(g->logits, g->m->logits, (size_t)B * g->m->cfg.padded_vocab_size * sizeof(float));
}

static void generate_batch(Generator *g, Request *r, int B) {
    Printer printer = {0, 0};
    if (g->stream) print_header(&r[0]);
    double t0 = wall_seconds();
    prefill(g, r, B);
    int active = sample_all(g, r, B, 0, t0);
    double t_prefill = wall_seconds() - t0;
    for (int b = 0; b < B; b++) g->prefill_tokens += r[b].n_ids;
    g->prefill_seconds += t_prefill;
    printer_update(&printer, g, r, B);

    int *tokens = malloc_or_die((size_t)B * sizeof(int)), *start = malloc_or_die((size_t)B * sizeof(int));
    int *seq = malloc_or_die((size_t)B * g->m->maxT * sizeof(int)), *len = malloc_or_die((size_t)B * sizeof(int));
    for (int step = 1; active > 0; step++) {
        decode_step(g, r, B, tokens, start, seq, len);
        g->decode_tokens += active;
        active = sample_all(g, r, B, step, t0);
        printer_update(&printer, g, r, B);
    }
    g->decode_seconds += wall_seconds() - t0 - t_prefill;
    free(tokens);
    free(start);
    free(seq);
    free(len);
}

static void generate_all(Generator *g, Request *r, int n) {
    for (int first = 0; first < n; first += g->cfg->max_batch_size) {
        int B = n - first < g->cfg->max_batch_size ? n - first : g->cfg->max_batch_size;
        generate_batch(g, r + first, B);
    }
}

// ---- requests from prompts -------------------------------------------------------------------

static void make_request(Request *r, long index, const char *shown, const char *templated,
                         const Tokenizer *tok, int maxT, int limit, const char *source) {
    memset(r, 0, sizeof *r);
    r->index = index;
    r->shown = shown;
    r->n_ids = tokenizer_encode(tok, templated, strlen(templated), &r->ids);
    if (r->n_ids >= maxT)
        fatal("%s: prompt %ld is %d tokens long in the Alpaca template, but the context is %d "
              "tokens (max_seq_len) and the answer needs at least one: shorten the prompt",
              source, index + 1, r->n_ids, maxT);
    r->limit = limit;
    r->out = malloc_or_die((size_t)limit * sizeof(int));
}

static void free_requests(Request *r, int n) {
    for (int i = 0; i < n; i++) {
        free(r[i].ids);
        free(r[i].out);
    }
    free(r);
}

// ---- timings --------------------------------------------------------------------------------

// A batch-1 decode step reads every weight once (the bf16 copy's, with bf16-mixed) and the cached
// keys and values of every position it attends over: those bytes at the process's read rate bound
// its tokens/s. One process, batch 1, with a cache: where each step is one sequence's token.
static bool prints_decode_bound(const Generator *g) {
    return g->cfg->max_batch_size == 1 && g->cfg->kv_cache && !g->m->grid;
}

// How fast this process reads the weights decode reads (the bf16 copy's with bf16-mixed, summed
// as floats: only the time counts), best of 3. Measured here, over those very buffers, not by a
// separate tool, and both before and after the decode: on the 2-core VM this was written on, the
// rate was ~34 GB/s in one process and ~58 in the next, and within one process it moved from one
// to the other between the two measurements (GPT-2 124M: 35.1 before, 56.8 after).
static double weights_read_rate(const KVModel *m) {
    const float *x = m->params16 ? (const float *)m->params16 : m->params;
    size_t n = m->params16 ? m->num_params / 2 : m->num_params;
    return read_rate(x, n, 3);
}

// The bound takes the faster rate (the tighter bound); when the two differ by more than a fifth,
// a second line says that the rate moved during the run, so the share is not the decode's alone.
static void print_decode_bound(const Generator *g, double rate_before) {
    const KVModel *m = g->m;
    if (!prints_decode_bound(g) || g->decode_steps == 0) return;
    double weights = (double)m->num_params * (m->params16 ? sizeof(half16) : sizeof(float));
    double cache = 2.0 * m->cfg.n_layer * m->cache.width * sizeof(float) * g->cache_rows_read / g->decode_steps;
    double rate_after = weights_read_rate(m), rate = fmax(rate_before, rate_after), slower = fmin(rate_before, rate_after);
    double bound = rate / (weights + cache);
    double tps = g->decode_tokens / g->decode_seconds;
    printf("decode bound at batch 1: %.1f MB of weights and %.1f MB of cache a step at %.1f GB/s (this "
           "process reading those weights, best of 3: %.1f before the decode, %.1f after) = %.1f "
           "tokens/s; decode ran at %.0f%% of it\n", weights / 1e6, cache / 1e6, rate / 1e9,
           rate_before / 1e9, rate_after / 1e9, bound, 100 * tps / bound);
    if (rate > 1.2 * slower)
        printf("(the read rate moved by %.0f%% during the run: the share above is against the faster rate)\n",
               100 * (rate / slower - 1));
}

static void print_timings(const Generator *g, const Request *r, int n, double rate_before) {
    printf("\n%-6s | %9s | %9s | %8s | %12s | %12s\n", "prompt", "in tokens", "out tokens",
           "TTFT ms", "ms per token", "decode tok/s");
    printf("-------|-----------|-----------|----------|--------------|-------------\n");
    for (int i = 0; i < n; i++) {
        double tpot = r[i].n_out > 1 ? (r[i].t_last - r[i].t_first) / (r[i].n_out - 1) : 0;
        printf("%-6ld | %9d | %9d | %8.1f | %12.2f | %12.1f\n", r[i].index + 1, r[i].n_ids,
               r[i].n_out, 1e3 * r[i].t_first, 1e3 * tpot, tpot > 0 ? 1 / tpot : 0.0);
    }
    printf("(TTFT and times count from the start of each prompt's batch of up to %d)\n",
           g->cfg->max_batch_size);
    printf("prefill: %ld tokens in %.1f ms = %.0f tokens/s | decode: %ld tokens in %.1f ms = %.0f "
           "tokens/s\n", g->prefill_tokens, 1e3 * g->prefill_seconds,
           g->prefill_seconds > 0 ? g->prefill_tokens / g->prefill_seconds : 0.0, g->decode_tokens,
           1e3 * g->decode_seconds, g->decode_seconds > 0 ? g->decode_tokens / g->decode_seconds : 0.0);
    if (g->cfg->compile && ops_graphs_supported())
        printf("compile: %ld decode steps replayed a CUDA graph\n", g->m->graph_replays);
    print_decode_bound(g, rate_before);
}

// ---- evaluation: exact answers on the held-out split ------------------------------------------

static void evaluate(Generator *g, const Config *cfg) {
    Dataset *d = load_dataset(cfg, g->tok);
    int n = dataset_size(d, SPLIT_VAL);
    if (n == 0) fatal("eval_accuracy: %s has no held-out records (val_fraction %g)", dataset_path(d), cfg->val_fraction);
    // a right answer ends with end-of-text right after the longest expected answer; generating
    // further could only make an answer longer, so wrong
    int limit = 1;
    for (int i = 0; i < n; i++) {
        int *ids, len = tokenizer_encode(g->tok, dataset_record(d, SPLIT_VAL, i)->output,
                                         strlen(dataset_record(d, SPLIT_VAL, i)->output), &ids);
        free(ids);
        if (len + 1 > limit) limit = len + 1;
    }
    if (cfg->tokens_to_generate < limit) limit = cfg->tokens_to_generate;
    Request *r = malloc_or_die((size_t)n * sizeof *r);
    for (int i = 0; i < n; i++) {
        const AlpacaRecord *rec = dataset_record(d, SPLIT_VAL, i);
        char *prompt = alpaca_format_prompt(rec, cfg->always_input_template);
        make_request(&r[i], i, rec->input, prompt, g->tok, g->m->maxT, limit, dataset_path(d));
        free(prompt);
    }
    g->stream = false;
    double t0 = wall_seconds();
    generate_all(g, r, n);
    double seconds = wall_seconds() - t0;

    // per instruction (task): right / total
    enum { MAX_TASKS = 64 };
    const char *task[MAX_TASKS];
    int right[MAX_TASKS] = {0}, total[MAX_TASKS] = {0}, ntasks = 0, all_right = 0;
    printf("\n%-26s %-12s %-12s %-12s\n", "instruction", "input", "answer", "expected");
    for (int i = 0; i < n; i++) {
        const AlpacaRecord *rec = dataset_record(d, SPLIT_VAL, i);
        char *answer = tokenizer_decode(g->tok, r[i].out, r[i].n_out);
        bool ok = r[i].stop == STOP_EOT && strcmp(answer, rec->output) == 0;
        int k = 0;
        while (k < ntasks && strcmp(task[k], rec->instruction) != 0) k++;
        if (k == ntasks && ntasks < MAX_TASKS) task[ntasks++] = rec->instruction;
        if (k < MAX_TASKS) right[k] += ok, total[k]++;
        all_right += ok;
        if (i < 10) printf("%-26.26s %-12.12s %-12.12s %-12.12s %s\n", rec->instruction, rec->input,
                           answer, rec->output, ok ? "right" : "WRONG");
        free(answer);
    }
    printf("\nper instruction:\n");
    for (int k = 0; k < ntasks; k++)
        printf("  %-26s %4d / %-4d = %5.1f%%\n", task[k], right[k], total[k], 100.0 * right[k] / total[k]);
    printf("exact-answer accuracy on %s's held-out split: %d / %d = %.1f%% (%.1f s, batches of %d)\n",
           dataset_path(d), all_right, n, 100.0 * all_right / n, seconds, cfg->max_batch_size);
    printf("prefill %.0f tokens/s, decode %.0f tokens/s\n", g->prefill_tokens / g->prefill_seconds,
           g->decode_seconds > 0 ? g->decode_tokens / g->decode_seconds : 0.0);
    free_requests(r, n);
    dataset_free(d);
}

// ---- set-up ---------------------------------------------------------------------------------

// Tensor parallelism over [x, y, 1] (config.c refuses z), every rank in the grid: generation
// has no rows to split over data.
static void check_layout(const Config *cfg, Comm *world) {
    const int *tp = cfg->tp_dimensions;
    if (comm_size(world) != tp[0] * tp[1])
        fatal("key 'tp_dimensions' [%d, %d, 1] needs x * y = %d ranks, but %d were started (no data "
              "parallelism in inference: start as many ranks as the grid has)", tp[0], tp[1],
              tp[0] * tp[1], comm_size(world));
}

// The whole model on every rank (as stage 05 loads a checkpoint), of which each keeps its share;
// returns the full buffer, which only the no-cache reference keeps.
static float *load_weights(KVModel *m, const Config *cfg) {
    const ParamLayout *full_layout = &m->full;
    float *full = dev_malloc(full_layout->num_params * sizeof(float));
    if (cfg->random_init) gpt_init_range(full, full_layout, 0, full_layout->num_params, (uint64_t)cfg->seed);
    else load_initial_weights(cfg, full_layout, full);
    kv_model_load(m, full);
    return full;
}

// Speculative decoding's draft model (rank 0 of a server): draft_model, with the tokenizer's
// vocabulary and the context, room for a decoding job's last two tokens besides a step's rows;
// its cache's pool (as many blocks as m's: it uses m's block tables) comes with m's (alloc_pools).
static void load_draft(KVModel *draft, KVModel *m, const Config *cfg, const Tokenizer *tok, int longest) {
    Config dc = *cfg;
    snprintf(dc.init_from, sizeof dc.init_from, "%s", cfg->draft_model);
    dc.random_init = false;
    GPTConfig dmc = model_shape(&dc, tok);
    kv_model_alloc(draft, &dmc, m->B, longest + 1, m->maxT, m->block_size, config_is_half(cfg));
    dev_free(load_weights(draft, &dc));
    m->draft = draft;
}

// kv_cache_memory_fraction's pool: the blocks that share of the device's free memory holds, now
// that everything else is allocated (the weights, the passes' buffers, the draft model's), each
// of per_block bytes (m's and the draft's pools take as many blocks each). Every rank takes the
// least rank's count: the ranks admit requests as one, so they must agree on the pool.
static int pool_blocks_of_free(KVModel *m, const Config *cfg, Comm *world, size_t per_block) {
    size_t free_bytes = dev_free_bytes();
    double blocks = (double)((size_t)(cfg->kv_cache_memory_fraction * (double)free_bytes) / per_block);
    blocks = -comm_max_double(world, -blocks);  // exact: counts and bytes stay below 2^53
    m->pool_free_bytes = (size_t)-comm_max_double(world, -(double)free_bytes);
    int whole = (m->maxT + m->block_size - 1) / m->block_size;
    if (blocks < whole)
        fatal("key 'kv_cache_memory_fraction': expected a share of the free memory (%zu bytes%s) that holds one "
              "whole context (%d blocks of %d positions, %zu bytes each), found %g (%.0f blocks)", m->pool_free_bytes,
              comm_size(world) > 1 ? ", the least of the ranks'" : "", whole, m->block_size, per_block,
              cfg->kv_cache_memory_fraction, blocks);
    return blocks > KV_MAX_BLOCKS ? KV_MAX_BLOCKS : (int)blocks;
}

// The KV cache's pool, allocated last: the server's from kv_cache_bytes per rank or from
// kv_cache_memory_fraction, the draft model's with as many blocks; the prompts mode gives each
// batch row a whole context.
static void alloc_pools(KVModel *m, const Config *cfg, Comm *world) {
    size_t per_block = kv_model_bytes_per_block(m);
    int blocks;
    if (cfg->serve && cfg->kv_cache_memory_fraction > 0)
        blocks = pool_blocks_of_free(m, cfg, world, per_block + (m->draft ? kv_model_bytes_per_block(m->draft) : 0));
    else blocks = kv_pool_blocks(cfg->serve ? (size_t)cfg->kv_cache_bytes : 0, m->B, m->maxT, m->block_size, per_block);
    kv_cache_alloc_pool(&m->cache, blocks);
    if (m->draft) kv_cache_alloc_pool(&m->draft->cache, blocks);
    if (!cfg->serve) kv_cache_slot_tables(&m->cache, cfg->max_batch_size);
}

// the server's pool: its size, and what decided it
static void print_pool(const KVModel *m, const Config *cfg, int ranks) {
    printf("KV cache pool: %d blocks of %d positions, %zu bytes per rank", m->cache.n_blocks, m->block_size,
           kv_cache_bytes(&m->cache));
    if (m->draft) printf(" (the draft model's: %zu more)", kv_cache_bytes(&m->draft->cache));
    if (cfg->kv_cache_memory_fraction > 0)
        printf(", from kv_cache_memory_fraction %g of %zu bytes free%s\n", cfg->kv_cache_memory_fraction,
               m->pool_free_bytes, ranks > 1 ? " (the least of the ranks')" : "");
    else if (cfg->kv_cache_bytes > 0) printf(", from kv_cache_bytes %.0f\n", cfg->kv_cache_bytes);
    else printf(", from max_batch_size: %d whole contexts\n", m->B);
    if (m->draft)
        printf("speculative decoding: %s proposes %d tokens a step (%s L=%d C=%d, %.2fM parameters)\n",
               cfg->draft_model, cfg->num_speculative_tokens, gpt_arch(&m->draft->cfg)->name, m->draft->cfg.n_layer,
               m->draft->cfg.n_embd, m->draft->full.num_params / 1e6);
}

static void print_setup(const Generator *g, const Config *cfg, int n_prompts) {
    const KVModel *m = g->m;
    const GPTConfig *mc = &m->cfg;
    printf("stage 06 | %s backend (%s) | %s L=%d H=%d C=%d V=%d | %.2fM parameters | %s\n",
           ops_backend_name(), config_is_half(cfg) ? ops_matmul_engine_16() : ops_matmul_engine(), gpt_arch(mc)->name, mc->n_layer, mc->n_head, mc->n_embd,
           mc->vocab_size, m->full.num_params / 1e6, cfg->random_init ? "random weights" : cfg->init_from);
    if (m->grid) {
        const TPGrid *grid = &m->grid->tp.grid;
        printf("tensor parallelism [%d, %d, 1]: %d ranks, each with %d of %d heads, %.2fM parameters "
               "and its heads' share of the KV cache\n", grid->X, grid->Y, grid->X * grid->Y,
               m->shape.n_head, mc->n_head, m->num_params / 1e6);
    }
    char what[32];  // in evaluation mode the prompts are the held-out records, counted later
    if (cfg->serve) snprintf(what, sizeof what, "requests");
    else if (cfg->eval_accuracy) snprintf(what, sizeof what, "held-out records");
    else snprintf(what, sizeof what, "%d prompts", n_prompts);
    printf("%s in batches of up to %d | %s | context %d | KV cache %s (%.2f MiB per rank: %d blocks of %d "
           "positions) | precision %s\n", what, cfg->max_batch_size,
           cfg->temperature > 0 ? "sampling" : "greedy", m->maxT,
           cfg->kv_cache ? "on" : "off: every step recomputes the whole text",
           cfg->kv_cache ? kv_cache_bytes(&m->cache) / 1048576.0 : 0.0, m->cache.n_blocks, m->cache.block_size,
           cfg->precision);
    if (cfg->temperature > 0)
        printf("sampling: temperature %g, top_k %d, top_p %g, seed %d\n", cfg->temperature,
               cfg->top_k, cfg->top_p, cfg->seed);
    if (cfg->compile && !ops_graphs_supported())
        printf("compile: true: CUDA graphs are a CUDA feature; on the %s backend nothing changes\n",
               ops_backend_name());
    else if (cfg->compile && !g->use_graph)
        printf("compile: true: with tensor parallelism the decode step runs op by op (its "
               "collectives are not captured in a graph)\n");
    else if (cfg->compile) printf("compile: true: the decode step is captured as a CUDA graph and replayed\n");
    if (cfg->serve) print_pool(m, cfg, m->grid ? m->grid->tp.grid.X * m->grid->tp.grid.Y : 1);
}

int main(int argc, char **argv) {
    Comm *world = comm_init(&argc, &argv);
    int rank = comm_rank(world);
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_INFERENCE);
    comm_configure(world, &cfg);  // every rank the same config; NCCL, or MPI where ranks share a GPU
    ops_set_half_format(config_half_format(&cfg));  // 16-mixed: fp16 weight copies
    check_layout(&cfg, world);
    ops_init();

    Tokenizer *tok = tokenizer_load(cfg.tokenizer_path);
    GPTConfig mc = model_shape(&cfg, tok);  // checks the checkpoint's vocabulary against tok's
    // a mixture of experts (stage 08's) generates without a capacity: with one, whether a token
    // reaches its expert would depend on how many tokens came in the same step (the prompt, or one)
    moe_model(&mc);
    if (mc.moe) mc.moe->capacity_factor = 0;
    tp_check_grid(&mc, cfg.tp_dimensions, comm_size(world), 1, 1);
    int maxT = cfg.max_seq_len;
    // every rank computes the same logits (after the head's all-gather) and so samples the same
    // tokens: rank 0 speaks for all
    if (rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot silence rank %d's output", rank);

    // the prompts (or the held-out records), as token ids in the Alpaca template
    int n_prompts = 0;
    char **prompts = NULL;
    Request *r = NULL;
    if (!cfg.eval_accuracy && !cfg.serve) {
        prompts = read_prompts(cfg.prompts_path, &n_prompts);
        r = malloc_or_die((size_t)n_prompts * sizeof *r);
        for (int i = 0; i < n_prompts; i++) {
            char *instruction = copy_string_or_die(prompts[i]), *tab = strchr(instruction, '\t');
            if (tab) *tab = '\0';
            AlpacaRecord rec = {.instruction = instruction, .input = tab ? tab + 1 : "", .output = ""};
            char *templated = alpaca_format_prompt(&rec, cfg.always_input_template);
            make_request(&r[i], i, prompts[i], templated, tok, maxT, cfg.tokens_to_generate, cfg.prompts_path);
            free(templated);
            free(instruction);
        }
    }
    // the prefill's capacity: the longest prompt (all of the context for the held-out records);
    // the server's steps hold a row per running request and a step's prompt rows (a whole
    // context, or max_prefill_tokens), max_batch_size x longest rows in all
    int longest = cfg.eval_accuracy ? maxT : 1;
    for (int i = 0; i < n_prompts; i++) longest = r[i].n_ids > longest ? r[i].n_ids : longest;
    if (cfg.serve) {
        int prompt_rows = cfg.max_prefill_tokens ? cfg.max_prefill_tokens : maxT;
        longest = (cfg.max_batch_size + prompt_rows + cfg.max_batch_size - 1) / cfg.max_batch_size;
    }

    KVModel m, draft;  // one device: the cache around the serial layers; a grid: around stage 05's
    if (comm_size(world) == 1)
        kv_model_alloc(&m, &mc, cfg.max_batch_size, longest, maxT, cfg.kv_block_size, config_is_half(&cfg));
    else kv_model_alloc_grid(&m, world, &mc, cfg.tp_dimensions, cfg.max_batch_size, longest, maxT,
                             cfg.kv_block_size, config_is_half(&cfg));
    float *full = load_weights(&m, &cfg);
    Generator g = {.cfg = &cfg, .m = &m, .tok = tok, .stream = true,
                   .use_graph = cfg.compile && ops_graphs_supported() && comm_size(world) == 1};
    // only the tokenizer's tokens can be drawn (vocab_size may add unused rows, as GPT-2's shape)
    sampler_init(&g.sampler, tokenizer_vocab_size(tok), (float)cfg.temperature, cfg.top_k, (float)cfg.top_p, (uint64_t)cfg.seed);
    g.logits = malloc_or_die((size_t)cfg.max_batch_size * mc.padded_vocab_size * sizeof(float));
    if (!cfg.kv_cache) g.nocache = nocache_alloc(&m, full, cfg.max_batch_size, maxT);
    else dev_free(full);
    if (cfg.serve && cfg.draft_model[0] && rank == 0) load_draft(&draft, &m, &cfg, tok, longest);
    alloc_pools(&m, &cfg, world);
    print_setup(&g, &cfg, n_prompts);

    if (cfg.serve) {
        serve(&cfg, &m, tok, &g.sampler, world, g.use_graph);
        if (m.draft) kv_model_free(m.draft);
    } else if (cfg.eval_accuracy) {
        evaluate(&g, &cfg);
    } else {
        double rate_before = prints_decode_bound(&g) ? weights_read_rate(&m) : 0;
        generate_all(&g, r, n_prompts);
        print_timings(&g, r, n_prompts, rate_before);
        free_requests(r, n_prompts);
        for (int i = 0; i < n_prompts; i++) free(prompts[i]);
        free(prompts);
    }

    nocache_free(g.nocache);
    free(g.logits);
    sampler_free(&g.sampler);
    kv_model_free(&m);
    tokenizer_free(tok);
    comm_finalize(world);
    return 0;
}
