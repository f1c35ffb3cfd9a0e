// http.c: the server's HTTP/1.1, by hand, on one polling thread (epoll) for every connection:
// accept (a place for each connection, MAX_CONNECTIONS_PER_CLIENT of them from one address),
// read each request (its head checked by http_head.c, then its body), route it (openai.c's JSON
// in and out, metrics.c's /metrics), write the answer, and keep the connection for the next
// request (keep-alive, pipelined requests answered in order) unless the client or the answer ends
// it. An answer that waits for its tokens holds its connection (no thread): a waker thread turns
// the scheduler's `progress` into an event of the polling thread, which writes what came.
//
//   accept -> READING: the head (check_head: refused -> an error, the connection ends)
//                      the body (Content-Length) -> route -> an answer at once (health, models,
//                      metrics, an error), or the request's jobs queued -> ANSWERING
//             ANSWERING: a stream's events as its tokens come, a whole answer when it is done
//                      -> READING again (kept alive), or closed
#include "http.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "http_head.h"
#include "metrics.h"
#include "openai.h"

// The limits a client meets (README.md, "Limits"; a request's own in http_head.h): MAX_CONNECTIONS
// open at once, MAX_CONNECTIONS_PER_CLIENT of them from one address, so that one client holding
// connections open cannot lock the others out; CLIENT_DEADLINE_S to send a request (from its
// connection's start, or from the answer before on a kept-alive one: the idle timeout) and to take
// each piece of an answer, so that a slow or idle client cannot hold its connections for ever.
enum { MAX_CONNECTIONS = 512, MAX_CONNECTIONS_PER_CLIENT = 128, CLIENT_DEADLINE_S = 10, RETRY_AFTER_S = 1 };
enum { REFUSED_LINGER_S = 1 };  // a refused connection's last bytes are read and dropped this long
enum { READ_CHUNK = 64 << 10 };
// what a connection reads ahead of its answer (pipelined requests): one whole request at most
static const size_t READ_AHEAD = MAX_HEADER_BYTES + MAX_BODY;

typedef enum {
    CONN_FREE,
    CONN_READING,    // a request's head and body come: the deadline runs
    CONN_ANSWERING,  // its request's jobs run: no deadline while nothing waits to be sent
    CONN_CLOSING,    // its last answer is out or on its way: what the client still sends is dropped
} ConnState;

typedef struct {
    ConnState state;
    int fd;
    struct sockaddr_in addr;
    double since;       // when the state began (CONN_READING: the idle timeout runs from it)
    double send_since;  // when the bytes waiting to be sent began to wait, or last moved (0: none wait)
    Buf in;             // bytes read, not yet answered: the request, and what the client pipelined after it
    Buf out;            // bytes to send
    size_t out_off;
    bool keep_alive;    // the request answered lets the connection carry another
    bool http10;        // no chunks: a stream ends with the connection
    bool continued;     // a 100 Continue has gone for the request
    bool shut;          // CONN_CLOSING: its last answer is out, its side of the connection shut
    // CONN_ANSWERING: the request's jobs (its prompts' choices), the answer written as they go
    Job **jobs;
    int n;
    bool stream, include_usage;
    unsigned events;    // what epoll watches now
} Conn;

struct Http {
    Server *s;
    Conn conns[MAX_CONNECTIONS];
    int listener, epoll, wake;  // the listening socket; the epoll set; an eventfd the waker writes
    pthread_t poller, waker;
    bool stop_poller, stop_waker;  // under s->lock
};

// ---- writing -------------------------------------------------------------------------------------

static const char *reason_phrase(int status) {
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
    }
}

// the status line and the headers every answer has; `extra`: more header lines ("" for none)
static void append_head(Conn *c, int status, const char *type, const char *extra) {
    char date[64];
    time_t now = time(NULL);
    struct tm tm;
    strftime(date, sizeof date, "%a, %d %b %Y %H:%M:%S GMT", gmtime_r(&now, &tm));
    buf_printf(&c->out, "HTTP/1.1 %d %s\r\nDate: %s\r\nContent-Type: %s\r\nConnection: %s\r\n%s", status,
               reason_phrase(status), date, type, c->keep_alive ? "keep-alive" : "close", extra);
}

// a whole answer: its head, Content-Length, and body[0..len)
static void append_answer(Conn *c, int status, const char *type, const char *extra, const char *body, size_t len) {
    append_head(c, status, type, extra);
    buf_printf(&c->out, "Content-Length: %zu\r\n\r\n", len);
    buf_append(&c->out, body, len);
}

// what epoll reports of c from now on (EPOLLIN, EPOLLOUT)
static void watch(Http *h, Conn *c, unsigned events) {
    if (events == c->events) return;
    struct epoll_event ev = {.events = events, .data.u32 = (uint32_t)(c - h->conns)};
    epoll_ctl(h->epoll, EPOLL_CTL_MOD, c->fd, &ev);
    c->events = events;
}

// the jobs of c's request let go (cancelled first, all before any is released: the scheduler frees
// the slots of those still running at its next step)
static void release_jobs(Server *s, Conn *c) {
    if (!c->jobs) return;
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < c->n; i++) c->jobs[i]->cancelled = true;
    for (int i = 0; i < c->n; i++) job_release(s, c->jobs[i]);
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->lock);
    free(c->jobs);
    c->jobs = NULL;
}

static void conn_close(Http *h, Conn *c) {
    release_jobs(h->s, c);
    epoll_ctl(h->epoll, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->in.p);
    free(c->out.p);
    *c = (Conn){.state = CONN_FREE};
}

// sends what c has to send, as far as the socket takes it (a client gone: c is closed)
static void conn_send(Http *h, Conn *c) {
    if (c->out.len && !c->send_since) c->send_since = wall_seconds();
    while (c->out_off < c->out.len) {
        ssize_t n = send(c->fd, c->out.p + c->out_off, c->out.len - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            conn_close(h, c);
            return;
        }
        c->out_off += (size_t)n;
        c->send_since = wall_seconds();
    }
    if (c->out_off == c->out.len) {
        if (c->send_since && c->state == CONN_READING) c->since = wall_seconds();  // idle from its answer's end
        c->out.len = c->out_off = 0, c->send_since = 0;
    }
    bool pending = c->out.len > 0;
    // read while a request may come (or, answering, to see a client gone: up to one request ahead);
    // write while bytes wait
    bool reading = c->state == CONN_CLOSING || c->in.len < READ_AHEAD;
    watch(h, c, (reading ? EPOLLIN | EPOLLRDHUP : 0) | (pending ? EPOLLOUT : 0));
    if (!pending && c->state == CONN_CLOSING && !c->shut) {  // then drained until the client closes
        shutdown(c->fd, SHUT_WR);
        c->shut = true;
        c->since = wall_seconds();
    }
}

// ---- answers ---------------------------------------------------------------------------------------

// the answer to c's request is all out (or queued to go): the connection waits for the next
// request, or ends
static void answered(Conn *c) {
    c->state = c->keep_alive ? CONN_READING : CONN_CLOSING;
    c->since = wall_seconds();
    c->continued = false;
}

static void answer(Conn *c, int status, const char *type, char *body) {
    append_answer(c, status, type, "", body, strlen(body));
    free(body);
    answered(c);
}

// an error as OpenAI's JSON; a 429 (the queue is full) says when to try again
static void answer_error(Server *s, Conn *c, const ApiError *e, bool counted) {
    if (counted) {
        pthread_mutex_lock(&s->lock);
        count_status(s, e->status);
        pthread_mutex_unlock(&s->lock);
    }
    char *json = api_error_json(e), retry[48] = "";
    if (e->status == 429) snprintf(retry, sizeof retry, "Retry-After: %d\r\n", RETRY_AFTER_S);
    append_answer(c, e->status, "application/json", retry, json, strlen(json));
    free(json);
    answered(c);
}

// a head that is not HTTP/1.x, or one HTTP refuses: its error, and the connection ends (what
// follows the head cannot be told apart from the next request)
static void refuse(Server *s, Conn *c, const ApiError *e) {
    c->keep_alive = false;
    answer_error(s, c, e, true);
    c->in.len = 0;
}

// queues a checked request's n jobs, all or none, or says why not (429: the queue is full; 503:
// the server is stopping)
static bool enqueue(Server *s, Job **jobs, int n, ApiError *e) {
    pthread_mutex_lock(&s->lock);
    bool ok = !s->stopping && s->queue_len + n <= s->cfg->max_queue;
    if (s->stopping) api_fail(e, 503, NULL, NULL, "the server is shutting down");
    else if (!ok) api_fail(e, 429, NULL, "queue_full", "%d requests are waiting already (max_queue): try again later",
                           s->queue_len);
    if (ok) {
        for (int i = 0; i < n; i++) s->queue[(s->queue_head + s->queue_len++) % s->cfg->max_queue] = jobs[i];
        s->live_jobs += n;
        count_status(s, 200);
        pthread_cond_signal(&s->work);
    } else {
        count_status(s, e->status);
    }
    pthread_mutex_unlock(&s->lock);
    return ok;
}

// whether c's jobs have something to write: a whole answer when every choice has finished; a
// stream at each token and finish (the lock held)
static bool has_news(const Conn *c) {
    bool all = true, any = false;
    for (int i = 0; i < c->n; i++) {
        const Job *j = c->jobs[i];
        all &= j->finish != FINISH_NONE;
        any |= (j->finish != FINISH_NONE && !j->done_written) || j->n_written < j->n_out;
    }
    return all || (c->stream && any);
}

// a piece of a stream: a chunk of HTTP/1.1's chunked coding (as it is under HTTP/1.0, which
// ends the stream with the connection)
static void append_chunk(Conn *c, const Buf *piece) {
    if (!piece->len) return;
    if (!c->http10) buf_printf(&c->out, "%zx\r\n", piece->len);
    buf_append(&c->out, piece->p, piece->len);
    if (!c->http10) buf_append(&c->out, "\r\n", 2);
}

// What came for c's answer since the last call, formatted: a stream's events (all of them once
// the last choice has finished, with its end), or the whole answer once it exists. Written at the
// client's pace: nothing more is formatted while bytes wait to be sent.
static void write_news(Http *h, Conn *c) {
    Server *s = h->s;
    if (c->state != CONN_ANSWERING || c->out.len) return;
    Buf piece = {0};
    pthread_mutex_lock(&s->lock);
    bool news = has_news(c), done = true;
    if (news && c->stream) {
        for (int i = 0; i < c->n; i++) {
            append_events(s, c->jobs[i], &piece);
            done &= c->jobs[i]->done_written;
        }
        if (done) append_stream_end(s, c->jobs, c->n, c->include_usage, &piece);
    } else if (news) {
        append_whole_answer(s, c->jobs, c->n, &piece);
    }
    pthread_mutex_unlock(&s->lock);
    if (!news) return;
    if (c->stream) append_chunk(c, &piece);
    else append_answer(c, 200, "application/json", "", piece.p, piece.len);
    free(piece.p);
    if (!done) return;
    if (c->stream && !c->http10) buf_append(&c->out, "0\r\n\r\n", 5);
    release_jobs(s, c);
    answered(c);
}

// A completion: its jobs queued, then answered as they go. A stream's head (200) goes at once; a
// whole answer's waits for the answer, so that its status is the outcome's.
static void serve_completion(Http *h, Conn *c, const char *body, size_t len, bool chat) {
    Server *s = h->s;
    ApiError e;
    int n;
    bool include_usage;
    Job **jobs = parse_request(s, body, len, chat, &n, &include_usage, &e);
    if (!jobs) {
        answer_error(s, c, &e, true);
        return;
    }
    if (!enqueue(s, jobs, n, &e)) {
        for (int i = 0; i < n; i++) job_free(jobs[i]);
        free(jobs);
        answer_error(s, c, &e, false);
        return;
    }
    c->state = CONN_ANSWERING;
    c->since = wall_seconds();
    c->jobs = jobs, c->n = n;
    c->stream = jobs[0]->stream, c->include_usage = include_usage;
    if (c->stream) append_head(c, 200, "text/event-stream", c->http10 ? "Cache-Control: no-cache\r\n\r\n"
                               : "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n");
}

static cJSON *models_list(const Server *s) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(root, "data"), model_object(s));
    return root;
}

static void answer_json(Conn *c, cJSON *root) {
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    answer(c, 200, "application/json", text);
}

// GET /v1/models/{id}: that model, if it is this one
static void serve_model(Server *s, Conn *c, const char *id) {
    ApiError e;
    if (strcmp(id, s->model) == 0) {
        answer_json(c, model_object(s));
    } else {
        api_fail(&e, 404, "model", "model_not_found", "the model '%s' does not exist (this server has '%s')", id, s->model);
        answer_error(s, c, &e, false);
    }
}

static void route(Http *h, Conn *c, const RequestHead *rh, const char *body) {
    Server *s = h->s;
    const char *method = rh->method, *url = rh->path;
    ApiError e;
    bool post = strcmp(method, "POST") == 0, get = strcmp(method, "GET") == 0;
    bool chat = strcmp(url, "/v1/chat/completions") == 0, completion = strcmp(url, "/v1/completions") == 0;
    if (get && strcmp(url, "/health") == 0) answer(c, 200, "application/json", copy_string_or_die("{\"status\":\"ok\"}\n"));
    else if (get && strcmp(url, "/metrics") == 0) answer(c, 200, "text/plain; version=0.0.4", metrics_text(s));
    else if (get && strcmp(url, "/v1/models") == 0) answer_json(c, models_list(s));
    else if (get && strncmp(url, "/v1/models/", 11) == 0) serve_model(s, c, url + 11);
    else if (chat || completion) {
        if (post) serve_completion(h, c, body, rh->body_len, chat);
        else answer_error(s, c, (api_fail(&e, 405, NULL, NULL, "%s %s: use POST", method, url), &e), true);
    } else {
        api_fail(&e, 404, NULL, "unknown_url", "%s %s: no such endpoint (POST /v1/completions, /v1/chat/completions; "
                 "GET /health, /metrics, /v1/models, /v1/models/{id})", method, url);
        answer_error(s, c, &e, true);
    }
}

// ---- reading -------------------------------------------------------------------------------------

// The requests that have come whole on c, each in turn while c is free to answer the next: its
// head checked (every request's, the first's or a later one's), its body awaited, then routed.
static void serve_requests(Http *h, Conn *c) {
    while (c->state == CONN_READING && c->in.len > 0) {
        ApiError e;
        size_t head_len;
        RequestHead rh;
        HeadCheck head = check_head(c->in.p, c->in.len < MAX_HEADER_BYTES + 1 ? c->in.len : MAX_HEADER_BYTES + 1,
                                    &head_len, &e);
        if (head == HEAD_PARTIAL) return;
        if (head == HEAD_BAD || !read_head(c->in.p, head_len, &rh, &e)) {
            refuse(h->s, c, &e);
            return;
        }
        if (c->in.len < head_len + rh.body_len) {
            // the client waits for a 100 before it sends its body (curl does, for a large one)
            if (rh.expect_continue && !c->continued) buf_printf(&c->out, "HTTP/1.1 100 Continue\r\n\r\n");
            c->continued = true;
            return;
        }
        c->keep_alive = !rh.http10 && !rh.close;
        c->http10 = rh.http10;
        route(h, c, &rh, c->in.p + head_len);
        size_t used = head_len + rh.body_len;
        if (c->state == CONN_CLOSING) used = c->in.len;  // nothing after an answer that ends the connection
        memmove(c->in.p, c->in.p + used, c->in.len - used);
        c->in.len -= used;
        write_news(h, c);  // an answer whose tokens came already
    }
}

// reads what c's client sent; false if it has gone (the connection is closed)
static bool conn_read(Http *h, Conn *c) {
    for (;;) {
        if (c->state != CONN_CLOSING && c->in.len >= READ_AHEAD) return true;
        if (c->in.cap < c->in.len + READ_CHUNK + 1) {
            c->in.cap = c->in.len + READ_CHUNK + 1;
            c->in.p = realloc(c->in.p, c->in.cap);
            if (!c->in.p) fatal("out of memory in the server");
        }
        ssize_t n = recv(c->fd, c->in.p + c->in.len, READ_CHUNK, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {  // the client has closed (or reset) its side: whatever it awaited is cancelled
            conn_close(h, c);
            return false;
        }
        if (c->state != CONN_CLOSING) c->in.len += (size_t)n;  // a closing one's are dropped
    }
}

// an event on connection c: what its client sent, then what c has to send
static void conn_event(Http *h, Conn *c, unsigned events) {
    if (events & (EPOLLHUP | EPOLLERR)) {  // reset, or closed both ways: nothing can reach the client
        conn_close(h, c);
        return;
    }
    if ((events & (EPOLLIN | EPOLLRDHUP)) && !conn_read(h, c)) return;
    serve_requests(h, c);
    conn_send(h, c);
}

// ---- connections -----------------------------------------------------------------------------------

// new connections each take a free place if their address holds fewer than
// MAX_CONNECTIONS_PER_CLIENT, else are closed at once
static void accept_connections(Http *h) {
    for (;;) {
        struct sockaddr_in addr;
        socklen_t len = sizeof addr;
        int fd = accept(h->listener, (struct sockaddr *)&addr, &len);  // its reads and writes are MSG_DONTWAIT
        if (fd < 0 && (errno == ECONNABORTED || errno == EINTR)) continue;
        if (fd < 0) return;
        Conn *place = NULL;
        int same = 0;
        for (int i = 0; i < MAX_CONNECTIONS; i++) {
            Conn *c = &h->conns[i];
            if (c->state == CONN_FREE) place = place ? place : c;
            else same += c->addr.sin_addr.s_addr == addr.sin_addr.s_addr;
        }
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.u32 = (uint32_t)(place - h->conns)};
        if (!place || same >= MAX_CONNECTIONS_PER_CLIENT || epoll_ctl(h->epoll, EPOLL_CTL_ADD, fd, &ev) != 0) {
            close(fd);
            continue;
        }
        *place = (Conn){.state = CONN_READING, .fd = fd, .addr = addr, .since = wall_seconds(), .events = ev.events};
        pthread_mutex_lock(&h->s->lock);
        h->s->metrics.connections_accepted++;
        pthread_mutex_unlock(&h->s->lock);
    }
}

// the connections past their deadline are closed: CLIENT_DEADLINE_S to send a request (from the
// connection's start or its last answer) and to take each piece of an answer; REFUSED_LINGER_S
// for a closing one's client to close
static void expire_connections(Http *h) {
    double now = wall_seconds();
    for (int i = 0; i < MAX_CONNECTIONS; i++) {
        Conn *c = &h->conns[i];
        double deadline = c->send_since ? c->send_since + CLIENT_DEADLINE_S
                          : c->state == CONN_READING ? c->since + CLIENT_DEADLINE_S
                          : c->state == CONN_CLOSING ? c->since + REFUSED_LINGER_S : 0;
        if (c->state != CONN_FREE && deadline > 0 && now > deadline) conn_close(h, c);
    }
}

// The polling thread: every connection's reads and writes, new connections, and the answers the
// waker says have news.
enum { EVENT_LISTENER = MAX_CONNECTIONS, EVENT_WAKE };  // epoll's data beside a connection's index
enum { POLL_TICK_MS = 100 };  // the longest wait: the deadlines are kept to it

static void *poll_connections(void *arg) {
    Http *h = arg;
    struct epoll_event ev[64];
    double next_expiry = 0;
    pthread_mutex_lock(&h->s->lock);
    while (!h->stop_poller) {
        pthread_mutex_unlock(&h->s->lock);
        int n = epoll_wait(h->epoll, ev, 64, POLL_TICK_MS);
        for (int k = 0; k < n; k++) {
            uint32_t id = ev[k].data.u32;
            eventfd_t wakes;
            if (id == EVENT_LISTENER) accept_connections(h);
            else if (id == EVENT_WAKE) eventfd_read(h->wake, &wakes);
            else if (h->conns[id].state != CONN_FREE) conn_event(h, &h->conns[id], ev[k].events);
        }
        for (int i = 0; i < MAX_CONNECTIONS; i++)  // tokens came: the answers that wait for them
            if (h->conns[i].state == CONN_ANSWERING) {
                write_news(h, &h->conns[i]);
                serve_requests(h, &h->conns[i]);  // the request pipelined after an answer just done
                if (h->conns[i].state != CONN_FREE) conn_send(h, &h->conns[i]);
            }
        if (wall_seconds() >= next_expiry) {  // once a tick, not on every event
            expire_connections(h);
            next_expiry = wall_seconds() + POLL_TICK_MS / 1000.0;
        }
        pthread_mutex_lock(&h->s->lock);
    }
    pthread_mutex_unlock(&h->s->lock);
    for (int i = 0; i < MAX_CONNECTIONS; i++)
        if (h->conns[i].state != CONN_FREE) conn_close(h, &h->conns[i]);
    return NULL;
}

// The waker: the scheduler broadcasts `progress` after every step that brings tokens; the polling
// thread, which waits on epoll (not on a condition variable), is woken by an event for it.
static void *wake_poller(void *arg) {
    Http *h = arg;
    pthread_mutex_lock(&h->s->lock);
    while (!h->stop_waker) {
        struct timespec until = deadline_in(1);
        pthread_cond_timedwait(&h->s->progress, &h->s->lock, &until);
        eventfd_write(h->wake, 1);
    }
    pthread_mutex_unlock(&h->s->lock);
    return NULL;
}

// ---- start and stop ----------------------------------------------------------------------------

// the listening socket on host:port, non-blocking (accept_connections takes all that wait)
static int listen_on(const Config *cfg) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)cfg->port)};
    if (inet_pton(AF_INET, cfg->host, &addr.sin_addr) != 1)
        fatal("key 'host': expected an IPv4 address such as 127.0.0.1 or 0.0.0.0, found '%s'", cfg->host);
    int fd = socket(AF_INET, SOCK_STREAM, 0), on = 1;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
        bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, SOMAXCONN) != 0 ||
        fcntl(fd, F_SETFL, O_NONBLOCK) != 0)
        fatal("key 'port': cannot listen on %s:%d (%s)", cfg->host, cfg->port, strerror(errno));
    return fd;
}

Http *http_start(Server *s) {
    Http *h = calloc_or_die(1, sizeof *h);
    h->s = s;
    h->listener = listen_on(s->cfg);
    h->epoll = epoll_create1(EPOLL_CLOEXEC);
    h->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event listener = {.events = EPOLLIN, .data.u32 = EVENT_LISTENER},
                       wake = {.events = EPOLLIN, .data.u32 = EVENT_WAKE};
    if (h->epoll < 0 || h->wake < 0 || epoll_ctl(h->epoll, EPOLL_CTL_ADD, h->listener, &listener) != 0 ||
        epoll_ctl(h->epoll, EPOLL_CTL_ADD, h->wake, &wake) != 0)
        fatal("the server cannot create its epoll set (%s)", strerror(errno));
    if (pthread_create(&h->waker, NULL, wake_poller, h) != 0 || pthread_create(&h->poller, NULL, poll_connections, h) != 0)
        fatal("the server cannot start a thread");
    struct sockaddr_in bound;
    socklen_t len = sizeof bound;
    getsockname(h->listener, (struct sockaddr *)&bound, &len);
    // under mpirun, signal this process: mpirun itself, signalled, kills every rank soon after
    printf("server: model '%s' on http://%s:%u/v1 | %d requests at once (max_batch_size), queue of %d "
           "(max_queue) | kill -TERM %ld stops it\n", s->model, s->cfg->host, ntohs(bound.sin_port), s->n_slots,
           s->cfg->max_queue, (long)getpid());
    fflush(stdout);
    return h;
}

void http_stop(Http *h) {
    Server *s = h->s;
    double t0 = wall_seconds();
    pthread_mutex_lock(&s->lock);
    while (s->live_jobs > 0 && wall_seconds() - t0 < 30) {
        struct timespec until = deadline_in(0.01);
        pthread_cond_timedwait(&s->work, &s->lock, &until);
    }
    long left = s->live_jobs;
    pthread_mutex_unlock(&s->lock);
    if (left) printf("server: %ld answers were still being written after 30 s: closing them\n", left);
    pthread_mutex_lock(&s->lock);
    h->stop_waker = true;
    pthread_cond_broadcast(&s->progress);
    pthread_mutex_unlock(&s->lock);
    pthread_join(h->waker, NULL);
    pthread_mutex_lock(&s->lock);
    h->stop_poller = true;
    pthread_mutex_unlock(&s->lock);
    pthread_join(h->poller, NULL);
    close(h->epoll);
    close(h->wake);
    close(h->listener);
    free(h);
    printf("server: stopped\n");
}
