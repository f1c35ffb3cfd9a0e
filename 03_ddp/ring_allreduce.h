// ring_allreduce.h: the all-reduce that NCCL and MPI run inside comm_all_reduce, written out on the
// comm layer's point-to-point calls, for the learner to read and write (exercise ring-allreduce).
// The stage itself calls comm_all_reduce; tests/mpi/ring_allreduce_check.c checks this one against
// it on any number of ranks.
#ifndef RING_ALLREDUCE_H
#define RING_ALLREDUCE_H

#include <stddef.h>

#include "comm/comm.h"

// buf (count floats, on every rank of c) becomes the element-wise sum over the ranks. The buffer
// is cut into P chunks (the last ones shorter when P does not divide count). P - 1 steps of
// reduce-scatter: each rank sends one chunk to the next rank and adds the chunk it receives from
// the previous one, until it holds one chunk's full sum; then P - 1 steps of all-gather pass the
// summed chunks round the ring. Each rank sends 2 (P - 1) / P of the buffer: the bus bandwidth's
// factor. scratch holds one chunk (ceil(count / P) floats, device memory like buf).
void ring_all_reduce(Comm *c, float *buf, size_t count, float *scratch);

#endif
