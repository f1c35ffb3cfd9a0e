// comm_hang: rank 1 never joins the all-reduce (a stuck rank, or with `die`, a dead one). The
// others must end the job with a message within COMM_TIMEOUT, not hang. Run by test_comm.sh.
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "ops.h"

int main(int argc, char **argv) {
    Comm *w = comm_init(&argc, &argv);
    ops_init();
    float *buf = dev_malloc(1024 * sizeof(float));
    if (comm_rank(w) == 1) {
        if (argc > 1 && strcmp(argv[1], "die") == 0) raise(SIGKILL);
        sleep(600);
    }
    comm_all_reduce(w, buf, 1024);
    comm_finalize(w);
    return 0;
}
