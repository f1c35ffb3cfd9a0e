// ring_allreduce.c: see ring_allreduce.h.
#include "ring_allreduce.h"

#include "ops/ops.h"

// chunk i of P over count elements: [*first, *first + return value)
static size_t chunk(size_t count, int P, int i, size_t *first) {
    size_t size = (count + (size_t)P - 1) / (size_t)P;
    size_t lo = size * (size_t)i < count ? size * (size_t)i : count;
    size_t hi = lo + size < count ? lo + size : count;
    *first = lo;
    return hi - lo;
}

void ring_all_reduce(Comm *c, float *buf, size_t count, float *scratch) {
    int P = comm_size(c), me = comm_rank(c);
    int next = (me + 1) % P, prev = (me + P - 1) % P;
    size_t send_at, recv_at;
    // reduce-scatter: at step s rank r sends chunk r - s and adds into chunk r - s - 1, so after
    // P - 1 steps it holds the whole sum of chunk r + 1
    for (int s = 0; s < P - 1; s++) {
        size_t ns = chunk(count, P, (me - s + P) % P, &send_at);
        size_t nr = chunk(count, P, (me - s - 1 + 2 * P) % P, &recv_at);
        comm_send_recv(c, buf + send_at, ns, next, scratch, nr, prev);
        add_inplace(buf + recv_at, scratch, nr);
    }
    // all-gather: the summed chunks travel on round the ring, each received one overwriting
    for (int s = 0; s < P - 1; s++) {
        size_t ns = chunk(count, P, (me + 1 - s + P) % P, &send_at);
        size_t nr = chunk(count, P, (me - s + P) % P, &recv_at);
        comm_send_recv(c, buf + send_at, ns, next, buf + recv_at, nr, prev);
    }
}
