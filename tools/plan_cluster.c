// plan_cluster.c: see plan_cluster.h.
#include "plan_cluster.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "base/log.h"

// what a JSON value is, in the words of an error message
static const char *found(const cJSON *v, char *buf, size_t n) {
    if (!v) return "nothing (the key is missing)";
    char *text = cJSON_PrintUnformatted(v);
    snprintf(buf, n, "%s", text ? text : "a value");
    free(text);
    return buf;
}

// obj.key as a number in [lo, hi]; `where` names the key for the message ("intra_node.latency_us")
static double number(const Cluster *c, const cJSON *obj, const char *key, const char *where, double lo, double hi) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    char buf[128];
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi))
        fatal("%s: key '%s': expected a number from %g to %g, found %s", c->path, where, lo, hi,
              found(v, buf, sizeof buf));
    return v->valuedouble;
}

static const cJSON *object(const Cluster *c, const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    char buf[128];
    if (!cJSON_IsObject(v)) fatal("%s: key '%s': expected an object, found %s", c->path, key, found(v, buf, sizeof buf));
    return v;
}

static void text(const Cluster *c, const cJSON *obj, const char *key, char *out, size_t n) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    char buf[128];
    if (!cJSON_IsString(v) || !v->valuestring[0])
        fatal("%s: key '%s': expected a non-empty string, found %s", c->path, key, found(v, buf, sizeof buf));
    snprintf(out, n, "%s", v->valuestring);
}

static Link link_of(const Cluster *c, const cJSON *root, const char *key) {
    const cJSON *o = object(c, root, key);
    char where[64];
    snprintf(where, sizeof where, "%s.bandwidth_GBps", key);
    double gbps = number(c, o, "bandwidth_GBps", where, 1e-6, 1e6);
    snprintf(where, sizeof where, "%s.latency_us", key);
    double us = number(c, o, "latency_us", where, 0, 1e6);
    return (Link){.bandwidth = gbps * 1e9, .latency = us * 1e-6};
}

// every key a description may hold: another is a typo, refused as the stages refuse one
static const char *const KEYS[] = {"name", "source", "nodes", "gpus_per_node", "peak_tflops", "efficiency",
                                   "memory_gib", "intra_node", "inter_node", "overlaps_compute", "cores", "stage_efficiency",
                                   "expected_busbw_GBps"};  // the preflight's (tools/preflight.py)

static void refuse_unknown_keys(const Cluster *c, const cJSON *root) {
    for (const cJSON *k = root->child; k; k = k->next) {
        bool known = false;
        for (size_t i = 0; i < sizeof KEYS / sizeof KEYS[0]; i++) known |= strcmp(k->string, KEYS[i]) == 0;
        if (!known) fatal("%s: key '%s': expected one of name, source, nodes, gpus_per_node, peak_tflops, "
                          "efficiency, stage_efficiency, memory_gib, intra_node, inter_node, overlaps_compute, cores, "
                          "expected_busbw_GBps; "
                          "found an unknown key", c->path, k->string);
    }
}

void cluster_load(Cluster *c, const char *path) {
    memset(c, 0, sizeof *c);
    snprintf(c->path, sizeof c->path, "%s", path);
    char *json = read_file_or_die(path, NULL);
    cJSON *root = cJSON_Parse(json);
    if (!cJSON_IsObject(root))
        fatal("%s: expected a JSON object (a cluster description), found text that does not parse as one "
              "(near \"%.20s\")", path, cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() : json);
    refuse_unknown_keys(c, root);
    text(c, root, "name", c->name, sizeof c->name);
    text(c, root, "source", c->source, sizeof c->source);
    c->nodes = (int)number(c, root, "nodes", "nodes", 1, 1e6);
    c->gpus_per_node = (int)number(c, root, "gpus_per_node", "gpus_per_node", 1, 1024);
    const cJSON *peak = object(c, root, "peak_tflops");
    c->peak_flops_f32 = 1e12 * number(c, peak, "fp32", "peak_tflops.fp32", 1e-6, 1e6);
    c->peak_flops_16 = 1e12 * number(c, peak, "bf16", "peak_tflops.bf16", 1e-6, 1e6);
    c->efficiency = number(c, root, "efficiency", "efficiency", 1e-4, 1);
    c->memory_bytes = number(c, root, "memory_gib", "memory_gib", 1e-3, 1e6) * 1073741824.0;
    c->intra = link_of(c, root, "intra_node");
    c->inter = link_of(c, root, "inter_node");
    const cJSON *overlaps = cJSON_GetObjectItemCaseSensitive(root, "overlaps_compute");
    char buf[128];
    if (!cJSON_IsBool(overlaps))
        fatal("%s: key 'overlaps_compute': expected true or false, found %s", path, found(overlaps, buf, sizeof buf));
    c->overlaps = cJSON_IsTrue(overlaps);
    if (cJSON_GetObjectItemCaseSensitive(root, "cores")) c->cores = (int)number(c, root, "cores", "cores", 1, 1e6);
    // {"3": 0.54, "5": 0.44}: each stage's own, where the stages reach different shares of peak
    if (cJSON_GetObjectItemCaseSensitive(root, "stage_efficiency")) {
        const cJSON *per = object(c, root, "stage_efficiency");
        for (const cJSON *e = per->child; e; e = e->next) {
            int stage = atoi(e->string);
            char where[64];
            snprintf(where, sizeof where, "stage_efficiency.%s", e->string);
            if (stage < 1 || stage > 10) fatal("%s: key '%s': expected a stage from 1 to 10, found '%s'", path, where, e->string);
            c->stage_efficiency[stage] = number(c, per, e->string, where, 1e-4, 1);
        }
    }
    cJSON_Delete(root);
    free(json);
}

double collective_seconds(CostKind kind, double bytes, long calls, int n, Link l, const char **algorithm) {
    *algorithm = "ring";
    if (calls == 0 || n < 2) return 0;
    double per_call = bytes / (double)calls, ring, tree;
    switch (kind) {
    case COST_ALL_REDUCE:
        ring = 2.0 * (n - 1) * l.latency + 2.0 * (n - 1) / n * per_call / l.bandwidth;
        tree = 2.0 * ceil(log2(n)) * l.latency + 2.0 * per_call / l.bandwidth;
        if (tree < ring) *algorithm = "tree";
        return calls * (tree < ring ? tree : ring);
    case COST_GATHER_SCATTER: return calls * ((n - 1) * l.latency + (double)(n - 1) / n * per_call / l.bandwidth);
    default: *algorithm = "p2p"; return calls * (l.latency + per_call / l.bandwidth);
    }
}

bool group_is_intra_node(const Cluster *c, int n, int stride) {
    return (long)(n - 1) * stride < c->gpus_per_node;  // rank 0's group: ranks 0, stride, ...
}
