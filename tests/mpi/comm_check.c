// comm_check: run under mpirun with any number of ranks. Checks every collective of comm.h
// (blocking and not, on the world and on split groups) against values computed locally, and the
// byte accounting against the nccl-tests definitions. Prints "comm_check: N passed, N failed"
// on rank 0 with the failures of every rank counted.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../check.h"
#include "comm.h"
#include "ops.h"

// rank r's element i: a value every rank can compute for every other rank
static float value(int r, size_t i) { return (float)(r + 1) * 0.5f + (float)(i % 7); }

static void test_world(Comm *w) {
    int P = comm_size(w), me = comm_rank(w);
    size_t n = 1000;
    float *buf = dev_malloc(n * P * sizeof(float)), *out = dev_malloc(n * P * sizeof(float));
    for (size_t i = 0; i < n; i++) buf[i] = value(me, i);
    comm_all_reduce(w, buf, n);
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < P; r++) want += value(r, i);
        bad += fabsf(buf[i] - want) > 1e-5f * fabsf(want);
    }
    CHECK(bad == 0, "all-reduce: %d wrong elements on rank %d", bad, me);

    for (size_t i = 0; i < n; i++) buf[i] = value(me, i);
    comm_all_gather(w, out, buf, n);
    bad = 0;
    for (int r = 0; r < P; r++)
        for (size_t i = 0; i < n; i++) bad += out[r * n + i] != value(r, i);
    CHECK(bad == 0, "all-gather: %d wrong elements on rank %d", bad, me);

    // reduce-scatter: rank r gets slice r of the sum of everyone's (P * n) buffer
    for (size_t i = 0; i < n * P; i++) buf[i] = value(me, i);
    comm_reduce_scatter(w, out, buf, n);
    bad = 0;
    for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < P; r++) want += value(r, (size_t)me * n + i);
        bad += fabsf(out[i] - want) > 1e-5f * fabsf(want);
    }
    CHECK(bad == 0, "reduce-scatter: %d wrong elements on rank %d", bad, me);

    for (size_t i = 0; i < n; i++) buf[i] = value(me, i);
    comm_broadcast(w, buf, n, P - 1);
    bad = 0;
    for (size_t i = 0; i < n; i++) bad += buf[i] != value(P - 1, i);
    CHECK(bad == 0, "broadcast from the last rank: %d wrong on rank %d", bad, me);

    // two non-blocking all-reduces in flight at once
    float *a = dev_malloc(n * sizeof(float)), *b = dev_malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) a[i] = 1, b[i] = (float)me;
    CommRequest *ra = comm_all_reduce_start(w, a, n), *rb = comm_all_reduce_start(w, b, n);
    comm_wait(rb);
    comm_wait(ra);
    CHECK(a[0] == P && a[n - 1] == P, "non-blocking all-reduce of ones gave %g", a[0]);
    CHECK(b[n / 2] == P * (P - 1) / 2.0f, "non-blocking all-reduce of ranks gave %g", b[n / 2]);
    CHECK_CLOSE(comm_sum_double(w, me + 0.25), P * (P - 1) / 2.0 + 0.25 * P, 1e-12, 0, "sum of doubles");
    CHECK(comm_sum_long(w, 1) == P, "sum of longs");
    CHECK(comm_max_double(w, me) == P - 1, "max of doubles");
    dev_free(a);
    dev_free(b);
    dev_free(buf);
    dev_free(out);
}

static void test_accounting(Comm *w) {
    int P = comm_size(w);
    CommStats before = comm_totals();
    size_t n = 4096;
    float *buf = dev_malloc(n * P * sizeof(float)), *out = dev_malloc(n * P * sizeof(float));
    comm_all_reduce(w, buf, n);
    comm_all_gather(w, out, buf, n);
    comm_reduce_scatter(w, out, buf, n);
    CommStats after = comm_totals();
    // nccl-tests sizes: all-reduce the buffer, all-gather the output, reduce-scatter the input
    CHECK(after.bytes[COLL_ALL_REDUCE] - before.bytes[COLL_ALL_REDUCE] == 4.0 * n, "all-reduce bytes");
    CHECK(after.bytes[COLL_ALL_GATHER] - before.bytes[COLL_ALL_GATHER] == 4.0 * n * P, "all-gather bytes");
    CHECK(after.bytes[COLL_REDUCE_SCATTER] - before.bytes[COLL_REDUCE_SCATTER] == 4.0 * n * P, "reduce-scatter bytes");
    CHECK(after.calls[COLL_ALL_REDUCE] - before.calls[COLL_ALL_REDUCE] == 1, "all-reduce calls");
    double bus = after.bus_bytes[COLL_ALL_REDUCE] - before.bus_bytes[COLL_ALL_REDUCE];
    CHECK_CLOSE(bus, 4.0 * n * 2.0 * (P - 1) / P, 1e-12, 0, "all-reduce bus factor 2(n-1)/n");
    bus = after.bus_bytes[COLL_ALL_GATHER] - before.bus_bytes[COLL_ALL_GATHER];
    CHECK_CLOSE(bus, 4.0 * n * P * (P - 1) / P, 1e-12, 0, "all-gather bus factor (n-1)/n");
    dev_free(buf);
    dev_free(out);
}

// groups of two neighbouring ranks (0,1), (2,3), ...: sums stay inside the group
static void test_split(Comm *w) {
    int me = comm_rank(w);
    Comm *pair = comm_split(w, me / 2, me, "pair");
    float x = (float)me;
    float *buf = dev_malloc(sizeof(float));
    buf[0] = x;
    comm_all_reduce(pair, buf, 1);
    int partner = me ^ 1;
    float want = partner < comm_size(w) ? (float)(me + partner) : (float)me;
    CHECK(buf[0] == want, "pair all-reduce on rank %d gave %g, want %g", me, buf[0], want);
    CHECK(comm_rank(pair) == me % 2, "rank in pair");
    dev_free(buf);
}

int main(int argc, char **argv) {
    Comm *w = comm_init(&argc, &argv);
    ops_init();
    test_world(w);
    test_accounting(w);
    test_split(w);
    // rank 0 reports everyone's counts
    long passed = comm_sum_long(w, check_passed_), failed = comm_sum_long(w, check_failed_);
    int rank = comm_rank(w);
    comm_finalize(w);
    if (rank == 0) printf("comm_check: %ld passed, %ld failed\n", passed, failed);
    return failed ? 1 : 0;
}
