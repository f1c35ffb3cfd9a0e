// server.c: stage 06 behind an OpenAI-compatible HTTP endpoint (--serve=true): the server's state
// set up on every rank, then rank 0 serves HTTP (http.c) while its main thread schedules
// (scheduler.c) and every other rank follows the steps. Up to max_batch_size requests run at
// once, each in the KV-cache blocks it holds, with continuous batching.
//
//   the polling thread (http.c)                           rank 0's main thread: the scheduler
//   parse and check the JSON (openai.c) -> a Job          admit it when its cache blocks fit
//                                   --- queue --->        (prefix-cached blocks shared)
//   write its tokens as they come (server-sent   <------  one pass a step: every running job's
//   events, or one JSON when it is done); with            next token and prompt rows; finished
//                                                         jobs leave
//   none yet, the connection waits until the waker        ... every other rank runs the same steps
//   thread says some came
#include "server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "chat_template.h"
#include "http.h"
#include "metrics.h"
#include "run/preemption.h"
#include "scheduler.h"

struct timespec deadline_in(double seconds) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    long ns = t.tv_nsec + (long)(seconds * 1e9);
    t.tv_sec += ns / 1000000000;
    t.tv_nsec = ns % 1000000000;
    return t;
}


// the name clients put in "model": served_model_name, else init_from's last path component
// without an extension ("out/demo-stage-1" -> "demo-stage-1", "x/model.safetensors" -> "model");
// one too long for `name` is an error, not a name cut short that no client could match
static void model_name(const Config *cfg, char *name, size_t size) {
    const char *from = cfg->served_model_name[0] ? cfg->served_model_name
                       : cfg->random_init || !cfg->init_from[0] ? "random" : cfg->init_from;
    char path[512];
    snprintf(path, sizeof path, "%s", from);
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') path[--n] = '\0';
    const char *base = cfg->served_model_name[0] ? path : strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    if (strlen(base) >= size)
        fatal("key '%s': the model's name '%s' is over %zu bytes", cfg->served_model_name[0] ? "served_model_name"
              : "init_from", base, size - 1);
    memcpy(name, base, strlen(base) + 1);
    char *dot = cfg->served_model_name[0] ? NULL : strrchr(name, '.');
    if (dot && strcmp(dot, ".safetensors") == 0) *dot = '\0';
}

void serve(const Config *cfg, KVModel *m, const Tokenizer *tok, Sampler *sampler, Comm *world,
           bool use_graph) {
    if (cfg->max_queue < 1) fatal("key 'max_queue': expected a positive number, found %d", cfg->max_queue);
    if (cfg->port < 0 || cfg->port > 65535) fatal("key 'port': expected 0 to 65535, found %d", cfg->port);
    preemption_watch();  // SIGTERM sets a flag on every rank: only rank 0 acts on it
    Server s = {.cfg = cfg, .tok = tok, .n_slots = m->B};
    model_name(cfg, s.model, sizeof s.model);  // on every rank: each refuses a bad name
    // the checkpoint's chat template, beside its tokenizer or its weights (on every rank: each refuses a bad one)
    ChatTemplate *chat = cfg->tokenizer_path[0] ? chat_template_load(cfg->tokenizer_path) : NULL;
    if (!chat) chat = chat_template_load(cfg->init_from);
    s.chat_template = chat;
    if (comm_rank(world) != 0) {
        chat_template_free(chat);
        scheduler_follow(m, world, use_graph);
        return;
    }
    if (chat) printf("server: chat messages through %s's chat_template\n", chat->path);
    else printf("server: chat messages into the Alpaca template (no chat_template beside the checkpoint)\n");
    pthread_mutex_init(&s.lock, NULL);
    pthread_cond_init(&s.work, NULL);
    pthread_cond_init(&s.progress, NULL);
    s.queue = calloc_or_die((size_t)cfg->max_queue, sizeof(Job *));
    s.slots = calloc_or_die((size_t)s.n_slots, sizeof(Job *));
    metrics_init(&s.metrics);
    Http *http = http_start(&s);
    scheduler_run(&s, m, sampler, world, use_graph);
    http_stop(http);
    chat_template_free(chat);
    free(s.queue);
    free(s.slots);
}

