// schedules.c: the schedules beyond GPipe and 1F1B (pipeline.c's pipe_schedule), the memory and
// bubble each implies, and the replay that measures a schedule's bubble from its op times.
//
// Interleaved 1F1B (Megatron): each stage holds `chunks` non-adjacent chunks of blocks, chunk c of
// stage s being virtual stage c * p + s, so a micro-batch crosses the ring of stages `chunks`
// times. The pipe fills in a chunk's time instead of a stage's: the bubble shrinks by v, for v
// times the point-to-point messages.
// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward is split into B, the input
// gradient that the previous stage waits for, and W, the weight gradients nobody waits for, which
// fill the time a stage would otherwise idle.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "pipeline.h"

bool pipe_interleaved(PipeSchedule schedule) { return schedule == SCHED_INTERLEAVED; }
bool pipe_zero_bubble(PipeSchedule schedule) { return schedule == SCHED_ZB_H1; }

int pipe_max_ops(int m, int chunks) { return 3 * m * chunks; }

// ---- interleaved 1F1B -------------------------------------------------------------------------

// The k-th forward (or backward) of a stage, in Megatron's order: micro-batches go in groups of p,
// each group through chunk 0, then chunk 1, ...; backwards run the chunks the other way round.
static PipeOp interleaved_op(int k, bool backward, int pp, int chunks) {
    int in_group = k % (pp * chunks), chunk = in_group / pp;
    int micro = k / (pp * chunks) * pp + k % pp;
    return (PipeOp){backward, micro, backward ? chunks - 1 - chunk : chunk, false};
}

// Warm-up: the forwards that fill the ring behind this stage, twice its distance to the last
// stage plus one full round of the ring per extra chunk; then one forward, one backward; then the
// backwards left.
int interleaved_schedule(PipeOp *ops, int m, int pp, int chunks, int stage) {
    int total = m * chunks, n = 0;
    int warm = 2 * (pp - stage - 1) + (chunks - 1) * pp;
    if (warm > total) warm = total;
    for (int k = 0; k < warm; k++) ops[n++] = interleaved_op(k, false, pp, chunks);
    for (int k = 0; k < total - warm; k++) {
        ops[n++] = interleaved_op(warm + k, false, pp, chunks);
        ops[n++] = interleaved_op(k, true, pp, chunks);
    }
    for (int k = total - warm; k < total; k++) ops[n++] = interleaved_op(k, true, pp, chunks);
    return n;
}

// ---- ZB-H1 ------------------------------------------------------------------------------------

// Every stage's order comes from playing the pipeline on a clock where F, B and W take one unit
// each: a free stage runs a backward whose gradient has arrived, else a forward whose input has
// arrived while it holds fewer than its limit of micro-batches (each from its F to its W), else
// the oldest weight pass left. The W's thus fill the waits; each kind runs in micro-batch order,
// so the gradients add up in 1F1B's order. The limit is p (1F1B's peak, stage 0's), and p + 1 on
// stage 0: with one micro-batch more in flight there, every (p, m) tried (p 2-5, m 4-16) reaches
// the paper's 3m + p - 1 units; with p alone, p 3 and more lose a unit or more per stage.
static int zb_h1_limit(int pp, int stage) { return stage == 0 ? pp + 1 : pp; }

int zb_h1_schedule(PipeOp *ops, int m, int pp, int stage) {
    int *f = calloc_or_die((size_t)pp * 3, sizeof *f), *b = f + pp, *w = b + pp;  // done (started) per stage
    int *f_end = malloc_or_die((size_t)pp * m * 2 * sizeof *f_end), *b_end = f_end + pp * m;
    int *free_at = calloc_or_die((size_t)pp, sizeof *free_at), n = 0;
    for (int t = 0; w[stage] < m || n < 3 * m; t++) {
        if (t > 10 * (3 * m + pp)) fatal("internal: the zb-h1 schedule does not finish");
        for (int s = 0; s < pp; s++) {
            if (free_at[s] > t) continue;
            PipeOp op;
            if (b[s] < f[s] && f_end[s * m + b[s]] <= t && (s == pp - 1 || b[s] < b[s + 1]) &&
                (s == pp - 1 || b_end[(s + 1) * m + b[s]] <= t)) {
                op = (PipeOp){true, b[s], 0, false};
                b_end[s * m + b[s]++] = t + 1;
            } else if (f[s] < m && f[s] - w[s] < zb_h1_limit(pp, s) &&
                       (s == 0 || (f[s] < f[s - 1] && f_end[(s - 1) * m + f[s]] <= t))) {
                op = (PipeOp){false, f[s], 0, false};
                f_end[s * m + f[s]++] = t + 1;
            } else if (w[s] < b[s]) {
                op = (PipeOp){true, w[s]++, 0, true};
            } else {
                continue;
            }
            free_at[s] = t + 1;
            if (s == stage) ops[n++] = op;
        }
    }
    free(f), free(f_end), free(free_at);
    return n;
}

// ---- what a schedule holds ----------------------------------------------------------------------

int pipe_slots(PipeSchedule schedule, int m, int pp, int chunks, int stage, int *per_chunk) {
    PipeOp *ops = malloc_or_die((size_t)pipe_max_ops(m, chunks) * sizeof *ops);
    int n = pipe_schedule(ops, schedule, m, pp, chunks, stage), total = 0;
    int *live = calloc_or_die((size_t)chunks * 2, sizeof *live), *most = live + chunks;
    bool split = pipe_zero_bubble(schedule);
    for (int k = 0; k < n; k++) {
        // a micro-batch's activations are needed from its forward to its last pass: B, or W
        int c = ops[k].chunk;
        if (!ops[k].backward) live[c]++;
        else if (ops[k].weights == split) live[c]--;
        if (live[c] > most[c]) most[c] = live[c];
    }
    for (int c = 0; c < chunks; c++) {
        total += most[c];
        if (per_chunk) per_chunk[c] = most[c];
    }
    free(ops), free(live);
    return total;
}

double pipe_bubble_theory(PipeSchedule schedule, int m, int pp, int chunks) {
    // zb-h1: p - 1 units of the first stage's idle remain (F + B - W) out of 3m of work
    if (pipe_zero_bubble(schedule)) return (double)(pp - 1) / (3.0 * m + pp - 1);
    return (double)(pp - 1) / ((double)chunks * m + pp - 1);
}

const char *pipe_bubble_formula(PipeSchedule schedule) {
    if (pipe_zero_bubble(schedule)) return "(p-1)/(3m+p-1) with F = B = W";
    if (pipe_interleaved(schedule)) return "(p-1)/(v*m+p-1)";
    return "(p-1)/(m+p-1)";
}

void pipe_op_peers(const PipeOp *op, int pp, int chunks, int stage, int *recv_from, int *send_to) {
    int vs = op->chunk * pp + stage, last = pp * chunks - 1;
    *recv_from = *send_to = -1;
    if (op->weights) return;
    if (!op->backward) {
        if (vs > 0) *recv_from = (vs - 1) % pp;
        if (vs < last) *send_to = (vs + 1) % pp;
    } else {
        if (vs < last) *recv_from = (vs + 1) % pp;
        if (vs > 0) *send_to = (vs - 1) % pp;
    }
}

// ---- the replay -------------------------------------------------------------------------------

// The op whose output this one receives, as (virtual stage, micro-batch): a forward the previous
// virtual stage's forward, a backward the next one's backward; -1: none (the first and the last
// virtual stage start from tokens and from their loss, a weight pass from its own backward).
static int producer_stage(const PipeOp *op, int stage, int pp, int chunks) {
    int vs = op->chunk * pp + stage;
    if (op->weights) return -1;
    if (!op->backward) return vs > 0 ? vs - 1 : -1;
    return vs < pp * chunks - 1 ? vs + 1 : -1;
}

static double unit_time(PipeSchedule schedule, const PipeOp *op) {
    return op->backward && !pipe_zero_bubble(schedule) ? 2.0 : 1.0;
}

// Each directed pair of stages carries its messages in one order (one tag): the receiver must ask
// for them in the order the sender sends them.
static void check_message_order(PipeOp **ops, const int *n, int pp, int chunks) {
    for (int from = 0; from < pp; from++)
        for (int to = 0; to < pp; to++) {
            int i = 0, j = 0;
            for (;;) {
                // the next message `from` sends to `to`, and the next `to` receives from `from`
                int recv_from, send_to;
                for (; i < n[from]; i++) {
                    pipe_op_peers(&ops[from][i], pp, chunks, from, &recv_from, &send_to);
                    if (send_to == to) break;
                }
                for (; j < n[to]; j++) {
                    pipe_op_peers(&ops[to][j], pp, chunks, to, &recv_from, &send_to);
                    if (recv_from == from) break;
                }
                if (i == n[from] || j == n[to]) {
                    if (i != n[from] || j != n[to])
                        fatal("internal: stages %d and %d disagree on their messages", from, to);
                    break;
                }
                const PipeOp *sent = &ops[from][i], *wanted = &ops[to][j];
                if (sent->micro != wanted->micro || sent->backward != wanted->backward ||
                    sent->chunk * pp + from != producer_stage(wanted, to, pp, chunks))
                    fatal("internal: stage %d would receive %s of micro-batch %d from stage %d while it sends "
                          "micro-batch %d's first", to, wanted->backward ? "a gradient" : "an activation",
                          wanted->micro, from, sent->micro);
                i++, j++;
            }
        }
}

double pipe_replay(PipeSchedule schedule, int m, int pp, int chunks, double *const *secs, double *busy) {
    int vs_count = pp * chunks, *n = calloc_or_die((size_t)pp * 2, sizeof *n), *next = n + pp;
    PipeOp **ops = calloc_or_die((size_t)pp, sizeof *ops);
    double *free_at = calloc_or_die((size_t)pp, sizeof *free_at), end = 0;
    // when each virtual stage's forward and backward of each micro-batch ends (< 0: not yet)
    double *f_end = malloc_or_die((size_t)vs_count * m * 2 * sizeof *f_end), *b_end = f_end + vs_count * m;
    for (int i = 0; i < vs_count * m * 2; i++) f_end[i] = -1;
    for (int s = 0; s < pp; s++) {
        ops[s] = malloc_or_die((size_t)pipe_max_ops(m, chunks) * sizeof **ops);
        n[s] = pipe_schedule(ops[s], schedule, m, pp, chunks, s);
        busy[s] = 0;
    }
    check_message_order(ops, n, pp, chunks);
    for (bool progress = true; progress;) {
        progress = false;
        for (int s = 0; s < pp; s++)
            for (; next[s] < n[s]; next[s]++) {
                const PipeOp *op = &ops[s][next[s]];
                int src = producer_stage(op, s, pp, chunks);
                double ready = src < 0 ? 0 : (op->backward ? b_end : f_end)[src * m + op->micro];
                if (ready < 0) break;  // its input is not produced yet
                double t = secs ? secs[s][next[s]] : unit_time(schedule, op);
                double start = ready > free_at[s] ? ready : free_at[s];
                free_at[s] = start + t, busy[s] += t;
                if (!op->weights) (op->backward ? b_end : f_end)[(op->chunk * pp + s) * m + op->micro] = start + t;
                if (start + t > end) end = start + t;
                progress = true;
            }
    }
    for (int s = 0; s < pp; s++)
        if (next[s] < n[s]) fatal("internal: the %s schedule deadlocks on stage %d", pipe_schedule_name(schedule), s);
    for (int s = 0; s < pp; s++) free(ops[s]);
    free(ops), free(n), free(free_at), free(f_end);
    return end;
}
