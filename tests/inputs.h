// inputs.h: what the test programs share besides check.h: reproducible random inputs, and the
// batch an oracle script (tests/oracle_*.py) hands to a program's --oracle mode.
#ifndef INPUTS_H
#define INPUTS_H

#include <stdint.h>
#include <stdio.h>

#include "base/log.h"

static uint64_t test_rng_state = 88172645463325252ull;

// uniform in [0, 1): xorshift64, for test inputs only
static inline double uniform(void) {
    test_rng_state ^= test_rng_state << 13;
    test_rng_state ^= test_rng_state >> 7;
    test_rng_state ^= test_rng_state << 17;
    return (double)(test_rng_state >> 11) / 9007199254740992.0;
}

// DIR/tokens.bin: int32 B, T, then B*T inputs and B*T targets; returns the whole file
static inline int *read_oracle_tokens(const char *dir, int *B, int *T) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokens.bin", dir);
    size_t len;
    int *raw = (int *)read_file_or_die(path, &len);
    *B = raw[0], *T = raw[1];
    if (len != (size_t)(2 + 2 * *B * *T) * sizeof(int)) fatal("%s: %zu bytes, expected B=%d T=%d", path, len, *B, *T);
    return raw;
}

#endif
