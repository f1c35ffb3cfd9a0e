// comm_mpi.c: the payload operations of comm.h over Open MPI (the mpi_path_* functions of
// comm_internal.h). Each starts non-blocking MPI operations; comm_wait finishes them. Both backends
// use it: the CPU backend for every group (comm_cpu.c), the CUDA backend when ranks share a GPU or
// the config asks for MPI (comm_nccl.c).
//
// The buffers are device buffers (comm.h). MPI reads and writes them directly when it can: on the
// CPU backend they are host memory, and a CUDA-aware MPI reads GPU memory. Otherwise they are
// staged: the input is copied into a host block when the operation starts and the output copied
// back to the device when it finishes (pinned memory on the CUDA backend, which the GPU copies at
// full speed; plain memcpy on the CPU backend, where comm_backend=mpi-staged runs this path so that
// the tests check it).
#include <limits.h>
#include <mpi.h>
#include <stdlib.h>

#include "base/device.h"
#include "base/log.h"
#include "comm_internal.h"

// Every point-to-point message of comm.h carries this one tag. MPI delivers messages between two
// ranks with the same tag and communicator in the order they were sent, so the n-th receive a
// rank posts from a peer gets the n-th message that peer sent it: NCCL's matching rule too, so
// code that is right on one backend is right on the other. Collectives cannot match it: MPI keeps
// their traffic apart from point-to-point traffic on the same communicator.
enum { P2P_TAG = 0 };

static bool g_staged;  // buffers go through host blocks (mpi_path_set_staged)

void mpi_path_set_staged(bool staged) { g_staged = staged; }

// ---- host blocks for staging ------------------------------------------------------------------

// Kept for reuse: pinned memory takes milliseconds to allocate, and every step stages the same
// sizes again. A block is busy from the start of an operation to its end.
typedef struct {
    void *ptr;
    size_t bytes;
    bool busy;
} HostBlock;
static HostBlock *g_blocks;
static int g_nblocks;

// The smallest free block that holds `bytes`; else a free one too small is given a new size, or
// a new block is made: at most as many blocks as operations were ever in flight at once.
static int take_block(size_t bytes) {
    int best = -1, small = -1;
    for (int i = 0; i < g_nblocks; i++) {
        if (g_blocks[i].busy) continue;
        if (g_blocks[i].bytes >= bytes && (best < 0 || g_blocks[i].bytes < g_blocks[best].bytes)) best = i;
        if (g_blocks[i].bytes < bytes) small = i;
    }
    if (best < 0 && small >= 0) {
        comm_host_free(g_blocks[small].ptr);
        best = small;
    } else if (best < 0) {
        g_blocks = realloc(g_blocks, (size_t)(g_nblocks + 1) * sizeof *g_blocks);
        if (!g_blocks) fatal("out of host memory for the list of staging blocks");
        best = g_nblocks++;
        g_blocks[best] = (HostBlock){NULL, 0, false};
    }
    if (g_blocks[best].bytes < bytes) {
        g_blocks[best].ptr = comm_host_alloc(bytes);
        g_blocks[best].bytes = bytes;
    }
    g_blocks[best].busy = true;
    return best;
}

void mpi_path_free_staging(void) {
    for (int i = 0; i < g_nblocks; i++) comm_host_free(g_blocks[i].ptr);
    free(g_blocks);
    g_blocks = NULL;
    g_nblocks = 0;
}

// What the end of a staged operation copies back: out_bytes from the block at out_offset to dev_out.
typedef struct {
    int block;
    void *dev_out;
    size_t out_offset, out_bytes;
} Staging;

static size_t round_up64(size_t n) { return (n + 63) / 64 * 64; }

// Where MPI reads the input (*host_in) and writes the output (the result): the buffers themselves
// once the device has finished writing them, or, staged, a host block holding a copy of the input
// and room for the output. out == in is an operation in place (one region); NULL and 0 bytes: no
// input (a receive) or no output (a send). with_gaps: MPI writes only parts of the output, and the
// rest must keep its values (an all-to-all-v's gaps), so the output is copied in too.
static void *host_view(CommRequest *r, void *out, size_t out_bytes, const void *in, size_t in_bytes,
                       const void **host_in, bool with_gaps) {
    bool in_place = out == in;
    // In a group of one, an operation in place moves nothing (MPI touches none of its bytes, as
    // NCCL's path skips it): nothing to stage, and the buffer may be one this rank does not hold.
    if (!g_staged || (in_place && r->comm->size == 1)) {
        dev_synchronize();  // what the ops wrote is in memory before MPI reads it
        *host_in = in;
        return out;
    }
    // never the output's address, even for an empty input: Open MPI's non-blocking collectives
    // take a send buffer equal to the receive buffer for MPI_IN_PLACE (a rank of an all-to-all-v
    // that sends nothing then sent its receive buffer, and the job hung)
    size_t in_region = in_place ? 0 : round_up64(in_bytes + 1);
    Staging *s = calloc_or_die(1, sizeof *s);
    s->block = take_block(in_region + out_bytes + 1);  // + 1: a block even for an empty message
    char *host = g_blocks[s->block].ptr;
    copy_to_host(host, in, in_bytes);
    if (with_gaps && !in_place) copy_to_host(host + in_region, out, out_bytes);
    *host_in = host;
    s->dev_out = out;
    s->out_offset = in_region;
    s->out_bytes = out_bytes;
    r->staging = s;
    return host + in_region;
}

// Ends a finished operation: a staged output goes back to the device, and its block is free again.
static void finish(CommRequest *r) {
    Staging *s = r->staging;
    if (!s) return;
    copy_to_device(s->dev_out, (char *)g_blocks[s->block].ptr + s->out_offset, s->out_bytes);
    g_blocks[s->block].busy = false;
    free(s);
    r->staging = NULL;
}

void mpi_path_wait(CommRequest *r) {
    comm_wait_mpi(r->mpi, 2, COMM_KIND_NAMES[r->kind], r->comm->name);
    finish(r);
}

double mpi_path_seconds(const CommRequest *r) { return wall_seconds() - r->start; }

int mpi_path_test(CommRequest *r) {
    int done = 0;
    comm_check_mpi(MPI_Testall(2, r->mpi, &done, MPI_STATUSES_IGNORE), COMM_KIND_NAMES[r->kind]);
    if (done) finish(r);
    return done;
}

// ---- the operations ---------------------------------------------------------------------------

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

// the floats an all-to-all-v touches from the start of its buffer: the end of the farthest block
static size_t extent(const size_t *counts, const size_t *offsets, int n) {
    size_t end = 0;
    for (int i = 0; i < n; i++)
        if (counts[i] && offsets[i] + counts[i] > end) end = offsets[i] + counts[i];
    return end;
}

CommRequest *mpi_path_all_reduce_start(Comm *c, float *buf, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_REDUCE, 4.0 * count);
    const void *unused;
    float *h = host_view(r, buf, 4 * count, buf, 4 * count, &unused, false);
    comm_check_mpi(MPI_Iallreduce(MPI_IN_PLACE, h, mpi_count(count, "all-reduce"), MPI_FLOAT, MPI_SUM, c->mpi,
                                  &r->mpi[0]),
                   "all-reduce");
    return r;
}

CommRequest *mpi_path_all_gather_start(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_GATHER, 4.0 * count * c->size);
    int n = mpi_count(count, "all-gather");
    const void *h_in;
    float *h_out = host_view(r, out, 4 * count * (size_t)c->size, in, 4 * count, &h_in, false);
    comm_check_mpi(MPI_Iallgather(h_in, n, MPI_FLOAT, h_out, n, MPI_FLOAT, c->mpi, &r->mpi[0]), "all-gather");
    return r;
}

CommRequest *mpi_path_all_gather16_start(Comm *c, uint16_t *out, const uint16_t *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_GATHER, 2.0 * count * c->size);
    int n = mpi_count(count, "all-gather");
    const void *h_in;
    uint16_t *h_out = host_view(r, out, 2 * count * (size_t)c->size, in, 2 * count, &h_in, false);
    comm_check_mpi(MPI_Iallgather(h_in, n, MPI_UINT16_T, h_out, n, MPI_UINT16_T, c->mpi, &r->mpi[0]), "all-gather");
    return r;
}

CommRequest *mpi_path_reduce_scatter_start(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_REDUCE_SCATTER, 4.0 * count * c->size);
    const void *h_in;
    float *h_out = host_view(r, out, 4 * count, in, 4 * count * (size_t)c->size, &h_in, false);
    comm_check_mpi(MPI_Ireduce_scatter_block(h_in, h_out, mpi_count(count, "reduce-scatter"), MPI_FLOAT, MPI_SUM,
                                             c->mpi, &r->mpi[0]),
                   "reduce-scatter");
    return r;
}

void mpi_path_broadcast(Comm *c, float *buf, size_t count, int root) {
    comm_check_peer(c, root, "broadcast");
    CommRequest *r = comm_new_request(c, COLL_BROADCAST, 4.0 * count);
    const void *unused;
    float *h = host_view(r, buf, 4 * count, buf, 4 * count, &unused, false);
    comm_check_mpi(MPI_Ibcast(h, mpi_count(count, "broadcast"), MPI_FLOAT, root, c->mpi, &r->mpi[0]), "broadcast");
    comm_wait(r);
}

void mpi_path_all_to_all(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_TO_ALL, 4.0 * count * c->size);
    int n = mpi_count(count, "all-to-all");
    size_t bytes = 4 * count * (size_t)c->size;
    const void *h_in;
    float *h_out = host_view(r, out, bytes, in, bytes, &h_in, false);
    comm_check_mpi(MPI_Ialltoall(h_in, n, MPI_FLOAT, h_out, n, MPI_FLOAT, c->mpi, &r->mpi[0]), "all-to-all");
    comm_wait(r);
}

void mpi_path_all_to_all_v(Comm *c, float *out, const size_t *recv_counts, const size_t *recv_offsets,
                           const float *in, const size_t *send_counts, const size_t *send_offsets) {
    const char *what = "all-to-all-v";
    int n = c->size;
    int *sc = mpi_counts(send_counts, n, what), *so = mpi_counts(send_offsets, n, what);
    int *rc = mpi_counts(recv_counts, n, what), *ro = mpi_counts(recv_offsets, n, what);
    CommRequest *r = comm_new_request(c, COLL_ALL_TO_ALL, 4.0 * comm_total_count(send_counts, n));
    const void *h_in;
    float *h_out = host_view(r, out, 4 * extent(recv_counts, recv_offsets, n), in,
                             4 * extent(send_counts, send_offsets, n), &h_in, true);
    comm_check_mpi(MPI_Ialltoallv(h_in, sc, so, MPI_FLOAT, h_out, rc, ro, MPI_FLOAT, c->mpi, &r->mpi[0]), what);
    comm_wait(r);  // MPI reads the count arrays until the operation ends
    free(sc);
    free(so);
    free(rc);
    free(ro);
}

CommRequest *mpi_path_send_start(Comm *c, const float *buf, size_t count, int peer) {
    comm_check_peer(c, peer, "send");
    CommRequest *r = comm_new_p2p_request(c, COLL_SEND, 4.0 * count, peer, -1);
    const void *h_in;
    host_view(r, NULL, 0, buf, 4 * count, &h_in, false);
    comm_check_mpi(MPI_Isend(h_in, mpi_count(count, "send"), MPI_FLOAT, peer, P2P_TAG, c->mpi, &r->mpi[0]), "send");
    return r;
}

CommRequest *mpi_path_recv_start(Comm *c, float *buf, size_t count, int peer) {
    comm_check_peer(c, peer, "recv");
    CommRequest *r = comm_new_p2p_request(c, COLL_RECV, 4.0 * count, -1, peer);
    const void *unused;
    float *h = host_view(r, buf, 4 * count, NULL, 0, &unused, false);
    comm_check_mpi(MPI_Irecv(h, mpi_count(count, "recv"), MPI_FLOAT, peer, P2P_TAG, c->mpi, &r->mpi[0]), "recv");
    return r;
}

CommRequest *mpi_path_send_recv_start(Comm *c, const float *send, size_t send_count, int dst, float *recv,
                                      size_t recv_count, int src) {
    const char *what = "send-recv";
    comm_check_peer(c, dst, what);
    comm_check_peer(c, src, what);
    CommRequest *r = comm_new_p2p_request(c, COLL_SEND_RECV, 4.0 * send_count, dst, src);
    const void *h_send;
    float *h_recv = host_view(r, recv, 4 * recv_count, send, 4 * send_count, &h_send, false);
    // both in flight at once, which is what makes a ring of them safe
    comm_check_mpi(MPI_Irecv(h_recv, mpi_count(recv_count, what), MPI_FLOAT, src, P2P_TAG, c->mpi, &r->mpi[0]), what);
    comm_check_mpi(MPI_Isend(h_send, mpi_count(send_count, what), MPI_FLOAT, dst, P2P_TAG, c->mpi, &r->mpi[1]), what);
    return r;
}
