// block_pool.h: the KV cache's blocks (kv_cache.h), handed out to sequences and given back.
//
// The pool is the whole cache: a sequence takes a block when its next position starts one, and
// gives its blocks back when it ends (or is preempted). A block may be held by several sequences
// at once (their prompts begin with the same tokens: prefix caching): it is free again when the
// last of them lets it go.
#ifndef BLOCK_POOL_H
#define BLOCK_POOL_H

typedef struct {
    int n_blocks;
    int *free_list, n_free;  // the free blocks, taken from the end
    int *refs;               // (n_blocks) the sequences holding each block
} BlockPool;

void block_pool_init(BlockPool *p, int n_blocks);
void block_pool_free(BlockPool *p);
// a free block, now held once; -1 when none is free
int block_pool_take(BlockPool *p);
// one holder lets block b go; the last one frees it
void block_pool_release(BlockPool *p, int b);
// blocks needed for positions 0 .. n - 1
int blocks_for(int n, int block_size);

#endif
