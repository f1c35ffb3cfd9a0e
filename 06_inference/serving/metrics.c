// metrics.c: GET /metrics, the server's figures in Prometheus's text format: requests by status,
// tokens, the queue and the running batch, the paged cache's (scheduler_metrics_text), and the
// histograms of the time to first token and per output token.
#include "metrics.h"

#include <stdio.h>

static const double TTFT_BUCKETS[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
static const double TPOT_BUCKETS[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1};
_Static_assert(sizeof TTFT_BUCKETS / sizeof TTFT_BUCKETS[0] == N_BUCKETS, "scheduler.h's N_BUCKETS");
_Static_assert(sizeof TPOT_BUCKETS / sizeof TPOT_BUCKETS[0] == N_BUCKETS, "scheduler.h's N_BUCKETS");

static void histogram_print(Buf *b, const char *name, const char *help, const Histogram *h) {
    buf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    long cumulative = 0;
    for (int i = 0; i < N_BUCKETS; i++) {
        cumulative += h->counts[i];
        buf_printf(b, "%s_bucket{le=\"%g\"} %ld\n", name, h->le[i], cumulative);
    }
    buf_printf(b, "%s_bucket{le=\"+Inf\"} %ld\n%s_sum %.6f\n%s_count %ld\n", name, h->count, name,
               h->sum, name, h->count);
}

void metrics_init(ServerMetrics *m) {
    m->ttft.le = TTFT_BUCKETS;
    m->tpot.le = TPOT_BUCKETS;
}

static const int STATUS_CODES[] = {200, 400, 404, 405, 411, 413, 414, 429, 431, 501, 503, 505};
_Static_assert(sizeof STATUS_CODES / sizeof STATUS_CODES[0] == N_CODES, "scheduler.h's N_CODES");

void count_status(Server *s, int code) {
    for (int i = 0; i < N_CODES; i++)
        if (STATUS_CODES[i] == code) s->metrics.requests[i]++;
}

char *metrics_text(Server *s) {
    Buf b = {0};
    pthread_mutex_lock(&s->lock);
    const ServerMetrics *m = &s->metrics;
    buf_printf(&b, "# HELP workbook_requests_total HTTP requests answered with a completion (200) or refused, by status\n"
                   "# TYPE workbook_requests_total counter\n");
    for (int i = 0; i < N_CODES; i++)
        buf_printf(&b, "workbook_requests_total{code=\"%d\"} %ld\n", STATUS_CODES[i], m->requests[i]);
    buf_printf(&b, "# HELP workbook_connections_accepted_total connections taken (each carries requests until it closes)\n"
                   "# TYPE workbook_connections_accepted_total counter\nworkbook_connections_accepted_total %ld\n",
               m->connections_accepted);
    buf_printf(&b, "# HELP workbook_prompt_tokens_total prompt tokens prefilled\n"
                   "# TYPE workbook_prompt_tokens_total counter\nworkbook_prompt_tokens_total %ld\n",
               m->prompt_tokens);
    buf_printf(&b, "# HELP workbook_generated_tokens_total tokens sampled\n"
                   "# TYPE workbook_generated_tokens_total counter\nworkbook_generated_tokens_total %ld\n",
               m->generated_tokens);
    buf_printf(&b, "# HELP workbook_queue_length requests waiting to run\n"
                   "# TYPE workbook_queue_length gauge\nworkbook_queue_length %d\n", s->queue_len);
    buf_printf(&b, "# HELP workbook_running_batch_size requests running at once: the decode batch\n"
                   "# TYPE workbook_running_batch_size gauge\nworkbook_running_batch_size %d\n", s->busy);
    buf_printf(&b, "# HELP workbook_batch_slots requests that may run at once (max_batch_size)\n"
                   "# TYPE workbook_batch_slots gauge\nworkbook_batch_slots %d\n", s->n_slots);
    scheduler_metrics_text(s, &b);
    histogram_print(&b, "workbook_time_to_first_token_seconds",
                    "from the request's arrival to its first token", &m->ttft);
    histogram_print(&b, "workbook_time_per_output_token_seconds",
                    "between a request's consecutive tokens", &m->tpot);
    pthread_mutex_unlock(&s->lock);
    return b.p;
}
