// sampler.c: greedy, temperature, top-k and top-p sampling (see sampler.h), on the host: one
// row of V logits per sequence and step is little work next to the forward pass.
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

#include "base/log.h"
#include "ops/kernels.h"

void sampler_init(Sampler *s, int V, float temperature, int top_k, float top_p, uint64_t seed) {
    s->temperature = temperature;
    s->top_k = top_k;
    s->top_p = top_p;
    s->min_p = 0.0f;
    s->seed = seed;
    s->V = V;
    s->prob = malloc_or_die((size_t)V * sizeof(float));
    s->order = malloc_or_die((size_t)V * sizeof(int));
}

void sampler_free(Sampler *s) {
    free(s->prob);
    free(s->order);
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static const float *g_sort_prob;  // qsort has no context argument
static int by_probability_desc(const void *a, const void *b) {
    float pa = g_sort_prob[*(const int *)a], pb = g_sort_prob[*(const int *)b];
    if (pa != pb) return pa < pb ? 1 : -1;
    return *(const int *)a - *(const int *)b;  // ties: the lower id first, so the order is fixed
}

// s->prob = softmax(logits / temperature), in place of the scratch
static void softmax_with_temperature(Sampler *s, const float *logits) {
    float max = logits[argmax(logits, s->V)], sum = 0.0f;
    for (int i = 0; i < s->V; i++) sum += s->prob[i] = expf((logits[i] - max) / s->temperature);
    for (int i = 0; i < s->V; i++) s->prob[i] /= sum;
}

// The candidates in order of probability, cut to the top k and to the top p of the mass;
// returns how many remain and their total probability in *mass.
static int candidates(Sampler *s, float *mass) {
    // Sorting all 50257 GPT-2 tokens every step would cost more than the rest of the step on a
    // small model; a token below (1 - p) / (V - 1) can never be in the nucleus (llama2.c's trick),
    // so only the ones above that are sorted.
    float cutoff = s->top_p < 1.0f ? (1.0f - s->top_p) / (float)(s->V - 1) : 0.0f;
    int n = 0;
    for (int i = 0; i < s->V; i++)
        if (s->prob[i] >= cutoff) s->order[n++] = i;
    g_sort_prob = s->prob;
    qsort(s->order, (size_t)n, sizeof(int), by_probability_desc);
    if (s->top_k > 0 && s->top_k < n) n = s->top_k;
    float total = 0.0f;
    for (int i = 0; i < n; i++) {
        total += s->prob[s->order[i]];
        if (total >= s->top_p) {
            n = i + 1;
            break;
        }
    }
    *mass = total;
    return n;
}

// The candidates (n of them, in order) cut to those at least min_p times as likely as the first;
// returns how many remain and their total probability in *mass.
static int cut_below_min_p(const Sampler *s, int n, float *mass) {
    if (s->min_p <= 0.0f) return n;
    float least = s->min_p * s->prob[s->order[0]], total = 0.0f;
    int kept = 0;
    while (kept < n && s->prob[s->order[kept]] >= least) total += s->prob[s->order[kept++]];
    *mass = total;
    return kept;
}

int sampler_next(Sampler *s, const float *logits, long prompt, int step) {
    if (s->temperature <= 0.0f) return argmax(logits, s->V);
    softmax_with_temperature(s, logits);
    float mass;
    int n = candidates(s, &mass);
    n = cut_below_min_p(s, n, &mass);
    // a uniform number in [0, mass) from the top 24 bits of the hash (exact in a float)
    uint64_t h = rng_hash(s->seed, (uint64_t)prompt, (uint64_t)step);
    float r = (float)(h >> 40) * (1.0f / 16777216.0f) * mass, acc = 0.0f;
    for (int i = 0; i < n; i++) {
        acc += s->prob[s->order[i]];
        if (r < acc) return s->order[i];
    }
    return s->order[n - 1];  // rounding left r at the very top
}

void sampler_probs(Sampler *s, const float *logits, float *probs) {
    softmax_with_temperature(s, logits);
    float mass;
    int n = candidates(s, &mass);
    n = cut_below_min_p(s, n, &mass);
    for (int i = 0; i < s->V; i++) probs[i] = 0.0f;
    for (int i = 0; i < n; i++) probs[s->order[i]] = s->prob[s->order[i]] / mass;
}

void sampler_logprobs(Sampler *s, const float *logits, float *logprobs) {
    if (s->temperature > 0.0f) {
        sampler_probs(s, logits, logprobs);
        for (int i = 0; i < s->V; i++) logprobs[i] = logprobs[i] > 0.0f ? logf(logprobs[i]) : -INFINITY;
        return;
    }
    float max = logits[argmax(logits, s->V)], sum = 0.0f;
    for (int i = 0; i < s->V; i++) sum += expf(logits[i] - max);
    for (int i = 0; i < s->V; i++) logprobs[i] = logits[i] - max - logf(sum);
}

// streams 1, 2, ...: the prompt's key shifted into the hash's upper bits (keys are far below 2^40)
float sampler_uniform(const Sampler *s, long prompt, int step, int stream) {
    uint64_t h = rng_hash(s->seed, (uint64_t)prompt + ((uint64_t)stream << 40), (uint64_t)step);
    return (float)(h >> 40) * (1.0f / 16777216.0f);
}

int sampler_draw(const Sampler *s, const float *probs, long prompt, int step, int stream) {
    float r = sampler_uniform(s, prompt, step, stream), acc = 0.0f;
    int last = 0;
    for (int i = 0; i < s->V; i++) {
        if (probs[i] <= 0.0f) continue;
        acc += probs[i];
        last = i;
        if (r < acc) return i;
    }
    return last;  // rounding left r at the very top
}
