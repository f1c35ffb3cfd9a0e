// buckets.h: the stage's second lesson: all-reduce gradient buckets while backward is still
// running, and the check that data parallelism kept the replicas identical.
//
// A bucket is a contiguous range of the flat gradient buffer made of whole blocks. Backward
// finishes the blocks from the last to the first, so buckets are cut from the end of the buffer;
// the last bucket also holds the root tensors (embeddings, final LayerNorm), whose gradients are
// final only when the embedding's backward is done.
#ifndef BUCKETS_H
#define BUCKETS_H

#include <stdbool.h>
#include <stddef.h>

#include "comm/comm.h"
#include "model/gpt.h"

typedef struct {
    size_t first, count;  // the range of the flat buffer
    int ready_after;      // launch when this block's backward is done (-1: the embedding's)
    CommRequest *req;
} Bucket;

typedef struct {
    Bucket buckets[256];
    int n, launched;
    float *grads;
    Comm *world;
} BucketPlan;

// buckets of about bucket_mb megabytes of whole blocks over the gradient buffer grads
void plan_buckets(BucketPlan *p, const ParamLayout *layout, double bucket_mb, float *grads, Comm *world);
// the GradReadyHook that backward calls each time a block's gradients are final: launches the
// buckets that are complete
void launch_ready_buckets(int layer, void *plan);
// says how the gradients are summed: buckets during backward (overlap), or one all-reduce after
void print_gradient_sync(const BucketPlan *p, bool overlap, double bucket_mb);
// waits for every bucket's all-reduce (all must have been launched)
void wait_buckets(BucketPlan *p);

#endif
