// tests/slurm/mpi_hello.c - stands in for a multi-rank stage in `make test-slurm`, so the
// launch path (sbatch -> slurm/stage-N.sh -> srun with PMIx, or mpirun inside the allocation)
// is tested before any parallel stage exists. Every rank takes part in one MPI_Allreduce and
// prints one line; the test checks that all ranks agree, and that $CONFIG_FILE and the
// command-line arguments reached every rank.
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    int mine = rank + 1, sum = 0;
    MPI_Allreduce(&mine, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    int expected = size * (size + 1) / 2;

    char host[256] = "?", args[1024] = "";
    gethostname(host, sizeof host - 1);
    for (int i = 1; i < argc; i++) {
        if (strlen(args) + strlen(argv[i]) + 2 >= sizeof args) break;
        if (i > 1) strcat(args, " ");
        strcat(args, argv[i]);
    }
    const char *cfg = getenv("CONFIG_FILE");
    printf("rank %d/%d host %s allreduce_sum=%d expected=%d config=%s args=[%s]\n", rank, size, host,
           sum, expected, cfg ? cfg : "(unset)", args);
    fflush(stdout);
    MPI_Finalize();
    return sum == expected ? 0 : 1;
}
