// comm_nccl.c: the payload operations of comm.h over NCCL, for buffers in GPU memory (the CUDA
// backend). Ranks that share a GPU cannot use NCCL (one rank per GPU): when a host runs more ranks
// than it has GPUs, or the config says comm_backend: mpi, every operation goes over MPI instead
// (comm_mpi.c), device buffers staged through pinned host memory unless the MPI library is
// CUDA-aware (asked at run time), with the same bounded waits, accounting and trace.
// Otherwise each group of two or more ranks gets its own NCCL communicator, bootstrapped by
// broadcasting rank 0's unique id over the group's MPI communicator, and its own stream, so
// communication can overlap the compute stream. A group of one rank has no communicator: its
// collectives are copies on the compute stream.
//
// Ordering, and why nothing waits on the host:
//   - a collective waits for the compute issued before it (an event the comm stream waits for);
//   - comm_wait makes the compute stream wait for the collective's event and returns at once: the
//     host runs ahead and queues the next compute, which is what lets communication overlap it;
//   - the host blocks only where the ops must (a copy to the host, a sum, dev_synchronize); while
//     it waits there, watch() checks every collective the compute stream waits for: finished ones
//     have their GPU time booked, a failed one (ncclCommGetAsyncError) or one past COMM_TIMEOUT
//     aborts its communicator and ends the job with a message, so a dead peer cannot hang it;
//   - communicators are non-blocking: set-up and every call that returns ncclInProgress are
//     polled against the same deadline (settle).
// Several communicators can have collectives in flight together (FSDP's prefetch all-gather
// beside its reduce-scatters are one communicator; stage 05's depth all-gather beside the x and
// y all-reduces are three). NCCL requires that ranks sharing communicators start their
// operations in one order: every rank runs the same program and starts its collectives in
// program order, so the order is the same on all of them, and no call here synchronises the
// whole device (the ops free memory in stream order), which could otherwise wait for a
// collective whose peers are waiting for us. Point-to-point operations use their group's stream,
// so NCCL runs them in the order they were started; a send-recv and an all-to-all put their sends
// and receives in one NCCL group, which progresses them together
// (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html).
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/device.h"
#include "base/log.h"
#include "comm_internal.h"
#include "flight.h"
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  // MPIX_Query_cuda_support, where Open MPI was built with its CUDA extension
#endif

// true: every operation goes over MPI (comm_mpi.c), for the reason in g_why (the banner's);
// g_staged: device buffers go through pinned host memory (else a CUDA-aware MPI reads them)
static bool g_via_mpi, g_staged;
static char g_why[300];

typedef struct {
    ncclComm_t nccl;
    cudaStream_t stream;
    cudaEvent_t ready;  // recorded on the compute stream before each collective
} NcclGroup;

// A collective the compute stream has been made to wait for, watched until it finishes.
typedef struct {
    Comm *comm;
    CollKind kind;
    cudaEvent_t start, done;  // on the group's stream, around the collective: its GPU time
    double deadline;
    long flight;  // its ticket in the flight recorder, completed when the GPU is done with it
} Watched;

static Watched *g_watched;
static int g_nwatched, g_watched_cap;

#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)

static void cuda_check(cudaError_t e, const char *what, const char *file, int line) {
    if (e != cudaSuccess) fatal("%s:%d: %s: CUDA error: %s", file, line, what, cudaGetErrorString(e));
}

static void nccl_failed(const Comm *c, ncclComm_t nccl, ncclResult_t r, const char *what) {
    fatal("%s on group '%s': NCCL error: %s (%s)", what, c->name, ncclGetErrorString(r),
          nccl ? ncclGetLastError(nccl) : "no communicator");
}

// Frees the GPU from a communicator's collectives before the job ends with a message. Should the
// abort fail too, that is said as well (the GPU may still be held), without hiding the first error.
static void abort_communicator(const Comm *c, ncclComm_t nccl) {
    if (!nccl) return;
    ncclResult_t r = ncclCommAbort(nccl);
    if (r != ncclSuccess)
        fprintf(stderr, "warning: ncclCommAbort on group '%s' failed too: %s\n", c->name, ncclGetErrorString(r));
}

// A non-blocking communicator's calls may return ncclInProgress and go on in NCCL's threads:
// poll until they are done, bounded by COMM_TIMEOUT, so that no NCCL call can hang the job.
static void settle(const Comm *c, ncclComm_t nccl, ncclResult_t r, const char *what) {
    double deadline = wall_seconds() + g_comm_timeout;
    struct timespec nap = {0, 20000};
    while (r == ncclInProgress) {
        if (wall_seconds() > deadline) {
            abort_communicator(c, nccl);
            comm_timeout_exceeded(what, c->name);
        }
        nanosleep(&nap, NULL);
        ncclResult_t q = ncclCommGetAsyncError(nccl, &r);
        if (q != ncclSuccess) r = q;
    }
    if (r != ncclSuccess) nccl_failed(c, nccl, r, what);
}

#define NCCL_CALL(c, g, call) settle((c), (g)->nccl, (call), #call)

static cudaStream_t compute_stream(void) { return (cudaStream_t)dev_stream(); }

// More ranks on a host than GPUs put two ranks on one GPU (ops_init: local rank modulo the GPUs),
// which NCCL refuses: then every rank of the job communicates over MPI. Returns whether any host
// is shared so (every rank gets the same answer) and says which one in g_why.
static bool ranks_share_gpus(Comm *world) {
    MPI_Comm host;
    comm_check_mpi(MPI_Comm_split_type(world->mpi, MPI_COMM_TYPE_SHARED, world->rank, MPI_INFO_NULL, &host),
                   "split by host");
    int ranks_here = 0, gpus = 0;
    MPI_Comm_size(host, &ranks_here);
    MPI_Comm_free(&host);
    if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
    int shared = ranks_here > gpus, any = shared;
    MPI_Request req;
    comm_check_mpi(MPI_Iallreduce(&shared, &any, 1, MPI_INT, MPI_MAX, world->mpi, &req), "ranks per GPU");
    comm_wait_mpi(&req, 1, "ranks per GPU", world->name);
    char name[65] = "this host";  // HOST_NAME_MAX + 1
    gethostname(name, sizeof name);
    if (shared)
        snprintf(g_why, sizeof g_why, "%d ranks share %s's %d GPU%s, and NCCL needs a GPU per rank", ranks_here,
                 name, gpus, gpus == 1 ? "" : "s");
    else if (any)
        snprintf(g_why, sizeof g_why, "ranks share the GPUs of another host, and NCCL needs a GPU per rank");
    return any;
}

// Whether the MPI library reads and writes GPU memory itself: Open MPI built with CUDA says so at
// run time (the library loaded may differ from the one compiled against).
static bool mpi_is_cuda_aware(void) {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    return MPIX_Query_cuda_support() == 1;
#else
    return false;
#endif
}

// Switches every operation to MPI, staging through pinned host memory unless MPI reads GPU memory.
static void use_mpi(bool force_staging) {
    g_via_mpi = true;
    g_staged = force_staging || !mpi_is_cuda_aware();
    mpi_path_set_staged(g_staged);
}

static void watch(void);

bool comm_p2p_in_order(void) { return !g_via_mpi; }

void comm_backend_init_group(Comm *c) {
    ops_init();  // picks this rank's GPU: the communicator is bound to the current device
    if (c->mpi == MPI_COMM_WORLD) {
        if (ranks_share_gpus(c)) use_mpi(false);
        dev_on_wait(watch);
    }
    if (g_via_mpi || c->size == 1) return;  // MPI, or a group of one: no communicator
    NcclGroup *g = calloc_or_die(1, sizeof *g);
    ncclUniqueId id;
    if (c->rank == 0) settle(c, NULL, ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Request req;
    comm_check_mpi(MPI_Ibcast(&id, sizeof id, MPI_BYTE, 0, c->mpi, &req), "NCCL id broadcast");
    comm_wait_mpi(&req, 1, "NCCL id broadcast", c->name);
    // non-blocking set-up: a rank that died before reaching it ends the job after COMM_TIMEOUT
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&g->nccl, c->size, id, c->rank, &config);
    settle(c, g->nccl, r, "NCCL communicator set-up (ncclCommInitRankConfig)");
    CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&g->ready, cudaEventDisableTiming));
    c->backend = g;
}

void comm_backend_free_group(Comm *c) {
    if (c->mpi == MPI_COMM_WORLD) mpi_path_free_staging();  // the last group freed
    NcclGroup *g = c->backend;
    if (!g) return;
    dev_synchronize();  // every collective waited for has finished, and its time is booked
    NCCL_CALL(c, g, ncclCommFinalize(g->nccl));
    ncclResult_t r = ncclCommDestroy(g->nccl);
    if (r != ncclSuccess) nccl_failed(c, NULL, r, "ncclCommDestroy");
    CUDA_CHECK(cudaStreamDestroy(g->stream));
    CUDA_CHECK(cudaEventDestroy(g->ready));
    free(g);
    c->backend = NULL;
}

// The collective must see what the compute stream wrote before it was called. One event per
// group serves every call: cudaStreamWaitEvent waits for the record made just before it, and a
// later record does not change what an earlier wait waits for.
static NcclGroup *begin(Comm *c, CommRequest *r) {
    NcclGroup *g = c->backend;
    CUDA_CHECK(cudaEventRecord(g->ready, compute_stream()));
    CUDA_CHECK(cudaStreamWaitEvent(g->stream, g->ready, 0));
    cudaEvent_t *ev = calloc_or_die(2, sizeof *ev);  // start, done: timed, for the GPU's own clock
    CUDA_CHECK(cudaEventCreate(&ev[0]));
    CUDA_CHECK(cudaEventCreate(&ev[1]));
    CUDA_CHECK(cudaEventRecord(ev[0], g->stream));
    r->event = ev;
    if (r->launch_mark >= 0) r->launch_mark = dev_mark_stream(g->stream);  // the trace's, likewise
    return g;
}

static CommRequest *end(CommRequest *r, NcclGroup *g) {
    cudaEvent_t *ev = r->event;
    CUDA_CHECK(cudaEventRecord(ev[1], g->stream));
    if (r->launch_mark >= 0) r->end_mark = dev_mark_stream(g->stream);
    return r;
}

static void book_gpu_time(Comm *c, CollKind kind, cudaEvent_t start, cudaEvent_t done) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, done));
    c->stats.seconds[kind] += ms / 1e3;
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(done));
}

// 1 when the collective whose end is `done` has finished; 0 while it runs; ends the job when its
// communicator reports an error or the deadline has passed
static int collective_finished(Comm *c, CollKind kind, cudaEvent_t done, double deadline) {
    cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) return 1;
    if (e != cudaErrorNotReady) cuda_check(e, COMM_KIND_NAMES[kind], __FILE__, __LINE__);
    NcclGroup *g = c->backend;
    ncclResult_t async;
    ncclResult_t q = ncclCommGetAsyncError(g->nccl, &async);
    if (q != ncclSuccess) async = q;
    if (async != ncclSuccess && async != ncclInProgress) {
        abort_communicator(c, g->nccl);
        nccl_failed(c, NULL, async, COMM_KIND_NAMES[kind]);
    }
    if (wall_seconds() > deadline) {
        abort_communicator(c, g->nccl);  // frees the GPU from the collective before we exit
        comm_timeout_exceeded(COMM_KIND_NAMES[kind], c->name);
    }
    return 0;
}

// 1 when w has finished (its time booked); 0 while it runs; ends the job when it failed or is late
static int watched_finished(Watched *w) {
    if (!collective_finished(w->comm, w->kind, w->done, w->deadline)) return 0;
    book_gpu_time(w->comm, w->kind, w->start, w->done);
    flight_completed(w->flight);
    return 1;
}

// dev_on_wait's check: drops the finished collectives, ends the job on a failed or late one
static void watch(void) {
    int kept = 0;
    for (int i = 0; i < g_nwatched; i++)
        if (!watched_finished(&g_watched[i])) g_watched[kept++] = g_watched[i];
    g_nwatched = kept;
}

static void add_watched(CommRequest *r, cudaEvent_t start, cudaEvent_t done) {
    if (g_nwatched == g_watched_cap) {
        g_watched_cap = g_watched_cap ? 2 * g_watched_cap : 64;
        g_watched = realloc(g_watched, (size_t)g_watched_cap * sizeof *g_watched);
        if (!g_watched) fatal("out of host memory for the list of collectives in flight");
    }
    g_watched[g_nwatched++] = (Watched){r->comm, r->kind, start, done, wall_seconds() + g_comm_timeout, r->flight};
    r->flight = -1;  // not complete when comm_wait returns: the GPU has yet to run it
}

// Stream-ordered: later compute waits for the collective on the GPU; the host goes on.
void comm_backend_wait(CommRequest *r) {
    if (g_via_mpi) {
        mpi_path_wait(r);
        return;
    }
    cudaEvent_t *ev = r->event;
    if (!ev) return;  // a group of one: a copy on the compute stream, already in order
    CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), ev[1], 0));
    add_watched(r, ev[0], ev[1]);
    free(ev);
    watch();
}

// Polled by a caller that overlaps compute with the operation: bounded like a wait, so a peer
// that never joins ends the job after COMM_TIMEOUT, and a failed communicator ends it at once.
int comm_backend_test(CommRequest *r) {
    if (g_via_mpi) return mpi_path_test(r);
    cudaEvent_t *ev = r->event;
    if (!ev) return 1;
    if (!collective_finished(r->comm, r->kind, ev[1], r->start + g_comm_timeout)) return 0;
    // finish the ordering and clean-up that comm_backend_wait would do
    CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), ev[1], 0));
    book_gpu_time(r->comm, r->kind, ev[0], ev[1]);
    free(ev);
    return 1;
}

double comm_backend_seconds(const CommRequest *r) {
    if (g_via_mpi) return mpi_path_seconds(r);
    return 0;  // booked by book_gpu_time
}

void *comm_host_alloc(size_t bytes) {
    void *p = NULL;
    cudaError_t e = cudaMallocHost(&p, bytes);
    if (e != cudaSuccess)
        fatal("cannot pin %zu bytes of host memory for staging GPU buffers: %s", bytes, cudaGetErrorString(e));
    return p;
}

void comm_host_free(void *ptr) { CUDA_CHECK(cudaFreeHost(ptr)); }

// NCCL was set up for the world at comm_init (when the ranks have a GPU each); asking for MPI
// frees that communicator before any other group exists.
void comm_select_backend(Comm *world, const char *comm_backend) {
    bool staged = strcmp(comm_backend, "mpi-staged") == 0;
    if (strcmp(comm_backend, "nccl") == 0 && g_via_mpi)
        fatal("key 'comm_backend' is \"nccl\" but %s: use auto or mpi", g_why);
    if (staged || strcmp(comm_backend, "mpi") == 0) {
        if (!g_via_mpi) {
            comm_backend_free_group(world);
            snprintf(g_why, sizeof g_why, "asked for (comm_backend: %s)", comm_backend);
        }
        use_mpi(staged);
    }
    if (world->rank != 0) return;
    if (!g_via_mpi) printf("communication: NCCL, a GPU per rank\n");
    else
        printf("communication: MPI (%s), device buffers %s\n", g_why,
               g_staged ? "staged through pinned host memory" : "handed to the CUDA-aware MPI library");
}

// A group of one: the collective is a copy of count floats (or nothing when in place).
static CommRequest *lone(CommRequest *r, float *out, const float *in, size_t count) {
    if (out != in) dev_copy(out, in, count * sizeof(float));
    return r;
}

CommRequest *comm_all_reduce_start(Comm *c, float *buf, size_t count) {
    if (g_via_mpi) return mpi_path_all_reduce_start(c, buf, count);
    CommRequest *r = comm_new_request(c, COLL_ALL_REDUCE, 4.0 * count);
    if (!c->backend) return r;  // the sum over one rank
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclAllReduce(buf, buf, count, ncclFloat, ncclSum, g->nccl, g->stream));
    return end(r, g);
}

CommRequest *comm_all_gather_start(Comm *c, float *out, const float *in, size_t count) {
    if (g_via_mpi) return mpi_path_all_gather_start(c, out, in, count);
    CommRequest *r = comm_new_request(c, COLL_ALL_GATHER, 4.0 * count * c->size);
    if (!c->backend) return lone(r, out, in, count);
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclAllGather(in, out, count, ncclFloat, g->nccl, g->stream));
    return end(r, g);
}

// 16-bit values move as pairs of bytes: a gather does no arithmetic, so the type is only a size
CommRequest *comm_all_gather16_start(Comm *c, uint16_t *out, const uint16_t *in, size_t count) {
    if (g_via_mpi) return mpi_path_all_gather16_start(c, out, in, count);
    CommRequest *r = comm_new_request(c, COLL_ALL_GATHER, 2.0 * count * c->size);
    if (!c->backend) {
        if (out != in) dev_copy(out, in, count * sizeof(uint16_t));
        return r;
    }
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclAllGather(in, out, 2 * count, ncclUint8, g->nccl, g->stream));
    return end(r, g);
}

CommRequest *comm_reduce_scatter_start(Comm *c, float *out, const float *in, size_t count) {
    if (g_via_mpi) return mpi_path_reduce_scatter_start(c, out, in, count);
    CommRequest *r = comm_new_request(c, COLL_REDUCE_SCATTER, 4.0 * count * c->size);
    if (!c->backend) return lone(r, out, in, count);
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclReduceScatter(in, out, count, ncclFloat, ncclSum, g->nccl, g->stream));
    return end(r, g);
}

void comm_broadcast(Comm *c, float *buf, size_t count, int root) {
    if (g_via_mpi) {
        mpi_path_broadcast(c, buf, count, root);
        return;
    }
    comm_check_peer(c, root, "broadcast");
    CommRequest *r = comm_new_request(c, COLL_BROADCAST, 4.0 * count);
    if (c->backend) {
        NcclGroup *g = begin(c, r);
        NCCL_CALL(c, g, ncclBroadcast(buf, buf, count, ncclFloat, root, g->nccl, g->stream));
        end(r, g);
    }
    comm_wait(r);
}

// Queues this rank's part of an exchange inside an NCCL group. A zero count queues nothing: the
// peer's matching count is zero too (comm.h), so both sides skip the pair.
static void queue_send_recv(const Comm *c, NcclGroup *g, const float *send, size_t send_count, int dst,
                            float *recv, size_t recv_count, int src) {
    if (send_count) NCCL_CALL(c, g, ncclSend(send, send_count, ncclFloat, dst, g->nccl, g->stream));
    if (recv_count) NCCL_CALL(c, g, ncclRecv(recv, recv_count, ncclFloat, src, g->nccl, g->stream));
}

void comm_all_to_all(Comm *c, float *out, const float *in, size_t count) {
    if (g_via_mpi) {
        mpi_path_all_to_all(c, out, in, count);
        return;
    }
    CommRequest *r = comm_new_request(c, COLL_ALL_TO_ALL, 4.0 * count * c->size);
    if (!c->backend) {
        comm_wait(lone(r, out, in, count));
        return;
    }
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclGroupStart());
    for (int p = 0; p < c->size; p++)
        queue_send_recv(c, g, in + (size_t)p * count, count, p, out + (size_t)p * count, count, p);
    NCCL_CALL(c, g, ncclGroupEnd());
    comm_wait(end(r, g));
}

void comm_all_to_all_v(Comm *c, float *out, const size_t *recv_counts, const size_t *recv_offsets,
                       const float *in, const size_t *send_counts, const size_t *send_offsets) {
    if (g_via_mpi) {
        mpi_path_all_to_all_v(c, out, recv_counts, recv_offsets, in, send_counts, send_offsets);
        return;
    }
    CommRequest *r = comm_new_request(c, COLL_ALL_TO_ALL, 4.0 * comm_total_count(send_counts, c->size));
    if (!c->backend) {
        comm_wait(lone(r, out + recv_offsets[0], in + send_offsets[0], send_counts[0]));
        return;
    }
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclGroupStart());
    for (int p = 0; p < c->size; p++)
        queue_send_recv(c, g, in + send_offsets[p], send_counts[p], p, out + recv_offsets[p], recv_counts[p], p);
    NCCL_CALL(c, g, ncclGroupEnd());
    comm_wait(end(r, g));
}

// A lone send or receive needs a peer: in a group of one there is none to match it.
static void require_peer_group(const Comm *c, const char *what) {
    if (!c->backend) fatal("%s on group '%s' of one rank: there is no other rank to exchange with", what, c->name);
}

CommRequest *comm_send_start(Comm *c, const float *buf, size_t count, int peer) {
    if (g_via_mpi) return mpi_path_send_start(c, buf, count, peer);
    comm_check_peer(c, peer, "send");
    require_peer_group(c, "send");
    CommRequest *r = comm_new_p2p_request(c, COLL_SEND, 4.0 * count, peer, -1);
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclSend(buf, count, ncclFloat, peer, g->nccl, g->stream));
    return end(r, g);
}

CommRequest *comm_recv_start(Comm *c, float *buf, size_t count, int peer) {
    if (g_via_mpi) return mpi_path_recv_start(c, buf, count, peer);
    comm_check_peer(c, peer, "recv");
    require_peer_group(c, "recv");
    CommRequest *r = comm_new_p2p_request(c, COLL_RECV, 4.0 * count, -1, peer);
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclRecv(buf, count, ncclFloat, peer, g->nccl, g->stream));
    return end(r, g);
}

CommRequest *comm_send_recv_start(Comm *c, const float *send, size_t send_count, int dst, float *recv,
                                  size_t recv_count, int src) {
    if (g_via_mpi) return mpi_path_send_recv_start(c, send, send_count, dst, recv, recv_count, src);
    comm_check_peer(c, dst, "send-recv");
    comm_check_peer(c, src, "send-recv");
    CommRequest *r = comm_new_p2p_request(c, COLL_SEND_RECV, 4.0 * send_count, dst, src);
    if (!c->backend) return lone(r, recv, send, send_count);  // to itself
    NcclGroup *g = begin(c, r);
    NCCL_CALL(c, g, ncclGroupStart());
    queue_send_recv(c, g, send, send_count, dst, recv, recv_count, src);
    NCCL_CALL(c, g, ncclGroupEnd());
    return end(r, g);
}
