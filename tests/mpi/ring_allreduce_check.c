// ring_allreduce_check: run under mpirun with any number of ranks. Stage 03's ring all-reduce
// (03_ddp/ring_allreduce.c, written on send/recv) against the library's all-reduce
// (comm_all_reduce) on buffers that divide evenly over the ranks, that do not, and that are
// shorter than the number of ranks. Rank 0 prints "ring_allreduce_check: N passed, N failed" with
// the failures of every rank counted.
#include <math.h>
#include <stdlib.h>

#include "../check.h"
#include "base/device.h"
#include "comm/comm.h"
#include "ring_allreduce.h"

static float value(int r, size_t i) { return (float)((r * 7 + 3) % 11) - 4.5f + 0.25f * (float)(i % 13); }

static void test_count(Comm *w, size_t n) {
    int P = comm_size(w), me = comm_rank(w);
    float *ring = dev_malloc((n + 1) * sizeof(float)), *lib = dev_malloc((n + 1) * sizeof(float));
    float *scratch = dev_malloc((n / (size_t)P + 2) * sizeof(float));
    for (size_t i = 0; i < n; i++) ring[i] = lib[i] = value(me, i);
    ring[n] = lib[n] = 123.0f;  // past the end: must stay as it is
    ring_all_reduce(w, ring, n, scratch);
    comm_all_reduce(w, lib, n);
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad += fabsf(ring[i] - lib[i]) > 1e-5f * (1.0f + fabsf(lib[i]));
    CHECK(bad == 0, "%zu floats on %d ranks: %d elements differ from comm_all_reduce on rank %d", n, P, bad, me);
    CHECK(ring[n] == 123.0f, "%zu floats: the element past the end was written on rank %d", n, me);
    dev_free(ring), dev_free(lib), dev_free(scratch);
}

int main(int argc, char **argv) {
    Comm *w = comm_init(&argc, &argv);
    int P = comm_size(w);
    test_count(w, 1000 * (size_t)P);   // even chunks
    test_count(w, 1003);               // uneven
    test_count(w, 1);                  // fewer elements than ranks
    test_count(w, (size_t)P + 1);
    long passed = comm_sum_long(w, check_passed_), failed = comm_sum_long(w, check_failed_);
    int rank = comm_rank(w);
    comm_finalize(w);
    if (rank == 0) printf("ring_allreduce_check on %d ranks: %ld passed, %ld failed\n", P, passed, failed);
    return failed ? 1 : 0;
}
