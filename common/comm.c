// comm.c: the backend-independent half of comm.h: process groups, accounting, the statistics
// table, small host-side reductions and the checks that ranks agree, all over MPI. The payload
// collectives are in comm_mpi.c (host buffers) or comm_nccl.c (GPU buffers).
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm_internal.h"
#include "device.h"
#include "log.h"
#include "trace.h"

static Comm *g_groups = NULL;
double g_comm_timeout = 300;
const char *COMM_KIND_NAMES[COLL_KINDS] = {"all-reduce", "all-gather", "reduce-scatter", "broadcast",
                                           "send", "recv", "send-recv", "all-to-all"};

void comm_check_mpi(int err, const char *what) {
    if (err == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(err, msg, &len);
    fatal("MPI %s failed: %s", what, msg);
}

void comm_timeout_exceeded(const char *what, const char *group) {
    fatal("%s on group '%s' did not finish within %.0f s: a rank has died or is stuck "
          "(COMM_TIMEOUT sets the limit)", what, group, g_comm_timeout);
}

// a peer outside the group would otherwise surface as MPI's or NCCL's less specific error
void comm_check_peer(const Comm *c, int peer, const char *what) {
    if (peer < 0 || peer >= c->size)
        fatal("%s with rank %d on group '%s': the group has ranks 0 to %d", what, peer, c->name, c->size - 1);
}

// Waits for all n requests. Polls instead of MPI_Waitall so that a dead or stuck peer ends the
// job after the timeout. The short sleeps give the core back, which matters when ranks outnumber
// cores.
void comm_wait_mpi(MPI_Request *reqs, int n, const char *what, const char *group) {
    double deadline = wall_seconds() + g_comm_timeout;
    struct timespec nap = {0, 20000};
    for (long polls = 0;; polls++) {
        int done = 0;
        comm_check_mpi(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE), what);
        if (done) return;
        if (polls > 100) nanosleep(&nap, NULL);
        if (wall_seconds() > deadline) comm_timeout_exceeded(what, group);
    }
}

// ---- groups -----------------------------------------------------------------------------------

static Comm *new_group(MPI_Comm mpi, const char *name) {
    Comm *c = calloc_or_die(1, sizeof *c);
    c->mpi = mpi;
    // errors come back as codes, so that we can say what failed instead of MPI aborting
    MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN);
    MPI_Comm_rank(mpi, &c->rank);
    MPI_Comm_size(mpi, &c->size);
    snprintf(c->name, sizeof c->name, "%s", name);
    comm_backend_init_group(c);
    c->next = g_groups;
    g_groups = c;
    return c;
}

Comm *comm_init(int *argc, char ***argv) {
    comm_check_mpi(MPI_Init(argc, argv), "init");
    const char *t = getenv("COMM_TIMEOUT");
    if (t && atof(t) > 0) g_comm_timeout = atof(t);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    log_set_rank(rank);
    return new_group(MPI_COMM_WORLD, "world");
}

void comm_finalize(Comm *world) {
    (void)world;
    while (g_groups) {
        Comm *c = g_groups;
        g_groups = c->next;
        comm_backend_free_group(c);
        if (c->mpi != MPI_COMM_WORLD) MPI_Comm_free(&c->mpi);
        free(c);
    }
    MPI_Finalize();
}

Comm *comm_split(Comm *parent, int color, int key, const char *name) {
    MPI_Comm mpi;
    comm_check_mpi(MPI_Comm_split(parent->mpi, color, key, &mpi), "comm_split");
    return new_group(mpi, name);
}

int comm_rank(const Comm *c) { return c->rank; }
int comm_size(const Comm *c) { return c->size; }

// ---- requests and accounting ------------------------------------------------------------------

CommRequest *comm_new_request(Comm *c, CollKind kind, double bytes) {
    CommRequest *r = calloc_or_die(1, sizeof *r);
    r->comm = c;
    r->kind = kind;
    r->bytes = bytes;
    r->start = wall_seconds();
    r->launch_mark = trace_mark();
    r->end_mark = -1;
    r->mpi[0] = r->mpi[1] = MPI_REQUEST_NULL;
    return r;
}

double comm_total_count(const size_t *counts, int n) {
    double total = 0;
    for (int i = 0; i < n; i++) total += (double)counts[i];
    return total;
}

// nccl-tests' factors (comm.h): what each link carries relative to the size
static double bus_factor(CollKind kind, int n) {
    switch (kind) {
    case COLL_ALL_REDUCE: return 2.0 * (n - 1) / n;
    case COLL_ALL_GATHER:
    case COLL_REDUCE_SCATTER:
    case COLL_ALL_TO_ALL: return (double)(n - 1) / n;
    default: return 1.0;  // broadcast and the point-to-point kinds
    }
}

int comm_test(CommRequest *r) {
    if (!r->done) r->done = comm_backend_test(r);
    return r->done;
}

void comm_wait(CommRequest *r) {
    int wait = trace_mark();
    if (!r->done) comm_backend_wait(r);
    int end = r->end_mark >= 0 ? r->end_mark : trace_mark();
    trace_collective(COMM_KIND_NAMES[r->kind], r->comm->name, r->bytes, r->launch_mark, wait, end);
    CommStats *s = &r->comm->stats;
    s->calls[r->kind]++;
    s->bytes[r->kind] += r->bytes;
    s->seconds[r->kind] += comm_backend_seconds(r);
    s->bus_bytes[r->kind] += r->bytes * bus_factor(r->kind, r->comm->size);
    free(r);
}

void comm_all_reduce(Comm *c, float *buf, size_t count) { comm_wait(comm_all_reduce_start(c, buf, count)); }
void comm_all_gather(Comm *c, float *out, const float *in, size_t count) {
    comm_wait(comm_all_gather_start(c, out, in, count));
}
void comm_reduce_scatter(Comm *c, float *out, const float *in, size_t count) {
    comm_wait(comm_reduce_scatter_start(c, out, in, count));
}
void comm_send(Comm *c, const float *buf, size_t count, int peer) { comm_wait(comm_send_start(c, buf, count, peer)); }
void comm_recv(Comm *c, float *buf, size_t count, int peer) { comm_wait(comm_recv_start(c, buf, count, peer)); }
void comm_send_recv(Comm *c, const float *send, size_t send_count, int dst, float *recv, size_t recv_count,
                    int src) {
    comm_wait(comm_send_recv_start(c, send, send_count, dst, recv, recv_count, src));
}

CommStats comm_totals(void) {
    CommStats t;
    memset(&t, 0, sizeof t);
    for (Comm *c = g_groups; c; c = c->next)
        for (int k = 0; k < COLL_KINDS; k++) {
            t.calls[k] += c->stats.calls[k];
            t.bytes[k] += c->stats.bytes[k];
            t.seconds[k] += c->stats.seconds[k];
            t.bus_bytes[k] += c->stats.bus_bytes[k];
        }
    return t;
}

double comm_stats_bytes(const CommStats *s) {
    double b = 0;
    for (int k = 0; k < COLL_KINDS; k++) b += s->bytes[k];
    return b;
}

double comm_stats_seconds(const CommStats *s) {
    double t = 0;
    for (int k = 0; k < COLL_KINDS; k++) t += s->seconds[k];
    return t;
}

void comm_since(const CommStats *before, double *bytes, double *ms) {
    CommStats now = comm_totals();
    *bytes = comm_stats_bytes(&now) - comm_stats_bytes(before);
    *ms = 1e3 * (comm_stats_seconds(&now) - comm_stats_seconds(before));
}

void comm_print_table(Comm *world) {
    if (world->rank != 0) return;
    printf("communication on rank 0 (sizes and bandwidths as nccl-tests defines them):\n");
    printf("  %-10s %-15s %7s %11s %10s %11s %11s\n", "group", "collective", "calls", "MB", "ms",
           "algbw GB/s", "busbw GB/s");
    for (Comm *c = g_groups; c; c = c->next)
        for (int k = 0; k < COLL_KINDS; k++) {
            const CommStats *s = &c->stats;
            if (!s->calls[k]) continue;
            double sec = s->seconds[k] > 0 ? s->seconds[k] : 1e-12;
            printf("  %-10s %-15s %7ld %11.2f %10.1f %11.4g %11.4g\n", c->name, COMM_KIND_NAMES[k],
                   s->calls[k], s->bytes[k] / 1e6, 1e3 * s->seconds[k], s->bytes[k] / sec / 1e9,
                   s->bus_bytes[k] / sec / 1e9);
        }
}

cJSON *comm_stats_json(void) {
    cJSON *list = cJSON_CreateArray();
    for (Comm *c = g_groups; c; c = c->next)
        for (int k = 0; k < COLL_KINDS; k++) {
            const CommStats *s = &c->stats;
            if (!s->calls[k]) continue;
            double sec = s->seconds[k] > 0 ? s->seconds[k] : 1e-12;  // as the table divides
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "group", c->name);
            cJSON_AddStringToObject(e, "kind", COMM_KIND_NAMES[k]);
            cJSON_AddNumberToObject(e, "calls", (double)s->calls[k]);
            cJSON_AddNumberToObject(e, "bytes", s->bytes[k]);
            cJSON_AddNumberToObject(e, "seconds", s->seconds[k]);
            cJSON_AddNumberToObject(e, "algbw_GBps", s->bytes[k] / sec / 1e9);
            cJSON_AddNumberToObject(e, "busbw_GBps", s->bus_bytes[k] / sec / 1e9);
            cJSON_AddItemToArray(list, e);
        }
    return list;
}

// ---- the trace ------------------------------------------------------------------------------

// How far rank 0's clock is ahead of this rank's, from ping-pongs with rank 0 (Cristian's method):
// the rank sends, rank 0 answers with its clock reading, and the reading is taken to belong to
// the middle of the round trip. The round trip of the fastest of a few tries bounds the error.
static double clock_offset_to_rank0(Comm *world) {
    enum { TRIES = 8 };
    double best_rtt = 1e30, offset = 0;
    for (int r = 1; r < world->size; r++)
        for (int i = 0; i < TRIES; i++) {
            double t = 0;
            if (world->rank == 0) {
                comm_check_mpi(MPI_Recv(&t, 1, MPI_DOUBLE, r, 0, world->mpi, MPI_STATUS_IGNORE), "clock sync");
                t = wall_seconds();
                comm_check_mpi(MPI_Send(&t, 1, MPI_DOUBLE, r, 0, world->mpi), "clock sync");
            } else if (world->rank == r) {
                double sent = wall_seconds();
                comm_check_mpi(MPI_Send(&t, 1, MPI_DOUBLE, 0, 0, world->mpi), "clock sync");
                comm_check_mpi(MPI_Recv(&t, 1, MPI_DOUBLE, 0, 0, world->mpi, MPI_STATUS_IGNORE), "clock sync");
                double back = wall_seconds();
                if (back - sent < best_rtt) best_rtt = back - sent, offset = t - (sent + back) / 2;
            }
        }
    return offset;
}

// One clock for every rank: rank 0's. Each rank's epoch is rank 0's epoch moved onto its own
// clock by the measured offset, so the ranks' timestamps agree within half a round trip.
void comm_trace_open(Comm *world, bool enabled, int trace_steps) {
    double epoch = wall_seconds();
    if (enabled) {
        double offset = clock_offset_to_rank0(world);
        comm_check_mpi(MPI_Bcast(&epoch, 1, MPI_DOUBLE, 0, world->mpi), "clock sync");
        epoch -= offset;
    }
    trace_open(enabled, trace_steps, world->rank, epoch);
}

// Rank 0 gathers every rank's event text and writes the one merged file.
void comm_trace_write(Comm *world, const char *out_dir, bool enabled) {
    if (!enabled) return;
    char *mine = trace_events_text();
    int len = (int)strlen(mine) + 1, P = world->size;
    int *lens = calloc_or_die((size_t)P, sizeof *lens), *offs = calloc_or_die((size_t)P, sizeof *offs);
    comm_check_mpi(MPI_Gather(&len, 1, MPI_INT, lens, 1, MPI_INT, 0, world->mpi), "trace gather");
    long total = 0;
    for (int r = 0; r < P; r++) offs[r] = (int)total, total += lens[r];
    char *all = world->rank == 0 ? malloc_or_die((size_t)total) : NULL;
    comm_check_mpi(MPI_Gatherv(mine, len, MPI_CHAR, all, lens, offs, MPI_CHAR, 0, world->mpi), "trace gather");
    if (world->rank == 0) {
        char **texts = calloc_or_die((size_t)P, sizeof *texts);
        for (int r = 0; r < P; r++) texts[r] = all + offs[r];
        trace_write_file(out_dir, texts, P);
        free(texts);
        free(all);
    }
    free(mine);
    free(lens);
    free(offs);
}

// ---- small host values ------------------------------------------------------------------------

static void reduce_host(Comm *c, void *x, int n, MPI_Datatype type, MPI_Op op, const char *what) {
    MPI_Request req;
    comm_check_mpi(MPI_Iallreduce(MPI_IN_PLACE, x, n, type, op, c->mpi, &req), what);
    comm_wait_mpi(&req, 1, what, c->name);
}

double comm_sum_double(Comm *c, double x) {
    reduce_host(c, &x, 1, MPI_DOUBLE, MPI_SUM, "sum of a value");
    return x;
}

void comm_sum_doubles(Comm *c, double *x, int n) {
    reduce_host(c, x, n, MPI_DOUBLE, MPI_SUM, "sum of values");
}

long comm_sum_long(Comm *c, long x) {
    reduce_host(c, &x, 1, MPI_LONG, MPI_SUM, "sum of a count");
    return x;
}

double comm_max_double(Comm *c, double x) {
    reduce_host(c, &x, 1, MPI_DOUBLE, MPI_MAX, "max of a value");
    return x;
}

void comm_configure(Comm *world, const Config *cfg) {
    comm_select_backend(world, cfg->comm_backend);
    char *config_json = config_to_json(cfg);
    comm_check_same(world, "the config", config_json);
    free(config_json);
}

void comm_check_same(Comm *c, const char *what, const char *text) {
    // the min and the max of the hashes agree only if every rank's is the same
    uint64_t lo = hash_bytes(text, strlen(text)), hi = lo;
    reduce_host(c, &lo, 1, MPI_UINT64_T, MPI_MIN, what);
    reduce_host(c, &hi, 1, MPI_UINT64_T, MPI_MAX, what);
    if (lo != hi)
        fatal("the ranks of group '%s' do not agree on %s (rank %d has %s); start every rank with "
              "the same config and arguments", c->name, what, c->rank, text);
}

void comm_check_replicas_identical(Comm *c, const float *params, size_t n) {
    float *host = malloc_or_die(n * sizeof(float));
    copy_to_host(host, params, n * sizeof(float));
    char text[32];
    snprintf(text, sizeof text, "%016llx", (unsigned long long)hash_bytes(host, n * sizeof(float)));
    comm_check_same(c, "the trained weights", text);
    printf("replicas identical on all %d ranks: weights hash %s\n", comm_size(c), text);
    free(host);
}
