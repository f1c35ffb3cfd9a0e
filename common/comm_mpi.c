// comm_mpi.c: the payload collectives of comm.h over Open MPI, for buffers in host memory (the
// CPU backend). Each starts a non-blocking MPI collective; comm_wait finishes it.
#include <mpi.h>

#include "comm_internal.h"

void comm_backend_init_group(Comm *c) { (void)c; }
void comm_backend_free_group(Comm *c) { (void)c; }

void comm_backend_wait(CommRequest *r) { comm_wait_mpi(&r->mpi, COMM_KIND_NAMES[r->kind], r->comm->name); }

int comm_backend_test(CommRequest *r) {
    int done = 0;
    comm_check_mpi(MPI_Test(&r->mpi, &done, MPI_STATUS_IGNORE), COMM_KIND_NAMES[r->kind]);
    return done;
}

CommRequest *comm_all_reduce_start(Comm *c, float *buf, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_REDUCE, 4.0 * count);
    comm_check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, c->mpi, &r->mpi), "all-reduce");
    return r;
}

CommRequest *comm_all_gather_start(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_ALL_GATHER, 4.0 * count * c->size);
    comm_check_mpi(MPI_Iallgather(in, (int)count, MPI_FLOAT, out, (int)count, MPI_FLOAT, c->mpi, &r->mpi), "all-gather");
    return r;
}

CommRequest *comm_reduce_scatter_start(Comm *c, float *out, const float *in, size_t count) {
    CommRequest *r = comm_new_request(c, COLL_REDUCE_SCATTER, 4.0 * count * c->size);
    comm_check_mpi(MPI_Ireduce_scatter_block(in, out, (int)count, MPI_FLOAT, MPI_SUM, c->mpi, &r->mpi),
                   "reduce-scatter");
    return r;
}

void comm_broadcast(Comm *c, float *buf, size_t count, int root) {
    CommRequest *r = comm_new_request(c, COLL_BROADCAST, 4.0 * count);
    comm_check_mpi(MPI_Ibcast(buf, (int)count, MPI_FLOAT, root, c->mpi, &r->mpi), "broadcast");
    comm_wait(r);
}
