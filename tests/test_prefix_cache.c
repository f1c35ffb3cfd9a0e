// test_prefix_cache.c: stage 06's prefix cache (06_inference/serving/prefix_cache.c over block_pool.c) as
// the scheduler uses it: a finished text's full blocks registered under their keys, and a new
// text's blocks looked up, each under its parent's key, until one is missing.
//
// Checked: two texts that differ in one token, at each position of the second of three blocks, in
// blocks of 4 and of 16 tokens: the second text, registered after the first and then looked up,
// finds its own blocks and never one of the first's (whose keys and values were computed over the
// other token). The first text's block before the change is shared, and looked up, it is found.
// A key that ignored part of a block's tokens would give the two texts' changed blocks one key,
// and their later blocks (equal tokens under equal parent keys) one entry: the first text's.
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "block_pool.h"
#include "check.h"

enum { BLOCKS = 3 };

// registers each full block of text (BLOCKS x block_size tokens) in blocks[], as a sequence that
// computed them would: under its key, after its parent's
static void register_text(BlockPool *p, const int *text, const int *blocks) {
    uint64_t parent = 0;
    for (int i = 0; i < BLOCKS; i++) {
        const int *tokens = text + (size_t)i * p->block_size;
        uint64_t key = prefix_key(parent, tokens, p->block_size);
        prefix_register(p, blocks[i], key, parent, tokens);
        parent = key;
    }
}

// the cached blocks text begins with, into found[]; returns how many
static int match_text(const BlockPool *p, const int *text, int *found) {
    uint64_t parent = 0;
    for (int i = 0; i < BLOCKS; i++) {
        const int *tokens = text + (size_t)i * p->block_size;
        uint64_t key = prefix_key(parent, tokens, p->block_size);
        if ((found[i] = prefix_lookup(p, key, parent, tokens)) < 0) return i;
        parent = key;
    }
    return BLOCKS;
}

static void check_texts_apart(int block_size, int changed) {
    BlockPool p;
    block_pool_init(&p, 2 * BLOCKS, block_size, true);
    int n = BLOCKS * block_size, *first = malloc((size_t)n * sizeof(int)), *second = malloc((size_t)n * sizeof(int));
    for (int t = 0; t < n; t++) first[t] = second[t] = (t * 37 + 11) % 50257;
    second[block_size + changed] += 1;
    int first_blocks[BLOCKS], second_blocks[BLOCKS], found[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) first_blocks[i] = block_pool_take(&p);
    for (int i = 0; i < BLOCKS; i++) second_blocks[i] = block_pool_take(&p);
    register_text(&p, first, first_blocks);
    register_text(&p, second, second_blocks);
    int matched = match_text(&p, second, found);
    bool own = matched == BLOCKS && found[0] == first_blocks[0];  // block 0 is the same text: shared
    for (int i = 1; i < matched; i++) own = own && found[i] == second_blocks[i];
    CHECK(own, "blocks of %d, token %d of block 1 changed: the second text finds %d blocks (%d %d %d), want "
          "block 0 shared (%d) and its own blocks 1 and 2 (%d %d)", block_size, changed, matched, found[0],
          matched > 1 ? found[1] : -1, matched > 2 ? found[2] : -1, first_blocks[0], second_blocks[1],
          second_blocks[2]);
    block_pool_free(&p);
    free(first), free(second);
}

int main(void) {
    for (int block_size = 4; block_size <= 16; block_size *= 4)
        for (int changed = 0; changed < block_size; changed++) check_texts_apart(block_size, changed);
    return test_summary("test_prefix_cache");
}
