// comm.c: the backend-independent half of comm.h: process groups, accounting, the statistics
// table, small host-side reductions and the checks that ranks agree, all over MPI. The payload
// collectives are in comm_mpi.c (host buffers) or comm_nccl.c (GPU buffers).
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/device.h"
#include "base/log.h"
#include "base/trace.h"
#include "comm_internal.h"
#include "flight.h"
#include "run/preemption.h"

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
    char message[256];
    snprintf(message, sizeof message, "%s on group '%s' did not finish within %.0f s: a rank has died or is stuck "
             "(COMM_TIMEOUT sets the limit)", what, group, g_comm_timeout);
    flight_on_timeout(message);
    fatal("%s", message);
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

// the group's members' world ranks, for the flight recorder's rings
static int add_flight_group(MPI_Comm mpi, const char *name, int rank, int size) {
    MPI_Group group, world;
    MPI_Comm_group(mpi, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int *ranks = malloc_or_die((size_t)size * sizeof *ranks), *world_ranks = malloc_or_die((size_t)size * sizeof *ranks);
    for (int i = 0; i < size; i++) ranks[i] = i;
    MPI_Group_translate_ranks(group, size, ranks, world, world_ranks);
    int id = flight_add_group(name, rank, size, world_ranks);
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    free(ranks);
    free(world_ranks);
    return id;
}

static Comm *new_group(MPI_Comm mpi, const char *name) {
    Comm *c = calloc_or_die(1, sizeof *c);
    c->mpi = mpi;
    // errors come back as codes, so that we can say what failed instead of MPI aborting
    MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN);
    MPI_Comm_rank(mpi, &c->rank);
    MPI_Comm_size(mpi, &c->size);
    snprintf(c->name, sizeof c->name, "%s", name);
    c->flight_group = add_flight_group(mpi, name, c->rank, c->size);
    c->sent = calloc_or_die((size_t)c->size, sizeof *c->sent);
    c->received = calloc_or_die((size_t)c->size, sizeof *c->received);
    comm_backend_init_group(c);
    c->next = g_groups;
    g_groups = c;
    return c;
}

static void read_fault(void);

// Every rank's process id and whether it shares this host: a rank that times out signals the
// others on its host to write their rings (flight.h).
static void start_flight_recorder(int rank, int size) {
    enum { HOST = 64 };
    char *hosts = calloc_or_die((size_t)size, HOST), *same = calloc_or_die((size_t)size, 1);
    int *pids = malloc_or_die((size_t)size * sizeof *pids), pid = (int)getpid();
    gethostname(hosts + (size_t)rank * HOST, HOST - 1);
    comm_check_mpi(MPI_Allgather(MPI_IN_PLACE, HOST, MPI_CHAR, hosts, HOST, MPI_CHAR, MPI_COMM_WORLD), "host names");
    comm_check_mpi(MPI_Allgather(&pid, 1, MPI_INT, pids, 1, MPI_INT, MPI_COMM_WORLD), "process ids");
    for (int r = 0; r < size; r++) same[r] = strcmp(hosts + (size_t)r * HOST, hosts + (size_t)rank * HOST) == 0;
    free(hosts);
    flight_init(rank, size, pids, same);  // keeps pids and same for the life of the process
    preemption_on_signal(flight_on_signal);
}

Comm *comm_init(int *argc, char ***argv) {
    comm_check_mpi(MPI_Init(argc, argv), "init");
    const char *t = getenv("COMM_TIMEOUT");
    if (t && atof(t) > 0) g_comm_timeout = atof(t);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    log_set_rank(rank);
    start_flight_recorder(rank, size);
    read_fault();
    return new_group(MPI_COMM_WORLD, "world");
}

void comm_finalize(Comm *world) {
    (void)world;
    while (g_groups) {
        Comm *c = g_groups;
        g_groups = c->next;
        comm_backend_free_group(c);
        if (c->mpi != MPI_COMM_WORLD) MPI_Comm_free(&c->mpi);
        free(c->sent);
        free(c->received);
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

static void inject_fault(Comm *c);

// The flight recorder's entry for an operation: collectives count per group, messages per peer.
static long record_collective(Comm *c, const char *kind, double bytes) {
    inject_fault(c);
    return flight_issued(kind, c->flight_group, ++c->collectives, -1, -1, -1, bytes);
}

static long record_p2p(Comm *c, const char *kind, double bytes, int dst, int src) {
    long send_seq = dst >= 0 ? ++c->sent[dst] : -1, recv_seq = src >= 0 ? ++c->received[src] : -1;
    if (dst < 0) return flight_issued(kind, c->flight_group, recv_seq, src, -1, -1, bytes);
    return flight_issued(kind, c->flight_group, send_seq, dst, recv_seq, src, bytes);
}

CommRequest *comm_new_request(Comm *c, CollKind kind, double bytes) {
    return comm_new_p2p_request(c, kind, bytes, -1, -1);
}

CommRequest *comm_new_p2p_request(Comm *c, CollKind kind, double bytes, int dst, int src) {
    CommRequest *r = calloc_or_die(1, sizeof *r);
    bool p2p = kind == COLL_SEND || kind == COLL_RECV || kind == COLL_SEND_RECV;
    r->flight = p2p ? record_p2p(c, COMM_KIND_NAMES[kind], bytes, dst, src)
                    : record_collective(c, COMM_KIND_NAMES[kind], bytes);
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

double comm_bus_factor(CollKind kind, int n) {
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
    if (r->done) flight_completed(r->flight);
    return r->done;
}

void comm_wait(CommRequest *r) {
    int wait = trace_mark();
    flight_started(r->flight);
    if (!r->done) comm_backend_wait(r);
    flight_completed(r->flight);
    int end = r->end_mark >= 0 ? r->end_mark : trace_mark();
    trace_collective(COMM_KIND_NAMES[r->kind], r->comm->name, r->bytes, r->launch_mark, wait, end);
    CommStats *s = &r->comm->stats;
    s->calls[r->kind]++;
    s->bytes[r->kind] += r->bytes;
    s->seconds[r->kind] += comm_backend_seconds(r);
    s->bus_bytes[r->kind] += r->bytes * comm_bus_factor(r->kind, r->comm->size);
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
    int type_bytes;
    MPI_Type_size(type, &type_bytes);
    long flight = record_collective(c, COMM_KIND_NAMES[COLL_ALL_REDUCE], (double)n * type_bytes);
    MPI_Request req;
    comm_check_mpi(MPI_Iallreduce(MPI_IN_PLACE, x, n, type, op, c->mpi, &req), what);
    flight_started(flight);
    comm_wait_mpi(&req, 1, what, c->name);
    flight_completed(flight);
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
    flight_set_dir(cfg->out_dir);
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

// ---- test only: injected hangs (tests/test_hangcheck.sh) ---------------------------------------
// COMM_FAULT=<class>:<world rank>:<group>:<n> makes that rank misbehave at collective #n of the
// group named, one way for each hang the flight recorder must explain: skip (it never issues #n
// and stays out of the comm layer), mismatch (it calls a one-float all-reduce at #n), dead (it
// is killed at #n), slow (it arrives half a timeout late at #n-3 to #n-1 and three timeouts late
// at #n), send (at #n it first sends 4 MB to the next rank of the group, which never receives it).

typedef enum { FAULT_NONE, FAULT_SKIP, FAULT_MISMATCH, FAULT_DEAD, FAULT_SLOW, FAULT_SEND } FaultClass;
static const char *FAULT_NAMES[] = {"", "skip", "mismatch", "dead", "slow", "send"};
static struct {
    FaultClass kind;
    int rank;
    char group[32];
    long seq;
} g_fault;

static void read_fault(void) {
    const char *spec = getenv("COMM_FAULT");
    if (!spec || !spec[0]) return;
    char kind[16];
    if (sscanf(spec, "%15[^:]:%d:%31[^:]:%ld", kind, &g_fault.rank, g_fault.group, &g_fault.seq) == 4)
        for (int k = FAULT_SKIP; k <= FAULT_SEND; k++)
            if (strcmp(kind, FAULT_NAMES[k]) == 0) g_fault.kind = (FaultClass)k;
    if (g_fault.kind == FAULT_NONE)
        fatal("COMM_FAULT (test only): expected <skip|mismatch|dead|slow|send>:<rank>:<group>:<n>, found '%s'", spec);
}

// sleeps the whole time even when a signal (a ring request) interrupts it
static void sleep_seconds(double s) {
    struct timespec left = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    while (nanosleep(&left, &left) != 0 && errno == EINTR) {}
}

static void send_unreceived(Comm *c) {
    enum { FLOATS = 1 << 20 };  // above every eager limit: the send waits for a receive
    float *buf = calloc_or_die(FLOATS, sizeof *buf);
    int peer = (c->rank + 1) % c->size;
    long flight = record_p2p(c, COMM_KIND_NAMES[COLL_SEND], 4.0 * FLOATS, peer, -1);
    MPI_Request req;
    comm_check_mpi(MPI_Isend(buf, FLOATS, MPI_FLOAT, peer, 0, c->mpi, &req), "send");
    flight_started(flight);
    comm_wait_mpi(&req, 1, COMM_KIND_NAMES[COLL_SEND], c->name);
    free(buf);
}

// called before collective #(c->collectives + 1) of c is recorded
static void inject_fault(Comm *c) {
    if (g_fault.kind == FAULT_NONE || log_rank() != g_fault.rank || strcmp(c->name, g_fault.group) != 0) return;
    long seq = c->collectives + 1, n = g_fault.seq;
    if (g_fault.kind == FAULT_SLOW && seq >= n - 3 && seq <= n) sleep_seconds(g_comm_timeout * (seq < n ? 0.5 : 3));
    if (seq != n) return;
    if (g_fault.kind == FAULT_SKIP)
        for (;;) sleep_seconds(60);
    if (g_fault.kind == FAULT_DEAD) raise(SIGKILL);
    if (g_fault.kind == FAULT_MISMATCH) {
        g_fault.kind = FAULT_NONE;  // once
        float one = 1;
        reduce_host(c, &one, 1, MPI_FLOAT, MPI_SUM, "all-reduce");
    }
    if (g_fault.kind == FAULT_SEND) send_unreceived(c);
}
