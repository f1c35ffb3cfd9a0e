// trace.c: the trace-event recorder of trace.h. Events are formatted into one growing text
// buffer as they end, so recording costs a snprintf and the merge only concatenates texts.
#include "trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "log.h"

#define MAX_LANES 64  // collectives in flight at once on one rank

static struct {
    bool enabled, in_window;
    int steps, steps_seen, rank;
    double epoch;
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

bool trace_recording(void) { return g_trace.in_window; }

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

void trace_span(const char *name, int tid, double t0, double t1, const char *args) {
    if (!g_trace.in_window) return;
    char ev[512];
    snprintf(ev, sizeof ev, "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f%s%s}",
             g_trace.len ? ",\n" : "", name, g_trace.rank, tid, micros(t0), 1e6 * (t1 - t0),
             args ? ",\"args\":" : "", args ? args : "");
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

void trace_collective(const char *kind, const char *group, double bytes, double launch, double wait, double end) {
    if (!g_trace.in_window) return;
    char args[160], name[64];
    snprintf(args, sizeof args, "{\"group\":\"%s\",\"bytes\":%.0f}", group, bytes);
    trace_span(kind, TRACK_COMM + free_lane(launch, end), launch, end, args);
    snprintf(name, sizeof name, "wait %s", kind);
    trace_span(name, TRACK_COMPUTE, wait, end, args);
}

char *trace_events_text(void) { return copy_string_or_die(g_trace.text ? g_trace.text : ""); }

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
