// test_phi.c: the phi architecture's own pieces, and our side of tests/test_phi_oracle.sh.
//
// Without arguments: rotary's backward is its forward's transpose (<R x, y> = <x, R^T y>), a
// rotation keeps each head's norm, the dims past rotary_dim pass through untouched, and the
// turned values equal a reference's that pairs dim i with dim i + rotary_dim/2.
//
// `test_phi --oracle DIR`: tests/oracle_step.h, for tests/oracle_phi.py.
//
// `test_phi --encode TOKENIZER_DIR FILE`: prints FILE's token ids as one JSON array (the
// tokenizer oracle compares them with transformers' CodeGenTokenizerFast).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "check.h"
#include "data/tokenizer.h"
#include "inputs.h"
#include "model/checkpoint.h"
#include "model/gpt.h"
#include "ops/ops.h"
#include "oracle_step.h"

static double dot(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

static void test_rotary(void) {
    enum { B = 2, T = 5, NH = 3, HS = 8, CA = NH * HS, ROT = 4 };
    size_t n = (size_t)B * T * 3 * CA;
    float *x = malloc_or_die(n * sizeof(float)), *y = malloc_or_die(n * sizeof(float));
    float *rx = malloc_or_die(n * sizeof(float)), *ry = malloc_or_die(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = sinf(0.7f * (float)i + 0.3f), y[i] = cosf(1.3f * (float)i);
    memcpy(rx, x, n * sizeof(float));
    memcpy(ry, y, n * sizeof(float));
    int start[B] = {0, 7};  // the second sequence continues at position 7 (a KV cache's decode)
    rotary_forward(rx, start, B, T, CA, NH, ROT, (Rope){.theta = 10000.0f});
    rotary_backward(ry, start, B, T, CA, NH, ROT, (Rope){.theta = 10000.0f});
    CHECK_CLOSE(dot(rx, y, n), dot(x, ry, n), 1e-5, 1e-5, "<R x, y> = <x, R^T y>");
    double moved = 0, kept = 0;
    for (size_t i = 0; i < n; i++) {
        size_t col = i % (3 * CA), in_head = col % HS;
        bool turned = col < 2 * CA && in_head < ROT;  // queries and keys, the first ROT dims
        if (turned) moved += fabs(rx[i] - x[i]);
        else kept += fabs(rx[i] - x[i]);
    }
    CHECK(kept == 0, "values, and dims past rotary_dim, pass through (%g changed)", kept);
    CHECK(moved > 0.1, "queries and keys turn (%g)", moved);
    CHECK_CLOSE(dot(rx, rx, n), dot(x, x, n), 1e-5, 0, "a rotation keeps the norm");
    // position 0 does not turn: the first token of sequence 0
    for (int c = 0; c < 3 * CA; c++) CHECK(rx[c] == x[c], "position 0 is the identity at column %d", c);
    free(x), free(y), free(rx), free(ry);
}

// The values, against a reference written here in double: within each head of the queries and
// keys, dim i (i < rot/2) and dim i + rot/2 turn together by pos * theta^(-2i/rot), the dims past
// rot stay. Pairs of neighbours (2i, 2i+1), another split of the head or another angle all fail.
static void test_rotary_values(void) {
    enum { B = 1, T = 6, NH = 2, HS = 12, CA = NH * HS, ROT = 8, HALF = ROT / 2 };
    size_t n = (size_t)B * T * 3 * CA;
    float *x = malloc_or_die(n * sizeof(float)), *rx = malloc_or_die(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = sinf(0.37f * (float)i + 0.1f);
    memcpy(rx, x, n * sizeof(float));
    int start[B] = {3};
    rotary_forward(rx, start, B, T, CA, NH, ROT, (Rope){.theta = 10000.0f});
    double worst = 0;
    for (int t = 0; t < T; t++)
        for (int col = 0; col < 3 * CA; col++) {
            int d = col % HS, pos = start[0] + t;
            const float *head = x + (size_t)t * 3 * CA + col - d;
            double want = head[d];
            if (col < 2 * CA && d < ROT) {
                int i = d % HALF;
                double angle = pos * pow(10000.0, -2.0 * i / ROT), c = cos(angle), s = sin(angle);
                want = d < HALF ? head[i] * c - head[i + HALF] * s : head[i + HALF] * c + head[i] * s;
            }
            double gap = fabs(rx[(size_t)t * 3 * CA + col] - want);
            if (gap > worst) worst = gap;
        }
    CHECK(worst < 1e-5, "rotary turns dims i and i + rot/2 of each query and key head by pos theta^(-2i/rot) "
                        "(largest gap %g)", worst);
    free(x), free(rx);
}

static int run_encode(const char *dir, const char *file) {
    Tokenizer *t = tokenizer_load(dir);
    size_t len;
    char *text = read_file_or_die(file, &len);
    int *ids, n = tokenizer_encode(t, text, len, &ids);
    printf("[");
    for (int i = 0; i < n; i++) printf("%s%d", i ? ", " : "", ids[i]);
    printf("]\n");
    free(ids), free(text);
    tokenizer_free(t);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--encode") == 0) return run_encode(argv[2], argv[3]);
    ops_init();
    if (argc == 3 && strcmp(argv[1], "--oracle") == 0) return run_oracle(argv[2]);
    test_rotary();
    test_rotary_values();
    return test_summary("test_phi");
}
