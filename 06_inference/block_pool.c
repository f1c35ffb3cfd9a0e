// block_pool.c: the KV cache's blocks (see block_pool.h).
#include "block_pool.h"

#include <stdlib.h>

#include "log.h"

void block_pool_init(BlockPool *p, int n_blocks) {
    *p = (BlockPool){.n_blocks = n_blocks, .n_free = n_blocks};
    p->free_list = malloc_or_die((size_t)n_blocks * sizeof(int));
    p->refs = calloc_or_die((size_t)n_blocks, sizeof(int));
    for (int i = 0; i < n_blocks; i++) p->free_list[i] = n_blocks - 1 - i;  // block 0 is taken first
}

void block_pool_free(BlockPool *p) {
    free(p->free_list);
    free(p->refs);
}

int block_pool_take(BlockPool *p) {
    if (!p->n_free) return -1;
    int b = p->free_list[--p->n_free];
    p->refs[b] = 1;
    return b;
}

void block_pool_release(BlockPool *p, int b) {
    if (b < 0 || b >= p->n_blocks || p->refs[b] <= 0) fatal("internal: block %d released but not held", b);
    if (--p->refs[b] == 0) p->free_list[p->n_free++] = b;
}

int blocks_for(int n, int block_size) { return (n + block_size - 1) / block_size; }
