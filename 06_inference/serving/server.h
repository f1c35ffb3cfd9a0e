// server.h: stage 06 behind an OpenAI-compatible HTTP endpoint (--serve=true), with continuous
// batching over the KV cache's slots and the same tensor-parallel grid as generation. See
// server.c, http.c (HTTP), openai.c (its JSON), scheduler.c (continuous batching) and README.md ("Serving").
#ifndef SERVER_H
#define SERVER_H

#include <stdbool.h>

#include "comm/comm.h"
#include "config/config.h"
#include "data/tokenizer.h"
#include "kv_model.h"
#include "sampler.h"

// Every rank calls it once the model is loaded; m holds cfg->max_batch_size cache slots and
// prefills up to cfg->max_seq_len rows. Rank 0 serves HTTP on cfg->port and schedules; every
// rank runs the steps it sends. Returns after a SIGTERM, once every accepted request is answered.
void serve(const Config *cfg, KVModel *m, const Tokenizer *tok, Sampler *sampler, Comm *world,
           bool use_graph);

#endif
