// run_stats.h: the figures that describe a run as a whole: the memory report, and
// <out_dir>/stats.json.
#ifndef RUN_STATS_H
#define RUN_STATS_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

#include "config/config.h"
#include "model/gpt.h"

// ---- memory -----------------------------------------------------------------------------------
typedef struct { const char *what; size_t bytes; } MemoryItem;
// prints the items and their total, and records each item for stats.json (run_stats_memory)
void print_memory_report(const char *title, const MemoryItem *items, int n);
// the memory report's name for the fp32 parameters: "(fp32)", the "(fp32 master)" of bf16-mixed,
// or pure bf16's "(bf16, no master)" (its weights are rounded to bf16 after each update)
const char *parameters_label(const Config *cfg);
// and for the 16-bit copies, naming the run's format: "parameters (bf16 copy)" or "(fp16 copy)";
// "activations (bf16 matmul inputs)", "(fp16 matmul inputs)", or "activations (fp32)"
const char *copy_label(const Config *cfg);
const char *activations_label(const Config *cfg);
// bf16 modes: what the same activations would take in fp32, and what stays fp32 and why
void print_16bit_activation_saving(const Activations *acts);

// ---- the machine ------------------------------------------------------------------------------
// How fast this process reads x (n floats, where the backend keeps its buffers): bytes a second
// of sum_values over them, the best of `passes` after one pass that warms up. The best, because
// other work on the machine only ever slows a pass down.
double read_rate(const float *x, size_t n, int passes);

// ---- the whole run's figures: <out_dir>/stats.json --------------------------------------------
// metrics.jsonl holds each step; stats.json holds what describes the run as a whole: the stage,
// its parallel layout, the memory report's items, the communication per group and kind, and the
// figures a stage adds (fields: docs/ARCHITECTURE.md, Outputs). Tests read their numbers here;
// the printed reports and tables are for people. Figures are recorded as the run reports them
// (print_memory_report records its items) and rank 0 writes the file once, at the end.
typedef struct {
    int dp;                // data-parallel replicas (1: none)
    bool sharded;          // parameters, gradients and optimizer state sharded over them (FSDP)
    int tp_dimensions[3];  // the tensor-parallel grid [x, y, z]; all 0: no tensor parallelism
    int pp;                // pipeline stages; 0: no pipeline parallelism
    int ep;                // ranks the experts are spread over; 0: no expert parallelism
    int cp;                // ranks each sequence is split over; 0: no context parallelism
} RunLayout;
// records one category of this rank's memory, in bytes, under "memory"
void run_stats_memory(const char *what, size_t bytes);
// records a figure of the run under `key` (e.g. "state_bytes")
void run_stats_number(const char *key, double value);
// writes <out_dir>/stats.json atomically: stage, world_size, layout, precision, what was
// recorded, and `communication` (comm_stats_json(), whose ownership it takes; NULL: a single
// process, an empty list). Call it on rank 0 only.
void run_stats_write(const Config *cfg, int stage, int world_size, RunLayout layout, cJSON *communication);

#endif
