// log.h: fatal errors, and the small helpers every file leans on: allocation and file reading
// that end through fatal() when they fail, the clock, peak memory and a hash.
#ifndef LOG_H
#define LOG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

// Which rank this process is, for fatal(); stages set it right after MPI starts (default 0).
void log_set_rank(int rank);
int log_rank(void);

// Print "error: <message>" once and exit(1). Every error of bad input goes through here.
// Rank 0 prints at once; other ranks wait a moment first, so when the whole job hits the same
// error (a bad config) the launcher has already stopped them and the message appears once, while
// an error only one rank sees (a file missing on one node) is still printed by that rank.
void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
// hook(message) runs first thing in fatal(), before anything is printed (the flight recorder's)
void log_on_fatal(void (*hook)(const char *message));

// fopen that exits through fatal() with the path and the reason when it fails
FILE *fopen_or_die(const char *path, const char *mode);
void *malloc_or_die(size_t bytes);
void *calloc_or_die(size_t count, size_t size);
char *copy_string_or_die(const char *s);  // a malloc'd copy
// the whole file as a NUL-terminated string; *len (if not NULL) gets its size
char *read_file_or_die(const char *path, size_t *len);

double wall_seconds(void);  // monotonic clock
double thread_cpu_seconds(void);  // the calling thread's CPU time

// this process's peak resident memory (VmHWM in /proc/self/status) in bytes; 0 where unknown
size_t peak_resident_bytes(void);

// FNV-1a hash of n bytes: a cheap fingerprint for comparing data across ranks
uint64_t hash_bytes(const void *data, size_t n);

#endif
