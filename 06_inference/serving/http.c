// http.c: the HTTP side of the server: libmicrohttpd's polling thread, which also runs the door
// (each connection's request head checked before libmicrohttpd parses it), the gate (a deadline
// and a place for each connection), the waker (answers waiting for their tokens resumed after each
// scheduler step), and the routes (openai.c's JSON in and out, metrics.c's /metrics).
#include "http.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"
#include "metrics.h"
#include "openai.h"

// The limits a client meets (README.md, "Limits"): headers of MAX_HEADER_BYTES, a body of
// MAX_BODY bytes; MAX_CONNECTIONS open at once, MAX_CONNECTIONS_PER_CLIENT of them from one
// address, so that one client holding connections open cannot lock the others out; CLIENT_DEADLINE_S
// to send its request (from the connection's start) and to take each piece of an answer, so that
// a slow or idle client cannot hold its connections for ever.
enum { MAX_BODY = 1 << 20, MAX_HEADER_BYTES = 16 << 10, MAX_CONNECTIONS = 512, MAX_CONNECTIONS_PER_CLIENT = 128,
       CLIENT_DEADLINE_S = 10, RETRY_AFTER_S = 1 };

// ---- a deadline for each client -----------------------------------------------------------------

// libmicrohttpd's own timeout counts the seconds a connection sends nothing: a client sending a
// byte every few seconds would hold its connection for ever; and it would close a connection
// whose answer takes long to generate. So the server keeps its own deadlines: CLIENT_DEADLINE_S to
// send the request (from the connection's start), none while the answer is generated,
// CLIENT_DEADLINE_S to take each piece of the answer. A watcher thread shuts a late connection's
// socket down, which libmicrohttpd then sees as a client gone (the door, below, closes its own
// late ones). Every connection has its place here from its accept to its close, so that the
// places held from one address can be counted, and its deadline runs on when the door hands it to
// libmicrohttpd.
typedef struct Gate Gate;
typedef enum {
    PLACE_FREE,
    PLACE_AT_DOOR,  // accepted; the door awaits its request's head
    PLACE_REFUSED,  // the door answered it an error: what the client still sends is read and dropped
    PLACE_SERVED,   // handed to libmicrohttpd
} PlaceState;
typedef struct {
    Gate *gate;
    PlaceState state;
    int fd;
    struct sockaddr_in addr;
    double deadline;  // wall_seconds(); 0: none
    bool watched;     // at the door, in the polling thread's epoll set (its head did not come with it)
} Arrival;

struct Gate {
    pthread_mutex_t lock;
    Arrival conns[MAX_CONNECTIONS];
    pthread_t watcher, poller;
    bool stop;
    Server *s;
    struct MHD_Daemon *daemon;
    int listener, epoll;  // the door's listening socket; the polling thread's epoll set (below)
    int wake;             // an eventfd in that set: the waker wakes the polling thread with it
};

static void arrival_set(Arrival *a, double seconds) {  // seconds 0: no deadline
    if (!a) return;
    pthread_mutex_lock(&a->gate->lock);
    a->deadline = seconds > 0 ? wall_seconds() + seconds : 0;
    pthread_mutex_unlock(&a->gate->lock);
}

// libmicrohttpd's word on a connection: started (the door has handed it over: it keeps its place,
// and the deadline it had at the door) or closed (before its socket is: the watcher never shuts a
// socket number down that a newer connection has taken)
static void gate_notify(void *cls, struct MHD_Connection *c, void **socket_context, enum MHD_ConnectionNotificationCode what) {
    Gate *g = cls;
    pthread_mutex_lock(&g->lock);
    if (what == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        for (int i = 0; i < MAX_CONNECTIONS && info; i++)
            if (g->conns[i].state == PLACE_SERVED && g->conns[i].fd == info->connect_fd) {
                *socket_context = &g->conns[i];
                break;
            }
    } else if (*socket_context) {
        ((Arrival *)*socket_context)->state = PLACE_FREE;
        *socket_context = NULL;
    }
    pthread_mutex_unlock(&g->lock);
}

static void *gate_watch(void *arg) {
    Gate *g = arg;
    pthread_mutex_lock(&g->lock);
    while (!g->stop) {
        double now = wall_seconds();
        for (int i = 0; i < MAX_CONNECTIONS; i++) {
            Arrival *a = &g->conns[i];
            if (a->state == PLACE_SERVED && a->deadline > 0 && now > a->deadline) {
                shutdown(a->fd, SHUT_RDWR);
                a->deadline = 0;
            }
        }
        pthread_mutex_unlock(&g->lock);
        nanosleep(&(struct timespec){.tv_nsec = 100000000}, NULL);
        pthread_mutex_lock(&g->lock);
    }
    pthread_mutex_unlock(&g->lock);
    return NULL;
}

static Arrival *arrival_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return info ? info->socket_context : NULL;
}

// ---- answers waiting for their tokens --------------------------------------------------------------

// libmicrohttpd runs every connection on one polling thread (epoll), which must never wait: a
// response with no bytes to send yet suspends its connection instead (read_response), and the
// waker thread resumes it when its job has news (the scheduler broadcasts `progress` after every
// step), when its client has gone, or when the server stops.
typedef struct Reader Reader;
typedef struct {
    Server *s;
    Gate *gate;
    Reader *suspended;  // a list, under the Server's lock
    pthread_t thread;
    bool stop;
} Waker;

struct Reader {
    Server *s;
    Job **jobs;    // the request's choices (n > 1: several)
    int n;
    struct MHD_Connection *c;
    bool include_usage;
    Arrival *arrival;
    Waker *waker;
    Reader *next;  // in the waker's list while suspended
    bool gone;     // its client went away while it was suspended
    Buf out;       // formatted, not yet handed to libmicrohttpd
    size_t out_off;
    bool done;     // the whole answer, or the stream's end, is formatted
};

static const double LOOK_AT_CLIENT_S = 0.05;  // how often the waker checks the waiting clients

// A client sends nothing while it waits for its answer: a socket that reads as closed (recv
// returns 0) means the client has gone. It is how a request that is still waiting for a slot, or
// for its whole answer, notices, before any write to the client could fail.
static bool client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    char byte;
    return info && recv(info->connect_fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

// a whole answer when every choice has finished; a stream at each token and finish
static bool has_news(const Reader *r) {
    bool all = true, any = false;
    for (int i = 0; i < r->n; i++) {
        const Job *j = r->jobs[i];
        all &= j->finish != FINISH_NONE;
        any |= (j->finish != FINISH_NONE && !j->done_written) || j->n_written < j->n_out;
    }
    return r->done || all || (r->jobs[0]->stream && any);
}

// a stream's events since the last call, formatted (the lock held)
static void format_news(Reader *r) {
    bool all = true;
    for (int i = 0; i < r->n; i++) {
        append_events(r->s, r->jobs[i], &r->out);
        all &= r->jobs[i]->done_written;
    }
    if (all) append_stream_end(r->s, r->jobs, r->n, r->include_usage, &r->out);
    r->done = all;
}

// resumed connections wait for the polling thread's next MHD_run: it is woken for them
// (libmicrohttpd, run by the server's own loop and without a listening socket, would not wake it)
static void wake_poller(const Waker *w) {
    eventfd_write(w->gate->wake, 1);
}

// The waker: after every step (or LOOK_AT_CLIENT_S), the suspended responses whose jobs have news,
// or whose clients have gone (a gone client's slot runs on until then: ~50 tokens of a
// 1 ms-a-token model), are resumed; libmicrohttpd then asks them for their bytes again.
static void *wake_readers(void *arg) {
    Waker *w = arg;
    pthread_mutex_lock(&w->s->lock);
    double look = wall_seconds() + LOOK_AT_CLIENT_S;
    while (!w->stop) {
        struct timespec until = deadline_in(LOOK_AT_CLIENT_S);
        pthread_cond_timedwait(&w->s->progress, &w->s->lock, &until);
        bool look_now = wall_seconds() >= look;
        if (look_now) look = wall_seconds() + LOOK_AT_CLIENT_S;
        for (Reader **p = &w->suspended; *p;) {
            Reader *r = *p;
            r->gone = !has_news(r) && look_now && client_gone(r->c);
            if (!has_news(r) && !r->gone) {
                p = &r->next;
                continue;
            }
            *p = r->next;
            MHD_resume_connection(r->c);
            wake_poller(w);
        }
    }
    while (w->suspended) {  // the server stops: every one ends (read_response sees w->stop)
        MHD_resume_connection(w->suspended->c);
        w->suspended = w->suspended->next;
    }
    wake_poller(w);
    pthread_mutex_unlock(&w->s->lock);
    return NULL;
}

// libmicrohttpd asks for the next bytes of a stream (on its polling thread, which must not
// wait): the formatted bytes still pending, or, once they are out, the tokens that came since;
// with none yet, the connection is suspended until the waker resumes it (returning 0: no bytes).
// It asks when the bytes before are taken: the client has CLIENT_DEADLINE_S to take what it gets.
static ssize_t read_response(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    Reader *r = cls;
    arrival_set(r->arrival, 0);
    if (r->out_off == r->out.len) {
        r->out.len = r->out_off = 0;
        pthread_mutex_lock(&r->s->lock);
        if (!has_news(r)) {
            bool end = r->gone || r->waker->stop;
            if (!end) {  // suspended under the lock: the waker resumes it only after this
                r->next = r->waker->suspended;
                r->waker->suspended = r;
                MHD_suspend_connection(r->c);
            }
            pthread_mutex_unlock(&r->s->lock);
            return end ? MHD_CONTENT_READER_END_WITH_ERROR : 0;  // release_response cancels the job
        }
        if (!r->done) format_news(r);
        pthread_mutex_unlock(&r->s->lock);
    }
    arrival_set(r->arrival, CLIENT_DEADLINE_S);
    if (r->out_off == r->out.len) return MHD_CONTENT_READER_END_OF_STREAM;
    size_t n = r->out.len - r->out_off < max ? r->out.len - r->out_off : max;
    memcpy(buf, r->out.p + r->out_off, n);
    r->out_off += n;
    return (ssize_t)n;
}

// the response is gone: sent, or its client went away (then its jobs are cancelled, all before
// any is released: the scheduler frees their slots at the next step)
static void release_response(void *cls) {
    Reader *r = cls;
    pthread_mutex_lock(&r->s->lock);
    for (int i = 0; i < r->n; i++) r->jobs[i]->cancelled = true;
    for (int i = 0; i < r->n; i++) job_release(r->s, r->jobs[i]);
    pthread_cond_signal(&r->s->work);
    pthread_mutex_unlock(&r->s->lock);
    free(r->jobs);
    free(r->out.p);
    free(r);
}

// ---- HTTP ------------------------------------------------------------------------------------

// Every answer ends its connection (Connection: close, after which libmicrohttpd closes it and
// drops what the client sent after the request): the next request comes on a new connection,
// through the door, so that no request head meets libmicrohttpd's own HTML page.
static enum MHD_Result queue_last(struct MHD_Connection *c, int status, struct MHD_Response *resp) {
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result send_text(struct MHD_Connection *c, int status, const char *type, char *text) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    return queue_last(c, status, resp);
}

// an error as OpenAI's JSON; a 429 (the queue is full) says when to try again
static enum MHD_Result send_error(Server *s, struct MHD_Connection *c, const ApiError *e, bool counted) {
    if (counted) {
        pthread_mutex_lock(&s->lock);
        count_status(s, e->status);
        pthread_mutex_unlock(&s->lock);
    }
    char *text = api_error_json(e);
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (e->status == 429) {
        char retry[16];
        snprintf(retry, sizeof retry, "%d", RETRY_AFTER_S);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, retry);
    }
    return queue_last(c, e->status, resp);
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

// a request's body as it comes, then, for a whole (not streamed) answer, the request waiting for it
typedef struct {
    Buf body;
    bool too_big;
    Reader *waiting;  // its connection suspended until every choice has finished
} Upload;

// A whole answer's status waits for the answer: its connection is suspended, without a response,
// until the waker resumes it (every choice finished, or the client gone), and then answered
// with the outcome (answer_when_done). A stream's 200 goes at once.
static enum MHD_Result wait_for_answer(Waker *waker, struct MHD_Connection *c, Upload *up, Reader *r) {
    up->waiting = r;
    pthread_mutex_lock(&r->s->lock);  // suspended under the lock: the waker resumes it only after this
    r->next = waker->suspended;
    waker->suspended = r;
    MHD_suspend_connection(c);
    pthread_mutex_unlock(&r->s->lock);
    return MHD_YES;
}

// a whole answer, resumed: 200 and the answer, or, its client gone, no answer (the connection ends)
static enum MHD_Result answer_when_done(struct MHD_Connection *c, Upload *up) {
    Reader *r = up->waiting;
    up->waiting = NULL;
    pthread_mutex_lock(&r->s->lock);
    bool done = !r->gone && has_news(r);
    if (done) append_whole_answer(r->s, r->jobs, r->n, &r->out);
    pthread_mutex_unlock(&r->s->lock);
    Buf out = r->out;
    r->out = (Buf){0};
    release_response(r);
    if (!done) {
        free(out.p);
        return MHD_NO;
    }
    arrival_set(arrival_of(c), CLIENT_DEADLINE_S);  // to take it
    struct MHD_Response *resp = MHD_create_response_from_buffer(out.len, out.p, MHD_RESPMEM_MUST_FREE);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    return queue_last(c, MHD_HTTP_OK, resp);
}

static enum MHD_Result serve_completion(Server *s, Waker *waker, struct MHD_Connection *c, Upload *up, bool chat) {
    const Buf *body = &up->body;
    ApiError e;
    bool include_usage;
    int n;
    Job **jobs = parse_request(s, body->p ? body->p : "", body->len, chat, &n, &include_usage, &e);
    if (!jobs) return send_error(s, c, &e, true);
    if (!enqueue(s, jobs, n, &e)) {
        for (int i = 0; i < n; i++) job_free(jobs[i]);
        free(jobs);
        return send_error(s, c, &e, false);
    }
    Reader *r = malloc_or_die(sizeof *r);
    *r = (Reader){.s = s, .jobs = jobs, .n = n, .c = c, .include_usage = include_usage, .arrival = arrival_of(c),
                  .waker = waker};
    if (!jobs[0]->stream) return wait_for_answer(waker, c, up, r);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, read_response, r, release_response);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    return queue_last(c, MHD_HTTP_OK, resp);
}

static enum MHD_Result send_json(struct MHD_Connection *c, cJSON *root) {
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return send_text(c, 200, "application/json", text);
}

// GET /v1/models: the list of the one model; GET /v1/models/{id}: that model, if it is this one
static enum MHD_Result serve_models(Server *s, struct MHD_Connection *c, const char *id) {
    if (id) {
        ApiError e;
        if (strcmp(id, s->model) == 0) return send_json(c, model_object(s));
        api_fail(&e, 404, "model", "model_not_found", "the model '%s' does not exist (this server has '%s')", id, s->model);
        return send_error(s, c, &e, false);
    }
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(root, "data"), model_object(s));
    return send_json(c, root);
}


// a Content-Length's value: one or more digits (400), at most MAX_BODY (413)
static bool content_length_ok(const char *v, size_t n, ApiError *e) {
    unsigned long long bytes = 0;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9')
            return api_fail(e, 400, NULL, "invalid_content_length", "Content-Length is not a number of bytes "
                        "(a digit expected at its byte %zu)", i);
        if (bytes <= MAX_BODY) bytes = bytes * 10 + (unsigned long long)(v[i] - '0');
    }
    if (n == 0) return api_fail(e, 400, NULL, "invalid_content_length", "Content-Length is empty");
    if (bytes > MAX_BODY)
        return api_fail(e, 413, NULL, "body_too_large", "the body is %.*s bytes, over %d", n < 40 ? (int)n : 40, v, MAX_BODY);
    return true;
}

typedef struct {
    int hosts;
    const char *length;             // the first Content-Length
    bool lengths_differ;
    const char *transfer_encoding;
} HeaderTally;

static enum MHD_Result tally_header(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    HeaderTally *t = cls;
    value = value ? value : "";
    if (strcasecmp(key, MHD_HTTP_HEADER_HOST) == 0) t->hosts++;
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0) {
        t->lengths_differ |= t->length && strcmp(t->length, value) != 0;
        if (!t->length) t->length = value;
    }
    if (strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING) == 0) t->transfer_encoding = value;
    return MHD_YES;
}

// What can be refused before the body comes, of the heads libmicrohttpd passes on (the door
// refuses those it would refuse itself, and every head over MAX_HEADER_BYTES): what RFC 9112 says
// to refuse with 400: an HTTP/1.1 request without one Host, two different Content-Lengths; a
// Content-Length over MAX_BODY (413); a body in chunks (411 Length Required: libmicrohttpd would
// answer a malformed chunk with its own HTML page, after route has accepted the head) or in a
// transfer coding it does not know (501, as RFC 9112 says).
static bool check_headers(struct MHD_Connection *c, const char *version, ApiError *e) {
    HeaderTally t = {0};
    MHD_get_connection_values(c, MHD_HEADER_KIND, tally_header, &t);
    if (strcmp(version, MHD_HTTP_VERSION_1_0) != 0 && t.hosts != 1)
        return api_fail(e, 400, NULL, "invalid_host", "an HTTP/1.1 request must have one Host header, this one has %d",
                    t.hosts);
    if (t.lengths_differ)
        return api_fail(e, 400, NULL, "invalid_content_length", "two Content-Length headers disagree");
    if (t.transfer_encoding && strcasecmp(t.transfer_encoding, "chunked") == 0)
        return api_fail(e, 411, NULL, "length_required", "a body in chunks is not taken: send its Content-Length");
    if (t.transfer_encoding)
        return api_fail(e, 501, NULL, "unsupported_transfer_encoding", "Transfer-Encoding '%.64s' is not "
                    "supported: send the body as it is, with its Content-Length", t.transfer_encoding);
    return !t.length || content_length_ok(t.length, strlen(t.length), e);
}

static enum MHD_Result route(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                             const char *version, const char *data, size_t *data_size, void **con_cls) {
    Waker *waker = cls;
    Server *s = waker->s;
    Upload *up = *con_cls;
    ApiError e;
    if (!up) {  // the headers: the body follows in later calls
        *con_cls = calloc_or_die(1, sizeof(Upload));
        return check_headers(c, version, &e) ? MHD_YES : send_error(s, c, &e, true);
    }
    if (*data_size) {
        if (up->body.len + *data_size > MAX_BODY) up->too_big = true;
        else buf_append(&up->body, data, *data_size);
        *data_size = 0;
        return MHD_YES;
    }
    if (up->waiting) return answer_when_done(c, up);  // resumed
    arrival_set(arrival_of(c), 0);  // the request is in: its answer may take its time to generate
    bool post = strcmp(method, "POST") == 0, get = strcmp(method, "GET") == 0;
    bool chat = strcmp(url, "/v1/chat/completions") == 0, completion = strcmp(url, "/v1/completions") == 0;
    if (get && strcmp(url, "/health") == 0) return send_text(c, 200, "application/json", copy_string_or_die("{\"status\":\"ok\"}\n"));
    if (get && strcmp(url, "/metrics") == 0) return send_text(c, 200, "text/plain; version=0.0.4", metrics_text(s));
    if (get && strcmp(url, "/v1/models") == 0) return serve_models(s, c, NULL);
    if (get && strncmp(url, "/v1/models/", 11) == 0) return serve_models(s, c, url + 11);
    if ((chat || completion) && !post)
        return api_fail(&e, 405, NULL, NULL, "%s %s: use POST", method, url), send_error(s, c, &e, true);
    if (!chat && !completion)
        return api_fail(&e, 404, NULL, "unknown_url", "%s %s: no such endpoint (POST /v1/completions, "
                    "/v1/chat/completions; GET /health, /metrics, /v1/models, /v1/models/{id})", method, url),
               send_error(s, c, &e, true);
    if (up->too_big)
        return api_fail(&e, 413, NULL, "body_too_large", "the body is over %d bytes", MAX_BODY), send_error(s, c, &e, true);
    return serve_completion(s, waker, c, up, chat);
}

// a request answered (or its client gone): its body is freed; its connection closes
static void request_done(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode why) {
    (void)cls, (void)c, (void)why;
    Upload *up = *con_cls;
    if (!up) return;
    // a whole answer's client gone: resumed, libmicrohttpd may close the connection without asking
    // for the answer (answer_when_done); its jobs are cancelled here then
    if (up->waiting) release_response(up->waiting);
    free(up->body.p);
    free(up);
    *con_cls = NULL;
}

// ---- the door: each request head, checked before libmicrohttpd parses it ---------------------

// libmicrohttpd answers a head it cannot parse (a malformed request line or header line, an HTTP
// version other than 1.x, a Content-Length that is not a number, a request line or headers over
// its memory) with its own HTML page, before it calls route, and offers no hook to answer
// otherwise. So the server accepts connections itself, on the polling thread (below): it peeks
// at each new connection's request head (MSG_PEEK: the bytes stay for libmicrohttpd), answers a
// head that libmicrohttpd would refuse with OpenAI's error object, and hands every other
// connection to libmicrohttpd (MHD_add_connection) as soon as its head is in. A connection
// carries one request (every answer closes it: queue_last), so the door sees every request.
typedef enum { HEAD_PARTIAL, HEAD_OK, HEAD_BAD } HeadCheck;
enum { REFUSED_LINGER_S = 1 };

static bool is_token_char(unsigned char c) {  // RFC 9110's tchar
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

// the request line, or as much of it as has come: METHOD SP target SP HTTP/d.d (RFC 9112 3); an
// HTTP major version other than 1 is 505
static bool request_line_ok(const char *l, size_t n, bool whole, ApiError *e) {
    static const char version[] = "HTTP/d.d";
    int part = 0;  // the method, the target, the version
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)l[i];
        if (c == ' ' && part < 2 && len > 0) {
            part++;
            len = 0;
            continue;
        }
        bool ok = part == 0 ? is_token_char(c) : part == 1 ? c > ' ' && c < 0x7F
                  : len < 8 && (version[len] == 'd' ? c >= '0' && c <= '9' : c == (unsigned char)version[len]);
        if (!ok)
            return api_fail(e, 400, NULL, "invalid_request_line", "the request line is malformed at its byte %zu: "
                        "expected METHOD /path HTTP/1.1", i);
        if (part == 2 && len == 5 && c != '1')
            return api_fail(e, 505, NULL, "http_version_not_supported", "HTTP/%c.x is not supported: this server "
                        "speaks HTTP/1.1 and 1.0", c);
        len++;
    }
    if (whole && (part < 2 || len < 8))
        return api_fail(e, 400, NULL, "invalid_request_line", "the request line is malformed: expected METHOD "
                    "/path HTTP/1.1");
    return true;
}

// header line k, or as much of it as has come: Name: value, the name a token, the value without
// control characters but tab (a NUL would cut it short); a line that starts with whitespace
// continues the one before (obs-fold, which libmicrohttpd joins); a Content-Length of digits
static bool header_line_ok(const char *l, size_t n, bool whole, int k, ApiError *e) {
    size_t i = 0;
    bool folded = k > 1 && n > 0 && (l[0] == ' ' || l[0] == '\t');
    if (!folded) {
        while (i < n && is_token_char((unsigned char)l[i])) i++;
        if (i < n ? l[i] != ':' || i == 0 : whole)
            return api_fail(e, 400, NULL, "invalid_header", "header line %d is malformed: expected Name: value", k);
    }
    for (size_t j = i; j < n; j++)
        if (((unsigned char)l[j] < ' ' && l[j] != '\t') || l[j] == 0x7F)
            return api_fail(e, 400, NULL, "invalid_header", "header line %d has the control character 0x%02x", k,
                        (unsigned char)l[j]);
    if (!whole || folded || i != strlen(MHD_HTTP_HEADER_CONTENT_LENGTH) ||
        strncasecmp(l, MHD_HTTP_HEADER_CONTENT_LENGTH, i) != 0)
        return true;
    for (i++; i < n && (l[i] == ' ' || l[i] == '\t'); i++) {}
    return content_length_ok(l + i, n - i, e);
}

// the head of p[0..n): its lines (ending in LF or CRLF, empty lines before it allowed, as RFC
// 9112 2.2 has it) up to the empty line that ends it; HEAD_PARTIAL while what has come is right
// so far and within MAX_HEADER_BYTES (beyond: 414 in the request line, else 431)
static HeadCheck check_head(const char *p, size_t n, ApiError *e) {
    size_t i = 0;
    while (i < n && (p[i] == '\r' || p[i] == '\n')) i++;
    int k = 0;
    for (;; k++) {
        const char *eol = memchr(p + i, '\n', n - i);
        size_t len = (eol ? (size_t)(eol - p) : n) - i;
        if (len > 0 && p[i + len - 1] == '\r') len--;
        if (eol && len == 0) return HEAD_OK;
        if (!(k == 0 ? request_line_ok(p + i, len, eol != NULL, e) : header_line_ok(p + i, len, eol != NULL, k, e)))
            return HEAD_BAD;
        if (!eol) break;
        i = (size_t)(eol - p) + 1;
    }
    if (n <= MAX_HEADER_BYTES) return HEAD_PARTIAL;
    if (k == 0) api_fail(e, 414, NULL, "uri_too_long", "the request line is over %d bytes", MAX_HEADER_BYTES);
    else api_fail(e, 431, NULL, "headers_too_large", "the request line and headers are over %d bytes", MAX_HEADER_BYTES);
    return HEAD_BAD;
}

static void place_close(Gate *g, Arrival *a) {
    pthread_mutex_lock(&g->lock);
    close(a->fd);
    a->state = PLACE_FREE;
    pthread_mutex_unlock(&g->lock);
}

// what a refused client still sends is read and dropped until it closes or REFUSED_LINGER_S
// passes: closing a socket with bytes unread resets it, which may lose the answer on its way
static void drain(Gate *g, Arrival *a, char *buf) {
    ssize_t n;
    while ((n = recv(a->fd, buf, MAX_HEADER_BYTES + 1, MSG_DONTWAIT)) > 0) {}
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) place_close(g, a);
}

// a head libmicrohttpd would refuse: OpenAI's error object, and the connection ends
static void door_refuse(Gate *g, Arrival *a, const ApiError *e, char *buf) {
    char *json = api_error_json(e);
    Buf answer = {0};
    buf_printf(&answer, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
               "Connection: close\r\n\r\n", e->status, MHD_get_reason_phrase_for((unsigned)e->status), strlen(json));
    buf_append(&answer, json, strlen(json));
    free(json);
    send(a->fd, answer.p, answer.len, MSG_NOSIGNAL | MSG_DONTWAIT);  // a short answer fits a new socket's buffer
    free(answer.p);
    shutdown(a->fd, SHUT_WR);
    pthread_mutex_lock(&g->s->lock);
    count_status(g->s, e->status);
    pthread_mutex_unlock(&g->s->lock);
    pthread_mutex_lock(&g->lock);
    a->state = PLACE_REFUSED;
    a->deadline = wall_seconds() + REFUSED_LINGER_S;
    pthread_mutex_unlock(&g->lock);
    drain(g, a, buf);
}

// a right head: libmicrohttpd takes the connection (gate_notify finds its place by its socket)
static void door_hand_over(Gate *g, Arrival *a) {
    if (a->watched) epoll_ctl(g->epoll, EPOLL_CTL_DEL, a->fd, NULL);
    pthread_mutex_lock(&g->lock);
    a->state = PLACE_SERVED;
    pthread_mutex_unlock(&g->lock);
    if (MHD_add_connection(g->daemon, a->fd, (const struct sockaddr *)&a->addr, sizeof a->addr) != MHD_YES) {
        pthread_mutex_lock(&g->lock);  // libmicrohttpd has closed the socket
        a->state = PLACE_FREE;
        pthread_mutex_unlock(&g->lock);
    }
}

// an event on a connection at the door (or, in the same batch of events, on one just handed over);
// hung_up: the client has closed its side (the bytes it sent before are still there to peek at,
// so only the event says so)
static void door_read(Gate *g, Arrival *a, char *buf, bool hung_up) {
    pthread_mutex_lock(&g->lock);
    PlaceState state = a->state;
    pthread_mutex_unlock(&g->lock);
    if (state == PLACE_REFUSED) drain(g, a, buf);
    if (state != PLACE_AT_DOOR) return;
    ssize_t n = recv(a->fd, buf, MAX_HEADER_BYTES + 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) place_close(g, a);  // the client is gone
    if (n <= 0) return;
    ApiError e;
    HeadCheck head = check_head(buf, (size_t)n, &e);
    if (head == HEAD_BAD) door_refuse(g, a, &e, buf);
    else if (head == HEAD_OK) door_hand_over(g, a);
    else if (hung_up) place_close(g, a);  // a head cut short can never be completed: its place is free now
}

// a new connection takes a free place if its address holds fewer than MAX_CONNECTIONS_PER_CLIENT,
// else it is closed at once; its head is looked at right away, as it often came with the
// connection, and the connection is watched for more bytes only if it did not
static void door_accept(Gate *g, char *buf) {
    for (;;) {
        struct sockaddr_in addr;
        socklen_t len = sizeof addr;
        int fd = accept(g->listener, (struct sockaddr *)&addr, &len);
        if (fd < 0 && (errno == ECONNABORTED || errno == EINTR)) continue;
        if (fd < 0) return;
        pthread_mutex_lock(&g->lock);
        Arrival *place = NULL;
        int same = 0;
        for (int i = 0; i < MAX_CONNECTIONS; i++) {
            Arrival *a = &g->conns[i];
            if (a->state == PLACE_FREE) place = place ? place : a;
            else same += a->addr.sin_addr.s_addr == addr.sin_addr.s_addr;
        }
        bool taken = place && same < MAX_CONNECTIONS_PER_CLIENT;
        if (taken) *place = (Arrival){g, PLACE_AT_DOOR, fd, addr, wall_seconds() + CLIENT_DEADLINE_S, false};
        else close(fd);
        pthread_mutex_unlock(&g->lock);
        if (!taken) continue;
        door_read(g, place, buf, false);  // a client that closed at once: its epoll event says so
        pthread_mutex_lock(&g->lock);
        if (place->state == PLACE_AT_DOOR || place->state == PLACE_REFUSED) {
            // edge-triggered: an event when more bytes come (or the client closes); the bytes
            // already there make one at once
            struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.u32 = (uint32_t)(place - g->conns)};
            place->watched = epoll_ctl(g->epoll, EPOLL_CTL_ADD, fd, &ev) == 0;
            if (!place->watched) {
                close(fd);
                place->state = PLACE_FREE;
            }
        }
        pthread_mutex_unlock(&g->lock);
    }
}

// the connections at the door past their deadline (CLIENT_DEADLINE_S for the head) are closed
static void door_expire(Gate *g) {
    double now = wall_seconds();
    pthread_mutex_lock(&g->lock);
    for (int i = 0; i < MAX_CONNECTIONS; i++) {
        Arrival *a = &g->conns[i];
        if ((a->state == PLACE_AT_DOOR || a->state == PLACE_REFUSED) && now > a->deadline) {
            close(a->fd);
            a->state = PLACE_FREE;
        }
    }
    pthread_mutex_unlock(&g->lock);
}

// The polling thread, the one of every connection: it runs the door and libmicrohttpd's event
// loop (MHD_run; libmicrohttpd's own epoll set is a member of this thread's), so that a
// connection handed over is read at once, without waking another thread.
enum { EVENT_LISTENER = MAX_CONNECTIONS, EVENT_LIBMICROHTTPD, EVENT_WAKE };  // epoll's data beside a place's index
enum { POLL_TICK_MS = 100 };  // the longest wait: the door's deadlines are kept to it

static void *poll_connections(void *arg) {
    Gate *g = arg;
    char *buf = malloc_or_die(MAX_HEADER_BYTES + 1);
    struct epoll_event ev[64];
    double next_expiry = 0;
    pthread_mutex_lock(&g->lock);
    while (!g->stop) {
        pthread_mutex_unlock(&g->lock);
        MHD_UNSIGNED_LONG_LONG due_ms;  // libmicrohttpd's next work, if it has some
        int wait_ms = MHD_get_timeout(g->daemon, &due_ms) == MHD_YES && due_ms < POLL_TICK_MS ? (int)due_ms : POLL_TICK_MS;
        int n = epoll_wait(g->epoll, ev, 64, wait_ms);
        for (int k = 0; k < n; k++) {
            eventfd_t wakes;
            if (ev[k].data.u32 == EVENT_LISTENER) door_accept(g, buf);
            else if (ev[k].data.u32 == EVENT_WAKE) eventfd_read(g->wake, &wakes);
            else if (ev[k].data.u32 < MAX_CONNECTIONS)
                door_read(g, &g->conns[ev[k].data.u32], buf, ev[k].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR));
        }
        MHD_run(g->daemon);
        if (wall_seconds() >= next_expiry) {  // once a tick, not on every event
            door_expire(g);
            next_expiry = wall_seconds() + POLL_TICK_MS / 1000.0;
        }
        pthread_mutex_lock(&g->lock);
    }
    for (int i = 0; i < MAX_CONNECTIONS; i++)
        if (g->conns[i].state == PLACE_AT_DOOR || g->conns[i].state == PLACE_REFUSED) {
            close(g->conns[i].fd);
            g->conns[i].state = PLACE_FREE;
        }
    pthread_mutex_unlock(&g->lock);
    free(buf);
    return NULL;
}

// the door's listening socket on host:port, non-blocking (the door accepts until none is left)
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

// the server's HTTP side: the door and the gate, the waker, libmicrohttpd
struct Http {
    Gate gate;
    Waker waker;
    struct MHD_Daemon *daemon;
};

// One polling thread (epoll) for every connection: the door's, and libmicrohttpd's, whose answers
// wait for their tokens suspended (the waker resumes them). MAX_CONNECTIONS_PER_CLIENT and the
// gate's deadlines keep one client's idle or slow connections from taking every place; the memory of a connection holds a head the door lets in
// (MAX_HEADER_BYTES) with room to spare.
Http *http_start(Server *s) {
    Http *h = calloc_or_die(1, sizeof *h);
    Gate *g = &h->gate;
    Waker *w = &h->waker;
    pthread_mutex_init(&g->lock, NULL);
    *w = (Waker){.s = s, .gate = g};
    g->s = s;
    g->listener = listen_on(s->cfg);
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET, 0, NULL, NULL,
        route, w,
        MHD_OPTION_NOTIFY_COMPLETED, request_done, s, MHD_OPTION_NOTIFY_CONNECTION, gate_notify, g,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)MAX_CONNECTIONS, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
        (unsigned)MAX_CONNECTIONS_PER_CLIENT, MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(4 * MAX_HEADER_BYTES),
        MHD_OPTION_END);
    if (!d) fatal("the server cannot start libmicrohttpd (%s)", strerror(errno));
    g->daemon = d;
    g->epoll = epoll_create1(EPOLL_CLOEXEC);
    const union MHD_DaemonInfo *mhd_epoll = MHD_get_daemon_info(d, MHD_DAEMON_INFO_EPOLL_FD);
    g->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event listener = {.events = EPOLLIN | EPOLLET, .data.u32 = EVENT_LISTENER},
                       daemon = {.events = EPOLLIN, .data.u32 = EVENT_LIBMICROHTTPD},
                       wake = {.events = EPOLLIN, .data.u32 = EVENT_WAKE};
    if (g->epoll < 0 || g->wake < 0 || !mhd_epoll || epoll_ctl(g->epoll, EPOLL_CTL_ADD, g->listener, &listener) != 0 ||
        epoll_ctl(g->epoll, EPOLL_CTL_ADD, mhd_epoll->epoll_fd, &daemon) != 0 ||
        epoll_ctl(g->epoll, EPOLL_CTL_ADD, g->wake, &wake) != 0)
        fatal("the server cannot create its epoll set (%s)", strerror(errno));
    if (pthread_create(&g->watcher, NULL, gate_watch, g) != 0 || pthread_create(&w->thread, NULL, wake_readers, w) != 0 ||
        pthread_create(&g->poller, NULL, poll_connections, g) != 0)
        fatal("the server cannot start a thread");
    struct sockaddr_in bound;
    socklen_t len = sizeof bound;
    getsockname(g->listener, (struct sockaddr *)&bound, &len);
    // under mpirun, signal this process: mpirun itself, signalled, kills every rank soon after
    printf("server: model '%s' on http://%s:%u/v1 | %d requests at once (max_batch_size), queue of %d "
           "(max_queue) | kill -TERM %ld stops it\n", s->model, s->cfg->host, ntohs(bound.sin_port), s->n_slots,
           s->cfg->max_queue, (long)getpid());
    fflush(stdout);
    h->daemon = d;
    return h;
}

// after the last step: the connections still writing answers finish (new requests meanwhile get
// 503) before the door and the daemon stop
void http_stop(Http *h) {
    Server *s = h->gate.s;
    Gate *g = &h->gate;
    Waker *w = &h->waker;
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
    w->stop = true;
    pthread_cond_broadcast(&s->progress);
    pthread_mutex_unlock(&s->lock);
    pthread_join(w->thread, NULL);
    pthread_mutex_lock(&g->lock);
    g->stop = true;
    pthread_mutex_unlock(&g->lock);
    pthread_join(g->poller, NULL);
    pthread_join(g->watcher, NULL);
    MHD_stop_daemon(h->daemon);
    close(g->epoll);
    close(g->wake);
    close(g->listener);
    pthread_mutex_destroy(&g->lock);
    free(h);
    printf("server: stopped\n");
}
