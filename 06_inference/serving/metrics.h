// metrics.h: the server's figures for GET /metrics (metrics.c)
#ifndef METRICS_H
#define METRICS_H

#include "scheduler.h"

// the histograms' bucket bounds
void metrics_init(ServerMetrics *m);
// one more answer with HTTP status code (the lock held)
void count_status(Server *s, int code);
// every figure in Prometheus's text format (takes the lock; the caller frees it)
char *metrics_text(Server *s);

#endif
