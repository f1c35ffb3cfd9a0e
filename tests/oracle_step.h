// oracle_step.h: our side of the transformers oracles (tests/oracle_phi.py, tests/oracle_llama.py),
// whatever the architecture: `--oracle DIR` in test_phi and test_llama. DIR holds a Hugging Face
// checkpoint (config.json, model.safetensors or its shards) and tokens.bin (int32 B, T, then B*T
// inputs and B*T targets). Writes
//   DIR/logits.bin     our logits (B*T rows of vocab_size floats) before any step
//   DIR/grads.json     {"loss": mean loss, "<tensor name>": gradient norm, ...}
//   DIR/resaved/       the loaded weights saved again (transformers must load them)
//   DIR/stepped/       the weights after one AdamW step (ORACLE_* hyper-parameters below)
#ifndef ORACLE_STEP_H
#define ORACLE_STEP_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/log.h"
#include "inputs.h"
#include "model/activations.h"
#include "model/checkpoint.h"
#include "model/gpt.h"
#include "ops/ops.h"

// the AdamW step the oracles take too
#define ORACLE_LR 1e-3f
#define ORACLE_BETA1 0.9f
#define ORACLE_BETA2 0.95f
#define ORACLE_EPS 1e-8f
#define ORACLE_WD 0.1f

static inline double oracle_dot(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

static inline void write_rows(const char *path, const float *rows, int N, int stride, int width) {
    FILE *f = fopen_or_die(path, "wb");
    for (int n = 0; n < N; n++) fwrite(rows + (size_t)n * stride, sizeof(float), (size_t)width, f);
    fclose(f);
}

static inline void write_grads(const char *path, const ParamLayout *l, const float *grads, double loss) {
    FILE *f = fopen_or_die(path, "w");
    fprintf(f, "{\"loss\": %.9g", loss);
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *t = &l->tensors[i];
        fprintf(f, ", \"%s\": %.9g", t->name, sqrt(oracle_dot(grads + t->offset, grads + t->offset, t->numel)));
    }
    fprintf(f, "}\n");
    fclose(f);
}

static inline int run_oracle(const char *dir) {
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

#endif
