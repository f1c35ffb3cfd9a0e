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

#endif
