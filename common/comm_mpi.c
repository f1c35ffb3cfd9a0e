// comm_mpi.c: the payload operations of comm.h over Open MPI, for buffers in host memory (the
// CPU backend). Each starts non-blocking MPI operations; comm_wait finishes them.
#include <limits.h>
#include <mpi.h>
#include <stdlib.h>

#include "comm_internal.h"
#include "log.h"

// Every point-to-point message of comm.h carries this one tag. MPI delivers messages between two
// ranks with the same tag and communicator in the order they were sent, so the n-th receive a
// rank posts from a peer gets the n-th message that peer sent it: NCCL's matching rule too, so
// code that is right on one backend is right on the other. Collectives cannot match it: MPI keeps
// their traffic apart from point-to-point traffic on the same communicator.
enum { P2P_TAG = 0 };

void comm_backend_init_group(Comm *c) { (void)c; }
void comm_backend_free_group(Comm *c) { (void)c; }

void comm_backend_wait(CommRequest *r) { comm_wait_mpi(r->mpi, 2, COMM_KIND_NAMES[r->kind], r->comm->name); }

double comm_backend_seconds(const CommRequest *r) { return wall_seconds() - r->start; }

int comm_backend_test(CommRequest *r) {
    int done = 0;
    comm_check_mpi(MPI_Testall(2, r->mpi, &done, MPI_STATUSES_IGNORE), COMM_KIND_NAMES[r->kind]);
    return done;
}

// MPI counts and offsets are int: a larger one would silently wrap, so refuse it
static int mpi_count(size_t count, const char *what) {
    if (count > INT_MAX)
        fatal("%s of %zu floats: MPI counts and offsets stop at %d; split the buffer", what, count, INT_MAX);
    return (int)count;
}

// n counts or offsets as MPI wants them; the caller frees the array
static int *mpi_counts(const size_t *counts, int n, const char *what) {
    int *out = malloc_or_die((size_t)n * sizeof *out);
    for (int i = 0; i < n; i++) out[i] = mpi_count(counts[i], what);
    return out;
}

CommRequest *comm_all_reduce_start(Comm *c, float *buf, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_REDUCE, 4.0 * count);
    comm_check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buf, mpi_count(count, "all-reduce"), MPI_FLOAT, MPI_SUM, c->mpi,
                                  &r->mpi[0]),
                   "all-reduce");
    return r;
}

CommRequest *comm_all_gather_start(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_GATHER, 4.0 * count * c->size);
    int n = mpi_count(count, "all-gather");
    comm_check_mpi(MPI_Iallgather(in, n, MPI_FLOAT, out, n, MPI_FLOAT, c->mpi, &r->mpi[0]), "all-gather");
    return r;
}

CommRequest *comm_all_gather16_start(Comm *c, uint16_t *out, const uint16_t *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_GATHER, 2.0 * count * c->size);
    int n = mpi_count(count, "all-gather");
    comm_check_mpi(MPI_Iallgather(in, n, MPI_UINT16_T, out, n, MPI_UINT16_T, c->mpi, &r->mpi[0]), "all-gather");
    return r;
}

CommRequest *comm_reduce_scatter_start(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_REDUCE_SCATTER, 4.0 * count * c->size);
    comm_check_mpi(MPI_Ireduce_scatter_block(in, out, mpi_count(count, "reduce-scatter"), MPI_FLOAT, MPI_SUM,
                                             c->mpi, &r->mpi[0]),
                   "reduce-scatter");
    return r;
}

void comm_broadcast(Comm *c, float *buf, size_t count, int root) {
    comm_check_peer(c, root, "broadcast");
    CommRequest *r = comm_new_request(c, COLL_BROADCAST, 4.0 * count);
    comm_check_mpi(MPI_Ibcast(buf, mpi_count(count, "broadcast"), MPI_FLOAT, root, c->mpi, &r->mpi[0]), "broadcast");
    comm_wait(r);
}

void comm_all_to_all(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_TO_ALL, 4.0 * count * c->size);
    int n = mpi_count(count, "all-to-all");
    comm_check_mpi(MPI_Ialltoall(in, n, MPI_FLOAT, out, n, MPI_FLOAT, c->mpi, &r->mpi[0]), "all-to-all");
    comm_wait(r);
}

void comm_all_to_all_v(Comm *c, float *out, const size_t *recv_counts, const size_t *recv_offsets,
                       const float *in, const size_t *send_counts, const size_t *send_offsets) {
    const char *what = "all-to-all-v";
    int n = c->size;
    int *sc = mpi_counts(send_counts, n, what), *so = mpi_counts(send_offsets, n, what);
    int *rc = mpi_counts(recv_counts, n, what), *ro = mpi_counts(recv_offsets, n, what);
    CommRequest *r = comm_new_request(c, COLL_ALL_TO_ALL, 4.0 * comm_total_count(send_counts, n));
    comm_check_mpi(MPI_Ialltoallv(in, sc, so, MPI_FLOAT, out, rc, ro, MPI_FLOAT, c->mpi, &r->mpi[0]), what);
    comm_wait(r);  // MPI reads the count arrays until the operation ends
    free(sc);
    free(so);
    free(rc);
    free(ro);
}

CommRequest *comm_send_start(Comm *c, const float *buf, size_t count, int peer) {
    comm_check_peer(c, peer, "send");
    CommRequest *r = comm_new_request(c, COLL_SEND, 4.0 * count);
    comm_check_mpi(MPI_Isend(buf, mpi_count(count, "send"), MPI_FLOAT, peer, P2P_TAG, c->mpi, &r->mpi[0]), "send");
    return r;
}

CommRequest *comm_recv_start(Comm *c, float *buf, size_t count, int peer) {
    comm_check_peer(c, peer, "recv");
    CommRequest *r = comm_new_request(c, COLL_RECV, 4.0 * count);
    comm_check_mpi(MPI_Irecv(buf, mpi_count(count, "recv"), MPI_FLOAT, peer, P2P_TAG, c->mpi, &r->mpi[0]), "recv");
    return r;
}

CommRequest *comm_send_recv_start(Comm *c, const float *send, size_t send_count, int dst, float *recv,
                                  size_t recv_count, int src) {
    const char *what = "send-recv";
    comm_check_peer(c, dst, what);
    comm_check_peer(c, src, what);
    CommRequest *r = comm_new_request(c, COLL_SEND_RECV, 4.0 * send_count);
    // both in flight at once, which is what makes a ring of them safe
    comm_check_mpi(MPI_Irecv(recv, mpi_count(recv_count, what), MPI_FLOAT, src, P2P_TAG, c->mpi, &r->mpi[0]), what);
    comm_check_mpi(MPI_Isend(send, mpi_count(send_count, what), MPI_FLOAT, dst, P2P_TAG, c->mpi, &r->mpi[1]), what);
    return r;
}
