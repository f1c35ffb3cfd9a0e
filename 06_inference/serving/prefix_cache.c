// prefix_cache.c: prefix caching over the block pool (see block_pool.h).
//
// A full block is known by a key that hashes its tokens and, through its parent's key, every
// token before them: two sequences reach the same key only with the same text up to the block's
// end. A lookup also compares the block's tokens and its parent's key, so a collision of the hash
// alone finds nothing. The table keeps every cached block, held or not; the ones nobody holds are
// in a least-recently-used list, from which block_pool_take evicts when no block is free.
#include "block_pool.h"

#include <string.h>

// FNV-1a over the parent's key and the tokens' bytes
uint64_t prefix_key(uint64_t parent, const int *tokens, int block_size) {
    uint64_t h = 1469598103934665603ULL;
    const unsigned char *bytes = (const unsigned char *)&parent;
    for (size_t i = 0; i < sizeof parent; i++) h = (h ^ bytes[i]) * 1099511628211ULL;
    bytes = (const unsigned char *)tokens;
    for (size_t i = 0; i < (size_t)block_size * sizeof(int); i++) h = (h ^ bytes[i]) * 1099511628211ULL;
    return h ? h : 1;  // 0 is the parent of a first block
}

static int bucket_of(const BlockPool *p, uint64_t key) { return (int)(key % (uint64_t)p->n_buckets); }

int prefix_lookup(const BlockPool *p, uint64_t key, uint64_t parent, const int *tokens) {
    for (int b = p->bucket[bucket_of(p, key)]; b >= 0; b = p->next[b])
        if (p->key[b] == key && p->parent_key[b] == parent &&
            memcmp(p->tokens + (size_t)b * p->block_size, tokens, (size_t)p->block_size * sizeof(int)) == 0)
            return b;
    return -1;
}

void prefix_register(BlockPool *p, int b, uint64_t key, uint64_t parent, const int *tokens) {
    if (p->cached[b] || prefix_lookup(p, key, parent, tokens) >= 0) return;
    p->key[b] = key;
    p->parent_key[b] = parent;
    memcpy(p->tokens + (size_t)b * p->block_size, tokens, (size_t)p->block_size * sizeof(int));
    p->cached[b] = true;
    int *head = &p->bucket[bucket_of(p, key)];
    p->next[b] = *head;
    *head = b;
}

static void unregister(BlockPool *p, int b) {
    int *link = &p->bucket[bucket_of(p, p->key[b])];
    while (*link != b) link = &p->next[*link];
    *link = p->next[b];
    p->cached[b] = false;
}

void prefix_lru_push(BlockPool *p, int b) {
    p->lru_prev[b] = p->lru_last, p->lru_next[b] = -1;
    if (p->lru_last >= 0) p->lru_next[p->lru_last] = b;
    else p->lru_first = b;
    p->lru_last = b;
    p->n_lru++;
}

void prefix_lru_remove(BlockPool *p, int b) {
    if (p->lru_prev[b] >= 0) p->lru_next[p->lru_prev[b]] = p->lru_next[b];
    else p->lru_first = p->lru_next[b];
    if (p->lru_next[b] >= 0) p->lru_prev[p->lru_next[b]] = p->lru_prev[b];
    else p->lru_last = p->lru_prev[b];
    p->n_lru--;
}

int prefix_evict(BlockPool *p) {
    int b = p->lru_first;
    if (b < 0) return -1;
    prefix_lru_remove(p, b);
    unregister(p, b);
    return b;
}
