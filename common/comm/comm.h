// comm.h: the communicator every parallel stage uses. One API, two implementations:
// comm_cpu.c moves CPU buffers with Open MPI; comm_nccl.c moves GPU buffers with NCCL (its
// communicators bootstrapped over MPI), or with MPI where ranks share a GPU (comm_select_backend;
// the MPI path itself is comm_mpi.c). Ranks always come from MPI, so `mpirun -np P` and
// Slurm's `srun` (PMIx) both start a job.
//
// Every collective and point-to-point operation is counted (calls, bytes, seconds) per group and
// per kind, and every wait is bounded: one that does not finish within the timeout (a dead or
// stuck peer) ends the job with a message instead of hanging it (environment COMM_TIMEOUT,
// seconds; default 300). The flight recorder (flight.h) keeps each rank's last operations, and
// writes them when a wait times out, the job fails or is signalled: tools/hangcheck reads them.
//
// Sizes follow nccl-tests: the "size" of all-reduce and broadcast is the buffer, of all-gather
// the gathered output, of reduce-scatter and all-to-all the input (every block, this rank's own
// included; for all-to-all-v the sum of the send counts), of a send and a send-recv the message
// sent, of a receive the message received. Bus bandwidth = size / time x factor, with factor 2(n-1)/n for
// all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for broadcast and the
// point-to-point kinds: the bandwidth each link must carry, comparable with the hardware's.
#ifndef COMM_H
#define COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "config/config.h"

typedef struct Comm Comm;
typedef struct CommRequest CommRequest;

typedef enum {
    COLL_ALL_REDUCE, COLL_ALL_GATHER, COLL_REDUCE_SCATTER, COLL_BROADCAST,
    COLL_SEND, COLL_RECV, COLL_SEND_RECV,
    COLL_ALL_TO_ALL,  // equal and variable counts alike
    COLL_KINDS
} CollKind;

// nccl-tests' bus factor of a collective of `kind` over n ranks: what each link carries relative
// to the size (all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; else 1), so
// that bus bandwidth = size x factor / seconds compares with a link's bandwidth at any n
double comm_bus_factor(CollKind kind, int n);

// Starts MPI and returns the world group; sets log_set_rank(). Call first in main.
Comm *comm_init(int *argc, char ***argv);
// Chooses what moves the payload, from the config's comm_backend: call on every rank right after
// the config is read, before any comm_split. "auto": the CUDA backend uses NCCL when every rank
// has a GPU of its own on its host, else MPI (ranks that share a GPU: NCCL needs one GPU per
// rank); the CPU backend uses MPI. "nccl": NCCL or an error. "mpi": MPI, which on the CUDA backend
// stages device buffers through pinned host memory, or hands them to an MPI built CUDA-aware.
// "mpi-staged": MPI with staging even so; on the CPU backend the staging copies are memcpy, which
// is how the tests run the shared-GPU path without a GPU. Rank 0 prints one line: which backend
// moves the bytes, and why.
void comm_select_backend(Comm *world, const char *comm_backend);
// Ends MPI after freeing every group; prints nothing.
void comm_finalize(Comm *world);
// Ranks with the same color form a group, ordered by key; `name` labels its statistics.
Comm *comm_split(Comm *parent, int color, int key, const char *name);
int comm_rank(const Comm *c);
int comm_size(const Comm *c);

// ---- collectives on float buffers (device pointers: host memory on the CPU backend) ----------
// buf (count) = sum over ranks of buf, in place
void comm_all_reduce(Comm *c, float *buf, size_t count);
// out (n * count) = every rank's in (count), in rank order
void comm_all_gather(Comm *c, float *out, const float *in, size_t count);
// out (count) = this rank's slice of the sum over ranks of in (n * count)
void comm_reduce_scatter(Comm *c, float *out, const float *in, size_t count);
void comm_broadcast(Comm *c, float *buf, size_t count, int root);
// out (n * count): block r = rank r's in block [this rank]; in (n * count): block r goes to rank r
void comm_all_to_all(Comm *c, float *out, const float *in, size_t count);
// variable counts (MPI_Alltoallv; counts and offsets in floats): send_counts[r] floats from
// in + send_offsets[r] go to rank r, recv_counts[r] from rank r land at out + recv_offsets[r].
// Zero counts are fine; send_counts[r] here must equal recv_counts[this rank] on rank r.
void comm_all_to_all_v(Comm *c, float *out, const size_t *recv_counts, const size_t *recv_offsets,
                       const float *in, const size_t *send_counts, const size_t *send_offsets);

// the same, started now and finished by comm_wait (which frees the request)
CommRequest *comm_all_reduce_start(Comm *c, float *buf, size_t count);
CommRequest *comm_all_gather_start(Comm *c, float *out, const float *in, size_t count);
// the same for 16-bit values (the bf16 or fp16 weight copies, moved as they are): half the bytes
CommRequest *comm_all_gather16_start(Comm *c, uint16_t *out, const uint16_t *in, size_t count);
CommRequest *comm_reduce_scatter_start(Comm *c, float *out, const float *in, size_t count);
void comm_wait(CommRequest *r);
// Lets a started operation make progress without waiting for it (MPI moves data only inside
// MPI calls); returns 1 once it has finished. comm_wait is still needed to end it.
int comm_test(CommRequest *r);

// ---- point-to-point on float buffers (counted like the collectives, bounded the same way) -----
// A receive takes exactly the count the peer sent. Messages from one rank to another arrive in
// the order they were sent, whatever their sizes (one MPI tag; NCCL's own per-peer order).
// MPI progresses every started send and receive at once; NCCL runs a rank's separately started
// ones one after another, each waiting for its peer. So where sends form a cycle (a ring, two
// ranks swapping, a rank sending to itself), use comm_send_recv, which runs both as one step on
// either backend; separate calls fit a chain such as a pipeline's forward pass.
// Whether separately started sends and receives run one after another (NCCL), not all at once (MPI)
bool comm_p2p_in_order(void);
void comm_send(Comm *c, const float *buf, size_t count, int peer);
void comm_recv(Comm *c, float *buf, size_t count, int peer);
// sends send_count floats to dst while receiving recv_count floats from src (MPI_Sendrecv)
void comm_send_recv(Comm *c, const float *send, size_t send_count, int dst, float *recv,
                    size_t recv_count, int src);
// the same, started now and finished by comm_wait / comm_test, so compute can overlap them
CommRequest *comm_send_start(Comm *c, const float *buf, size_t count, int peer);
CommRequest *comm_recv_start(Comm *c, float *buf, size_t count, int peer);
CommRequest *comm_send_recv_start(Comm *c, const float *send, size_t send_count, int dst,
                                  float *recv, size_t recv_count, int src);

// ---- small host values (for losses, norms and checks; not counted as payload) ----------------
double comm_sum_double(Comm *c, double x);
// x[0..n) summed element-wise over the group in one reduction: several numbers, one round trip
void comm_sum_doubles(Comm *c, double *x, int n);
long comm_sum_long(Comm *c, long x);
double comm_max_double(Comm *c, double x);
// Ends the job with a message on every rank unless all ranks passed the same text (e.g. the
// config as JSON): a mismatched config would otherwise give silently different answers.
void comm_check_same(Comm *c, const char *what, const char *text);
// The same for weights that data parallelism keeps identical on every rank of the group (the
// replicas): ends the job unless they all hold the same params[0..n) (device memory); prints
// their hash.
void comm_check_replicas_identical(Comm *c, const float *params, size_t n);
// What a parallel stage does right after config_load: selects the backend cfg's comm_backend
// names (comm_select_backend), then ends the job unless every rank loaded the same config: every
// rank must train the same model on the same batches.
void comm_configure(Comm *world, const Config *cfg);

// ---- accounting -------------------------------------------------------------------------------
typedef struct {
    long calls[COLL_KINDS];
    double bytes[COLL_KINDS];    // sizes as defined above
    double seconds[COLL_KINDS];  // from start to the end of the wait
    double bus_bytes[COLL_KINDS];  // sum of size x bus factor: bus bandwidth = bus_bytes / seconds
} CommStats;
// totals over every group since the start (take differences for one step)
CommStats comm_totals(void);
double comm_stats_bytes(const CommStats *s);
double comm_stats_seconds(const CommStats *s);
// the bytes and milliseconds communicated since `before` (comm_totals() then): one step's figures
void comm_since(const CommStats *before, double *bytes, double *ms);
// rank 0 prints a table per group and kind: calls, MB, ms, algorithmic and bus bandwidth
void comm_print_table(Comm *world);
// The same figures as data, for stats.json: a list of {group, kind, calls, bytes, seconds,
// algbw_GBps, busbw_GBps}, one per group and kind with calls, summed since the start. They are
// this process's counts (the table's are rank 0's); the caller owns the list.
cJSON *comm_stats_json(void);

// ---- the trace (trace.h) on every rank, merged ---------------------------------------------------
// Call on every rank: opens the trace on rank 0's clock (each rank's offset from ping-pongs).
void comm_trace_open(Comm *world, bool enabled, int trace_steps);
// Call on every rank at the end: rank 0 writes <out_dir>/trace.json with every rank's events.
void comm_trace_write(Comm *world, const char *out_dir, bool enabled);

#endif
