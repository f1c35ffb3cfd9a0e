#define _POSIX_C_SOURCE 200809L
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int g_rank = 0;

void log_set_rank(int rank) { g_rank = rank; }
int log_rank(void) { return g_rank; }

static void (*g_on_fatal)(const char *message);

void log_on_fatal(void (*hook)(const char *message)) { g_on_fatal = hook; }

void fatal(const char *fmt, ...) {
    if (g_on_fatal) {
        char message[512];  // enough to say why; a longer one is cut
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(message, sizeof message, fmt, ap);
        va_end(ap);
        g_on_fatal(message);
    }
    if (g_rank != 0) sleep(2);  // see log.h: let rank 0 speak for the job when all ranks fail
    fflush(stdout);
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, g_rank == 0 ? "error: " : "error (rank %d): ", g_rank);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

FILE *fopen_or_die(const char *path, const char *mode) {
    FILE *f = fopen(path, mode);
    if (!f) fatal("cannot open %s: %s", path, strerror(errno));
    return f;
}

void *malloc_or_die(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) fatal("out of memory allocating %zu bytes", bytes);
    return p;
}

char *copy_string_or_die(const char *s) {
    size_t n = strlen(s) + 1;
    return memcpy(malloc_or_die(n), s, n);
}

void *calloc_or_die(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) fatal("out of memory allocating %zu x %zu bytes", count, size);
    return p;
}

char *read_file_or_die(const char *path, size_t *len) {
    FILE *f = fopen_or_die(path, "rb");
    if (fseek(f, 0, SEEK_END) != 0) fatal("cannot seek in %s: %s", path, strerror(errno));
    long size = ftell(f);
    if (size < 0) fatal("cannot read %s: %s", path, strerror(errno));
    rewind(f);
    char *buf = malloc_or_die((size_t)size + 1);
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) fatal("cannot read %s: short read", path);
    fclose(f);
    buf[size] = '\0';
    if (len) *len = (size_t)size;
    return buf;
}

size_t peak_resident_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");  // Linux only: elsewhere we report 0
    if (!f) return 0;
    char line[256];
    size_t kib = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %zu kB", &kib) == 1) break;
    fclose(f);
    return kib * 1024;
}

uint64_t hash_bytes(const void *data, size_t n) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

double wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double thread_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
