// test_phi.c: the phi architecture's own pieces, and our side of tests/test_phi_oracle.sh.
//
// Without arguments: rotary's backward is its forward's transpose (<R x, y> = <x, R^T y>), a
// rotation keeps each head's norm, the dims past rotary_dim pass through untouched, and the
// turned values equal a reference's that pairs dim i with dim i + rotary_dim/2.
//
// `test_phi --oracle DIR`: DIR holds a Hugging Face phi checkpoint (config.json,
// model.safetensors) and tokens.bin (int32 B, T, then B*T inputs and B*T targets). Writes
//   DIR/logits.bin     our logits (B*T rows of vocab_size floats) before any step
//   DIR/grads.json     {"loss": mean loss, "<tensor name>": gradient norm, ...}
//   DIR/resaved/       the loaded weights saved again (transformers must load them)
//   DIR/stepped/       the weights after one AdamW step (ORACLE_* hyper-parameters below)
//
// `test_phi --encode TOKENIZER_DIR FILE`: prints FILE's token ids as one JSON array (the
// tokenizer oracle compares them with transformers' CodeGenTokenizerFast).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "checkpoint.h"
#include "device.h"
#include "gpt.h"
#include "inputs.h"
#include "log.h"
#include "ops.h"
#include "tokenizer.h"

// the AdamW step tests/oracle_phi.py takes too
#define ORACLE_LR 1e-3f
#define ORACLE_BETA1 0.9f
#define ORACLE_BETA2 0.95f
#define ORACLE_EPS 1e-8f
#define ORACLE_WD 0.1f

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

static void write_rows(const char *path, const float *rows, int N, int stride, int width) {
    FILE *f = fopen_or_die(path, "wb");
    for (int n = 0; n < N; n++) fwrite(rows + (size_t)n * stride, sizeof(float), (size_t)width, f);
    fclose(f);
}

static void write_grads(const char *path, const ParamLayout *l, const float *grads, double loss) {
    FILE *f = fopen_or_die(path, "w");
    fprintf(f, "{\"loss\": %.9g", loss);
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *t = &l->tensors[i];
        fprintf(f, ", \"%s\": %.9g", t->name, sqrt(dot(grads + t->offset, grads + t->offset, t->numel)));
    }
    fprintf(f, "}\n");
    fclose(f);
}

static int run_oracle(const char *dir) {
    GPTConfig cfg;
    checkpoint_read_config(dir, &cfg);
    ParamLayout l;
    gpt_layout(&l, &cfg);
    size_t P = l.num_params;
    float *params = calloc_or_die(P, sizeof(float)), *grads = calloc_or_die(P, sizeof(float));
    float *m = calloc_or_die(P, sizeof(float)), *v = calloc_or_die(P, sizeof(float));
    checkpoint_load_model(dir, &l, params);
    char path[1024];
    snprintf(path, sizeof path, "%s/resaved", dir);
    checkpoint_save_model(path, &l, params, NULL);
    int B, T;
    int *tokens = read_oracle_tokens(dir, &B, &T);
    const int *x = tokens + 2, *y = tokens + 2 + B * T;
    Weights w, g;
    weights_point(&w, &l, params);  // the CPU backend: device pointers are host pointers
    weights_point(&g, &l, grads);
    Activations a;
    acts_alloc(&a, &cfg, B, T, 0);
    int N = B * T;
    double loss = gpt_forward_backward(&a, &w, &g, &cfg, x, y, B, T, 1.0f / (float)N) / N;
    gpt_forward(&a, &w, x, B, T);  // the logits again: backward overwrote them with their gradient
    snprintf(path, sizeof path, "%s/logits.bin", dir);
    write_rows(path, a.logits, N, cfg.padded_vocab_size, cfg.vocab_size);
    snprintf(path, sizeof path, "%s/grads.json", dir);
    write_grads(path, &l, grads, loss);
    for (int i = 0; i < l.num_tensors; i++) {
        const TensorInfo *t = &l.tensors[i];
        adamw_update(params + t->offset, grads + t->offset, 1.0f, m + t->offset, v + t->offset, t->numel, ORACLE_LR,
                     ORACLE_BETA1, ORACLE_BETA2, ORACLE_EPS, t->decay ? ORACLE_WD : 0.0f, 1);
    }
    snprintf(path, sizeof path, "%s/stepped", dir);
    checkpoint_save_model(path, &l, params, NULL);
    acts_free(&a);
    weights_free(&w), weights_free(&g);
    gpt_layout_free(&l);
    free(tokens), free(params), free(grads), free(m), free(v);
    return 0;
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
