// test_lora.c: LoRA's own parts (common/lora.h), and our side of tests/test_lora_oracle.sh's peft oracle.
//
// Without arguments: the adapters a Llama's lora_targets describe sit in the right rows of the
// fused projections (q, k, v in qkv; gate and up in fc) with PEFT's shapes; a target naming no
// linear is refused by name (a child process); and the adapted model's logits equal those of the base with lora_merge's W + scale B A, on random
// adapters (B non-zero).
//
// `test_lora --oracle DIR`: DIR holds ckpt/ (a Hugging Face checkpoint), adapter/ (a PEFT adapter
// for it) and tokens.bin (int32 B, T, then B*T inputs and B*T targets). Writes
//   DIR/logits.bin          the adapted model's logits (B*T rows of vocab_size floats)
//   DIR/grads/              the adapters' gradients of one step's mean loss, as an adapter (PEFT's names)
//   DIR/stepped/            the adapters after one AdamW step (ORACLE_* of tests/oracle_step.h), our files
//   DIR/stepped_logits.bin  the adapted model's logits after that step
//   DIR/base_after/         the base's weights after the step (they must not have moved)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "lora.h"
#include "ops.h"
#include "oracle_step.h"

static GPTConfig tiny_llama(void) {
    return (GPTConfig){.arch = &ARCH_LLAMA, .max_seq_len = 16, .vocab_size = 50, .padded_vocab_size = 128,
                       .n_layer = 2, .n_head = 4, .n_embd = 32, .n_kv_head = 2, .ffn_dim = 40,
                       .rope_theta = 10000.0f, .norm_eps = 1e-5f};
}

static const LoraSite *site_named(const Lora *lo, const char *module) {
    char name[80];
    snprintf(name, sizeof name, "%s.lora_A.weight", module);
    for (int i = 0; i < lo->n_sites; i++)
        if (strcmp(lo->layout.tensors[lo->sites[i].a].name, name) == 0) return &lo->sites[i];
    return NULL;
}

static void test_sites(void) {
    GPTConfig cfg = tiny_llama();
    ParamLayout l;
    gpt_layout(&l, &cfg);
    Lora lo;
    lora_describe(&lo, &l, 4, 8, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "test");
    CHECK(lo.n_sites == 14 && lo.layout.num_tensors == 28, "7 linears x 2 blocks: %d sites", lo.n_sites);
    struct { const char *module; LinearKind kind; int row0, rows, in; } want[] = {
        {"model.layers.1.self_attn.q_proj", LIN_QKV, 0, 32, 32},
        {"model.layers.1.self_attn.k_proj", LIN_QKV, 32, 16, 32},
        {"model.layers.1.self_attn.v_proj", LIN_QKV, 48, 16, 32},
        {"model.layers.1.self_attn.o_proj", LIN_ATTN_PROJ, 0, 32, 32},
        {"model.layers.1.mlp.gate_proj", LIN_FC, 0, 40, 32},
        {"model.layers.1.mlp.up_proj", LIN_FC, 40, 40, 32},
        {"model.layers.1.mlp.down_proj", LIN_FC_PROJ, 0, 32, 40},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const LoraSite *s = site_named(&lo, want[i].module);
        CHECK(s && s->kind == want[i].kind && s->row0 == want[i].row0 && s->rows == want[i].rows &&
                  s->in_dim == want[i].in && s->layer == 1,
              "%s: kind, rows [row0, row0 + rows) of the fused output, input width", want[i].module);
        if (!s) continue;
        const TensorInfo *a = &lo.layout.tensors[s->a], *b = &lo.layout.tensors[s->b];
        CHECK(a->shape[0] == 4 && a->shape[1] == want[i].in && b->shape[0] == want[i].rows && b->shape[1] == 4,
              "%s: A (r, in) and B (out, r), PEFT's shapes", want[i].module);
    }
    lora_free(&lo);
    lora_describe(&lo, &l, 2, 2, "", "test");
    CHECK(lo.n_sites == 4 && site_named(&lo, "model.layers.0.self_attn.v_proj") &&
              !site_named(&lo, "model.layers.0.self_attn.k_proj"),
          "empty lora_targets: PEFT's default for Llama, q_proj and v_proj (%d sites)", lo.n_sites);
    lora_free(&lo);
    // a target naming no linear: refused by name, in a child (fatal exits)
    int pipefd[2];
    if (pipe(pipefd) != 0) return;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pipefd[1], 2);
        lora_describe(&lo, &l, 2, 2, "q_proj,c_attn", "command line");
        _exit(0);
    }
    close(pipefd[1]);
    char msg[1024] = {0};
    size_t used = 0;
    for (ssize_t got; used < sizeof msg - 1 && (got = read(pipefd[0], msg + used, sizeof msg - 1 - used)) > 0;)
        used += (size_t)got;  // fatal() may write its message in pieces: read to the end
    close(pipefd[0]);
    int status;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) != 0 && strstr(msg, "lora_targets") && strstr(msg, "\"c_attn\"") &&
              strstr(msg, "gate_proj"),
          "lora_targets c_attn on a Llama is refused naming it and the linears there are: %s", msg);
    gpt_layout_free(&l);
}

// the adapted model's logits against the merged base's, on random adapters
static void test_merge_equals_adapted(void) {
    GPTConfig cfg = tiny_llama();
    ParamLayout l;
    gpt_layout(&l, &cfg);
    float *params = malloc_or_die(l.num_params * sizeof(float));
    gpt_init_range(params, &l, 0, l.num_params, 7);
    Lora lo;
    lora_describe(&lo, &l, 4, 8, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "test");
    float *adapters = malloc_or_die(lo.layout.num_params * sizeof(float));
    lora_init(&lo, adapters, 3);
    for (size_t i = 0; i < lo.layout.num_params; i++)
        if (adapters[i] == 0) adapters[i] = 0.05f * (float)((i * 7919) % 13) - 0.3f;  // B non-zero
    int B = 2, T = 8, N = B * T, tokens[16];
    for (int i = 0; i < N; i++) tokens[i] = (i * 17 + 3) % cfg.vocab_size;
    Weights w;
    weights_point(&w, &l, params);
    Activations a;
    acts_alloc(&a, &cfg, B, T, 0);
    lora_plug(&lo, adapters, params, &a);
    gpt_forward(&a, &w, tokens, B, T);
    float *adapted = malloc_or_die((size_t)N * cfg.padded_vocab_size * sizeof(float));
    memcpy(adapted, a.logits, (size_t)N * cfg.padded_vocab_size * sizeof(float));
    acts_free(&a);
    lora_merge(&lo, adapters, params);
    acts_alloc(&a, &cfg, B, T, 0);
    gpt_forward(&a, &w, tokens, B, T);
    double worst = 0, largest = 0;
    for (int n = 0; n < N; n++)
        for (int v = 0; v < cfg.vocab_size; v++) {
            size_t i = (size_t)n * cfg.padded_vocab_size + v;
            worst = fmax(worst, fabs(adapted[i] - a.logits[i]));
            largest = fmax(largest, fabs(a.logits[i]));
        }
    CHECK(worst <= 1e-5 * largest + 1e-6, "adapted logits equal the merged model's (max |diff| %.3g of %.3g)", worst,
          largest);
    acts_free(&a);
    lora_free(&lo);
    weights_free(&w);
    gpt_layout_free(&l);
    free(params), free(adapters), free(adapted);
}

// ---- the oracle run -------------------------------------------------------------------------------

static int run_lora_oracle(const char *dir) {
    char path[1024], adapter_dir[1024];
    snprintf(path, sizeof path, "%s/ckpt", dir);
    snprintf(adapter_dir, sizeof adapter_dir, "%s/adapter", dir);
    GPTConfig cfg;
    checkpoint_read_config(path, &cfg);
    ParamLayout l;
    gpt_layout(&l, &cfg);
    size_t P = l.num_params;
    float *params = calloc_or_die(P, sizeof(float));
    checkpoint_load_model(path, &l, params);
    int rank;
    double alpha;
    char targets[256];
    lora_read_adapter_config(adapter_dir, &rank, &alpha, targets, sizeof targets);
    Lora lo;
    lora_describe(&lo, &l, rank, alpha, targets, adapter_dir);
    size_t n = lo.layout.num_params;
    float *adapters = calloc_or_die(n, sizeof(float)), *host = calloc_or_die(n, sizeof(float));
    lora_read_adapter(&lo, adapter_dir, adapters);

    int B, T;
    int *tokens = read_oracle_tokens(dir, &B, &T);
    const int *x = tokens + 2, *y = tokens + 2 + B * T;
    int N = B * T;
    Weights w, g;
    weights_point(&w, &l, params);
    g = (Weights){.n_layer = cfg.n_layer, .h = calloc_or_die((size_t)cfg.n_layer, sizeof(BlockWeights))};
    Activations a;
    acts_alloc(&a, &cfg, B, T, 0);
    lora_plug(&lo, adapters, params, &a);
    gpt_forward(&a, &w, x, B, T);
    snprintf(path, sizeof path, "%s/logits.bin", dir);
    write_rows(path, a.logits, N, cfg.padded_vocab_size, cfg.vocab_size);
    double loss = gpt_forward_backward(&a, &w, &g, &cfg, x, y, B, T, 1.0f / (float)N) / N;
    printf("loss %.9g\n", loss);
    copy_to_host(host, lo.grads, lo.bytes);
    snprintf(path, sizeof path, "%s/grads", dir);
    lora_write_adapter(&lo, path, host, "ckpt");
    for (int i = 0; i < lo.layout.num_tensors; i++) {
        const TensorInfo *t = &lo.layout.tensors[i];
        adamw_update(lo.params + t->offset, lo.grads + t->offset, 1.0f, lo.m + t->offset, lo.v + t->offset, t->numel,
                     ORACLE_LR, ORACLE_BETA1, ORACLE_BETA2, ORACLE_EPS, ORACLE_WD, 1);
    }
    copy_to_host(host, lo.params, lo.bytes);
    snprintf(path, sizeof path, "%s/stepped", dir);
    lora_write_adapter(&lo, path, host, "ckpt");
    gpt_forward(&a, &w, x, B, T);
    snprintf(path, sizeof path, "%s/stepped_logits.bin", dir);
    write_rows(path, a.logits, N, cfg.padded_vocab_size, cfg.vocab_size);
    snprintf(path, sizeof path, "%s/base_after", dir);
    checkpoint_save_model(path, &l, params, NULL);
    acts_free(&a);
    lora_free(&lo);
    weights_free(&w), weights_free(&g);
    gpt_layout_free(&l);
    free(tokens), free(params), free(adapters), free(host);
    return 0;
}

int main(int argc, char **argv) {
    ops_init();
    if (argc == 3 && strcmp(argv[1], "--oracle") == 0) return run_lora_oracle(argv[2]);
    test_sites();
    test_merge_equals_adapted();
    return test_summary("test_lora");
}
