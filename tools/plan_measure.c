// plan_measure.c: the planner's measurements on this machine. --measure runs every planned layout
// for a few steps with the stages' own binaries and reads back what they write (metrics.jsonl,
// stats.json); --calibrate measures what a cluster description says, for this machine.
#define _POSIX_C_SOURCE 200809L  // setenv, gethostname, popen
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "base/device.h"
#include "base/log.h"
#include "comm/comm.h"
#include "ops/ops.h"
#include "ops/ops_peak.h"
#include "plan.h"

// mpirun as the tests start it: ranks may outnumber the cores, nothing bound (MPIRUN overrides)
static const char *mpirun(void) {
    const char *m = getenv("MPIRUN");
    return m && *m ? m : "mpirun --oversubscribe --bind-to none";
}

// where the runs write (PLAN_OUT overrides): one directory per layout, kept for a look
static const char *out_root(void) {
    const char *o = getenv("PLAN_OUT");
    return o && *o ? o : "out/plan";
}

// appends ' arg' single-quoted for the shell
static void append_quoted(char *cmd, size_t size, const char *arg) {
    size_t len = strlen(cmd);
    if (len + 3 >= size) fatal("internal: command line too long");
    cmd[len++] = ' ';
    cmd[len++] = '\'';
    for (const char *c = arg; *c; c++) {
        const char *piece = *c == '\'' ? "'\\''" : (char[]){*c, 0};
        size_t n = strlen(piece);
        if (len + n + 2 >= size) fatal("internal: command line too long");
        memcpy(cmd + len, piece, n);
        len += n;
    }
    cmd[len++] = '\'';
    cmd[len] = 0;
}

// runs `np` ranks of build/stage-<stage> with the config arguments, the layout's (extra) and the
// short-run keys, writing dir/ and dir.log; fatal with the log's name when it fails
static void run_stage(int np, int stage, char **config_args, int n_config_args, char (*extra)[48], int n_extra,
                      int steps, const char *dir) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s -np %d build/stage-%d", mpirun(), np, stage);
    for (int i = 0; i < n_config_args; i++) append_quoted(cmd, sizeof cmd, config_args[i]);
    for (int i = 0; i < n_extra; i++) append_quoted(cmd, sizeof cmd, extra[i]);
    char keys[200], out_dir[600];
    // resume=false: a run in the same directory before (the previous pass, an earlier --measure)
    // saved a checkpoint there, which resume=auto would continue, running no step and leaving
    // that run's metrics.jsonl to be read again as this one's
    snprintf(keys, sizeof keys, " --stop_iteration=%d --eval_batches=0 --eval_interval=0 --checkpoint_interval=0 "
             "--log_interval=1000 --resume=false", steps);
    strncat(cmd, keys, sizeof cmd - strlen(cmd) - 1);
    snprintf(out_dir, sizeof out_dir, "--out_dir=%s", dir);
    append_quoted(cmd, sizeof cmd, out_dir);
    strncat(cmd, " >", sizeof cmd - strlen(cmd) - 1);
    char log[600];
    snprintf(log, sizeof log, "%s.log", dir);
    append_quoted(cmd, sizeof cmd, log);
    strncat(cmd, " 2>&1", sizeof cmd - strlen(cmd) - 1);
    int rc = system(cmd);
    if (rc != 0) fatal("build/stage-%d on %d ranks failed (status %d): see %s", stage, np, rc, log);
}

static cJSON *read_json(const char *path) {
    char *text = read_file_or_die(path, NULL);
    cJSON *j = cJSON_Parse(text);
    if (!j) fatal("%s: expected JSON, found text that does not parse", path);
    free(text);
    return j;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// metrics.jsonl's `key` over the steps after the first (which warms up), sorted, and the last
// step's comm_bytes
enum { MAX_STEPS = 4096 };
static int steps_after_first(const char *dir, const char *key, double values[MAX_STEPS], double *last_comm_bytes) {
    char path[600];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen_or_die(path, "r");
    int n = 0;
    char line[4096];
    while (fgets(line, sizeof line, f) && n < MAX_STEPS) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key), *s = cJSON_GetObjectItemCaseSensitive(j, "step");
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(j, "comm_bytes");
        if (!cJSON_IsNumber(v) || !cJSON_IsNumber(s)) fatal("%s: expected a number under '%s' on every line", path, key);
        if (s->valuedouble > 1) values[n++] = v->valuedouble;
        if (last_comm_bytes) *last_comm_bytes = cJSON_IsNumber(c) ? c->valuedouble : 0;
        cJSON_Delete(j);
    }
    fclose(f);
    if (n == 0) fatal("%s: expected at least 2 steps, found fewer", path);
    qsort(values, (size_t)n, sizeof(double), compare_doubles);
    return n;
}

// stats.json's memory against the prediction's rows: the total, and whether every row agrees
static void compare_memory(Plan *p, const char *dir) {
    char path[600];
    snprintf(path, sizeof path, "%s/stats.json", dir);
    cJSON *stats = read_json(path);
    const cJSON *memory = cJSON_GetObjectItemCaseSensitive(stats, "memory");
    p->measured_memory_total = 0;
    int rows = 0;
    p->memory_agrees = true;
    for (const cJSON *m = memory ? memory->child : NULL; m; m = m->next, rows++) {
        p->measured_memory_total += (size_t)m->valuedouble;
        bool found = false;
        for (int i = 0; i < p->n_memory; i++)
            if (strcmp(p->memory[i].what, m->string) == 0) found = (double)p->memory[i].bytes == m->valuedouble;
        p->memory_agrees &= found;
    }
    p->memory_agrees &= rows == p->n_memory;
    cJSON_Delete(stats);
}

// the directory a layout's runs write: out/plan/ddp, fsdp, zero1-hsdp1, tp-2-2-1, pp-2-m8, ep-2, mesh-2-2-1-m8
static void layout_dir(const Plan *p, char *dir, size_t size) {
    int n = snprintf(dir, size, "%s/", out_root());
    if (p->stage == 3) snprintf(dir + n, size - n, "ddp");
    if (p->stage == 4 && p->zero_stage == 3 && p->replicas == 1) snprintf(dir + n, size - n, "fsdp");
    else if (p->stage == 4) snprintf(dir + n, size - n, "zero%d-hsdp%d", p->zero_stage, p->replicas);
    if (p->stage == 5) snprintf(dir + n, size - n, "tp-%d-%d-%d", p->dims[0], p->dims[1], p->dims[2]);
    if (p->stage == 7) snprintf(dir + n, size - n, "pp-%d-m%d", p->pp, p->microbatches);
    if (p->stage == 8) snprintf(dir + n, size - n, "ep-%d", p->ep);
    if (p->stage == 10) snprintf(dir + n, size - n, "mesh-%d-%d-%d-m%d", p->dims[0], p->pp, p->cp, p->microbatches);
}

// ---- what other jobs took from the cores during a run ------------------------------------------

// seconds of CPU the whole machine has been busy (/proc/stat's first line: user, nice, system,
// irq, softirq, steal), summed over the cores; -1 where there is no /proc/stat
static double machine_busy_seconds(void) {
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return -1;
    unsigned long long user, nice, sys, idle, iowait, irq, softirq, steal;
    int got = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &sys, &idle, &iowait, &irq,
                     &softirq, &steal);
    fclose(f);
    if (got != 8) return -1;
    return (double)(user + nice + sys + irq + softirq + steal) / (double)sysconf(_SC_CLK_TCK);
}

// seconds of CPU this process's finished children used (mpirun and, through it, the ranks)
static double children_cpu_seconds(void) {
    struct rusage r;
    getrusage(RUSAGE_CHILDREN, &r);
    return (double)r.ru_utime.tv_sec + (double)r.ru_stime.tv_sec + 1e-6 * (double)(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

typedef struct {
    double busy, children, wall;
} CpuMark;

static CpuMark cpu_mark(void) {
    return (CpuMark){machine_busy_seconds(), children_cpu_seconds(), wall_seconds()};
}

// How many cores other jobs kept busy since `before`, on average: the machine's busy time less
// what the runs used. A run beside another job measures the job too; tools/plan_order.py leaves
// such passes out. -1: unknown (no /proc/stat).
static double others_cores_since(CpuMark before) {
    CpuMark now = cpu_mark();
    if (before.busy < 0 || now.busy < 0 || now.wall <= before.wall) return -1;
    double others = (now.busy - before.busy - (now.children - before.children)) / (now.wall - before.wall);
    return others > 0 ? others : 0;
}

// One pass of one layout: its median step joins the other passes'; the step time is the fastest
// pass, the slowest bounds the spread. The median, not the fastest step: where ranks outnumber
// the cores they take turns, and rank 0's steps alternate (29, 36, 32, 36, 33 ms in one DDP run
// here): a step that starts while the others finish the one before is short, and the fastest
// step would flatter the layout (by a fifth, in that run's pass).
static void measure_pass(Plan *p, int ranks, char **config_args, int n_config_args, int steps) {
    char dir[512];
    layout_dir(p, dir, sizeof dir);
    CpuMark before = cpu_mark();
    run_stage(ranks, p->stage, config_args, n_config_args, p->args, p->n_args, steps, dir);
    p->pass_others_cores[p->n_passes] = others_cores_since(before);
    double ms[MAX_STEPS];
    int n = steps_after_first(dir, "ms", ms, &p->measured_comm_bytes);
    double step_s = (n % 2 ? ms[n / 2] : (ms[n / 2 - 1] + ms[n / 2]) / 2) / 1e3;
    p->pass_step_s[p->n_passes++] = step_s;
    if (!p->measured || step_s < p->measured_step_s) p->measured_step_s = step_s;
    if (!p->measured || step_s > p->measured_slowest_s) p->measured_slowest_s = step_s;
    compare_memory(p, dir);
    p->measured = true;
}

// Passes over all the layouts, one after another, interleaved: a load another job puts on the
// machine for a while then falls on every layout's pass, not on all of one layout's. Each pass
// starts one layout further on, so that no layout always runs first, or after the same one.
void measure_plans(Plan *plans, int n, int ranks, char **config_args, int n_config_args, int steps, int passes) {
    if (steps < 2) fatal("command line: option '--measure': expected at least 2 steps (the first warms up), found %d", steps);
    if (passes > PLAN_MAX_PASSES)
        fatal("command line: option '--passes': expected at most %d, found %d", PLAN_MAX_PASSES, passes);
    mkdir("out", 0755);
    if (mkdir(out_root(), 0755) != 0 && access(out_root(), W_OK) != 0)
        fatal("%s: cannot create the directory for the measured runs", out_root());
    for (int pass = 0; pass < passes; pass++)
        for (int k = 0; k < n; k++) {
            Plan *p = &plans[(pass + k) % n];
            fprintf(stderr, "measuring %s: %d ranks, %d steps (pass %d of %d) ...\n", p->name, ranks, steps, pass + 1,
                    passes);
            measure_pass(p, ranks, config_args, n_config_args, steps);
        }
}

// ---- calibration ------------------------------------------------------------------------------

void pingpong(int *argc, char ***argv) {
    Comm *world = comm_init(argc, argv);
    int rank = comm_rank(world), peer = rank ^ 1;
    // every pair (0, 1), (2, 3), ... at once: with as many ranks as the runs, ranks that share a
    // core (more ranks than cores) pay for it here as they will there
    if (comm_size(world) % 2) fatal("--pingpong: expected an even number of ranks, found %d", comm_size(world));
    enum { SMALL_TRIES = 200, BIG_TRIES = 20 };
    size_t big = 1 << 20;  // floats: 4 MiB, where the bandwidth term dominates
    float *buf = calloc_or_die(big, sizeof(float));
    double small_rtt[SMALL_TRIES], big_rtt[BIG_TRIES];
    for (int k = 0; k < 2; k++) {
        size_t count = k ? big : 1;
        int tries = k ? BIG_TRIES : SMALL_TRIES;
        for (int i = 0; i < tries; i++) {
            double t0 = wall_seconds();
            if (rank % 2 == 0) {
                comm_send(world, buf, count, peer);
                comm_recv(world, buf, count, peer);
            } else {
                comm_recv(world, buf, count, peer);
                comm_send(world, buf, count, peer);
            }
            (k ? big_rtt : small_rtt)[i] = wall_seconds() - t0;
        }
    }
    qsort(small_rtt, SMALL_TRIES, sizeof(double), compare_doubles);
    qsort(big_rtt, BIG_TRIES, sizeof(double), compare_doubles);
    // one way = half a round trip; the big message's time less the latency is its transfer
    double latency = small_rtt[SMALL_TRIES / 2] / 2, one_way = big_rtt[BIG_TRIES / 2] / 2;
    double bandwidth = (double)big * sizeof(float) / (one_way > latency ? one_way - latency : one_way);
    if (rank == 0) printf("latency_us %.3f bandwidth_GBps %.4f\n", latency * 1e6, bandwidth / 1e9);
    free(buf);
    comm_finalize(world);
}

static void measure_link(int ranks, double *latency_us, double *bandwidth_gbps) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s -np %d build/plan --pingpong", mpirun(), ranks % 2 ? ranks + 1 : ranks);
    FILE *p = popen(cmd, "r");
    if (!p) fatal("cannot start '%s'", cmd);
    char line[256];
    bool got = false;
    while (fgets(line, sizeof line, p))
        got |= sscanf(line, "latency_us %lf bandwidth_GBps %lf", latency_us, bandwidth_gbps) == 2;
    int rc = pclose(p);
    if (rc != 0 || !got) fatal("'%s' failed (status %d) or printed no 'latency_us ... bandwidth_GBps ...' line", cmd, rc);
}

// Each stage's efficiency: its best MFU on one rank (steps 2-6), against the peak just measured.
// The best step: one rank runs alone, so a slower step is only another job holding its core (one
// run here: 657, 794, 786, 654, 837 ms a step, its median a disturbed step's). (the
// stages differ: stage 05's layers and stage 07's schedule cost more than stage 03's loop).
// Stage 05 runs the [1, 1, 1] grid, stages 07 and 10 one stage; a mixture of experts runs on stage 08
// alone (all experts on the one rank), the others refuse it. With passes > 1 the stages run in
// turn that many times and each keeps its best: a stage measured while another job held a core
// would otherwise look slower than the others, and the plan would rank layouts by that job.
static void measure_efficiency(char **config_args, int n_config_args, bool experts, double peak_f32, double peak_16,
                               int passes, double efficiency[11]) {
    char text[64];
    snprintf(text, sizeof text, "%.6e", peak_f32);
    setenv("OPS_PEAK_FLOPS_F32", text, 1);
    snprintf(text, sizeof text, "%.6e", peak_16);
    setenv("OPS_PEAK_FLOPS_BF16", text, 1);
    mkdir("out", 0755);
    mkdir(out_root(), 0755);
    static const int dense[] = {3, 4, 5, 7, 10}, moe[] = {8};
    const int *stages = experts ? moe : dense, n = experts ? 1 : 5;
    double best[11] = {0};
    for (int pass = 0; pass < passes; pass++)
        for (int i = 0; i < n; i++) {
            char dir[512], keys[1][48] = {"--gradient_acc_steps=1"};
            snprintf(dir, sizeof dir, "%s/calibrate-stage-%d", out_root(), stages[i]);
            run_stage(1, stages[i], config_args, n_config_args, keys, stages[i] == 7 || stages[i] == 10, 6, dir);
            double mfu[MAX_STEPS];
            int n_steps = steps_after_first(dir, "mfu", mfu, NULL);
            best[stages[i]] = mfu[n_steps - 1] > best[stages[i]] ? mfu[n_steps - 1] : best[stages[i]];
        }
    for (int i = 0; i < n; i++) {
        double mfu = best[stages[i]];
        // above 1: the peak was measured while other jobs held the cores, the run after they left
        if (mfu > 1)
            fprintf(stderr, "calibrate: stage %d reached %.2f of the peak measured before it (the machine was "
                    "busier then): its efficiency is taken as 1\n", stages[i], mfu);
        efficiency[stages[i]] = mfu > 1 ? 1 : mfu;
    }
}

static size_t memory_total_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? (size_t)pages * (size_t)size : 0;
}

// The matmul peak, as the stages measure it (ops_peak_flops), the best of `passes` measurements:
// this one's and build/peak_flops' (the same function, in a process of its own: a process
// measures once). A peak measured while another job held a core is low, and every efficiency
// divided by it then high, the matmuls' share of a step with it.
static void best_peaks(int passes, double *f32, double *b16) {
    *f32 = ops_peak_flops(0), *b16 = ops_peak_flops(1);
    for (int pass = 1; pass < passes; pass++) {
        FILE *p = popen("build/peak_flops", "r");
        if (!p) fatal("cannot start build/peak_flops");
        char line[512];
        double v;
        while (fgets(line, sizeof line, p)) {
            if (sscanf(line, "export " PEAK_ENV_F32 "=%lf", &v) == 1 && v > *f32) *f32 = v;
            if (sscanf(line, "export " PEAK_ENV_BF16 "=%lf", &v) == 1 && v > *b16) *b16 = v;
        }
        int rc = pclose(p);
        if (rc != 0) fatal("build/peak_flops failed (status %d)", rc);
    }
}

void calibrate_machine(const char *path, int ranks, char **config_args, int n_config_args, bool experts, int passes) {
    ops_init();
    double peak_f32, peak_16;
    best_peaks(passes, &peak_f32, &peak_16);
    double latency_us, bandwidth_gbps;
    measure_link(ranks, &latency_us, &bandwidth_gbps);
    double efficiency[11] = {0};
    measure_efficiency(config_args + 1, n_config_args - 1, experts, peak_f32, peak_16, passes, efficiency);
    int main_stage = experts ? 8 : 3;  // the description's `efficiency`
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    char host[128] = "localhost", when[64];
    gethostname(host, sizeof host - 1);
    time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    cJSON *c = cJSON_CreateObject();
    char name[256];
    snprintf(name, sizeof name, "this machine (%s), %d ranks", host, ranks);
    cJSON_AddStringToObject(c, "name", name);
    char source[1024];
    snprintf(source, sizeof source, "measured by build/plan --calibrate on %s: matmul peak as the stages measure it "
             "(ops_peak_flops, the best of %d: %s); efficiency = each stage's best MFU on one rank over steps 2-6 (of %d "
             "interleaved passes); link = "
             "median MPI ping-pong between the pairs of %d ranks at once (1 float for latency, 4 MiB for "
             "bandwidth)", when, passes, ops_peak_flops_source(0), passes, ranks % 2 ? ranks + 1 : ranks);
    cJSON_AddStringToObject(c, "source", source);
    cJSON_AddNumberToObject(c, "nodes", 1);
    cJSON_AddNumberToObject(c, "gpus_per_node", ranks);
    cJSON *peak = cJSON_AddObjectToObject(c, "peak_tflops");
    cJSON_AddNumberToObject(peak, "fp32", peak_f32 / 1e12);
    cJSON_AddNumberToObject(peak, "bf16", peak_16 / 1e12);
    cJSON_AddNumberToObject(c, "efficiency", efficiency[main_stage]);
    cJSON *per = cJSON_AddObjectToObject(c, "stage_efficiency");
    for (int st = 1; st < 11; st++)
        if (efficiency[st] > 0) {
            char key[4];
            snprintf(key, sizeof key, "%d", st);
            cJSON_AddNumberToObject(per, key, efficiency[st]);
        }
    cJSON_AddNumberToObject(c, "memory_gib", (double)memory_total_bytes() / ranks / 1073741824.0);
    for (int k = 0; k < 2; k++) {  // one node: the inter-node link is never crossed; the same figures
        cJSON *l = cJSON_AddObjectToObject(c, k ? "inter_node" : "intra_node");
        cJSON_AddNumberToObject(l, "bandwidth_GBps", bandwidth_gbps);
        cJSON_AddNumberToObject(l, "latency_us", latency_us);
    }
    // comm.h: MPI moves data only inside MPI calls, so a collective started before compute does
    // not progress during it
    cJSON_AddBoolToObject(c, "overlaps_compute", false);
    cJSON_AddNumberToObject(c, "cores", (double)cores);
    char *text = cJSON_Print(c);
    FILE *f = fopen_or_die(path, "w");
    if (!text || fputs(text, f) == EOF || fclose(f) != 0) fatal("%s: cannot write the cluster description", path);
    printf("wrote %s: %.3g GFLOP/s fp32 (%.3g 16-bit), efficiency %.2f (stage 0%d), %.2f us, %.2f GB/s between ranks, %ld cores\n",
           path, peak_f32 / 1e9, peak_16 / 1e9, efficiency[main_stage], main_stage, latency_us, bandwidth_gbps, cores);
    free(text);
    cJSON_Delete(c);
}
