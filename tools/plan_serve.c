// plan_serve.c: the planner's --inference mode (plan.h): what stage 06 holds per rank to generate
// with the config's model on each tensor-parallel grid [x, y, 1] of the ranks (generation has no
// data parallelism: every rank is in the grid), by the stage's own arithmetic (tp_model_layout,
// kv_width, kv_bytes_per_block, kv_pool_blocks):
//   weights   the rank's share of the parameters in fp32, and their 16-bit copy when the precision
//             has one (stage 06 casts the fp32 weights it loaded, and keeps both);
//   KV cache  max_batch_size whole contexts of max_seq_len positions (serving: kv_cache_bytes, or
//             kv_cache_memory_fraction of what the weights leave of the GPU), in blocks of
//             kv_block_size positions, keys and values of the rank's n_kv_head / x key/value heads
//             in fp32.
// Not counted: one pass's activations and logits, which grow with the longest prompt.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "base/log.h"
#include "data/tokenizer.h"
#include "kv_cache.h"
#include "model/gpt.h"
#include "ops/ops.h"
#include "plan.h"
#include "run/run_setup.h"
#include "run/run_stats.h"
#include "tp_model.h"

enum { SERVE_MEMORY_ITEMS = 3 };

typedef struct {
    int dims[3];
    int kv_heads, blocks;  // the key/value heads a rank caches; the pool's blocks
    MemoryItem memory[SERVE_MEMORY_ITEMS];
    size_t total;
    bool fits;
} ServePlan;

// kv_cache_memory_fraction's pool as the planner sees it: the share of what the weights leave of
// the GPU. The server measures the free memory once the passes' buffers are allocated too (and the
// CUDA context), so its pool comes out a little smaller.
static int blocks_of_share(double fraction, double left, size_t per_block) {
    double n = left > 0 ? floor(fraction * left / (double)per_block) : 0;
    return n > KV_MAX_BLOCKS ? KV_MAX_BLOCKS : (int)n;
}

static void plan_grid(ServePlan *p, const Config *cfg, const GPTConfig *mc, int X, int Y, double capacity) {
    TPGrid grid = {.X = X, .Y = Y, .Z = 1, .D = 1};
    TPModel m;
    tp_model_layout(&m, mc, &grid, true);  // rank (0, 0)'s share, as kv_grid.c makes it
    size_t n = m.layout.num_params, per_block = kv_bytes_per_block(mc->n_layer, cfg->kv_block_size, kv_width(&m.shape));
    *p = (ServePlan){.dims = {X, Y, 1}, .kv_heads = m.shape.n_kv_head};
    bool half = config_is_half(cfg);
    p->memory[0] = (MemoryItem){"weights (fp32)", n * sizeof(float)};
    p->memory[1] = (MemoryItem){config_half_format(cfg) == HALF_FP16 ? "weights (fp16 copy)" : "weights (bf16 copy)",
                                half ? n * sizeof(half16) : 0};
    // the prompts mode gives each batch row a whole context; the server a pool of kv_cache_bytes,
    // or a share of what the weights leave (fewer blocks than a whole context: it does not fit)
    size_t pool = cfg->serve ? (size_t)cfg->kv_cache_bytes : 0;
    bool share = cfg->serve && cfg->kv_cache_memory_fraction > 0;
    p->blocks = share ? blocks_of_share(cfg->kv_cache_memory_fraction,
                                        capacity - (double)(p->memory[0].bytes + p->memory[1].bytes), per_block)
                      : kv_pool_blocks(pool, cfg->max_batch_size, cfg->max_seq_len, cfg->kv_block_size, per_block);
    p->memory[2] = (MemoryItem){"KV cache (fp32)", (size_t)p->blocks * per_block};
    for (int i = 0; i < SERVE_MEMORY_ITEMS; i++) p->total += p->memory[i].bytes;
    int whole = (cfg->max_seq_len + cfg->kv_block_size - 1) / cfg->kv_block_size;
    p->fits = (double)p->total <= capacity && p->blocks >= whole;
    tp_model_free(&m);
}

static void write_serve_json(const char *path, const Cluster *c, int ranks, const Config *cfg, const ServePlan *plans,
                             int n) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "mode", "inference");
    cJSON_AddStringToObject(root, "cluster", c->path);
    cJSON_AddNumberToObject(root, "ranks", ranks);
    cJSON_AddNumberToObject(root, "batch", cfg->max_batch_size);
    cJSON_AddNumberToObject(root, "context", cfg->max_seq_len);
    cJSON *list = cJSON_AddArrayToObject(root, "layouts");
    for (int i = 0; i < n; i++) {
        const ServePlan *p = &plans[i];
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToObject(j, "tp_dimensions", cJSON_CreateIntArray(p->dims, 3));
        cJSON_AddNumberToObject(j, "kv_heads_per_rank", p->kv_heads);
        cJSON_AddNumberToObject(j, "kv_cache_blocks", p->blocks);
        cJSON *mem = cJSON_AddObjectToObject(j, "memory");
        for (int k = 0; k < SERVE_MEMORY_ITEMS; k++) cJSON_AddNumberToObject(mem, p->memory[k].what, (double)p->memory[k].bytes);
        cJSON_AddNumberToObject(j, "memory_total", (double)p->total);
        cJSON_AddBoolToObject(j, "fits", p->fits);
        cJSON_AddItemToArray(list, j);
    }
    write_plan_json(path, root);
}

static void print_serve_plan(const Cluster *c, int ranks, const Config *cfg, const GPTConfig *mc,
                             const ServePlan *plans, int n) {
    printf("plan --inference | %s | %d rank%s | %s L=%d H=%d (%d key/value heads) C=%d V=%d | batch %d x context %d, "
           "KV blocks of %d | precision %s\n", c->name, ranks, ranks > 1 ? "s" : "", gpt_arch(mc)->name, mc->n_layer,
           mc->n_head, mc->n_kv_head ? mc->n_kv_head : mc->n_head, mc->n_embd, mc->vocab_size, cfg->max_batch_size,
           cfg->max_seq_len, cfg->kv_block_size, cfg->precision);
    printf("\nmemory per rank (GiB; not counted: one pass's activations and logits):\n");
    printf("  %-10s %9s %9s %9s %9s %9s %4s\n", "grid", "kv heads", "weights", "copy", "KV cache", "total", "fits");
    for (int i = 0; i < n; i++) {
        const ServePlan *p = &plans[i];
        char grid[32];
        snprintf(grid, sizeof grid, "[%d,%d,1]", p->dims[0], p->dims[1]);
        printf("  %-10s %9d", grid, p->kv_heads);
        for (int k = 0; k < SERVE_MEMORY_ITEMS; k++) printf(" %9.2f", p->memory[k].bytes / 1073741824.0);
        printf(" %9.2f %4s\n", p->total / 1073741824.0, p->fits ? "yes" : "NO");
    }
}

void plan_inference(const Cluster *cluster, int ranks, const char *layout, const char *json, int argc, char **argv) {
    Config cfg;
    config_load(&cfg, argc, argv, STAGE_INFERENCE);
    ops_set_half_format(config_half_format(&cfg));
    Tokenizer *tok = tokenizer_load(cfg.tokenizer_path);
    GPTConfig mc = model_shape(&cfg, tok);
    int P = ranks ? ranks : cfg.tp_dimensions[0] * cfg.tp_dimensions[1];
    ServePlan *plans = calloc_or_die((size_t)P, sizeof *plans);
    int n = 0;
    char why[320] = "";
    for (int X = 1; X <= P; X++) {
        int dims[3] = {X, P / X, 1};
        char name[48];
        snprintf(name, sizeof name, "%d,%d,1", dims[0], dims[1]);
        if (P % X || (layout[0] && strcmp(layout, name) != 0)) continue;
        if (!tp_grid_fits(&mc, dims, P, 1, 1, why, sizeof why)) continue;
        plan_grid(&plans[n++], &cfg, &mc, dims[0], dims[1], cluster->memory_bytes);
    }
    if (!n)
        fatal("command line: option '--layout': no grid [x, y, 1] of %d ranks%s%s can run this model: %s", P,
              layout[0] ? " named " : "", layout, why[0] ? why : "expected x,y,1 with x * y the ranks");
    print_serve_plan(cluster, P, &cfg, &mc, plans, n);
    if (json) write_serve_json(json, cluster, P, &cfg, plans, n);
    free(plans);
    tokenizer_free(tok);
}
