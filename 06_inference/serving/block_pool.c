// block_pool.c: the KV cache's blocks (see block_pool.h); what prefix caching adds is in
// prefix_cache.c.
#include "block_pool.h"

#include <stdlib.h>

#include "base/log.h"

void block_pool_init(BlockPool *p, int n_blocks, int block_size, bool caching) {
    *p = (BlockPool){.n_blocks = n_blocks, .block_size = block_size, .n_free = n_blocks, .caching = caching,
                     .lru_first = -1, .lru_last = -1};
    p->free_list = malloc_or_die((size_t)n_blocks * sizeof(int));
    p->refs = calloc_or_die((size_t)n_blocks, sizeof(int));
    for (int i = 0; i < n_blocks; i++) p->free_list[i] = n_blocks - 1 - i;  // block 0 is taken first
    if (!caching) return;
    p->key = calloc_or_die((size_t)n_blocks, sizeof(uint64_t));
    p->parent_key = calloc_or_die((size_t)n_blocks, sizeof(uint64_t));
    p->tokens = calloc_or_die((size_t)n_blocks * block_size, sizeof(int));
    p->cached = calloc_or_die((size_t)n_blocks, sizeof(bool));
    p->n_buckets = 2 * n_blocks;
    p->bucket = malloc_or_die((size_t)p->n_buckets * sizeof(int));
    for (int i = 0; i < p->n_buckets; i++) p->bucket[i] = -1;
    p->next = malloc_or_die((size_t)n_blocks * sizeof(int));
    p->lru_prev = malloc_or_die((size_t)n_blocks * sizeof(int));
    p->lru_next = malloc_or_die((size_t)n_blocks * sizeof(int));
}

void block_pool_free(BlockPool *p) {
    free(p->free_list);
    free(p->refs);
    free(p->key);
    free(p->parent_key);
    free(p->tokens);
    free(p->cached);
    free(p->bucket);
    free(p->next);
    free(p->lru_prev);
    free(p->lru_next);
}

int block_pool_take(BlockPool *p) {
    int b = p->n_free ? p->free_list[--p->n_free] : p->caching ? prefix_evict(p) : -1;
    if (b >= 0) p->refs[b] = 1;
    return b;
}

void block_pool_hold(BlockPool *p, int b) {
    if (p->refs[b]++ == 0) prefix_lru_remove(p, b);  // only a cached block is found with nobody holding it
}

void block_pool_release(BlockPool *p, int b) {
    if (b < 0 || b >= p->n_blocks || p->refs[b] <= 0) fatal("internal: block %d released but not held", b);
    if (--p->refs[b] > 0) return;
    if (p->caching && p->cached[b]) prefix_lru_push(p, b);
    else p->free_list[p->n_free++] = b;
}

int block_pool_available(const BlockPool *p) { return p->n_free + p->n_lru; }

int blocks_for(int n, int block_size) { return (n + block_size - 1) / block_size; }
