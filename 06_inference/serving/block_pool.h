// block_pool.h: the KV cache's blocks (kv_cache.h), handed out to sequences and given back.
//
// The pool is the whole cache: a sequence takes a block when its next position starts one, and
// gives its blocks back when it ends (or is preempted). A block may be held by several sequences
// at once: with prefix caching, a full block is known by the tokens it holds and every token
// before them (its prefix), and a sequence whose text begins with the same tokens takes that
// block instead of computing its keys and values again. A cached block no sequence holds stays
// cached until the pool needs it (the least recently used first).
#ifndef BLOCK_POOL_H
#define BLOCK_POOL_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    int n_blocks, block_size;
    int *free_list, n_free;  // blocks holding nothing, taken from the end
    int *refs;               // (n_blocks) the sequences holding each block
    // prefix caching (prefix_cache.c); caching false: none of it is used
    bool caching;
    uint64_t *key;           // (n_blocks) a cached block's prefix hash (prefix_key)
    uint64_t *parent_key;    // (n_blocks) the key of the block before it (0 for a first block)
    int *tokens;             // (n_blocks, block_size) a cached block's tokens
    bool *cached;            // (n_blocks) whether the block is in the table
    int *bucket, *next;      // the hash table: chains of blocks, -1 ended
    int n_buckets;
    int *lru_prev, *lru_next, lru_first, lru_last, n_lru;  // cached blocks nobody holds, oldest first
} BlockPool;

void block_pool_init(BlockPool *p, int n_blocks, int block_size, bool caching);
void block_pool_free(BlockPool *p);
// a block holding nothing, now held once: a free one, else the least recently used cached block
// nobody holds (forgotten); -1 when there is none
int block_pool_take(BlockPool *p);
// one more holder of block b (a cached block found by its prefix)
void block_pool_hold(BlockPool *p, int b);
// one holder lets block b go; the last one frees it, or leaves it cached for a later prefix
void block_pool_release(BlockPool *p, int b);
// blocks that block_pool_take can still hand out
int block_pool_available(const BlockPool *p);
// blocks needed for positions 0 .. n - 1
int blocks_for(int n, int block_size);

// ---- prefix caching (prefix_cache.c) --------------------------------------------------------------
// the key of a block holding tokens[0 .. block_size) after a prefix whose last block's key is parent
uint64_t prefix_key(uint64_t parent, const int *tokens, int block_size);
// the cached block with that key, prefix and tokens; -1 when there is none
int prefix_lookup(const BlockPool *p, uint64_t key, uint64_t parent, const int *tokens);
// block b, now full with tokens after the prefix parent, is known by key from now on (unless
// another block already is)
void prefix_register(BlockPool *p, int b, uint64_t key, uint64_t parent, const int *tokens);
// a block nobody holds any more (lru: in the list of evictable ones) or held again (out of it)
void prefix_lru_push(BlockPool *p, int b);
void prefix_lru_remove(BlockPool *p, int b);
// the least recently used cached block nobody holds, forgotten; -1 when there is none
int prefix_evict(BlockPool *p);

#endif
