// test_top_p.c: stage 06's sampler (06_inference/sampler.c) against the definitions written out
// here in double. Greedy is the argmax; with temperature, top-k and top-p every token drawn over
// many steps lies in the reference's candidate set (the k most likely, ties to the lower id, then
// the smallest prefix of them whose probability, not renormalized after the top-k cut, reaches p)
// and every member of that set is drawn; the distribution drawn from (sampler_probs) is the
// candidates' probabilities over their total mass. Exact ties, whose cut lands exactly on p, tell
// ">= p" from "> p" and the order of tied tokens.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"
#include "sampler.h"

#define V 40
#define DRAWS 4000

static int by_desc(const void *a, const void *b, const double *p) {
    int i = *(const int *)a, j = *(const int *)b;
    if (p[i] != p[j]) return p[i] < p[j] ? 1 : -1;
    return i - j;
}
static const double *g_p;
static int cmp(const void *a, const void *b) { return by_desc(a, b, g_p); }

// in[i] = 1 when token i may be drawn at this temperature, top_k and top_p, and want[i] its
// probability of being drawn; returns how many may be
static int reference_set(int *in, double *want, const float *logits, double temperature, int top_k, double top_p) {
    double p[V], max = -INFINITY, sum = 0;
    int order[V];
    for (int i = 0; i < V; i++) max = fmax(max, logits[i]);
    for (int i = 0; i < V; i++) sum += p[i] = exp((logits[i] - max) / temperature);
    for (int i = 0; i < V; i++) p[i] /= sum, order[i] = i, in[i] = 0;
    g_p = p;
    qsort(order, V, sizeof(int), cmp);
    int n = top_k > 0 && top_k < V ? top_k : V;
    double total = 0;
    for (int i = 0; i < n; i++) {
        total += p[order[i]];
        if (total >= top_p - 1e-6) {  // float accumulates what double adds here
            n = i + 1;
            break;
        }
    }
    double mass = 0;
    for (int i = 0; i < n; i++) in[order[i]] = 1, mass += p[order[i]];
    for (int i = 0; i < V; i++) want[i] = in[i] ? p[i] / mass : 0.0;
    return n;
}

static void test_draws(const float *logits, float temperature, int top_k, float top_p) {
    int in[V], seen[V] = {0}, outside = 0;
    double want[V];
    int n = reference_set(in, want, logits, temperature, top_k, top_p);
    Sampler s;
    sampler_init(&s, V, temperature, top_k, top_p, 1234);
    float probs[V];
    sampler_probs(&s, logits, probs);
    double worst = 0;
    for (int i = 0; i < V; i++) worst = fmax(worst, fabs(probs[i] - want[i]));
    CHECK(worst <= 1e-5, "temperature %g, top_k %d, top_p %g: the candidates' probabilities over their mass "
          "are off by up to %g (is the mass returned their total?)", temperature, top_k, top_p, worst);
    for (int step = 0; step < DRAWS; step++) {
        int t = sampler_next(&s, logits, 3, step);
        if (t < 0 || t >= V || !in[t]) outside++;
        else seen[t] = 1;
    }
    int covered = 0;
    for (int i = 0; i < V; i++) covered += seen[i];
    CHECK(outside == 0, "temperature %g, top_k %d, top_p %g: %d of %d draws outside the %d candidates",
          temperature, top_k, top_p, outside, DRAWS, n);
    CHECK(covered == n, "temperature %g, top_k %d, top_p %g: %d of the %d candidates drawn", temperature,
          top_k, top_p, covered, n);
    sampler_free(&s);
}

int main(void) {
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = 2.0f * sinf(1.7f * (float)i) + 0.05f * (float)i;  // no ties
    Sampler greedy;
    sampler_init(&greedy, V, 0.0f, 0, 1.0f, 1);
    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    CHECK(sampler_next(&greedy, logits, 0, 0) == best, "greedy draws the argmax");
    sampler_free(&greedy);
    test_draws(logits, 1.0f, 0, 1.0f);   // every token
    test_draws(logits, 1.0f, 0, 0.5f);   // the nucleus of half the mass
    test_draws(logits, 0.7f, 0, 0.9f);
    test_draws(logits, 1.3f, 5, 1.0f);   // top-k alone
    test_draws(logits, 1.0f, 8, 0.6f);   // both: p of the probabilities before the cut (7 tokens, not 4)
    // 8 tokens tied at probability 1/8 (ids 3, 8, ..., 38), the rest 0: p = 0.5 is reached exactly
    // after 4 of them, the 4 lowest ids; top-k 3 keeps the 3 lowest
    float tied[V];
    for (int i = 0; i < V; i++) tied[i] = i % 5 == 3 ? 0.0f : -1e4f;
    test_draws(tied, 1.0f, 0, 0.5f);
    test_draws(tied, 1.0f, 3, 1.0f);
    return test_summary("test_top_p");
}
