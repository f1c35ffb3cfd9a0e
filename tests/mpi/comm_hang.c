// comm_hang <operation> [die]: rank 1 never answers (a stuck rank, or with `die`, a dead one)
// while the others call an operation that needs it: all-reduce; send (rank 0 sends to rank 1,
// which never posts the receive); recv (rank 0 waits for a message rank 1 never sends);
// all-to-all. They must end the job with a message within COMM_TIMEOUT, not hang. Run by
// test_comm.sh.
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "base/device.h"
#include "base/log.h"
#include "comm/comm.h"

// 16 MB: far past any eager limit, so a send cannot finish before its receive is posted
#define COUNT ((size_t)4 << 20)

static void call_without_rank_1(Comm *w, const char *operation, float *buf, float *out) {
    int rank = comm_rank(w);
    if (strcmp(operation, "all-reduce") == 0) comm_all_reduce(w, buf, 1024);
    else if (strcmp(operation, "send") == 0) { if (rank == 0) comm_send(w, buf, COUNT, 1); }
    else if (strcmp(operation, "recv") == 0) { if (rank == 0) comm_recv(w, buf, COUNT, 1); }
    else if (strcmp(operation, "all-to-all") == 0) comm_all_to_all(w, out, buf, COUNT / comm_size(w));
    else fatal("comm_hang: unknown operation '%s' (all-reduce, send, recv, all-to-all)", operation);
}

int main(int argc, char **argv) {
    Comm *w = comm_init(&argc, &argv);
    ops_init();
    const char *operation = argc > 1 ? argv[1] : "all-reduce";
    float *buf = dev_malloc(COUNT * sizeof(float)), *out = dev_malloc(COUNT * sizeof(float));
    if (comm_rank(w) == 1) {
        if (argc > 2 && strcmp(argv[2], "die") == 0) raise(SIGKILL);
        sleep(600);
    }
    call_without_rank_1(w, operation, buf, out);
    comm_finalize(w);
    return 0;
}
