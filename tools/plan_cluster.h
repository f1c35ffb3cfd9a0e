// plan_cluster.h: the planner's machine: a cluster description (configs/clusters/*.json) and the
// alpha-beta cost of a collective on the links it crosses.
//
// A collective of n ranks moving a message of S bytes (sizes as comm.h defines them) costs
//   ring all-reduce              2(n-1) alpha + 2(n-1)/n S / beta
//   tree all-reduce              2 ceil(log2 n) alpha + 2 S / beta   (pipelined double binary tree)
//   ring all-gather / reduce-scatter   (n-1) alpha + (n-1)/n S / beta
//   point-to-point               alpha + S / beta
// per call, where alpha is the link's latency and beta its bandwidth per GPU in one direction.
// A group whose ranks all sit on one node uses the intra-node link (NVLink; shared memory here);
// a group that crosses nodes is as fast as its slowest hop, the inter-node link (InfiniBand).
// All-reduce takes the cheaper of ring and tree, as NCCL picks per size.
#ifndef PLAN_CLUSTER_H
#define PLAN_CLUSTER_H

#include <stdbool.h>

typedef struct {
    double bandwidth;  // bytes/s per GPU, one direction
    double latency;    // seconds per message
} Link;

typedef struct {
    char path[512], name[128], source[1024];
    int nodes, gpus_per_node;
    double peak_flops_f32, peak_flops_16;  // per GPU (FLOP/s): fp32 and bf16/fp16 matmuls
    double efficiency;        // the fraction of peak the model's step reaches (its MFU ceiling)
    double stage_efficiency[11];  // per stage binary (1 to 10) where calibrated (0: `efficiency`)
    double memory_bytes;      // per GPU
    Link intra, inter;
    bool overlaps;            // communication progresses while compute runs (NCCL on its own
                              // stream: yes; MPI on CPU buffers: only inside MPI calls, no)
    int cores;                // CPU "GPUs": ranks share this many cores (0: each rank has its own)
} Cluster;

// Reads and checks a cluster description; any missing or wrong key is one fatal() naming the
// file, the key, what was expected and what was found.
void cluster_load(Cluster *c, const char *path);

typedef enum { COST_ALL_REDUCE, COST_GATHER_SCATTER, COST_POINT_TO_POINT } CostKind;

// seconds for `calls` calls moving `bytes` in all over a group of n ranks on link l; *algorithm:
// "ring" or "tree" (the cheaper)
double collective_seconds(CostKind kind, double bytes, long calls, int n, Link l, const char **algorithm);

// whether the group of rank 0 with n ranks, `stride` apart, stays on one node
bool group_is_intra_node(const Cluster *c, int n, int stride);

#endif
