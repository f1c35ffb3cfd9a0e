// preflight_comm: the communication part of the preflight (tools/preflight.py), one MPI job over
// every rank the session will use. It proves that every rank starts and joins the communicator
// (MPI, and NCCL where the CUDA backend picks it), measures all-reduce and all-gather bus
// bandwidth at a few sizes, and the bandwidth of every pair of hosts (one rank of each, sending
// and receiving at once), so that a fabric that falls short can be traced to its slowest link.
// Rank 0 writes the figures as JSON (--json=FILE, else stdout).
//
//   mpirun -np 4 build/preflight_comm [--sizes=262144,4194304,33554432] [--iters=5]
//                                     [--pair_bytes=16777216] [--json=FILE]
//
// Sizes and bus bandwidth follow nccl-tests, as comm.h counts them: the size of an all-reduce is
// the buffer, of an all-gather the gathered output; busbw = size / time x 2(n-1)/n for
// all-reduce, x (n-1)/n for all-gather. A time is the slowest rank's mean over the iterations,
// after one untimed warm-up. On one host the "pairs" are pairs of ranks.
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "comm/comm.h"

#define MAX_SIZES 16

typedef struct {
    size_t sizes[MAX_SIZES];
    int n_sizes, iters;
    size_t pair_bytes;
    const char *json_path;
} Options;

typedef struct {
    int n_units;    // hosts, or ranks when every rank is on one host
    int *leader;    // the rank that speaks for each unit
    char (*label)[MPI_MAX_PROCESSOR_NAME + 16];
} Units;

static size_t parse_size(const char *text, const char *option) {
    char *end;
    unsigned long long v = strtoull(text, &end, 10);
    if (end == text || (*end != '\0' && *end != ',') || v < 8)
        fatal("preflight_comm: %s: expected byte counts of at least 8, found '%s'", option, text);
    return (size_t)v;
}

static Options parse_options(int argc, char **argv) {
    Options o = {.sizes = {262144, 4194304, 33554432}, .n_sizes = 3, .iters = 5,
                 .pair_bytes = 16777216, .json_path = NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--sizes=", 8) == 0) {
            o.n_sizes = 0;
            for (const char *p = a + 8; *p && o.n_sizes < MAX_SIZES; p = strchr(p, ',') ? strchr(p, ',') + 1 : "")
                o.sizes[o.n_sizes++] = parse_size(p, "--sizes");
        } else if (strncmp(a, "--iters=", 8) == 0) {
            o.iters = atoi(a + 8);
            if (o.iters < 1) fatal("preflight_comm: --iters: expected a positive count, found '%s'", a + 8);
        } else if (strncmp(a, "--pair_bytes=", 13) == 0) {
            o.pair_bytes = parse_size(a + 13, "--pair_bytes");
        } else if (strncmp(a, "--json=", 7) == 0) {
            o.json_path = a + 7;
        } else {
            fatal("preflight_comm: unknown option '%s' (--sizes, --iters, --pair_bytes, --json)", a);
        }
    }
    return o;
}

// every rank's host name, gathered with plain MPI: metadata, not payload the comm layer counts
static char (*gather_hosts(int size))[MPI_MAX_PROCESSOR_NAME] {
    char(*hosts)[MPI_MAX_PROCESSOR_NAME] = calloc_or_die((size_t)size, sizeof *hosts);
    char mine[MPI_MAX_PROCESSOR_NAME] = {0};
    int len;
    MPI_Get_processor_name(mine, &len);
    MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts, MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                  MPI_COMM_WORLD);
    return hosts;
}

static Units find_units(char (*hosts)[MPI_MAX_PROCESSOR_NAME], int size) {
    Units u = {0, calloc_or_die((size_t)size, sizeof(int)), calloc_or_die((size_t)size, sizeof *u.label)};
    for (int r = 0; r < size; r++) {
        int seen = 0;
        for (int k = 0; k < u.n_units && !seen; k++) seen = strcmp(hosts[u.leader[k]], hosts[r]) == 0;
        if (!seen) {
            u.leader[u.n_units] = r;
            snprintf(u.label[u.n_units], sizeof u.label[0], "%s", hosts[r]);
            u.n_units++;
        }
    }
    if (u.n_units == 1 && size > 1) {  // one host: its ranks' pairs stand in for the links
        for (int r = 0; r < size; r++) {
            u.leader[r] = r;
            snprintf(u.label[r], sizeof u.label[0], "%s:rank%d", hosts[0], r);
        }
        u.n_units = size;
    }
    return u;
}

// the slowest rank's mean seconds per call of `kind` at `bytes`
static double time_collective(Comm *w, const char *kind, size_t bytes, int iters, float *a, float *b) {
    size_t n = comm_size(w), count = bytes / sizeof(float);
    size_t per_rank = count / n ? count / n : 1;
    double t0 = 0;
    for (int i = -1; i < iters; i++) {
        if (i == 0) {
            comm_sum_double(w, 0);  // line the ranks up before the clock starts
            t0 = wall_seconds();
        }
        if (strcmp(kind, "all_reduce") == 0) comm_all_reduce(w, a, count);
        else comm_all_gather(w, b, a, per_rank);
    }
    dev_synchronize();
    return comm_max_double(w, (wall_seconds() - t0) / iters);
}

static cJSON *measure_collective(Comm *w, const char *kind, const Options *o, float *a, float *b) {
    int n = comm_size(w);
    double factor = comm_bus_factor(strcmp(kind, "all_reduce") == 0 ? COLL_ALL_REDUCE : COLL_ALL_GATHER, n);
    cJSON *rows = cJSON_CreateArray();
    for (int s = 0; s < o->n_sizes; s++) {
        // the all-gather's size is its output: n equal blocks
        size_t bytes = strcmp(kind, "all_reduce") == 0 ? o->sizes[s]
                     : (o->sizes[s] / sizeof(float) / (size_t)n ? o->sizes[s] / sizeof(float) / (size_t)n : 1) *
                           (size_t)n * sizeof(float);
        double sec = time_collective(w, kind, bytes, o->iters, a, b);
        cJSON *row = cJSON_CreateObject();
        cJSON_AddNumberToObject(row, "bytes", (double)bytes);
        cJSON_AddNumberToObject(row, "seconds", sec);
        cJSON_AddNumberToObject(row, "algbw_GBps", bytes / sec / 1e9);
        cJSON_AddNumberToObject(row, "busbw_GBps", bytes / sec / 1e9 * factor);
        cJSON_AddItemToArray(rows, row);
    }
    return rows;
}

// ranks a and b swap pair_bytes at once, iters times; the others wait. Returns GB/s each way.
static double measure_pair(Comm *w, int a, int b, const Options *o, float *send, float *recv) {
    int me = comm_rank(w), peer = me == a ? b : a;
    size_t count = o->pair_bytes / sizeof(float);
    double sec = 0;
    comm_sum_double(w, 0);
    if (me == a || me == b) {
        comm_send_recv(w, send, count, peer, recv, count, peer);  // warm-up: the connection
        double t0 = wall_seconds();
        for (int i = 0; i < o->iters; i++) comm_send_recv(w, send, count, peer, recv, count, peer);
        dev_synchronize();
        sec = (wall_seconds() - t0) / o->iters;
    }
    sec = comm_max_double(w, sec);
    return count * sizeof(float) / sec / 1e9;
}

static cJSON *measure_pairs(Comm *w, const Units *u, const Options *o, float *send, float *recv) {
    cJSON *pairs = cJSON_CreateArray();
    for (int i = 0; i < u->n_units; i++)
        for (int j = i + 1; j < u->n_units; j++) {
            double gbps = measure_pair(w, u->leader[i], u->leader[j], o, send, recv);
            cJSON *p = cJSON_CreateObject();
            cJSON_AddStringToObject(p, "a", u->label[i]);
            cJSON_AddStringToObject(p, "b", u->label[j]);
            cJSON_AddNumberToObject(p, "rank_a", u->leader[i]);
            cJSON_AddNumberToObject(p, "rank_b", u->leader[j]);
            cJSON_AddNumberToObject(p, "bytes", (double)(o->pair_bytes / sizeof(float) * sizeof(float)));
            cJSON_AddNumberToObject(p, "GBps", gbps);
            cJSON_AddItemToArray(pairs, p);
        }
    return pairs;
}

static cJSON *hosts_json(char (*hosts)[MPI_MAX_PROCESSOR_NAME], int size) {
    cJSON *list = cJSON_CreateArray();
    for (int r = 0; r < size; r++) cJSON_AddItemToArray(list, cJSON_CreateString(hosts[r]));
    return list;
}

static void write_json(const cJSON *root, const char *path) {
    char *text = cJSON_Print(root);
    FILE *f = path ? fopen_or_die(path, "w") : stdout;
    fprintf(f, "%s\n", text);
    if (path && fclose(f) != 0) fatal("preflight_comm: %s: cannot write", path);
    free(text);
}

int main(int argc, char **argv) {
    Comm *w = comm_init(&argc, &argv);
    Options o = parse_options(argc, argv);
    ops_init();
    comm_select_backend(w, getenv("PREFLIGHT_COMM_BACKEND") ? getenv("PREFLIGHT_COMM_BACKEND") : "auto");
    int size = comm_size(w);
    char(*hosts)[MPI_MAX_PROCESSOR_NAME] = gather_hosts(size);
    Units units = find_units(hosts, size);

    size_t biggest = o.pair_bytes;
    for (int s = 0; s < o.n_sizes; s++) biggest = o.sizes[s] > biggest ? o.sizes[s] : biggest;
    float *a = dev_malloc(biggest + 64), *b = dev_malloc(biggest + 64);

    cJSON *root = cJSON_CreateObject();
    cJSON_AddNumberToObject(root, "ranks", size);
    cJSON_AddItemToObject(root, "hosts", hosts_json(hosts, size));
    cJSON_AddItemToObject(root, "all_reduce", measure_collective(w, "all_reduce", &o, a, b));
    cJSON_AddItemToObject(root, "all_gather", measure_collective(w, "all_gather", &o, a, b));
    cJSON_AddItemToObject(root, "pairs", measure_pairs(w, &units, &o, a, b));
    if (comm_rank(w) == 0) write_json(root, o.json_path);

    cJSON_Delete(root);
    dev_free(a);
    dev_free(b);
    free(hosts);
    free(units.leader);
    free(units.label);
    comm_finalize(w);
    return 0;
}
