// openai.h: OpenAI's request and response JSON (openai.c), apart from HTTP: http.c hands it a
// request's body and writes the bytes it makes.
#ifndef OPENAI_H
#define OPENAI_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>

#include "scheduler.h"

// An OpenAI-style error: {"error": {"message", "type", "param", "code"}}
typedef struct {
    int status;
    char message[512];
    char param[64];  // "": none (a copy: it may name a field of a request that is freed first)
    const char *code;
} ApiError;

// fills *e (status, the field in param or NULL, code or NULL, the message); returns false
bool api_fail(ApiError *e, int status, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
// e as OpenAI's error object (the caller frees it)
char *api_error_json(const ApiError *e);

// A request's body (to /v1/chat/completions if chat, else /v1/completions) as the jobs of its
// answers, every field checked: each prompt's n choices (completions' `prompt` may be a list),
// job i answer `index` i, as OpenAI orders them (*n_jobs of them; *include_usage: a stream's usage);
// or NULL and the error (the caller frees the list)
Job **parse_request(Server *s, const char *body, size_t len, bool chat, int *n_jobs, bool *include_usage, ApiError *e);
// frees a job no scheduler holds (job_release drops a reference)
void job_free(Job *j);

// a request's whole answer: every choice (its n jobs, all finished) and the usage (the lock held)
void append_whole_answer(const Server *s, Job *const *jobs, int n, Buf *out);
// the server-sent events of one choice's tokens that came since the last call, then its finish
void append_events(const Server *s, Job *j, Buf *out);
// a stream's end, once every choice has finished: the usage if asked for, and [DONE]
void append_stream_end(const Server *s, Job *const *jobs, int n, bool include_usage, Buf *out);

// the served model as GET /v1/models lists it
cJSON *model_object(const Server *s);

#endif
