// trace.c: the trace-event recorder of trace.h. While recording, an event is kept as its name,
// arguments and marks; the marks are read and the events formatted only when the trace is
// written, because on a GPU a mark's time is known once the device has passed it, and reading
// it sooner would make the host wait for the device in the middle of the steps being traced.
#include "trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "files.h"
#include "log.h"

#define MAX_LANES 64  // collectives in flight at once on one rank

typedef struct {
    char name[48], args[160];  // args: a JSON object's text, "" for none
    int tid;                   // the compute track, or TRACK_COMM for a collective (lane: when read)
    int begin, wait, end;      // marks; wait: a collective's only
} Pending;

static struct {
    bool enabled, in_window;
    int steps, steps_seen, rank;
    double epoch;
    Pending *pending;
    int n_pending, cap_pending;
    int op_depth;  // ops open now (trace_op_begin without its end)
    char *text;
    size_t len, cap;
    double lane_end[MAX_LANES];  // the latest end of a collective on each comm lane
} g_trace;

void trace_open(bool enabled, int trace_steps, int rank, double epoch) {
    g_trace.enabled = enabled;
    g_trace.steps = trace_steps;
    g_trace.rank = rank;
    g_trace.epoch = epoch;
}

void trace_step(void) { g_trace.in_window = g_trace.enabled && g_trace.steps_seen++ < g_trace.steps; }

int trace_mark(void) { return g_trace.in_window ? dev_mark() : -1; }

static void keep(const char *name, const char *args, int tid, int begin, int wait, int end) {
    if (!g_trace.in_window || begin < 0 || end < 0) return;
    if (g_trace.n_pending == g_trace.cap_pending) {
        g_trace.cap_pending = g_trace.cap_pending ? 2 * g_trace.cap_pending : 1024;
        g_trace.pending = realloc(g_trace.pending, (size_t)g_trace.cap_pending * sizeof(Pending));
        if (!g_trace.pending) fatal("out of memory for %d trace events; lower trace_steps", g_trace.cap_pending);
    }
    Pending *p = &g_trace.pending[g_trace.n_pending++];
    snprintf(p->name, sizeof p->name, "%s", name);
    snprintf(p->args, sizeof p->args, "%s", args ? args : "");
    p->tid = tid;
    p->begin = begin;
    p->wait = wait;
    p->end = end;
}

void trace_span(const char *name, int tid, int m0, int m1, const char *args) { keep(name, args, tid, m0, -1, m1); }

int trace_op_begin(void) { return g_trace.op_depth++ ? -1 : trace_mark(); }

void trace_op_end(const char *name, int m0, double bytes, double flops, const char *shape) {
    g_trace.op_depth--;
    if (m0 < 0) return;
    char args[160];
    snprintf(args, sizeof args, "{\"op\":true,\"bytes\":%.0f,\"flops\":%.0f%s%s%s}", bytes, flops,
             shape ? ",\"shape\":\"" : "", shape ? shape : "", shape ? "\"" : "");
    keep(name, args, TRACK_COMPUTE, m0, -1, trace_mark());
}

void trace_collective(const char *kind, const char *group, double bytes, int launch, int wait, int end) {
    char args[160];
    snprintf(args, sizeof args, "{\"group\":\"%s\",\"bytes\":%.0f}", group, bytes);
    keep(kind, args, TRACK_COMM, launch, wait, end);
}

static void append(const char *s) {
    size_t n = strlen(s);
    if (g_trace.len + n + 1 > g_trace.cap) {
        g_trace.cap = 2 * (g_trace.len + n + 1) + 4096;
        g_trace.text = realloc(g_trace.text, g_trace.cap);
        if (!g_trace.text) fatal("out of memory for the trace (%zu bytes); lower trace_steps", g_trace.cap);
    }
    memcpy(g_trace.text + g_trace.len, s, n + 1);
    g_trace.len += n;
}

static double micros(double t) { return 1e6 * (t - g_trace.epoch); }

static void append_event(const char *name, int tid, double t0, double t1, const char *args) {
    char ev[512];
    snprintf(ev, sizeof ev, "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f%s%s}",
             g_trace.len ? ",\n" : "", name, g_trace.rank, tid, micros(t0), 1e6 * (t1 - t0),
             args[0] ? ",\"args\":" : "", args);
    append(ev);
}

// the first lane whose collectives all ended by `launch`: events on one lane never overlap
static int free_lane(double launch, double end) {
    for (int i = 0; i < MAX_LANES; i++)
        if (g_trace.lane_end[i] <= launch) {
            g_trace.lane_end[i] = end;
            return i;
        }
    fatal("more than %d collectives in flight at once on rank %d; the trace has no lane for more",
          MAX_LANES, g_trace.rank);
}

static void append_collective(const Pending *p) {
    double launch = dev_mark_seconds(p->begin), wait = dev_mark_seconds(p->wait), end = dev_mark_seconds(p->end);
    append_event(p->name, TRACK_COMM + free_lane(launch, end), launch, end, p->args);
    char name[64];
    snprintf(name, sizeof name, "wait %s", p->name);
    // a GPU collective may have ended before the compute stream reached its wait: nothing waited
    append_event(name, TRACK_COMPUTE, wait, end > wait ? end : wait, p->args);
}

// reads every kept event's marks and formats it (the lanes are given in the order of launch
// calls, as they were kept); the marks are then free for another trace
static void format_pending(void) {
    for (int i = 0; i < g_trace.n_pending; i++) {
        const Pending *p = &g_trace.pending[i];
        if (p->tid == TRACK_COMM) append_collective(p);
        else append_event(p->name, p->tid, dev_mark_seconds(p->begin), dev_mark_seconds(p->end), p->args);
    }
    g_trace.n_pending = 0;
    dev_marks_clear();
}

char *trace_events_text(void) {
    format_pending();
    return copy_string_or_die(g_trace.text ? g_trace.text : "");
}

// (after_events: a comma must separate the names from the events before them)
static void append_track_names(char **out, size_t *len, int n_ranks, bool after_events) {
    for (int r = 0; r < n_ranks; r++) {
        char meta[320];
        int n = snprintf(meta, sizeof meta, "%s{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"ts\":0,"
                         "\"args\":{\"name\":\"rank %d\"}},\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,"
                         "\"tid\":0,\"ts\":0,\"args\":{\"name\":\"compute\"}}", r || after_events ? ",\n" : "", r, r, r);
        *out = realloc(*out, *len + (size_t)n + 1);
        if (!*out) fatal("out of memory merging the trace");
        memcpy(*out + *len, meta, (size_t)n + 1);
        *len += (size_t)n;
    }
}

void trace_write_file(const char *out_dir, char **rank_texts, int n_ranks) {
    size_t len = strlen("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    char *out = copy_string_or_die("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    bool first = true;
    for (int r = 0; r < n_ranks; r++) {
        if (!rank_texts[r][0]) continue;
        size_t n = strlen(rank_texts[r]);
        out = realloc(out, len + n + 3);
        if (!out) fatal("out of memory merging the trace");
        if (!first) memcpy(out + len, ",\n", 3), len += 2;
        memcpy(out + len, rank_texts[r], n + 1);
        len += n;
        first = false;
    }
    append_track_names(&out, &len, n_ranks, !first);
    out = realloc(out, len + 4);
    if (!out) fatal("out of memory merging the trace");
    memcpy(out + len, "\n]}", 4);
    write_text_file(out_dir, "trace.json", out);
    printf("trace: %s/trace.json (%d rank%s; open it in https://ui.perfetto.dev or chrome://tracing)\n",
           out_dir, n_ranks, n_ranks == 1 ? "" : "s");
    free(out);
}

void trace_write(const char *out_dir) {
    if (!g_trace.enabled) return;
    char *text = trace_events_text();
    trace_write_file(out_dir, &text, 1);
    free(text);
}
