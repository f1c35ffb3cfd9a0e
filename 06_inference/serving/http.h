// http.h: the server's HTTP side (http.c): connections on one polling thread, their deadlines,
// and the waker, over the state the scheduler shares (scheduler.h)
#ifndef HTTP_H
#define HTTP_H

#include "scheduler.h"

typedef struct Http Http;

// listens on s->cfg's host:port and serves every connection on threads of its own; prints the
// address and the process id that stops it
Http *http_start(Server *s);
// after the scheduler's last step: the answers still being written finish (30 s at most), then
// every connection closes and the threads end
void http_stop(Http *h);

#endif
