// test_sampler.c: stage 06's sampler (06_inference/sampler.c) against a sampler written here.
//
// The reference ranks every token by how many tokens beat it (higher probability, or equal and a
// lower id), keeps those ranked below k, and walks the kept tokens from the most likely down until
// the cumulative probability passes u x (their total), in double. Both draw with the same uniform
// u of each (seed, prompt, step): the top 24 bits of rng_hash, as sampler.h documents. Checked:
// the same token at every draw of top_k 1, 2, 5 and no limit (draws within rounding of a boundary
// between two tokens are not counted), only the top k are ever drawn, and all of them are.
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"
#include "ops/kernels.h"
#include "sampler.h"

enum { V = 37, DRAWS = 3000 };

// the rank of token i: how many tokens come before it
static int rank_of(const double *p, int i) {
    int rank = 0;
    for (int j = 0; j < V; j++) rank += p[j] > p[i] || (p[j] == p[i] && j < i);
    return rank;
}

// the reference's draw for uniform u; *near: u lies within rounding of a boundary between tokens
static int reference_draw(const float *logits, float temperature, int k, double u, bool *near) {
    double p[V], sum = 0, mass = 0, acc = 0;
    for (int i = 0; i < V; i++) sum += p[i] = exp((double)logits[i] / temperature);
    int by_rank[V], kept = k > 0 && k < V ? k : V;
    for (int i = 0; i < V; i++) by_rank[rank_of(p, i)] = i;
    for (int r = 0; r < kept; r++) mass += p[by_rank[r]] / sum;
    *near = false;
    for (int r = 0; r < kept; r++) {
        acc += p[by_rank[r]] / sum;
        if (fabs(u * mass - acc) < 1e-5) *near = true;
        if (u * mass < acc) return by_rank[r];
    }
    return by_rank[kept - 1];
}

static void check_top_k(const float *logits, float temperature, int k) {
    Sampler s;
    sampler_init(&s, V, temperature, k, 1.0f, 42);
    int kept = k > 0 ? k : V, mismatches = 0, counted = 0, outside = 0, hits[V] = {0};
    double p[V];
    for (int i = 0; i < V; i++) p[i] = logits[i];  // the ranks of the logits are those of the probabilities
    for (int d = 0; d < DRAWS; d++) {
        long prompt = d % 7;
        int step = d / 7;
        double u = (double)(rng_hash(42, (uint64_t)prompt, (uint64_t)step) >> 40) / 16777216.0;
        bool near;
        int want = reference_draw(logits, temperature, k, u, &near), got = sampler_next(&s, logits, prompt, step);
        hits[got]++;
        outside += rank_of(p, got) >= kept;
        if (near) continue;
        counted++;
        mismatches += got != want;
    }
    int drawn = 0;
    for (int i = 0; i < V; i++) drawn += hits[i] > 0 && rank_of(p, i) < kept;
    CHECK(mismatches == 0 && counted > DRAWS * 9 / 10,
          "top_k %d, temperature %g: %d of %d draws differ from the reference's", k, temperature, mismatches, counted);
    CHECK(outside == 0, "top_k %d: %d draws outside the top %d", k, outside, kept);
    if (k > 0) CHECK(drawn == kept, "top_k %d: %d of the top %d tokens drawn in %d draws", k, drawn, kept, DRAWS);
    sampler_free(&s);
}

int main(void) {
    // distinct logits in a scrambled order (the top tokens are not the first ids), two of them
    // tied, so that the order of ties matters
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = 2.0f * sinf(1.7f * (float)i + 0.4f);
    logits[11] = logits[23];
    int ks[] = {0, 1, 2, 5};
    for (int i = 0; i < 4; i++) {
        check_top_k(logits, 1.0f, ks[i]);
        check_top_k(logits, 0.7f, ks[i]);
    }
    return test_summary("test_sampler");
}
