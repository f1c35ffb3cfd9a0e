// test_request_logits.c: a server request's own changes to the logits (06_inference/serving/request_logits.c)
// and min_p (06_inference/sampler.c), against references written here from OpenAI's and vLLM's
// definitions:
//   logit_bias          logits[t] + bias[t]
//   repetition_penalty  each token of the prompt or the answer, once: logit / r if positive, else x r
//   frequency_penalty   - f x (times t is in the answer)       (the prompt does not count)
//   presence_penalty    - p if t is in the answer
// applied in that order; min_p keeps the tokens at least min_p times as likely as the likeliest
// (after temperature and top-k/top-p), renormalised. A vocabulary of 23 with ties, tokens repeated
// in the prompt and the answer, and tokens in both.
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "request_logits.h"
#include "sampler.h"

enum { V = 23 };

static void reference(const Job *j, const float *in, double *out) {
    for (int t = 0; t < V; t++) out[t] = in[t];
    for (int i = 0; i < j->n_bias; i++) out[j->bias_ids[i]] += j->bias[i];
    for (int t = 0; t < V; t++) {
        bool seen = false;
        int times = 0;
        for (int i = 0; i < j->n_ids; i++) seen |= j->ids[i] == t;
        for (int i = 0; i < j->n_out; i++) times += j->out_ids[i] == t;
        if (seen || times) out[t] = out[t] > 0 ? out[t] / j->repetition_penalty : out[t] * j->repetition_penalty;
        out[t] -= j->frequency_penalty * times + (times ? j->presence_penalty : 0.0);
    }
}

static void check_adjust(const char *what, Job *j, const float *logits) {
    float got[V];
    double want[V];
    int counts[V] = {0}, nonzero = 0;
    memcpy(got, logits, sizeof got);
    if (request_changes_logits(j)) request_adjust_logits(j, got, counts);
    reference(j, logits, want);
    for (int t = 0; t < V; t++) CHECK_CLOSE(got[t], want[t], 1e-6, 1e-6, what);
    for (int t = 0; t < V; t++) nonzero += counts[t] != 0;
    CHECK(nonzero == 0, "%s: the scratch counts left with %d non-zero", what, nonzero);
}

// min_p over sampler_probs: the reference keeps p >= min_p x max p of the top-k/top-p set
static void check_min_p(const float *logits, float temperature, float top_p, float min_p) {
    Sampler s;
    sampler_init(&s, V, temperature, 0, top_p, 7);
    float without[V], with[V];
    sampler_probs(&s, logits, without);
    s.min_p = min_p;
    sampler_probs(&s, logits, with);
    double max = 0, kept = 0;
    for (int t = 0; t < V; t++) max = without[t] > max ? without[t] : max;
    for (int t = 0; t < V; t++) kept += without[t] >= min_p * max ? without[t] : 0;
    int n = 0;
    for (int t = 0; t < V; t++) {
        double want = without[t] >= min_p * max ? without[t] / kept : 0;
        CHECK_CLOSE(with[t], want, 1e-5, 1e-7, "min_p's distribution");
        n += with[t] > 0;
    }
    CHECK(n > 1 && n < V, "min_p %g: %d tokens kept, want some but not all", min_p, n);
    for (int d = 0; d < 200; d++) {  // the draws too: never below the floor
        int t = sampler_next(&s, logits, 3, d);
        CHECK(without[t] >= min_p * max, "min_p %g: token %d drawn, p %g under %g", min_p, t, without[t], min_p * max);
    }
    sampler_free(&s);
}

int main(void) {
    float logits[V];
    for (int t = 0; t < V; t++) logits[t] = (float)((t * 7) % 11) * 0.5f - 2.0f;  // ties, both signs
    int ids[] = {3, 5, 5, 9, 0}, out[] = {5, 12, 12, 12, 7, 0}, bias_ids[] = {12, 4, 20};
    float bias[] = {1.5f, -3.0f, 0.25f};
    Job none = {.ids = ids, .n_ids = 5, .out_ids = out, .n_out = 6, .repetition_penalty = 1.0f};
    CHECK(!request_changes_logits(&none), "a job that asks for nothing changes its logits");
    Job j = none;
    j.bias_ids = bias_ids, j.bias = bias, j.n_bias = 3;
    check_adjust("logit_bias", &j, logits);
    j = none, j.repetition_penalty = 1.7f;
    check_adjust("repetition_penalty 1.7", &j, logits);
    j = none, j.repetition_penalty = 0.6f;
    check_adjust("repetition_penalty 0.6", &j, logits);
    j = none, j.frequency_penalty = 0.8f;
    check_adjust("frequency_penalty", &j, logits);
    j = none, j.presence_penalty = -1.2f;
    check_adjust("presence_penalty", &j, logits);
    j = none, j.bias_ids = bias_ids, j.bias = bias, j.n_bias = 3;
    j.repetition_penalty = 1.3f, j.frequency_penalty = 0.5f, j.presence_penalty = 0.7f;
    check_adjust("all four", &j, logits);
    check_min_p(logits, 1.0f, 1.0f, 0.3f);
    check_min_p(logits, 0.7f, 0.9f, 0.05f);
    return test_summary("test_request_logits");
}
