// comm_cpu.c: the CPU backend's comm.h: every payload operation is MPI's (comm_mpi.c) on host
// memory. comm_backend=mpi-staged sends the buffers through host blocks all the same, the path
// the CUDA backend takes when ranks share a GPU, so that the tests run it here.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "comm_internal.h"

void comm_backend_init_group(Comm *c) { (void)c; }
void comm_backend_free_group(Comm *c) {
    if (c->mpi == MPI_COMM_WORLD) mpi_path_free_staging();  // the last group freed
}

void comm_backend_wait(CommRequest *r) { mpi_path_wait(r); }
int comm_backend_test(CommRequest *r) { return mpi_path_test(r); }
double comm_backend_seconds(const CommRequest *r) { return mpi_path_seconds(r); }

void *comm_host_alloc(size_t bytes) { return malloc_or_die(bytes); }
void comm_host_free(void *ptr) { free(ptr); }

void comm_select_backend(Comm *world, const char *comm_backend) {
    const char *why = "host memory, which MPI reads directly";
    if (strcmp(comm_backend, "nccl") == 0)
        fatal("key 'comm_backend' is \"nccl\" but this is the CPU build, which moves its bytes with MPI: "
              "NCCL needs the CUDA build (make BACKEND=cuda)");
    if (strcmp(comm_backend, "mpi-staged") == 0) {
        mpi_path_set_staged(true);
        why = "staged through host copies (comm_backend: mpi-staged), as ranks sharing a GPU do";
    }
    if (world->rank == 0) printf("communication: MPI, %s\n", why);
}

bool comm_p2p_in_order(void) { return false; }

CommRequest *comm_all_reduce_start(Comm *c, float *buf, size_t count) {
    return mpi_path_all_reduce_start(c, buf, count);
}
CommRequest *comm_all_gather_start(Comm *c, float *out, const float *in, size_t count) {
    return mpi_path_all_gather_start(c, out, in, count);
}
CommRequest *comm_all_gather16_start(Comm *c, uint16_t *out, const uint16_t *in, size_t count) {
    return mpi_path_all_gather16_start(c, out, in, count);
}
CommRequest *comm_reduce_scatter_start(Comm *c, float *out, const float *in, size_t count) {
    return mpi_path_reduce_scatter_start(c, out, in, count);
}
void comm_broadcast(Comm *c, float *buf, size_t count, int root) { mpi_path_broadcast(c, buf, count, root); }
void comm_all_to_all(Comm *c, float *out, const float *in, size_t count) { mpi_path_all_to_all(c, out, in, count); }
void comm_all_to_all_v(Comm *c, float *out, const size_t *recv_counts, const size_t *recv_offsets,
                       const float *in, const size_t *send_counts, const size_t *send_offsets) {
    mpi_path_all_to_all_v(c, out, recv_counts, recv_offsets, in, send_counts, send_offsets);
}
CommRequest *comm_send_start(Comm *c, const float *buf, size_t count, int peer) {
    return mpi_path_send_start(c, buf, count, peer);
}
CommRequest *comm_recv_start(Comm *c, float *buf, size_t count, int peer) {
    return mpi_path_recv_start(c, buf, count, peer);
}
CommRequest *comm_send_recv_start(Comm *c, const float *send, size_t send_count, int dst, float *recv,
                                  size_t recv_count, int src) {
    return mpi_path_send_recv_start(c, send, send_count, dst, recv, recv_count, src);
}
