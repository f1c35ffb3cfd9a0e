// buckets.c: see buckets.h.
#include "buckets.h"

#include <stdio.h>
#include <stdlib.h>

#include "base/log.h"

void plan_buckets(BucketPlan *p, const ParamLayout *layout, double bucket_mb, float *grads, Comm *world) {
    size_t limit = (size_t)(bucket_mb * 1e6 / sizeof(float)), end = layout->num_params;
    p->n = p->launched = 0;
    p->grads = grads;
    p->world = world;
    for (int l = layout->cfg.n_layer - 1; l >= 0; l--) {
        size_t start = l == 0 ? 0 : layout_block_start(layout, l);  // the last bucket takes the root tensors too
        if (end - start < limit && l > 0) continue;
        if (p->n == (int)(sizeof p->buckets / sizeof p->buckets[0])) fatal("more than 256 gradient buckets");
        p->buckets[p->n++] = (Bucket){.first = start, .count = end - start, .ready_after = l == 0 ? -1 : l};
        end = start;
    }
}

void launch_ready_buckets(int layer, void *plan) {
    BucketPlan *p = plan;
    while (p->launched < p->n && p->buckets[p->launched].ready_after == layer) {
        Bucket *b = &p->buckets[p->launched++];
        b->req = comm_all_reduce_start(p->world, p->grads + b->first, b->count);
    }
    // MPI moves a non-blocking collective's data only inside MPI calls: give it a nudge
    for (int i = 0; i < p->launched; i++) comm_test(p->buckets[i].req);
}

void print_gradient_sync(const BucketPlan *p, bool overlap, double bucket_mb) {
    printf("gradient all-reduce: %s\n", overlap ? "bucketed, launched during backward"
                                               : "one all-reduce of the flat buffer after backward");
    if (overlap) printf("  %d buckets of about %g MB\n", p->n, bucket_mb);
}

void wait_buckets(BucketPlan *p) {
    if (p->launched != p->n) fatal("internal: %d of %d gradient buckets were launched", p->launched, p->n);
    for (int i = 0; i < p->n; i++) comm_wait(p->buckets[i].req);
    p->launched = 0;  // ready for the next step
}
