// comm_check [comm_backend]: run under mpirun with any number of ranks (up to 16). Checks every collective and
// point-to-point operation of comm.h (blocking and not, on the world and on split groups) against
// values computed locally, and the byte accounting against the nccl-tests definitions. Rank 0
// prints the statistics table, then "comm_check: N passed, N failed" with the failures of every
// rank counted.
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../check.h"
#include "base/device.h"
#include "base/log.h"
#include "comm/comm.h"

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

// element i of message `seq` from rank `from` (in an all-to-all, of the block from `from` to rank
// `seq`): different for every sender, message and element, and exact in a float (below 2^24)
// for up to 16 ranks, 10 messages and 100000 elements
static float label(int from, int seq, size_t i) { return (float)(1000000L * from + 100000L * seq + (long)i); }

static void fill_labels(float *buf, size_t n, int from, int seq) {
    for (size_t i = 0; i < n; i++) buf[i] = label(from, seq, i);
}

static int count_wrong_labels(const float *buf, size_t n, int from, int seq) {
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad += buf[i] != label(from, seq, i);
    return bad;
}

static int next_rank(Comm *w) { return (comm_rank(w) + 1) % comm_size(w); }
static int prev_rank(Comm *w) { return (comm_rank(w) + comm_size(w) - 1) % comm_size(w); }

// One ring step with blocking calls, on two or more ranks. If every rank sent first, each send
// could wait for a receive posted only after the next rank's send: a cycle. Even ranks send
// first and odd ranks receive first, so rank 1 receives before it sends and the cycle is broken
// (the order NCCL needs for separately started sends and receives too).
static void ring_step_in_order(Comm *w, const float *send, float *recv, size_t n) {
    if (comm_rank(w) % 2 == 0) {
        comm_send(w, send, n, next_rank(w));
        comm_recv(w, recv, n, prev_rank(w));
    } else {
        comm_recv(w, recv, n, prev_rank(w));
        comm_send(w, send, n, next_rank(w));
    }
}

// polls comm_test like a compute loop between checks would, for at most 30 s; 1 once all finished
static int finish_by_testing(CommRequest **reqs, int n) {
    double deadline = wall_seconds() + 30;
    struct timespec nap = {0, 20000};  // gives the core back: the ranks may outnumber the cores
    for (;;) {
        int finished = 0;
        for (int k = 0; k < n; k++) finished += comm_test(reqs[k]);
        if (finished == n) return 1;
        if (wall_seconds() > deadline) return 0;
        nanosleep(&nap, NULL);
    }
}

// Every rank sends to the next and receives from the previous (itself, on one rank). 5000 floats
// are past Open MPI's eager limit, so a send really waits for its receive.
static void test_ring(Comm *w) {
    int P = comm_size(w), me = comm_rank(w), prev = prev_rank(w);
    enum { MESSAGES = 3 };
    size_t n = 5000;
    float *send = dev_malloc(MESSAGES * n * sizeof(float)), *recv = dev_malloc(MESSAGES * n * sizeof(float));

    if (P > 1) {  // a blocking send to oneself would wait for the receive after it
        fill_labels(send, n, me, 0);
        ring_step_in_order(w, send, recv, n);
        CHECK(count_wrong_labels(recv, n, prev, 0) == 0, "blocking ring send/recv: wrong on rank %d", me);
    }

    fill_labels(send, n, me, 1);
    comm_send_recv(w, send, n, next_rank(w), recv, n, prev);
    CHECK(count_wrong_labels(recv, n, prev, 1) == 0, "blocking ring send-recv: wrong on rank %d", me);

    if (P > 1) {  // separate calls to oneself form a cycle on NCCL: comm.h says use send-recv
        // three messages in flight to the same rank must arrive in the order sent; sizes differ
        // so that a mix-up cannot go unnoticed
        CommRequest *sends[MESSAGES], *recvs[MESSAGES];
        size_t len[MESSAGES] = {n, n - 10, n - 20};
        for (int m = 0; m < MESSAGES; m++) fill_labels(send + m * n, len[m], me, 2 + m);
        for (int pass = 0; pass < 2; pass++)
            for (int m = 0; m < MESSAGES; m++) {
                // even ranks start their sends first, odd ranks their receives (ring_step_in_order)
                if ((pass == 0) == (me % 2 == 0)) sends[m] = comm_send_start(w, send + m * n, len[m], next_rank(w));
                else recvs[m] = comm_recv_start(w, recv + m * n, len[m], prev);
            }
        CHECK(finish_by_testing(recvs, MESSAGES), "non-blocking ring: receives not done after 30 s on rank %d", me);
        for (int m = 0; m < MESSAGES; m++) {
            comm_wait(sends[m]);
            comm_wait(recvs[m]);
            CHECK(count_wrong_labels(recv + m * n, len[m], prev, 2 + m) == 0,
                  "non-blocking ring: message %d wrong on rank %d", m, me);
        }
    }

    fill_labels(send, n, me, 5);
    CommRequest *r = comm_send_recv_start(w, send, n, next_rank(w), recv, n, prev);
    CHECK(finish_by_testing(&r, 1), "non-blocking send-recv not done after 30 s on rank %d", me);
    comm_wait(r);
    CHECK(count_wrong_labels(recv, n, prev, 5) == 0, "non-blocking ring send-recv: wrong on rank %d", me);
    dev_free(send);
    dev_free(recv);
}

// in block p goes to rank p; out block p must be rank p's block for this rank
static void test_all_to_all(Comm *w) {
    int P = comm_size(w), me = comm_rank(w);
    size_t n = 777;
    float *in = dev_malloc(n * P * sizeof(float)), *out = dev_malloc(n * P * sizeof(float));
    for (int p = 0; p < P; p++) fill_labels(in + p * n, n, me, p);
    comm_all_to_all(w, out, in, n);
    int bad = 0;
    for (int p = 0; p < P; p++) bad += count_wrong_labels(out + p * n, n, p, me);
    CHECK(bad == 0, "all-to-all: %d wrong elements on rank %d", bad, me);
    dev_free(in);
    dev_free(out);
}

// floats rank `from` sends rank `to` in the uneven all-to-all: 0, 7, 14 or 21; some pairs send
// nothing whenever there are two ranks or more (1 to 0, for one)
static size_t uneven_count(int from, int to) { return (size_t)((3 * from + 5 * to + 1) % 4) * 7; }

// Uneven blocks at uneven places: this rank's send blocks lie in reverse rank order, each after
// a gap of 3 floats; received blocks lie in rank order, each after a gap of 2 that must stay -1.
static void test_all_to_all_v(Comm *w) {
    int P = comm_size(w), me = comm_rank(w);
    size_t *send_counts = calloc_or_die(P, sizeof(size_t)), *send_offsets = calloc_or_die(P, sizeof(size_t));
    size_t *recv_counts = calloc_or_die(P, sizeof(size_t)), *recv_offsets = calloc_or_die(P, sizeof(size_t));
    size_t in_len = 0, out_len = 0;
    for (int p = P - 1; p >= 0; p--) {
        send_offsets[p] = in_len + 3;
        send_counts[p] = uneven_count(me, p);
        in_len = send_offsets[p] + send_counts[p];
    }
    for (int p = 0; p < P; p++) {
        recv_offsets[p] = out_len + 2;
        recv_counts[p] = uneven_count(p, me);
        out_len = recv_offsets[p] + recv_counts[p];
    }
    float *in = dev_malloc(in_len * sizeof(float)), *out = dev_malloc(out_len * sizeof(float));
    float *want = malloc_or_die(out_len * sizeof(float));
    for (size_t i = 0; i < in_len; i++) in[i] = -2;
    for (int p = 0; p < P; p++) fill_labels(in + send_offsets[p], send_counts[p], me, p);
    for (size_t i = 0; i < out_len; i++) out[i] = want[i] = -1;
    for (int p = 0; p < P; p++) fill_labels(want + recv_offsets[p], recv_counts[p], p, me);

    comm_all_to_all_v(w, out, recv_counts, recv_offsets, in, send_counts, send_offsets);
    int bad = 0;
    for (size_t i = 0; i < out_len; i++) bad += out[i] != want[i];
    CHECK(bad == 0, "all-to-all-v: %d of %zu elements wrong on rank %d", bad, out_len, me);
    free(want);
    dev_free(in);
    dev_free(out);
    free(send_counts);
    free(send_offsets);
    free(recv_counts);
    free(recv_offsets);
}

// The last rank sends nothing at all and the others send every rank but it 30000 floats (beyond
// MPI's eager size): a rank whose whole input is empty (an expert rank no token chose) must still
// receive, and send nothing.
static void test_all_to_all_v_empty_sender(Comm *w) {
    int P = comm_size(w), me = comm_rank(w), last = P - 1;
    const size_t k = 30000;
    size_t *sc = calloc_or_die(P, sizeof(size_t)), *so = calloc_or_die(P, sizeof(size_t));
    size_t *rc = calloc_or_die(P, sizeof(size_t)), *ro = calloc_or_die(P, sizeof(size_t));
    for (int p = 0; p < P; p++) {
        sc[p] = me == last ? 0 : k, so[p] = me == last ? 0 : (size_t)p * k;
        rc[p] = p == last ? 0 : k, ro[p] = (size_t)p * k;
    }
    float *in = dev_malloc((size_t)P * k * sizeof(float)), *out = dev_malloc((size_t)P * k * sizeof(float));
    for (int p = 0; p < P; p++) fill_labels(in + (size_t)p * k, sc[p], me, p);
    comm_all_to_all_v(w, out, rc, ro, in, sc, so);
    int bad = 0;
    for (int p = 0; p < last; p++) bad += count_wrong_labels(out + (size_t)p * k, k, p, me);
    CHECK(bad == 0, "all-to-all-v with rank %d sending nothing: %d elements wrong on rank %d", last, bad, me);
    free(sc), free(so), free(rc), free(ro);
    dev_free(in);
    dev_free(out);
}

// calls, sizes and bus bytes of the point-to-point and all-to-all kinds (comm.h)
static void test_p2p_accounting(Comm *w) {
    int P = comm_size(w), me = comm_rank(w);
    size_t n = 1024;
    float *a = dev_malloc(n * P * sizeof(float)), *b = dev_malloc(n * P * sizeof(float));
    for (size_t i = 0; i < n * P; i++) a[i] = 1;
    // all-to-all-v, packed: every rank sends p + 1 floats to rank p
    size_t *to = calloc_or_die(P, sizeof(size_t)), *to_at = calloc_or_die(P, sizeof(size_t));
    size_t *from = calloc_or_die(P, sizeof(size_t)), *from_at = calloc_or_die(P, sizeof(size_t));
    for (int p = 0; p < P; p++) {
        to[p] = (size_t)p + 1, to_at[p] = (size_t)p * (p + 1) / 2;
        from[p] = (size_t)me + 1, from_at[p] = (size_t)p * (me + 1);
    }
    CommStats before = comm_totals();
    if (P > 1) ring_step_in_order(w, a, b, n);
    comm_send_recv(w, a, n, next_rank(w), b, n, prev_rank(w));
    comm_all_to_all(w, b, a, n);
    comm_all_to_all_v(w, b, from, from_at, a, to, to_at);
    CommStats after = comm_totals();

    double p2p = P > 1 ? 4.0 * n : 0;
    CHECK(after.calls[COLL_SEND] - before.calls[COLL_SEND] == (P > 1), "send calls");
    CHECK(after.calls[COLL_RECV] - before.calls[COLL_RECV] == (P > 1), "recv calls");
    CHECK(after.bytes[COLL_SEND] - before.bytes[COLL_SEND] == p2p, "send bytes");
    CHECK(after.bytes[COLL_RECV] - before.bytes[COLL_RECV] == p2p, "recv bytes");
    CHECK(after.bus_bytes[COLL_SEND] - before.bus_bytes[COLL_SEND] == p2p, "send bus factor 1");
    CHECK(after.calls[COLL_SEND_RECV] - before.calls[COLL_SEND_RECV] == 1, "send-recv calls");
    CHECK(after.bytes[COLL_SEND_RECV] - before.bytes[COLL_SEND_RECV] == 4.0 * n, "send-recv bytes: the message sent");
    CHECK(after.bus_bytes[COLL_SEND_RECV] - before.bus_bytes[COLL_SEND_RECV] == 4.0 * n, "send-recv bus factor 1");
    // all-to-all: the whole input, n * P floats; all-to-all-v: the floats sent, 1 + 2 + ... + P
    double a2a = 4.0 * n * P + 4.0 * P * (P + 1) / 2;
    CHECK(after.calls[COLL_ALL_TO_ALL] - before.calls[COLL_ALL_TO_ALL] == 2, "all-to-all calls (equal and v)");
    CHECK(after.bytes[COLL_ALL_TO_ALL] - before.bytes[COLL_ALL_TO_ALL] == a2a, "all-to-all bytes");
    double bus = after.bus_bytes[COLL_ALL_TO_ALL] - before.bus_bytes[COLL_ALL_TO_ALL];
    CHECK_CLOSE(bus, a2a * (P - 1) / P, 1e-12, 0, "all-to-all bus factor (n-1)/n");
    free(to);
    free(to_at);
    free(from);
    free(from_at);
    dev_free(a);
    dev_free(b);
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
    // the comm_backend to check: mpi-staged runs the path of ranks that share a GPU
    comm_select_backend(w, argc > 1 ? argv[1] : "auto");
    ops_init();
    test_world(w);
    test_accounting(w);
    test_split(w);
    test_ring(w);
    test_all_to_all(w);
    test_all_to_all_v(w);
    test_all_to_all_v_empty_sender(w);
    test_p2p_accounting(w);
    comm_print_table(w);
    // rank 0 reports everyone's counts
    long passed = comm_sum_long(w, check_passed_), failed = comm_sum_long(w, check_failed_);
    int rank = comm_rank(w);
    comm_finalize(w);
    if (rank == 0) printf("comm_check: %ld passed, %ld failed\n", passed, failed);
    return failed ? 1 : 0;
}
