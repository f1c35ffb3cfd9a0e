// comm_nccl.c: the payload operations of comm.h over NCCL, for buffers in GPU memory (the CUDA
// backend). Each group gets its own NCCL communicator, bootstrapped by broadcasting rank 0's
// unique id over the group's MPI communicator, and its own stream, so communication can overlap
// the compute stream. A collective waits for the compute issued before it (an event), and
// comm_wait polls its completion with the same timeout as the MPI backend. Point-to-point
// operations use the same stream, so NCCL runs them in the order they were started; a send-recv
// and an all-to-all put their sends and receives in one NCCL group, which progresses them
// together (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html).
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdlib.h>
#include <time.h>

#include "comm_internal.h"
#include "log.h"
#include "ops.h"

typedef struct {
    ncclComm_t nccl;
    cudaStream_t stream;
    cudaEvent_t ready;  // recorded on the compute stream before each collective
} NcclGroup;

#define NCCL_CHECK(call) nccl_check((call), #call, __FILE__, __LINE__)
#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)

static void nccl_check(ncclResult_t r, const char *what, const char *file, int line) {
    if (r != ncclSuccess) fatal("%s:%d: %s: NCCL error: %s", file, line, what, ncclGetErrorString(r));
}

static void cuda_check(cudaError_t e, const char *what, const char *file, int line) {
    if (e != cudaSuccess) fatal("%s:%d: %s: CUDA error: %s", file, line, what, cudaGetErrorString(e));
}

static cudaStream_t compute_stream(void) { return (cudaStream_t)ops_stream(); }

void comm_backend_init_group(Comm *c) {
    ops_init();  // picks this rank's GPU: the communicator is bound to the current device
    NcclGroup *g = calloc_or_die(1, sizeof *g);
    ncclUniqueId id;
    if (c->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_Request req;
    comm_check_mpi(MPI_Ibcast(&id, sizeof id, MPI_BYTE, 0, c->mpi, &req), "NCCL id broadcast");
    comm_wait_mpi(&req, 1, "NCCL id broadcast", c->name);
    NCCL_CHECK(ncclCommInitRank(&g->nccl, c->size, id, c->rank));
    CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&g->ready, cudaEventDisableTiming));
    c->backend = g;
}

void comm_backend_free_group(Comm *c) {
    NcclGroup *g = c->backend;
    if (!g) return;
    ncclCommDestroy(g->nccl);
    cudaStreamDestroy(g->stream);
    cudaEventDestroy(g->ready);
    free(g);
    c->backend = NULL;
}

// The collective must see what the compute stream wrote before it was called. One event per
// group serves every call: cudaStreamWaitEvent waits for the record made just before it, and a
// later record does not change what an earlier wait waits for.
static NcclGroup *begin(Comm *c) {
    NcclGroup *g = c->backend;
    CUDA_CHECK(cudaEventRecord(g->ready, compute_stream()));
    CUDA_CHECK(cudaStreamWaitEvent(g->stream, g->ready, 0));
    return g;
}

static CommRequest *end(CommRequest *r, NcclGroup *g) {
    cudaEvent_t done;
    CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(done, g->stream));
    r->event = done;
    return r;
}

void comm_backend_wait(CommRequest *r) {
    NcclGroup *g = r->comm->backend;
    cudaEvent_t done = r->event;
    double deadline = wall_seconds() + g_comm_timeout;
    struct timespec nap = {0, 20000};
    for (;;) {
        cudaError_t e = cudaEventQuery(done);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) cuda_check(e, COMM_KIND_NAMES[r->kind], __FILE__, __LINE__);
        ncclResult_t async;
        NCCL_CHECK(ncclCommGetAsyncError(g->nccl, &async));
        NCCL_CHECK(async);
        if (wall_seconds() > deadline) {
            ncclCommAbort(g->nccl);  // frees the GPU from the collective before we exit
            comm_timeout_exceeded(COMM_KIND_NAMES[r->kind], r->comm->name);
        }
        nanosleep(&nap, NULL);
    }
    // later compute on the compute stream must see the result
    CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), done, 0));
    CUDA_CHECK(cudaEventDestroy(done));
}

int comm_backend_test(CommRequest *r) {
    cudaError_t e = cudaEventQuery((cudaEvent_t)r->event);
    if (e == cudaErrorNotReady) return 0;
    cuda_check(e, COMM_KIND_NAMES[r->kind], __FILE__, __LINE__);
    // finish the ordering and clean-up that comm_backend_wait would do
    CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), (cudaEvent_t)r->event, 0));
    CUDA_CHECK(cudaEventDestroy((cudaEvent_t)r->event));
    return 1;
}

CommRequest *comm_all_reduce_start(Comm *c, float *buf, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_REDUCE, 4.0 * count);
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclAllReduce(buf, buf, count, ncclFloat, ncclSum, g->nccl, g->stream));
    return end(r, g);
}

CommRequest *comm_all_gather_start(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_GATHER, 4.0 * count * c->size);
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclAllGather(in, out, count, ncclFloat, g->nccl, g->stream));
    return end(r, g);
}

CommRequest *comm_reduce_scatter_start(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_REDUCE_SCATTER, 4.0 * count * c->size);
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclReduceScatter(in, out, count, ncclFloat, ncclSum, g->nccl, g->stream));
    return end(r, g);
}

void comm_broadcast(Comm *c, float *buf, size_t count, int root) {
    comm_check_peer(c, root, "broadcast");
    CommRequest *r = comm_new_request(c, COLL_BROADCAST, 4.0 * count);
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclBroadcast(buf, buf, count, ncclFloat, root, g->nccl, g->stream));
    comm_wait(end(r, g));
}

// Queues this rank's part of an exchange inside an NCCL group. A zero count queues nothing: the
// peer's matching count is zero too (comm.h), so both sides skip the pair.
static void queue_send_recv(NcclGroup *g, const float *send, size_t send_count, int dst, float *recv,
                            size_t recv_count, int src) {
    if (send_count) NCCL_CHECK(ncclSend(send, send_count, ncclFloat, dst, g->nccl, g->stream));
    if (recv_count) NCCL_CHECK(ncclRecv(recv, recv_count, ncclFloat, src, g->nccl, g->stream));
}

void comm_all_to_all(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_TO_ALL, 4.0 * count * c->size);
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < c->size; p++)
        queue_send_recv(g, in + (size_t)p * count, count, p, out + (size_t)p * count, count, p);
    NCCL_CHECK(ncclGroupEnd());
    comm_wait(end(r, g));
}

void comm_all_to_all_v(Comm *c, float *out, const size_t *recv_counts, const size_t *recv_offsets,
                       const float *in, const size_t *send_counts, const size_t *send_offsets) {
    CommRequest *r = comm_new_request(c, COLL_ALL_TO_ALL, 4.0 * comm_total_count(send_counts, c->size));
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < c->size; p++)
        queue_send_recv(g, in + send_offsets[p], send_counts[p], p, out + recv_offsets[p], recv_counts[p], p);
    NCCL_CHECK(ncclGroupEnd());
    comm_wait(end(r, g));
}

CommRequest *comm_send_start(Comm *c, const float *buf, size_t count, int peer) {
    comm_check_peer(c, peer, "send");
    CommRequest *r = comm_new_request(c, COLL_SEND, 4.0 * count);
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclSend(buf, count, ncclFloat, peer, g->nccl, g->stream));
    return end(r, g);
}

CommRequest *comm_recv_start(Comm *c, float *buf, size_t count, int peer) {
    comm_check_peer(c, peer, "recv");
    CommRequest *r = comm_new_request(c, COLL_RECV, 4.0 * count);
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclRecv(buf, count, ncclFloat, peer, g->nccl, g->stream));
    return end(r, g);
}

CommRequest *comm_send_recv_start(Comm *c, const float *send, size_t send_count, int dst, float *recv,
                                  size_t recv_count, int src) {
    comm_check_peer(c, dst, "send-recv");
    comm_check_peer(c, src, "send-recv");
    CommRequest *r = comm_new_request(c, COLL_SEND_RECV, 4.0 * send_count);
    NcclGroup *g = begin(c);
    NCCL_CHECK(ncclGroupStart());
    queue_send_recv(g, send, send_count, dst, recv, recv_count, src);
    NCCL_CHECK(ncclGroupEnd());
    return end(r, g);
}
