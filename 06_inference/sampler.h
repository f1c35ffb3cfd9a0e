// sampler.h: the next token from a row of logits.
//
//   greedy       temperature 0 (the default): the most likely token, ties to the lowest id
//   temperature  softmax(logits / temperature): below 1 sharper, above 1 flatter
//   top-k        only the k most likely tokens may be drawn (0: no limit)
//   top-p        only the smallest set of most likely tokens whose probability adds up to p
//                ("nucleus" sampling; 1: no limit)
//   min-p        of those, only the tokens at least min_p times as likely as the likeliest
//                (0: no limit; the server's requests set it, as vLLM's do)
//
// The random number of step s of prompt p is a pure function of (seed, p, s) (numbers.h's
// counter-based hash), so a prompt gets the same sampled answer alone or in any batch.
#ifndef SAMPLER_H
#define SAMPLER_H

#include <stdint.h>

typedef struct {
    float temperature;
    int top_k;
    float top_p;
    float min_p;        // 0 from sampler_init
    uint64_t seed;
    int V;              // the real vocabulary: logits past V are padding, never drawn
    // scratch for V candidates
    float *prob;
    int *order;
} Sampler;

void sampler_init(Sampler *s, int V, float temperature, int top_k, float top_p, uint64_t seed);
void sampler_free(Sampler *s);
// logits: one row of at least V floats (host); prompt and step pick the random number
int sampler_next(Sampler *s, const float *logits, long prompt, int step);
// The distribution sampler_next draws from (temperature > 0): probs (V) is softmax(logits /
// temperature) cut to the top k and top p and renormalised, 0 elsewhere.
void sampler_probs(Sampler *s, const float *logits, float *probs);
// The log-probabilities (V) of the distribution sampler_next draws from: log of sampler_probs'
// (-INFINITY outside the kept tokens); greedy (temperature 0), of softmax(logits), uncut.
void sampler_logprobs(Sampler *s, const float *logits, float *logprobs);
// a token drawn from probs (V, summing to 1) with the uniform number of (prompt, step) in stream
// `stream` (the speculative decoder's draws are kept apart from sampler_next's)
int sampler_draw(const Sampler *s, const float *probs, long prompt, int step, int stream);
// that uniform number in [0, 1)
float sampler_uniform(const Sampler *s, long prompt, int step, int stream);

#endif
