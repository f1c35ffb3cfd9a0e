// fuzz_log.c: log.h for the fuzz harnesses. fatal() jumps back into the harness instead of exiting,
// so a bad input ends one run (as it should) and the fuzzer goes on to the next input.
// (Memory allocated before the error is not freed: run the harnesses that hit fatal() with
// -detect_leaks=0, see run.sh.)
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "base/log.h"
#include "fuzz_common.h"

jmp_buf fuzz_on_fatal;
int fuzz_fatal_count;

void log_set_rank(int rank) { (void)rank; }
int log_rank(void) { return 0; }

void fatal(const char *fmt, ...) {
    char message[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);  // formatting the message is part of what we test
    va_end(ap);
    fuzz_fatal_count++;
    longjmp(fuzz_on_fatal, 1);
}

FILE *fopen_or_die(const char *path, const char *mode) {
    FILE *f = fopen(path, mode);
    if (!f) fatal("cannot open %s", path);
    return f;
}

void *malloc_or_die(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) fatal("out of memory");
    return p;
}

void *calloc_or_die(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) fatal("out of memory");
    return p;
}

char *read_file_or_die(const char *path, size_t *len) {
    FILE *f = fopen_or_die(path, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    rewind(f);
    char *buf = malloc_or_die((size_t)size + 1);
    size_t got = fread(buf, 1, (size_t)size, f);
    fclose(f);
    buf[got] = '\0';
    if (len) *len = got;
    return buf;
}

double wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
