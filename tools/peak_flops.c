// peak_flops: MFU's peak on this machine, for f32 and bf16 matmuls, found as the stages find it
// (ops_peak_flops: measured on the CPU, derived from the device on a GPU), printed as lines a
// shell can evaluate:
//
//   export OPS_PEAK_FLOPS_F32=1.65e+11  # 165 GFLOP/s f32, measured: best of 11 oneDNN ...
//
// scripts/bench.sh evaluates them once, so every run it starts divides by the same peak instead
// of measuring its own. Run with the OMP_NUM_THREADS the runs will use.
#include <stdio.h>

#include "base/device.h"
#include "ops/ops.h"
#include "ops/ops_peak.h"

int main(int argc, char **argv) {
    (void)argv;
    if (argc > 1) {
        fprintf(stderr, "usage: build/peak_flops  (no arguments; OMP_NUM_THREADS sets the threads)\n");
        return 2;
    }
    ops_init();
    printf("export %s=%.4e  # %s\n", PEAK_ENV_F32, ops_peak_flops(0), ops_peak_flops_source(0));
    printf("export %s=%.4e  # %s\n", PEAK_ENV_BF16, ops_peak_flops(1), ops_peak_flops_source(1));
    return 0;
}
