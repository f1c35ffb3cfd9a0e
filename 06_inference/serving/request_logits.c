// request_logits.c: a request's own changes to a row of logits before it is sampled, as OpenAI
// and vLLM define them, in vLLM's order:
//   logit_bias          logits[t] += bias[t]
//   repetition_penalty  every token of the prompt or the answer so far: a positive logit divided
//                       by it, a negative one multiplied (1: none; above 1 repeats less)
//   frequency_penalty   logits[t] -= frequency_penalty x (times t is in the answer so far)
//   presence_penalty    logits[t] -= presence_penalty, if t is in the answer so far
// then temperature, top-k, top-p and min-p (sampler.c). They change the distribution the token
// is drawn from (or the greedy choice), so a request that asks for one is never speculated on:
// the draft's proposals would be checked against other logits.
#include "request_logits.h"

#include <math.h>
#include <string.h>

bool request_changes_logits(const Job *j) {
    return j->n_bias || j->presence_penalty != 0.0f || j->frequency_penalty != 0.0f || j->repetition_penalty != 1.0f;
}

static void repetition_penalty(const Job *j, float *logits, int *counts) {
    int n = j->n_ids + j->n_out;
    for (int i = 0; i < n; i++) {
        int t = i < j->n_ids ? j->ids[i] : j->out_ids[i - j->n_ids];
        if (counts[t]++) continue;  // once a token
        logits[t] = logits[t] > 0.0f ? logits[t] / j->repetition_penalty : logits[t] * j->repetition_penalty;
    }
    for (int i = 0; i < n; i++) counts[i < j->n_ids ? j->ids[i] : j->out_ids[i - j->n_ids]] = 0;
}

static void answer_penalties(const Job *j, float *logits, int *counts) {
    for (int i = 0; i < j->n_out; i++) counts[j->out_ids[i]]++;
    for (int i = 0; i < j->n_out; i++) {
        int t = j->out_ids[i];
        if (!counts[t]) continue;  // done
        logits[t] -= j->frequency_penalty * (float)counts[t] + j->presence_penalty;
        counts[t] = 0;
    }
}

void request_record_logprobs(Job *j, const float *logprobs, int V, int token) {
    int k = j->logprobs, *ids = j->top_ids + (size_t)j->n_out * k;
    float *lp = j->top_lp + (size_t)j->n_out * k;
    j->token_lp[j->n_out] = logprobs[token];
    for (int i = 0; i < k; i++) ids[i] = -1;
    for (int t = 0; t < V; t++) {  // insertion into the k best so far: k is at most 20
        if (logprobs[t] == -INFINITY) continue;
        int at = k;
        while (at > 0 && (ids[at - 1] < 0 || logprobs[t] > lp[at - 1])) at--;
        if (at == k) continue;
        memmove(ids + at + 1, ids + at, (size_t)(k - at - 1) * sizeof(int));
        memmove(lp + at + 1, lp + at, (size_t)(k - at - 1) * sizeof(float));
        ids[at] = t, lp[at] = logprobs[t];
    }
}

void request_adjust_logits(const Job *j, float *logits, int *counts) {
    for (int i = 0; i < j->n_bias; i++)
        logits[j->bias_ids[i]] += j->bias[i];  // ids below V: openai.c checks them
    if (j->repetition_penalty != 1.0f) repetition_penalty(j, logits, counts);
    if (j->presence_penalty != 0.0f || j->frequency_penalty != 0.0f) answer_penalties(j, logits, counts);
}
