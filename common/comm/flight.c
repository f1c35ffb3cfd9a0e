// flight.c: see flight.h. The ring is written from signal handlers, so flight_write uses only
// async-signal-safe calls (open, write, rename, clock_gettime) and formats its numbers itself.
#define _XOPEN_SOURCE 700  // SA_ONSTACK
#include "flight.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "run/preemption.h"

enum { FLIGHT_GROUPS = 64, PATH_LEN = 600 };
typedef enum { ISSUED, STARTED, COMPLETED } OpState;
static const char *STATE_NAMES[] = {"issued", "started", "completed"};

typedef struct {
    long ticket;  // which operation holds the slot (tickets count every operation of this rank)
    const char *kind;
    int group, peer, recv_peer;
    long seq, recv_seq;
    double bytes;
    OpState state;
    long issued_us, started_us, completed_us;  // the real-time clock, so hosts' rings line up
} FlightOp;

typedef struct {
    char name[32];
    int rank, size;
    int *members;  // world ranks
} FlightGroup;

static FlightOp g_ring[FLIGHT_OPS];
static long g_tickets;
static FlightGroup g_groups[FLIGHT_GROUPS];
static int g_ngroups;
static bool g_on;
static int g_rank, g_size;
static const int *g_pids;
static const char *g_same_host;
static char g_dir[PATH_LEN], g_path[PATH_LEN + 40], g_tmp[PATH_LEN + 40], g_host[64];
static bool g_dir_from_env;

static long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (long)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

// ---- recording --------------------------------------------------------------------------------

long flight_issued(const char *kind, int group, long seq, int peer, long recv_seq, int recv_peer,
                   double bytes) {
    if (!g_on) return -1;
    long ticket = g_tickets++;
    g_ring[ticket % FLIGHT_OPS] = (FlightOp){ticket, kind, group, peer, recv_peer, seq, recv_seq, bytes,
                                             ISSUED, now_us(), 0, 0};
    return ticket;
}

// the slot of a ticket still in the ring (more than FLIGHT_OPS later operations overwrite it)
static FlightOp *slot(long ticket) {
    if (ticket < 0 || g_ring[ticket % FLIGHT_OPS].ticket != ticket) return NULL;
    return &g_ring[ticket % FLIGHT_OPS];
}

void flight_started(long ticket) {
    FlightOp *op = slot(ticket);
    if (op && op->state == ISSUED) op->state = STARTED, op->started_us = now_us();
}

void flight_completed(long ticket) {
    FlightOp *op = slot(ticket);
    if (op && op->state != COMPLETED) op->state = COMPLETED, op->completed_us = now_us();
}

int flight_add_group(const char *name, int rank, int size, const int *world_ranks) {
    if (g_ngroups == FLIGHT_GROUPS) fatal("the flight recorder holds %d groups; this run makes more", FLIGHT_GROUPS);
    FlightGroup *g = &g_groups[g_ngroups];
    snprintf(g->name, sizeof g->name, "%s", name);
    g->rank = rank;
    g->size = size;
    g->members = malloc_or_die((size_t)size * sizeof *g->members);
    memcpy(g->members, world_ranks, (size_t)size * sizeof *g->members);
    return g_ngroups++;
}

// ---- writing, async-signal-safe -----------------------------------------------------------------

typedef struct {
    int fd;
    size_t n;
    char buf[4096];
} Out;

static void flush_out(Out *o) {
    for (size_t done = 0; done < o->n;) {
        ssize_t w = write(o->fd, o->buf + done, o->n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;  // a full disk: the ring is lost, the job goes on failing as it would
        done += (size_t)w;
    }
    o->n = 0;
}

static void put_char(Out *o, char c) {
    if (o->n == sizeof o->buf) flush_out(o);
    o->buf[o->n++] = c;
}

static void put_text(Out *o, const char *s) {
    while (*s) put_char(o, *s++);
}

static void put_long(Out *o, long v) {
    char digits[24];
    int n = 0;
    unsigned long u = v < 0 ? 0ul - (unsigned long)v : (unsigned long)v;
    do digits[n++] = (char)('0' + u % 10); while (u /= 10);
    if (v < 0) put_char(o, '-');
    while (n) put_char(o, digits[--n]);
}

static void put_string(Out *o, const char *s) {
    put_char(o, '"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') put_char(o, '\\');
        put_char(o, c < 0x20 ? ' ' : (char)c);  // a newline in a message would break the JSON
    }
    put_char(o, '"');
}

// "key": value pairs, the first of an object without the comma
static void put_key(Out *o, const char *key, bool first) {
    if (!first) put_char(o, ',');
    put_string(o, key);
    put_char(o, ':');
}

static void put_group(Out *o, int id) {
    const FlightGroup *g = &g_groups[id];
    put_text(o, id ? ",\n  {" : "\n  {");
    put_key(o, "name", true), put_string(o, g->name);
    put_key(o, "rank", false), put_long(o, g->rank);
    put_key(o, "members", false), put_char(o, '[');
    for (int i = 0; i < g->size; i++) {
        if (i) put_char(o, ',');
        put_long(o, g->members[i]);
    }
    put_text(o, "]}");
}

static void put_op(Out *o, const FlightOp *op, bool first) {
    put_text(o, first ? "\n  {" : ",\n  {");
    put_key(o, "ticket", true), put_long(o, op->ticket);
    put_key(o, "kind", false), put_string(o, op->kind);
    put_key(o, "group", false), put_long(o, op->group);
    put_key(o, "seq", false), put_long(o, op->seq);
    put_key(o, "peer", false), put_long(o, op->peer);
    put_key(o, "recv_seq", false), put_long(o, op->recv_seq);
    put_key(o, "recv_peer", false), put_long(o, op->recv_peer);
    put_key(o, "bytes", false), put_long(o, (long)op->bytes);
    put_key(o, "state", false), put_string(o, STATE_NAMES[op->state]);
    put_key(o, "issued_us", false), put_long(o, op->issued_us);
    put_key(o, "started_us", false), put_long(o, op->started_us);
    put_key(o, "completed_us", false), put_long(o, op->completed_us);
    put_char(o, '}');
}

// make_dir: a hang or a request for the rings may come before rank 0 made out_dir, or on a host
// that does not share it; a bad-input error (fatal()) leaves no directory behind that was not there.
static void write_ring(const char *reason, bool make_dir) {
    if (!g_on || !g_path[0]) return;  // no directory yet: the run has not read its config
    int saved_errno = errno;          // a handler must leave errno as it found it
    if (make_dir) mkdir(g_dir, 0777);
    Out o = {.fd = open(g_tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644)};
    if (o.fd >= 0) {
        put_char(&o, '{');
        put_key(&o, "rank", true), put_long(&o, g_rank);
        put_key(&o, "world_size", false), put_long(&o, g_size);
        put_key(&o, "host", false), put_string(&o, g_host);
        put_key(&o, "pid", false), put_long(&o, (long)getpid());
        put_key(&o, "reason", false), put_string(&o, reason);
        put_key(&o, "written_us", false), put_long(&o, now_us());
        put_key(&o, "ring_size", false), put_long(&o, FLIGHT_OPS);
        put_key(&o, "groups", false), put_char(&o, '[');
        for (int i = 0; i < g_ngroups; i++) put_group(&o, i);
        put_text(&o, "],\n");
        put_key(&o, "ops", true), put_char(&o, '[');
        long first = g_tickets > FLIGHT_OPS ? g_tickets - FLIGHT_OPS : 0;
        for (long t = first; t < g_tickets; t++) put_op(&o, &g_ring[t % FLIGHT_OPS], t == first);
        put_text(&o, "]}\n");
        flush_out(&o);
        close(o.fd);
        rename(g_tmp, g_path);  // a reader sees the whole ring or none
    }
    errno = saved_errno;
}

void flight_write(const char *reason) { write_ring(reason, true); }

// ---- when to write ------------------------------------------------------------------------------

static void set_paths(const char *dir) {
    snprintf(g_dir, sizeof g_dir, "%s", dir);
    snprintf(g_path, sizeof g_path, "%s/flight-rank%d.json", g_dir, g_rank);
    snprintf(g_tmp, sizeof g_tmp, "%s/.flight-rank%d.json.tmp", g_dir, g_rank);
}

void flight_set_dir(const char *dir) {
    if (!g_dir_from_env) set_paths(dir);
    // rings and an analysis left by an earlier run would be read as this run's
    unlink(g_path);
    char path[PATH_LEN + 32];
    if (g_rank != 0) return;
    snprintf(path, sizeof path, "%s/hangcheck.txt", g_dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/hangcheck.lock", g_dir);
    unlink(path);
}

// the handlers' reasons: fixed texts, since a handler cannot format one
static const char *signal_reason(int sig) {
    switch (sig) {
    case SIGUSR1: return "signal SIGUSR1";
    case SIGUSR2: return "signal SIGUSR2";
    case SIGINT: return "signal SIGINT";
    default: return "signal SIGTERM";
    }
}

// Only SIGUSR2, which a person or a timed-out peer sends to ask for the rings, may make out_dir:
// the SIGTERM a launcher sends the other ranks when one refuses bad input must leave no directory.
void flight_on_signal(int sig) { write_ring(signal_reason(sig), sig == SIGUSR2); }

// SIGUSR2: write and carry on. SIGTERM, SIGINT: write, then end the process by the signal as
// before (a handler installed later, preemption's, replaces this one and calls flight_on_signal).
static void on_signal(int sig) {
    flight_on_signal(sig);
    if (sig == SIGUSR2) return;
    signal(sig, SIG_DFL);
    raise(sig);  // delivered when this handler returns
}

static void install_handlers(void) {
    signal_handlers_own_stack();  // preemption.h: a SIGUSR2 lands mid-computation too
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_ONSTACK;
    if (sigaction(SIGUSR2, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0 ||
        sigaction(SIGINT, &sa, NULL) != 0)
        fatal("cannot install the flight recorder's signal handlers: %s", strerror(errno));
}

static void on_fatal(const char *message) { write_ring(message, false); }

void flight_init(int world_rank, int world_size, const int *pids, const char *same_host) {
    const char *on = getenv("FLIGHT_RECORDER"), *dir = getenv("FLIGHT_DIR");
    g_on = !(on && strcmp(on, "0") == 0);
    g_rank = world_rank;
    g_size = world_size;
    g_pids = pids;
    g_same_host = same_host;
    gethostname(g_host, sizeof g_host - 1);
    g_dir_from_env = dir && dir[0];
    if (g_dir_from_env) set_paths(dir);
    if (!g_on) return;
    install_handlers();
    log_on_fatal(on_fatal);
}

// ---- at a timeout -----------------------------------------------------------------------------

static int rings_present(void) {
    int n = 0;
    char path[PATH_LEN + 32];
    for (int r = 0; r < g_size; r++) {
        snprintf(path, sizeof path, "%s/flight-rank%d.json", g_dir, r);
        n += access(path, R_OK) == 0;
    }
    return n;
}

// The ranks that time out do so within moments of each other; a rank elsewhere (computing, or
// stuck outside the comm layer) writes its ring when signalled. A few seconds let them land.
static void wait_for_rings(void) {
    double until = wall_seconds() + 3;
    struct timespec nap = {0, 100000000};
    while (rings_present() < g_size && wall_seconds() < until) nanosleep(&nap, NULL);
}

// The ranks that time out end the job, and the launcher then stops every rank: they wait a few
// seconds for the analysis to appear so that the one running it is not stopped halfway.
static void wait_for_analysis(const char *txt) {
    double until = wall_seconds() + 10;
    struct timespec nap = {0, 100000000};
    while (access(txt, R_OK) != 0 && wall_seconds() < until) nanosleep(&nap, NULL);
}

// The first rank to create hangcheck.lock runs the analysis into hangcheck.txt; the others wait
// for it.
static void run_hangcheck(void) {
    char lock[PATH_LEN + 32], txt[PATH_LEN + 32], cmd[6 * PATH_LEN];
    snprintf(lock, sizeof lock, "%s/hangcheck.lock", g_dir);
    snprintf(txt, sizeof txt, "%s/hangcheck.txt", g_dir);
    int fd = open(lock, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
        wait_for_analysis(txt);
        return;
    }
    close(fd);
    fprintf(stderr, "flight recorder: %d of %d ranks wrote their rings to %s; python3 tools/hangcheck %s says:\n",
            rings_present(), g_size, g_dir, g_dir);
    fflush(stderr);
    if (access("tools/hangcheck", R_OK) != 0) {
        fprintf(stderr, "  (tools/hangcheck is not in this directory: run it from the repository)\n");
        return;
    }
    // written aside and renamed, so that the waiting ranks see it only when it is whole
    snprintf(cmd, sizeof cmd, "python3 tools/hangcheck '%s' >'%s.tmp'; cat '%s.tmp' >&2; mv '%s.tmp' '%s'", g_dir,
             txt, txt, txt, txt);
    if (system(cmd) != 0) fprintf(stderr, "  (tools/hangcheck failed)\n");
}

void flight_on_timeout(const char *reason) {
    if (!g_on) return;
    flight_write(reason);
    for (int r = 0; r < g_size; r++)
        if (r != g_rank && g_same_host[r]) kill(g_pids[r], SIGUSR2);
    wait_for_rings();
    run_hangcheck();
}
