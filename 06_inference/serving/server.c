// server.c: stage 06 behind an OpenAI-compatible HTTP endpoint: libmicrohttpd's polling thread,
// OpenAI's request JSON in, its response JSON (or server-sent events) out, the metrics, and the
// limits that keep one client from holding the server. Up to max_batch_size requests run at once,
// each in the KV-cache blocks it holds, with continuous batching: scheduler.c, the engine, which every rank of a tensor-parallel grid
// runs; scheduler.h is what the two share.
//
//   libmicrohttpd's polling thread (every connection)     rank 0's main thread: the scheduler
//   parse and check the JSON -> a Job --- queue --->      admit it when its cache blocks fit
//                                                         (prefix-cached blocks shared)
//   write its tokens as they come (server-sent   <------  one pass a step: every running job's
//   events, or one JSON when it is done); with            next token and prompt rows; finished
//                                                         jobs leave
//   none yet, suspend it until the waker thread           ... every other rank runs the same steps
//   resumes it
#include "server.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <pthread.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "api_fields.h"
#include "base/device.h"
#include "base/log.h"
#include "chat_template.h"
#include "data/alpaca.h"
#include "run/preemption.h"
#include "scheduler.h"

static const char *FINISH_NAMES[] = {"", "stop", "length"};
// The limits a client meets (README.md, "Limits"): headers of MAX_HEADER_BYTES, a body of
// MAX_BODY bytes; MAX_CONNECTIONS open at once, MAX_CONNECTIONS_PER_CLIENT of them from one
// address, so that one client holding connections open cannot lock the others out; CLIENT_DEADLINE_S
// to send its request (from the connection's start) and to take each piece of an answer, so that
// a slow or idle client cannot hold its connections for ever.
enum { MAX_BODY = 1 << 20, MAX_HEADER_BYTES = 16 << 10, MAX_CONNECTIONS = 512, MAX_CONNECTIONS_PER_CLIENT = 128,
       CLIENT_DEADLINE_S = 10, RETRY_AFTER_S = 1 };
enum { MAX_STOP_IDS = 64, MAX_LOGIT_BIAS = 300 };  // a request's stop_token_ids, logit_bias (OpenAI's limit)
enum { MAX_TOP_LOGPROBS = 20 };                    // the alternatives a request's logprobs may ask for (OpenAI's)

// ---- a growable byte buffer (buf.c): formatted ------------------------------------------------

static void buf_printf(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(Buf *b, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    buf_append(b, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

static bool all_continuation_bytes(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) return false;
    return true;
}

// Appends the valid UTF-8 of s[0..n) to out, a bad byte as U+FFFD; an incomplete character at the
// end is held back (its other bytes come with the next token) unless `final`. Returns the bytes
// of s it used. A BPE or byte token can end in the middle of a character, and JSON wants text.
// the bytes the lead byte c says its character has (0: no lead byte)
static size_t utf8_length(unsigned char c) {
    return c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
}

// whether s[0..n) begins with a whole, valid character of len bytes
static bool utf8_char_at(const char *s, size_t n, size_t len) {
    return len > 0 && len <= n && utf8_is_valid(s, len, NULL);
}

static size_t append_utf8(Buf *out, const char *s, size_t n, bool final) {
    size_t i = 0;
    while (i < n) {
        size_t len = utf8_length((unsigned char)s[i]);
        if (len > 1 && i + len > n && !final && all_continuation_bytes(s + i + 1, n - i - 1)) break;
        if (utf8_char_at(s + i, n - i, len)) {
            buf_append(out, s + i, len);
            i += len;
        } else {
            buf_append(out, "\xEF\xBF\xBD", 3);
            i++;
        }
    }
    return i;
}

struct timespec deadline_in(double seconds) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    long ns = t.tv_nsec + (long)(seconds * 1e9);
    t.tv_sec += ns / 1000000000;
    t.tv_nsec = ns % 1000000000;
    return t;
}

// ---- a request's life ------------------------------------------------------------------------

static void job_free(Job *j) {
    free(j->ids);
    for (int i = 0; i < j->n_stops; i++) free(j->stops[i]);
    free(j->text.p);
    free(j->ends);
    free(j->out_ids);
    free(j->bias_ids);
    free(j->bias);
    free(j->stop_ids);
    free(j->token_lp);
    free(j->top_lp);
    free(j->top_ids);
    free(j);
}

void job_release(Server *s, Job *j) {
    if (--j->refs > 0) return;
    job_free(j);
    s->live_jobs--;
}

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

// ---- metrics (Prometheus text format) ----------------------------------------------------------

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

static const int STATUS_CODES[] = {200, 400, 404, 405, 411, 413, 414, 429, 431, 501, 503, 505};
_Static_assert(sizeof STATUS_CODES / sizeof STATUS_CODES[0] == N_CODES, "scheduler.h's N_CODES");

static void count_status(Server *s, int code) {
    for (int i = 0; i < N_CODES; i++)
        if (STATUS_CODES[i] == code) s->metrics.requests[i]++;
}

static char *metrics_text(Server *s) {
    Buf b = {0};
    pthread_mutex_lock(&s->lock);
    const ServerMetrics *m = &s->metrics;
    buf_printf(&b, "# HELP workbook_requests_total HTTP requests answered with a completion (200) or refused, by status\n"
                   "# TYPE workbook_requests_total counter\n");
    for (int i = 0; i < N_CODES; i++)
        buf_printf(&b, "workbook_requests_total{code=\"%d\"} %ld\n", STATUS_CODES[i], m->requests[i]);
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

// ---- requests: OpenAI's JSON in, a Job out -----------------------------------------------------

// An OpenAI-style error: {"error": {"message", "type", "param", "code"}}
typedef struct {
    int status;
    char message[512];
    char param[64];  // "": none (a copy: it may name a field of a request that is freed first)
    const char *code;
} ApiError;

static bool fail(ApiError *e, int status, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static bool fail(ApiError *e, int status, const char *param, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    e->code = code;
    return false;
}

static char *error_json(const ApiError *e) {
    cJSON *root = cJSON_CreateObject(), *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", e->message);
    cJSON_AddStringToObject(err, "type", e->status == 429 ? "rate_limit_error"
                                         : e->status == 503 ? "server_error" : "invalid_request_error");
    if (e->param[0]) cJSON_AddStringToObject(err, "param", e->param);
    else cJSON_AddNullToObject(err, "param");
    if (e->code) cJSON_AddStringToObject(err, "code", e->code);
    else cJSON_AddNullToObject(err, "code");
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return text;
}

// Reads an optional number field into *x; false (and the error) if it is there but not a number
// in [lo, hi].
static bool optional_number(const cJSON *req, const char *key, double lo, double hi, double *x, ApiError *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(req, key);
    if (!v || cJSON_IsNull(v)) return true;
    if (!cJSON_IsNumber(v)) return fail(e, 400, key, "invalid_type", "'%s' must be a number", key);
    if (!(v->valuedouble >= lo && v->valuedouble <= hi))
        return fail(e, 400, key, "invalid_value", "'%s' is %g, expected a value in [%g, %g]", key,
                    v->valuedouble, lo, hi);
    *x = v->valuedouble;
    return true;
}

static bool optional_integer(const cJSON *req, const char *key, double lo, double hi, long *x, ApiError *e) {
    double d = (double)*x;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(req, key);
    if (v && cJSON_IsNumber(v) && v->valuedouble != floor(v->valuedouble))
        return fail(e, 400, key, "invalid_type", "'%s' must be an integer, found %g", key, v->valuedouble);
    if (!optional_number(req, key, lo, hi, &d, e)) return false;
    *x = (long)d;
    return true;
}

static const char *string_field(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

// A message's content may be a list of parts, as OpenAI's API allows: text parts are joined with
// newlines (as vLLM does) into the string the template takes; this model reads nothing else.
static bool join_text_parts(cJSON *messages, ApiError *e) {
    cJSON *msg;
    int i = 0;
    cJSON_ArrayForEach(msg, messages) {
        cJSON *parts = cJSON_GetObjectItemCaseSensitive(msg, "content"), *part;
        if (!cJSON_IsArray(parts)) {
            i++;
            continue;
        }
        Buf text = {0};
        buf_append(&text, "", 0);
        int k = 0;
        cJSON_ArrayForEach(part, parts) {
            const char *type = string_field(part, "type"), *piece = string_field(part, "text");
            if (!type || strcmp(type, "text") != 0 || !piece) {
                free(text.p);
                return fail(e, 400, "messages", "invalid_value", "messages[%d].content[%d]: this model "
                            "reads text parts only ({\"type\": \"text\", \"text\": ...})", i, k);
            }
            if (k++) buf_append(&text, "\n", 1);
            buf_append(&text, piece, strlen(piece));
        }
        cJSON_ReplaceItemInObjectCaseSensitive(msg, "content", cJSON_CreateString(text.p));
        free(text.p);
        i++;
    }
    return true;
}

// The chat as one Alpaca prompt: each user message is an instruction (a system message before it
// becomes that instruction's input, the template's "further context"), each assistant message
// the response to the one before; the last message is the user's, whose response is wanted.
// One user message gives exactly the prompt stage 06 makes from a line of the prompts file.
static char *chat_prompt(const cJSON *messages, bool always_input, ApiError *e) {
    if (!cJSON_IsArray(messages) || cJSON_GetArraySize(messages) == 0)
        return fail(e, 400, "messages", "invalid_type", "'messages' must be a non-empty array"), NULL;
    Buf prompt = {0};
    buf_append(&prompt, "", 0);
    const char *system = "", *last_role = "";
    int i = 0;
    const cJSON *msg;
    cJSON_ArrayForEach(msg, messages) {
        const char *role = string_field(msg, "role"), *content = string_field(msg, "content");
        if (!cJSON_IsObject(msg) || !role || !content) {
            free(prompt.p);
            return fail(e, 400, "messages", "invalid_type", "messages[%d] must be an object with "
                        "string 'role' and 'content'", i), NULL;
        }
        if (strcmp(role, "system") == 0 || strcmp(role, "developer") == 0) {
            system = content;
        } else if (strcmp(role, "user") == 0) {
            AlpacaRecord rec = {.instruction = (char *)content, .input = (char *)system, .output = ""};
            char *turn = alpaca_format_prompt(&rec, always_input);
            buf_append(&prompt, turn, strlen(turn));
            free(turn);
            system = "";
        } else if (strcmp(role, "assistant") == 0) {
            buf_append(&prompt, content, strlen(content));
            buf_append(&prompt, "\n\n", 2);
        } else {
            free(prompt.p);
            return fail(e, 400, "messages", "invalid_value", "messages[%d]: unknown role '%s' "
                        "(expected system, user or assistant)", i, role), NULL;
        }
        last_role = role;
        i++;
    }
    if (strcmp(last_role, "user") != 0) {
        free(prompt.p);
        return fail(e, 400, "messages", "invalid_value", "the last message must be the user's"), NULL;
    }
    return prompt.p;
}

// The chat through the checkpoint's own template (tokenizer_config.json's chat_template), with the
// assistant's turn begun (add_generation_prompt); a template that raises on it (roles that do not
// alternate, say) refuses it with its words.
static char *templated_prompt(const ChatTemplate *t, const cJSON *messages, ApiError *e) {
    const cJSON *msg;
    int i = 0;
    if (!cJSON_IsArray(messages) || cJSON_GetArraySize(messages) == 0)
        return fail(e, 400, "messages", "invalid_type", "'messages' must be a non-empty array"), NULL;
    cJSON_ArrayForEach(msg, messages) {
        if (!cJSON_IsObject(msg) || !string_field(msg, "role") || !string_field(msg, "content"))
            return fail(e, 400, "messages", "invalid_type", "messages[%d] must be an object with string 'role' and "
                        "'content'", i), NULL;
        i++;
    }
    char err[400];
    char *text = chat_template_render(t->text, messages, true, t->bos, t->eos, err, sizeof err);
    if (!text) fail(e, 400, "messages", "invalid_value", "%s (%s)", err, t->path);
    return text;
}

static bool read_stops(const cJSON *req, Job *j, ApiError *e) {
    const cJSON *stop = cJSON_GetObjectItemCaseSensitive(req, "stop"), *item;
    if (!stop || cJSON_IsNull(stop)) return true;
    if (cJSON_IsString(stop)) {
        if (!stop->valuestring[0]) return fail(e, 400, "stop", "invalid_value", "'stop' must not be empty");
        j->stops[j->n_stops++] = copy_string_or_die(stop->valuestring);
        return true;
    }
    if (!cJSON_IsArray(stop) || cJSON_GetArraySize(stop) > MAX_STOPS)
        return fail(e, 400, "stop", "invalid_type", "'stop' must be a string or up to %d strings", MAX_STOPS);
    cJSON_ArrayForEach(item, stop) {
        if (!cJSON_IsString(item) || !item->valuestring[0])
            return fail(e, 400, "stop", "invalid_type", "'stop' must hold non-empty strings");
        j->stops[j->n_stops++] = copy_string_or_die(item->valuestring);
    }
    return true;
}

static bool read_sampling(const cJSON *req, const Config *cfg, Job *j, ApiError *e) {
    double temperature = cfg->temperature, top_p = cfg->top_p, min_p = 0;
    long top_k = cfg->top_k, seed = -1;
    if (!optional_number(req, "temperature", 0, 2, &temperature, e) ||
        !optional_number(req, "top_p", 1e-9, 1, &top_p, e) ||
        !optional_number(req, "min_p", 0, 1, &min_p, e) ||
        !optional_integer(req, "top_k", 0, 1e9, &top_k, e) ||
        !optional_integer(req, "seed", 0, 9007199254740991.0, &seed, e))
        return false;
    const cJSON *stream = cJSON_GetObjectItemCaseSensitive(req, "stream");
    if (stream && !cJSON_IsNull(stream) && !cJSON_IsBool(stream))
        return fail(e, 400, "stream", "invalid_type", "'stream' must be true or false");
    j->stream = cJSON_IsTrue(stream);
    j->temperature = (float)temperature;
    j->top_p = (float)top_p;
    j->min_p = (float)min_p;
    j->top_k = (int)top_k;
    // a request's own seed makes its sample a function of the seed alone; otherwise the server's
    // seed and the request's number pick it
    j->seed = seed >= 0 ? (uint64_t)seed : (uint64_t)cfg->seed;
    j->key = seed >= 0 ? 0 : j->id;
    return read_stops(req, j, e);
}

// an optional true or false
static bool optional_bool(const cJSON *req, const char *key, bool *x, ApiError *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(req, key);
    if (!v || cJSON_IsNull(v)) return true;
    if (!cJSON_IsBool(v)) return fail(e, 400, key, "invalid_type", "'%s' must be true or false", key);
    *x = cJSON_IsTrue(v);
    return true;
}

// a token id as a request gives it: an integer in [0, V)
static bool token_id_ok(double id, int V) { return id >= 0 && id < V && id == floor(id); }

// stop_token_ids: a list of token ids, each of which ends the answer (kept in it, as vLLM does)
static bool read_stop_token_ids(const cJSON *req, int V, Job *j, ApiError *e) {
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(req, "stop_token_ids"), *id;
    if (!ids || cJSON_IsNull(ids)) return true;
    if (!cJSON_IsArray(ids) || cJSON_GetArraySize(ids) > MAX_STOP_IDS)
        return fail(e, 400, "stop_token_ids", "invalid_type", "'stop_token_ids' must be a list of up to %d token ids",
                    MAX_STOP_IDS);
    j->stop_ids = malloc_or_die((size_t)MAX_STOP_IDS * sizeof(int));
    cJSON_ArrayForEach(id, ids) {
        if (!cJSON_IsNumber(id) || !token_id_ok(id->valuedouble, V))
            return fail(e, 400, "stop_token_ids", "invalid_value", "'stop_token_ids' must hold token ids in [0, %d)", V);
        j->stop_ids[j->n_stop_ids++] = (int)id->valuedouble;
    }
    return true;
}

// logit_bias: {"token id": a bias in [-100, 100], ...}, OpenAI's (up to MAX_LOGIT_BIAS tokens)
static bool read_logit_bias(const cJSON *req, int V, Job *j, ApiError *e) {
    const cJSON *bias = cJSON_GetObjectItemCaseSensitive(req, "logit_bias"), *b;
    if (!bias || cJSON_IsNull(bias)) return true;
    if (!cJSON_IsObject(bias) || cJSON_GetArraySize(bias) > MAX_LOGIT_BIAS)
        return fail(e, 400, "logit_bias", "invalid_type", "'logit_bias' must be an object of up to %d token ids "
                    "and their biases", MAX_LOGIT_BIAS);
    j->bias_ids = malloc_or_die((size_t)MAX_LOGIT_BIAS * sizeof(int));
    j->bias = malloc_or_die((size_t)MAX_LOGIT_BIAS * sizeof(float));
    cJSON_ArrayForEach(b, bias) {
        char *end;
        double id = strtod(b->string, &end);
        if (!b->string[0] || *end || !token_id_ok(id, V))
            return fail(e, 400, "logit_bias", "invalid_value", "'logit_bias': '%.40s' is not a token id in [0, %d)",
                        b->string, V);
        if (!cJSON_IsNumber(b) || !(b->valuedouble >= -100 && b->valuedouble <= 100))
            return fail(e, 400, "logit_bias", "invalid_value", "'logit_bias': token %s's bias must be a number in "
                        "[-100, 100]", b->string);
        j->bias_ids[j->n_bias] = (int)id;
        j->bias[j->n_bias++] = (float)b->valuedouble;
    }
    return true;
}

// logprobs: completions' is the number of alternatives wanted with each token's (0 to
// MAX_TOP_LOGPROBS); chat's is true or false, and its top_logprobs that number
static bool read_logprobs(const cJSON *req, bool chat, Job *j, ApiError *e) {
    long n = -1;
    j->logprobs = -1;
    if (!chat) {
        if (!optional_integer(req, "logprobs", 0, MAX_TOP_LOGPROBS, &n, e)) return false;
        j->logprobs = (int)n;
        return true;
    }
    bool wanted = false;
    if (!optional_bool(req, "logprobs", &wanted, e) || !optional_integer(req, "top_logprobs", 0, MAX_TOP_LOGPROBS, &n, e))
        return false;
    if (n > 0 && !wanted) return fail(e, 400, "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
    if (wanted) j->logprobs = n > 0 ? (int)n : 0;
    return true;
}

// echo (completions): the answer begins with the prompt; its log-probabilities are not computed
static bool read_echo(const cJSON *req, Job *j, ApiError *e) {
    if (j->chat) return true;  // chat has none (api_fields.c refuses it)
    if (!optional_bool(req, "echo", &j->echo, e)) return false;
    if (j->echo && j->logprobs >= 0)
        return fail(e, 400, "echo", "unsupported_parameter", "'echo' with 'logprobs' is refused: the prompt's "
                    "log-probabilities are not computed");
    return true;
}

// the request's own changes to the logits (request_logits.c) and to when its answer ends
static bool read_logit_rules(const cJSON *req, const Server *s, Job *j, ApiError *e) {
    double presence = 0, frequency = 0, repetition = 1;
    int V = tokenizer_vocab_size(s->tok);
    if (!optional_number(req, "presence_penalty", -2, 2, &presence, e) ||
        !optional_number(req, "frequency_penalty", -2, 2, &frequency, e) ||
        !optional_number(req, "repetition_penalty", 0.01, 100, &repetition, e) ||
        !optional_bool(req, "ignore_eos", &j->ignore_eos, e) || !read_stop_token_ids(req, V, j, e) ||
        !read_logit_bias(req, V, j, e))
        return false;
    j->presence_penalty = (float)presence;
    j->frequency_penalty = (float)frequency;
    j->repetition_penalty = (float)repetition;
    return true;
}

// a prompt as its tokens: ids in [0, V)
static bool read_token_prompt(const cJSON *p, int V, Job *j, ApiError *e) {
    const cJSON *id;
    j->ids = malloc_or_die((size_t)cJSON_GetArraySize(p) * sizeof(int));
    cJSON_ArrayForEach(id, p) {
        if (!cJSON_IsNumber(id) || !token_id_ok(id->valuedouble, V))
            return fail(e, 400, "prompt", "invalid_value", "'prompt': token %d is not a token id in [0, %d)", j->n_ids, V);
        j->ids[j->n_ids++] = (int)id->valuedouble;
    }
    return true;
}

static bool read_prompt(cJSON *req, const Server *s, Job *j, ApiError *e) {
    char *text;
    if (j->chat) {
        cJSON *messages = cJSON_GetObjectItemCaseSensitive(req, "messages");
        if (cJSON_IsArray(messages) && !join_text_parts(messages, e)) return false;
        text = s->chat_template ? templated_prompt(s->chat_template, messages, e)
                                : chat_prompt(messages, s->cfg->always_input_template, e);
        if (!text) return false;
    } else {  // completions: the text as it is, or its tokens (either alone, or in a list of one)
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(req, "prompt");
        if (cJSON_IsArray(p) && cJSON_GetArraySize(p) > 1 && !cJSON_IsNumber(p->child))
            return fail(e, 400, "prompt", "invalid_value", "'prompt' holds %d prompts: this server takes one a "
                        "request", cJSON_GetArraySize(p));
        if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && !cJSON_IsNumber(p->child)) p = p->child;
        if (cJSON_IsArray(p) && p->child) text = NULL;
        else if (!cJSON_IsString(p) || !p->valuestring[0])
            return fail(e, 400, "prompt", "invalid_type", "'prompt' must be a non-empty string, a list of token "
                        "ids, or a list of one of them");
        else text = copy_string_or_die(p->valuestring);
        if (!text && !read_token_prompt(p, tokenizer_vocab_size(s->tok), j, e)) return false;
    }
    if (text) j->n_ids = tokenizer_encode(s->tok, text, strlen(text), &j->ids);
    free(text);
    int maxT = s->cfg->max_seq_len;
    if (j->n_ids >= maxT)
        return fail(e, 400, j->chat ? "messages" : "prompt", "context_length_exceeded",
                    "the prompt is %d tokens, but this model's context is %d tokens and the answer "
                    "needs at least one", j->n_ids, maxT);
    return true;
}

// The answer may fill the context: max_tokens in [1, context - prompt]; omitted, the server's
// tokens_to_generate as far as the context allows.
static bool read_max_tokens(const cJSON *req, const Config *cfg, Job *j, ApiError *e) {
    long room = cfg->max_seq_len - j->n_ids;
    long max_tokens = cfg->tokens_to_generate < room ? cfg->tokens_to_generate : room;
    const char *key = j->chat && cJSON_GetObjectItemCaseSensitive(req, "max_completion_tokens")
                          ? "max_completion_tokens" : "max_tokens";
    if (!optional_integer(req, key, -1e18, 1e18, &max_tokens, e)) return false;
    if (max_tokens < 1 || max_tokens > room)
        return fail(e, 400, key, "invalid_value", "'%s' is %ld, expected 1 to %ld (the context of "
                    "%d tokens less the prompt's %d)", key, max_tokens, room, cfg->max_seq_len, j->n_ids);
    j->max_tokens = (int)max_tokens;
    return true;
}

// stream_options {"include_usage": true}: a streamed answer's last event before [DONE] carries
// the usage, with no choices (OpenAI's shape); only a streamed request may ask for it
static bool read_stream_options(const cJSON *req, bool stream, bool *include_usage, ApiError *e) {
    const cJSON *options = cJSON_GetObjectItemCaseSensitive(req, "stream_options");
    *include_usage = false;
    if (!options || cJSON_IsNull(options)) return true;
    if (!stream) return fail(e, 400, "stream_options", "invalid_value", "'stream_options' needs 'stream': true");
    const cJSON *usage = cJSON_GetObjectItemCaseSensitive(options, "include_usage");
    if (!cJSON_IsObject(options) || (usage && !cJSON_IsNull(usage) && !cJSON_IsBool(usage)))
        return fail(e, 400, "stream_options", "invalid_type", "'stream_options' must be an object whose "
                    "'include_usage' is true or false");
    *include_usage = cJSON_IsTrue(usage);
    return true;
}

// JSON escapes "\u0000" into a NUL, which would end the C string there: refused, like a raw NUL.
// A backslash outside a string is no JSON at all, so every one seen here starts an escape.
static bool has_escaped_nul(const char *body, size_t len) {
    for (size_t i = 0; i + 1 < len; i++)
        if (body[i] == '\\') {
            if (i + 5 < len && memcmp(body + i + 1, "u0000", 5) == 0) return true;
            i++;  // the escaped character: \\u0000 is a backslash, then text
        }
    return false;
}

// The body as a JSON object: valid UTF-8 with no NUL (escaped or not), and nothing after the
// object but white space. NULL and the error otherwise.
static cJSON *parse_body(const char *body, size_t len, ApiError *e) {
    size_t bad;
    if (!utf8_is_valid(body, len, &bad))
        return fail(e, 400, NULL, "invalid_encoding", "the body is not valid UTF-8 (byte %zu)", bad), NULL;
    if (memchr(body, '\0', len) || has_escaped_nul(body, len))
        return fail(e, 400, NULL, "invalid_value", "the body holds a NUL character, which no prompt may"), NULL;
    const char *end = NULL;
    cJSON *req = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!cJSON_IsObject(req)) {
        cJSON_Delete(req);
        return fail(e, 400, NULL, NULL, "the body is not a JSON object"), NULL;
    }
    while (end < body + len && *end && strchr(" \t\r\n", *end)) end++;
    if (end < body + len) {
        cJSON_Delete(req);
        return fail(e, 400, NULL, NULL, "the body goes on after its JSON object (byte %zu)", (size_t)(end - body)), NULL;
    }
    return req;
}

// every field of the request is one this server honours (api_fields.c), or the first that is not
static bool fields_honoured(const cJSON *req, bool chat, ApiError *e) {
    const char *why, *field = api_refused_field(req, chat ? API_CHAT : API_COMPLETIONS, &why);
    return !field || fail(e, 400, field, "unsupported_parameter", "'%s' is refused: %s (README.md, \"The API, "
                          "field by field\")", field, why);
}

// The request as a job (its choice 0; *n: the choices it asks for, n), or NULL and the error.
static Job *parse_request(Server *s, const char *body, size_t len, bool chat, bool *include_usage, int *n, ApiError *e) {
    cJSON *req = parse_body(body, len, e);
    if (!req) return NULL;
    Job *j = calloc_or_die(1, sizeof *j);
    j->chat = chat;
    pthread_mutex_lock(&s->lock);
    j->id = ++s->next_id;
    pthread_mutex_unlock(&s->lock);
    const char *model = string_field(req, "model");
    bool ok = model ? strcmp(model, s->model) == 0 ||
                          fail(e, 404, "model", "model_not_found", "the model '%s' does not exist "
                               "(this server has '%s')", model, s->model)
                    : fail(e, 400, "model", "invalid_type", "'model' must be a string (this server has '%s')", s->model);
    long choices = 1;
    ok = ok && fields_honoured(req, chat, e) &&
         optional_integer(req, "n", 1, s->cfg->max_queue, &choices, e) && read_prompt(req, s, j, e) && read_max_tokens(req, s->cfg, j, e) && read_sampling(req, s->cfg, j, e) &&
         read_logit_rules(req, s, j, e) && read_logprobs(req, chat, j, e) && read_echo(req, j, e) &&
         read_stream_options(req, j->stream, include_usage, e);
    cJSON_Delete(req);
    if (!ok) {
        job_free(j);
        return NULL;
    }
    j->ends = malloc_or_die((size_t)j->max_tokens * sizeof(size_t));
    j->out_ids = malloc_or_die((size_t)j->max_tokens * sizeof(int));
    if (j->logprobs >= 0) {
        size_t top = (size_t)j->max_tokens * (size_t)(j->logprobs ? j->logprobs : 1);
        j->token_lp = malloc_or_die((size_t)j->max_tokens * sizeof(float));
        j->top_lp = malloc_or_die(top * sizeof(float));
        j->top_ids = malloc_or_die(top * sizeof(int));
    }
    *n = (int)choices;
    j->request_id = j->id;
    j->created = time(NULL);
    j->t_arrival = wall_seconds();
    j->refs = 2;
    return j;
}

// ---- responses: a Job's tokens as OpenAI's JSON --------------------------------------------------

static cJSON *response_head(const Server *s, const Job *j, const char *object) {
    cJSON *root = cJSON_CreateObject();
    char id[48];
    snprintf(id, sizeof id, "%s-%ld", j->chat ? "chatcmpl" : "cmpl", j->request_id);
    cJSON_AddStringToObject(root, "id", id);
    cJSON_AddStringToObject(root, "object", object);
    cJSON_AddNumberToObject(root, "created", (double)j->created);
    cJSON_AddStringToObject(root, "model", s->model);
    return root;
}

// ---- log-probabilities: the scheduler's record of each token (request_logits.c) as OpenAI's JSON

// a token as logprobs name it: its bytes when they are whole UTF-8 characters, else OpenAI's
// "bytes:\xNN..." (a byte or BPE token may hold part of a character)
static char *token_text(const Tokenizer *tok, int id) {
    int len;
    const char *bytes = tokenizer_token_bytes(tok, id, &len);
    Buf t = {0};
    buf_append(&t, "", 0);
    if (utf8_is_valid(bytes, (size_t)len, NULL) && !memchr(bytes, 0, (size_t)len)) buf_append(&t, bytes, (size_t)len);
    else {
        buf_append(&t, "bytes:", 6);
        for (int i = 0; i < len; i++) buf_printf(&t, "\\x%02x", (unsigned char)bytes[i]);
    }
    return t.p;
}

// chat's {"token", "logprob", "bytes"} of token id
static cJSON *chat_token_logprob(const Tokenizer *tok, int id, float logprob) {
    cJSON *o = cJSON_CreateObject();
    char *text = token_text(tok, id);
    int len;
    const char *bytes = tokenizer_token_bytes(tok, id, &len);
    cJSON_AddStringToObject(o, "token", text);
    cJSON_AddNumberToObject(o, "logprob", logprob);
    cJSON *b = cJSON_AddArrayToObject(o, "bytes");
    for (int i = 0; i < len; i++) cJSON_AddItemToArray(b, cJSON_CreateNumber((unsigned char)bytes[i]));
    free(text);
    return o;
}

// text_offset: the characters of text[0..len) as the answer writes them (append_utf8: a byte that
// is no character's is a U+FFFD) that lie wholly before byte `at` (a token that begins inside a
// character is at that character)
static int characters_before(const char *text, size_t len, size_t at) {
    int count = 0;
    for (size_t i = 0, n; i < len; i += n, count++) {
        n = utf8_char_at(text + i, len - i, utf8_length((unsigned char)text[i])) ? utf8_length((unsigned char)text[i]) : 1;
        if (i + n > at) break;
    }
    return count;
}

// The logprobs of j's tokens from..to-1: chat's {"content": [...]}, completions' {"tokens",
// "token_logprobs", "top_logprobs", "text_offset"}; each with its j->logprobs likeliest alternatives.
static cJSON *logprobs_json(const Server *s, const Job *j, int from, int to) {
    cJSON *root = cJSON_CreateObject(), *content = NULL, *tokens = NULL, *lps = NULL, *tops = NULL, *offsets = NULL;
    if (j->chat) content = cJSON_AddArrayToObject(root, "content");
    else {
        tokens = cJSON_AddArrayToObject(root, "tokens");
        lps = cJSON_AddArrayToObject(root, "token_logprobs");
        tops = cJSON_AddArrayToObject(root, "top_logprobs");
        offsets = cJSON_AddArrayToObject(root, "text_offset");
    }
    for (int i = from; i < to; i++) {
        const int *ids = j->top_ids + (size_t)i * j->logprobs;
        const float *top = j->top_lp + (size_t)i * j->logprobs;
        if (j->chat) {
            cJSON *item = chat_token_logprob(s->tok, j->out_ids[i], j->token_lp[i]);
            cJSON *alternatives = cJSON_AddArrayToObject(item, "top_logprobs");
            for (int k = 0; k < j->logprobs && ids[k] >= 0; k++)
                cJSON_AddItemToArray(alternatives, chat_token_logprob(s->tok, ids[k], top[k]));
            cJSON_AddItemToArray(content, item);
            continue;
        }
        char *text = token_text(s->tok, j->out_ids[i]);
        cJSON_AddItemToArray(tokens, cJSON_CreateString(text));
        free(text);
        cJSON_AddItemToArray(lps, cJSON_CreateNumber(j->token_lp[i]));
        cJSON *alternatives = cJSON_CreateObject();
        for (int k = 0; k < j->logprobs && ids[k] >= 0; k++) {
            text = token_text(s->tok, ids[k]);
            cJSON_AddNumberToObject(alternatives, text, top[k]);
            free(text);
        }
        cJSON_AddItemToArray(tops, alternatives);
        cJSON_AddItemToArray(offsets, cJSON_CreateNumber(characters_before(j->text.p, j->text.len, i ? j->ends[i - 1] : 0)));
    }
    return root;
}

// the tokens a whole answer shows: those that begin before its visible end (a stop string cuts it)
static int visible_tokens(const Job *j) {
    int n = 0;
    while (n < j->n_out && (n ? j->ends[n - 1] : 0) < j->visible) n++;
    return n;
}

// One choice: the text (NULL: none), the finish reason (NULL: not yet), and the logprobs of the
// tokens from..to-1 when the request asked for them; chat puts the text in a message, or in a
// delta when streaming.
static void add_choice(cJSON *root, const Server *s, const Job *j, const char *text, const char *finish, bool role,
                       int from, int to) {
    cJSON *choice = cJSON_CreateObject();
    cJSON_AddNumberToObject(choice, "index", j->choice);
    if (j->chat) {
        cJSON *msg = cJSON_AddObjectToObject(choice, j->stream ? "delta" : "message");
        if (role) cJSON_AddStringToObject(msg, "role", "assistant");
        if (text) cJSON_AddStringToObject(msg, "content", text);
    } else {
        cJSON_AddStringToObject(choice, "text", text ? text : "");
    }
    if (j->logprobs >= 0 && from < to) cJSON_AddItemToObject(choice, "logprobs", logprobs_json(s, j, from, to));
    else cJSON_AddNullToObject(choice, "logprobs");
    if (finish) cJSON_AddStringToObject(choice, "finish_reason", finish);
    else cJSON_AddNullToObject(choice, "finish_reason");
    cJSON *choices = cJSON_GetObjectItemCaseSensitive(root, "choices");
    cJSON_AddItemToArray(choices ? choices : cJSON_AddArrayToObject(root, "choices"), choice);
}

static void append_json(Buf *b, cJSON *root, bool event) {
    char *text = cJSON_PrintUnformatted(root);
    if (event) buf_append(b, "data: ", 6);
    buf_append(b, text, strlen(text));
    buf_append(b, event ? "\n\n" : "\n", event ? 2 : 1);
    free(text);
    cJSON_Delete(root);
}

// the usage of a request's jobs (its n choices): the prompt once, the answers' tokens together
static void append_usage(cJSON *root, Job *const *jobs, int n) {
    int completion = 0;
    for (int i = 0; i < n; i++) completion += jobs[i]->n_out;
    cJSON *usage = cJSON_AddObjectToObject(root, "usage");
    cJSON_AddNumberToObject(usage, "prompt_tokens", jobs[0]->n_ids);
    cJSON_AddNumberToObject(usage, "completion_tokens", completion);
    cJSON_AddNumberToObject(usage, "total_tokens", jobs[0]->n_ids + completion);
    // the prompt's positions found in the prefix cache (prefix_caching), not computed again
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(usage, "prompt_tokens_details"), "cached_tokens", jobs[0]->cached_tokens);
}

// the prompt's text, for echo: the bytes of its tokens
static void append_prompt(const Server *s, const Job *j, Buf *bytes) {
    for (int i = 0; i < j->n_ids; i++) {
        int len;
        const char *b = tokenizer_token_bytes(s->tok, j->ids[i], &len);
        buf_append(bytes, b, (size_t)len);
    }
}

// a request's whole answer: every choice (its jobs, all finished) and the usage
static void append_whole_answer(const Server *s, Job *const *jobs, int n, Buf *out) {
    cJSON *root = response_head(s, jobs[0], jobs[0]->chat ? "chat.completion" : "text_completion");
    for (int i = 0; i < n; i++) {
        Job *j = jobs[i];
        Buf text = {0}, bytes = {0};
        buf_append(&text, "", 0);
        buf_append(&bytes, "", 0);
        if (j->echo) append_prompt(s, j, &bytes);
        buf_append(&bytes, j->text.p ? j->text.p : "", j->visible);
        append_utf8(&text, bytes.p, bytes.len, true);
        free(bytes.p);
        add_choice(root, s, j, text.p, FINISH_NAMES[j->finish], true, 0, visible_tokens(j));
        free(text.p);
        j->done_written = true;
    }
    append_usage(root, jobs, n);
    append_json(out, root, false);
}

// the events of one choice's tokens that came since the last call: one per token, then the finish
static void append_events(const Server *s, Job *j, Buf *out) {
    const char *object = j->chat ? "chat.completion.chunk" : "text_completion";
    if (j->chat && j->n_written == 0 && !j->done_written) {
        cJSON *root = response_head(s, j, object);  // OpenAI's first chunk: the role
        add_choice(root, s, j, "", NULL, true, 0, 0);
        append_json(out, root, true);
    }
    if (j->echo && !j->echo_written) {  // the first chunk: the prompt
        Buf bytes = {0}, text = {0};
        buf_append(&bytes, "", 0);
        buf_append(&text, "", 0);
        append_prompt(s, j, &bytes);
        append_utf8(&text, bytes.p, bytes.len, true);
        cJSON *root = response_head(s, j, object);
        add_choice(root, s, j, text.p, NULL, false, 0, 0);
        append_json(out, root, true);
        free(bytes.p);
        free(text.p);
        j->echo_written = true;
    }
    for (; j->n_written < j->n_out; j->n_written++) {
        size_t end = j->ends[j->n_written] < j->visible ? j->ends[j->n_written] : j->visible;
        Buf piece = {0};
        buf_append(&piece, "", 0);
        if (end > j->used) j->used += append_utf8(&piece, j->text.p + j->used, end - j->used, false);
        cJSON *root = response_head(s, j, object);
        add_choice(root, s, j, piece.p, NULL, false, j->n_written, j->n_written + 1);
        append_json(out, root, true);
        free(piece.p);
    }
    if (j->finish == FINISH_NONE || j->done_written) return;
    Buf rest = {0};  // what an incomplete last character held back
    buf_append(&rest, "", 0);
    if (j->visible > j->used) j->used += append_utf8(&rest, j->text.p + j->used, j->visible - j->used, true);
    cJSON *root = response_head(s, j, object);
    add_choice(root, s, j, j->chat && !rest.len ? NULL : rest.p, FINISH_NAMES[j->finish], false, 0, 0);
    append_json(out, root, true);
    free(rest.p);
    j->done_written = true;
}

// a stream's end, once every choice has finished: the usage if the request asked for it
// (stream_options.include_usage), and [DONE]
static void append_stream_end(const Server *s, Job *const *jobs, int n, bool include_usage, Buf *out) {
    if (include_usage) {
        cJSON *root = response_head(s, jobs[0], jobs[0]->chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddArrayToObject(root, "choices");
        append_usage(root, jobs, n);
        append_json(out, root, true);
    }
    buf_append(out, "data: [DONE]\n\n", 14);
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
    char *text = error_json(e);
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
    if (s->stopping) fail(e, 503, NULL, NULL, "the server is shutting down");
    else if (!ok) fail(e, 429, NULL, "queue_full", "%d requests are waiting already (max_queue): try again later",
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
    Job *j = parse_request(s, body->p ? body->p : "", body->len, chat, &include_usage, &n, &e);
    if (!j) return send_error(s, c, &e, true);
    Job **jobs = malloc_or_die((size_t)n * sizeof(Job *));
    jobs[0] = j;
    for (int i = 1; i < n; i++) {  // choice i: the same request, parsed again (as it was: no error)
        jobs[i] = parse_request(s, body->p, body->len, chat, &include_usage, &n, &e);
        jobs[i]->choice = i, jobs[i]->first = j, jobs[i]->request_id = j->id;
        if (!jobs[i]->key) jobs[i]->key = i;  // a seeded request's choice i draws the seed's i-th numbers
    }
    if (!enqueue(s, jobs, n, &e)) {
        for (int i = 0; i < n; i++) job_free(jobs[i]);
        free(jobs);
        return send_error(s, c, &e, false);
    }
    Reader *r = malloc_or_die(sizeof *r);
    *r = (Reader){.s = s, .jobs = jobs, .n = n, .c = c, .include_usage = include_usage, .arrival = arrival_of(c),
                  .waker = waker};
    if (!j->stream) return wait_for_answer(waker, c, up, r);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, read_response, r, release_response);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    return queue_last(c, MHD_HTTP_OK, resp);
}

static cJSON *model_object(const Server *s) {
    cJSON *model = cJSON_CreateObject();
    cJSON_AddStringToObject(model, "id", s->model);
    cJSON_AddStringToObject(model, "object", "model");
    cJSON_AddNumberToObject(model, "created", 0);
    cJSON_AddStringToObject(model, "owned_by", "workbook");
    return model;
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
        fail(&e, 404, "model", "model_not_found", "the model '%s' does not exist (this server has '%s')", id, s->model);
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
            return fail(e, 400, NULL, "invalid_content_length", "Content-Length is not a number of bytes "
                        "(a digit expected at its byte %zu)", i);
        if (bytes <= MAX_BODY) bytes = bytes * 10 + (unsigned long long)(v[i] - '0');
    }
    if (n == 0) return fail(e, 400, NULL, "invalid_content_length", "Content-Length is empty");
    if (bytes > MAX_BODY)
        return fail(e, 413, NULL, "body_too_large", "the body is %.*s bytes, over %d", n < 40 ? (int)n : 40, v, MAX_BODY);
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
        return fail(e, 400, NULL, "invalid_host", "an HTTP/1.1 request must have one Host header, this one has %d",
                    t.hosts);
    if (t.lengths_differ)
        return fail(e, 400, NULL, "invalid_content_length", "two Content-Length headers disagree");
    if (t.transfer_encoding && strcasecmp(t.transfer_encoding, "chunked") == 0)
        return fail(e, 411, NULL, "length_required", "a body in chunks is not taken: send its Content-Length");
    if (t.transfer_encoding)
        return fail(e, 501, NULL, "unsupported_transfer_encoding", "Transfer-Encoding '%.64s' is not "
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
        return fail(&e, 405, NULL, NULL, "%s %s: use POST", method, url), send_error(s, c, &e, true);
    if (!chat && !completion)
        return fail(&e, 404, NULL, "unknown_url", "%s %s: no such endpoint (POST /v1/completions, "
                    "/v1/chat/completions; GET /health, /metrics, /v1/models, /v1/models/{id})", method, url),
               send_error(s, c, &e, true);
    if (up->too_big)
        return fail(&e, 413, NULL, "body_too_large", "the body is over %d bytes", MAX_BODY), send_error(s, c, &e, true);
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
            return fail(e, 400, NULL, "invalid_request_line", "the request line is malformed at its byte %zu: "
                        "expected METHOD /path HTTP/1.1", i);
        if (part == 2 && len == 5 && c != '1')
            return fail(e, 505, NULL, "http_version_not_supported", "HTTP/%c.x is not supported: this server "
                        "speaks HTTP/1.1 and 1.0", c);
        len++;
    }
    if (whole && (part < 2 || len < 8))
        return fail(e, 400, NULL, "invalid_request_line", "the request line is malformed: expected METHOD "
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
            return fail(e, 400, NULL, "invalid_header", "header line %d is malformed: expected Name: value", k);
    }
    for (size_t j = i; j < n; j++)
        if (((unsigned char)l[j] < ' ' && l[j] != '\t') || l[j] == 0x7F)
            return fail(e, 400, NULL, "invalid_header", "header line %d has the control character 0x%02x", k,
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
    if (k == 0) fail(e, 414, NULL, "uri_too_long", "the request line is over %d bytes", MAX_HEADER_BYTES);
    else fail(e, 431, NULL, "headers_too_large", "the request line and headers are over %d bytes", MAX_HEADER_BYTES);
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
    char *json = error_json(e);
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

// ---- start and stop ----------------------------------------------------------------------------

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

// One polling thread (epoll) for every connection: the door's, and libmicrohttpd's, whose answers
// wait for their tokens suspended (the waker resumes them). MAX_CONNECTIONS_PER_CLIENT and the gate's deadlines keep one client's idle or slow connections
// from taking every place; the memory of a connection holds a head the door lets in
// (MAX_HEADER_BYTES) with room to spare.
static struct MHD_Daemon *start_http(Server *s, Gate *g, Waker *w) {
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
    return d;
}

// after the last step: the connections still writing answers finish (new requests meanwhile get
// 503) before the door and the daemon stop
static void stop_http(Server *s, struct MHD_Daemon *d, Gate *g, Waker *w) {
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
    MHD_stop_daemon(d);
    close(g->epoll);
    close(g->wake);
    close(g->listener);
    printf("server: stopped\n");
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
    s.metrics.ttft.le = TTFT_BUCKETS;
    s.metrics.tpot.le = TPOT_BUCKETS;
    Gate *gate = calloc_or_die(1, sizeof *gate);
    pthread_mutex_init(&gate->lock, NULL);
    Waker waker = {.s = &s, .gate = gate};
    struct MHD_Daemon *d = start_http(&s, gate, &waker);
    scheduler_run(&s, m, sampler, world, use_graph);
    stop_http(&s, d, gate, &waker);
    chat_template_free(chat);
    free(gate);
    free(s.queue);
    free(s.slots);
}
