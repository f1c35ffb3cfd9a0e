// request_logits.h: a request's own changes to a row of logits before it is sampled (the server's
// logit_bias, presence_penalty, frequency_penalty, repetition_penalty; request_logits.c)
#ifndef REQUEST_LOGITS_H
#define REQUEST_LOGITS_H

#include <stdbool.h>

#include "scheduler.h"

// whether job j changes its logits at all
bool request_changes_logits(const Job *j);
// j's changes to logits (a row of the vocabulary), given its text so far; counts: a vocabulary of zeros,
// scratch, left zeros
void request_adjust_logits(const Job *j, float *logits, int *counts);

// Records, as job j's token number n_out, the log-probability of `token` and of its j->logprobs
// likeliest alternatives in logprobs (V: the distribution it was drawn from, sampler_logprobs);
// the likeliest first, ties to the lower id, none outside the distribution (-INFINITY).
void request_record_logprobs(Job *j, const float *logprobs, int V, int token);

#endif
