// plan.h: what the planner predicts for one parallel layout (tools/plan.c), and what --measure
// finds when it runs the layout (tools/plan_measure.c).
#ifndef PLAN_H
#define PLAN_H

#include <stdbool.h>
#include <stddef.h>

#include "config/config.h"
#include "plan_cluster.h"
#include "run/run_stats.h"

// one collective of a step, as rank 0 counts it (comm.h's sizes)
typedef struct {
    const char *group, *kind;  // as the stages name them in stats.json: "data", "all-reduce"
    double bytes;              // per step
    long calls;                // per step (the latency term; the stages' count, approximately)
    int n, stride;             // ranks in the group, world-rank distance between them
    CostKind cost;
    bool hideable;             // the stage can run it under compute (when the machine overlaps)
    double seconds;            // alpha-beta, on the link it crosses
    const char *algorithm;
    bool intra;                // stays on one node
} Collective;

enum { PLAN_MAX_MEMORY = 8, PLAN_MAX_COMM = 10, PLAN_MAX_PASSES = 32 };

typedef struct {
    char name[64];            // "DDP", "FSDP", "TP [2,2,1] x 1", "tp2-pp2 x 4, 1f1b m8"
    int stage;                // the binary that runs it: build/stage-N
    char args[8][48];         // what it adds to the config: "--strategy=axonn", "--tp_dimensions=2,2,1"
    int n_args;
    int dims[3], dp;
    int pp, microbatches;     // pipelines: stages, micro-batches per step
    int ep;                   // experts: ranks a replica's experts are spread over
    int zero_stage, replicas; // stage 04's ladder: its rung, and HSDP's replica groups (1: none)
    int cp;                   // stage 10: the ranks a sequence is split over
    MemoryItem memory[PLAN_MAX_MEMORY];  // rank 0's memory report, row for row
    int n_memory;
    size_t memory_total;
    int heaviest_stage;       // stage 10: the pipeline stage whose t = 0 rank holds the most, and its total
    size_t heaviest_total;
    bool fits;
    Collective comm[PLAN_MAX_COMM];
    int n_comm;
    double comm_bytes;        // per step: what metrics.jsonl's comm_bytes counts
    double compute_s, bubble_s, comm_s, exposed_s, step_s, tokens_per_s;
    // --measure: each pass's median step after the first, and over the passes the fastest (the
    // step time) and the slowest (with it, the spread a shared machine put on the figure)
    bool measured;
    double pass_step_s[PLAN_MAX_PASSES];
    double pass_others_cores[PLAN_MAX_PASSES];  // cores other jobs kept busy during the pass (-1: unknown)
    int n_passes;
    double measured_step_s, measured_slowest_s, measured_comm_bytes;
    size_t measured_memory_total;
    bool memory_agrees;       // every row of stats.json's memory equals the prediction's
} Plan;

// --measure: runs each plan for `steps` steps with mpirun on this machine (config_args: the
// --config and --key=value arguments the planner was given) and fills the measured fields; with
// passes > 1, over every layout again (each pass starting one layout further on), each pass's
// median step kept
void measure_plans(Plan *plans, int n, int ranks, char **config_args, int n_config_args, int steps, int passes);

// --calibrate: writes a cluster description of this machine to `path`: matmul FLOP/s
// (ops_peak_flops, as the stages measure it), the model's efficiency (each stage on one rank with
// config_args: 03, 04, 05, 07 and 10, or 08 alone for a mixture of experts), MPI latency and
// bandwidth between ranks (ping-pongs in pairs, --pingpong); with passes > 1 the stages run in
// turn that many times, each stage's best efficiency kept
void calibrate_machine(const char *path, int ranks, char **config_args, int n_config_args, bool experts, int passes);
// the ping-pong itself, under mpirun with an even number of ranks, in pairs: prints
// "latency_us L bandwidth_GBps B" (rank 0's pair) on rank 0
void pingpong(int *argc, char ***argv);

// --inference: stage 06's memory per rank (weights, KV cache) on every tensor-parallel grid
// [x, y, 1] of `ranks` (0: the config's tp_dimensions) or the one `layout` names ("" : every one),
// for the config (argv: the --config and --key=value arguments, loaded as stage 06 loads them);
// root written to path as indented JSON, then freed
void write_plan_json(const char *path, cJSON *root);

// printed, and written to json unless NULL (tools/plan_serve.c)
void plan_inference(const Cluster *cluster, int ranks, const char *layout, const char *json, int argc, char **argv);

#endif
