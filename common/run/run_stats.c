// run_stats.c: see run_stats.h.
#include "run_stats.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/files.h"
#include "base/log.h"
#include "model/activations.h"
#include "ops/ops.h"

void print_memory_report(const char *title, const MemoryItem *items, int n) {
    size_t total = 0;
    printf("%s\n", title);
    for (int i = 0; i < n; i++) {
        printf("  %-28s %10.2f MiB\n", items[i].what, items[i].bytes / 1048576.0);
        total += items[i].bytes;
        run_stats_memory(items[i].what, items[i].bytes);
    }
    printf("  %-28s %10.2f MiB\n", "total", total / 1048576.0);
}

const char *parameters_label(const Config *cfg) {
    if (!config_is_half(cfg)) return "parameters (fp32)";
    return cfg->prec == PREC_BF16 ? "parameters (bf16, no master)" : "parameters (fp32 master)";
}

static bool is_fp16(const Config *cfg) { return config_half_format(cfg) == HALF_FP16; }

const char *copy_label(const Config *cfg) {
    return is_fp16(cfg) ? "parameters (fp16 copy)" : "parameters (bf16 copy)";
}

const char *activations_label(const Config *cfg) {
    if (!config_is_half(cfg)) return "activations (fp32)";
    return is_fp16(cfg) ? "activations (fp16 matmul inputs)" : "activations (bf16 matmul inputs)";
}

void print_16bit_activation_saving(const Activations *acts) {
    if (!acts->spec.half) return;
    // the matmul inputs are kept in bf16; what backward reads outside a matmul stays fp32: the
    // LayerNorm statistics, q/k/v and what attention keeps for its backward (the probabilities
    // on the CPU, log-sum-exps on a GPU), the pre-GELU values (GELU backward), the residual stream
    ActsSpec fp32 = acts->spec;
    fp32.half = false;
    size_t fp32_bytes = acts_bytes(&fp32);
    printf("  (in fp32 the activations would take %.2f MiB: %s matmul inputs save %.0f%%; the "
           "statistics, attention, pre-GELU values and residual stream stay fp32)\n",
           fp32_bytes / 1048576.0, ops_half_format() == HALF_FP16 ? "fp16" : "bf16", 100.0 * (1.0 - (double)acts->bytes / fp32_bytes));
    run_stats_number("fp32_activations_bytes", (double)fp32_bytes);
}

// ---- the machine ------------------------------------------------------------------------------

double read_rate(const float *x, size_t n, int passes) {
    double best = 1e30;
    for (int pass = 0; pass <= passes; pass++) {
        double t0 = wall_seconds();
        sum_values(x, n);
        double dt = wall_seconds() - t0;
        if (pass > 0 && dt < best) best = dt;
    }
    return n * sizeof(float) / best;
}

// ---- stats.json -------------------------------------------------------------------------------

// What the run has recorded so far, until run_stats_write puts it into the file. One record per
// process, as comm.c keeps its counts: a report records what it prints without the stage passing
// a handle around, so that each stage's diff stays its technique.
static cJSON *g_recorded = NULL;

static cJSON *recorded(void) {
    if (!g_recorded) g_recorded = cJSON_CreateObject();
    if (!g_recorded) fatal("out of memory recording the run's figures");
    return g_recorded;
}

// sets obj[key] = value, replacing an earlier value (a figure recorded again is updated)
static void set_item(cJSON *obj, const char *key, cJSON *value) {
    if (!value) fatal("out of memory recording '%s' for stats.json", key);
    if (cJSON_GetObjectItemCaseSensitive(obj, key)) cJSON_ReplaceItemInObjectCaseSensitive(obj, key, value);
    else cJSON_AddItemToObject(obj, key, value);
}

void run_stats_memory(const char *what, size_t bytes) {
    cJSON *memory = cJSON_GetObjectItemCaseSensitive(recorded(), "memory");
    if (!memory) memory = cJSON_AddObjectToObject(recorded(), "memory");
    set_item(memory, what, cJSON_CreateNumber((double)bytes));
}

void run_stats_number(const char *key, double value) { set_item(recorded(), key, cJSON_CreateNumber(value)); }

static cJSON *layout_json(RunLayout layout) {
    cJSON *j = cJSON_CreateObject();
    if (layout.tp_dimensions[0])
        cJSON_AddItemToObject(j, "tp_dimensions", cJSON_CreateIntArray(layout.tp_dimensions, 3));
    if (layout.pp) cJSON_AddNumberToObject(j, "pp", layout.pp);
    if (layout.ep) cJSON_AddNumberToObject(j, "ep", layout.ep);
    if (layout.cp) cJSON_AddNumberToObject(j, "cp", layout.cp);
    cJSON_AddNumberToObject(j, "dp", layout.dp);
    if (layout.sharded) cJSON_AddTrueToObject(j, "sharded");
    return j;
}

void run_stats_write(const Config *cfg, int stage, int world_size, RunLayout layout, cJSON *communication) {
    // the fields that say what ran come first, for the person who opens the file
    cJSON *stats = cJSON_CreateObject();
    cJSON_AddNumberToObject(stats, "stage", stage);
    cJSON_AddNumberToObject(stats, "world_size", world_size);
    cJSON_AddItemToObject(stats, "layout", layout_json(layout));
    cJSON_AddStringToObject(stats, "precision", cfg->precision);
    cJSON *figures = recorded();
    while (figures->child) {
        cJSON *item = cJSON_DetachItemViaPointer(figures, figures->child);
        cJSON_AddItemToObject(stats, item->string, item);
    }
    cJSON_AddItemToObject(stats, "communication", communication ? communication : cJSON_CreateArray());
    char *text = cJSON_Print(stats);
    if (!text) fatal("out of memory writing %s/stats.json", cfg->out_dir);
    write_text_file(cfg->out_dir, "stats.json", text);
    free(text);
    cJSON_Delete(stats);
    cJSON_Delete(figures);
    g_recorded = NULL;
}
