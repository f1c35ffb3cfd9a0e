// files.c: see files.h.
#define _POSIX_C_SOURCE 200809L
#include "files.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

void join_path(char *out, const char *dir, const char *name) {
    if (snprintf(out, FILE_PATH_LEN, "%s/%s", dir, name) >= FILE_PATH_LEN) fatal("path too long: %s/%s", dir, name);
}

bool is_directory(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

void make_directories(const char *dir) {
    char buf[FILE_PATH_LEN];
    if (dir[0] == '\0') fatal("the output directory name is empty");
    if (snprintf(buf, sizeof buf, "%s", dir) >= FILE_PATH_LEN) fatal("path too long: %s", dir);
    for (char *p = buf + 1;; p++) {  // create each ancestor in turn, like mkdir -p
        int last = *p == '\0';
        if (*p != '/' && !last) continue;
        *p = '\0';
        if (mkdir(buf, 0777) != 0 && errno != EEXIST) fatal("cannot create directory %s: %s", buf, strerror(errno));
        if (last) break;
        *p = '/';
    }
    if (!is_directory(dir)) fatal("cannot create directory %s: a file of that name exists", dir);
}

void atomic_open(AtomicFile *a, const char *dir, const char *name, uint64_t size) {
    make_directories(dir);
    a->size = size;
    snprintf(a->dir, sizeof a->dir, "%s", dir);
    join_path(a->final, dir, name);
    if (snprintf(a->tmp, sizeof a->tmp, "%s.tmp", a->final) >= FILE_PATH_LEN) fatal("path too long: %s.tmp", a->final);
    a->f = fopen(a->tmp, "wb");
    if (!a->f) fatal("cannot create %s (%llu bytes to write): %s", a->tmp, (unsigned long long)size, strerror(errno));
}

// The group being written (a checkpoint's files): the files written so far wait here, synced but
// not renamed, until atomic_group_commit.
static AtomicFile pending[4];
static int num_pending = -1;  // -1: no group being written, rename each file at once

static void remove_pending(void) {
    for (int i = 0; i < num_pending; i++) remove(pending[i].tmp);
    num_pending = -1;
}

// A failed write (disk full, quota) removes the temp files: no partial output is left behind.
static void atomic_fail(AtomicFile *a) {
    const char *why = strerror(errno);
    fclose(a->f);
    remove(a->tmp);
    remove_pending();
    fatal("cannot write %s (%llu bytes needed): %s; the previous %s is untouched", a->tmp,
          (unsigned long long)a->size, why, a->final);
}

// Test hook: CHECKPOINT_KILL_AT_BYTE=N kills the process (SIGKILL, like scancel after KillWait)
// once it has written N bytes of output files in all, so that a test can stop a save at a
// chosen point inside a chosen file (tests/test_kill_during_save.sh).
static void kill_if_test_asks(size_t bytes) {
    static unsigned long long written, kill_at;
    static int read_env;
    if (!read_env++) {
        const char *env = getenv("CHECKPOINT_KILL_AT_BYTE");
        kill_at = env ? strtoull(env, NULL, 10) : 0;
    }
    written += bytes;
    if (kill_at && written >= kill_at) {
        fflush(NULL);
        raise(SIGKILL);
    }
}

void atomic_write(AtomicFile *a, const void *data, size_t bytes) {
    if (bytes && fwrite(data, 1, bytes, a->f) != bytes) atomic_fail(a);
    kill_if_test_asks(bytes);
}

static void rename_into_place(const AtomicFile *a) {
    if (rename(a->tmp, a->final) != 0) {
        const char *why = strerror(errno);
        remove(a->tmp);
        fatal("cannot rename %s to %s: %s", a->tmp, a->final, why);
    }
    // the rename itself lives in the directory: sync it too (some filesystems refuse; harmless)
    int fd = open(a->dir, O_RDONLY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

void atomic_commit(AtomicFile *a) {
    // fflush hands stdio's buffer to the kernel; fsync makes the kernel put it on the disk, so
    // that after a power cut the renamed file has its data and not just its name
    if (fflush(a->f) != 0 || fsync(fileno(a->f)) != 0) atomic_fail(a);
    if (fclose(a->f) != 0) {
        remove(a->tmp);
        remove_pending();
        fatal("cannot write %s (%llu bytes needed): %s", a->tmp, (unsigned long long)a->size, strerror(errno));
    }
    if (num_pending >= 0 && num_pending < (int)(sizeof pending / sizeof pending[0])) {
        pending[num_pending++] = *a;
        return;
    }
    rename_into_place(a);
}

void write_text_file(const char *dir, const char *name, const char *text) {
    AtomicFile a;
    atomic_open(&a, dir, name, strlen(text) + 1);
    atomic_write(&a, text, strlen(text));
    atomic_write(&a, "\n", 1);
    atomic_commit(&a);
}

void atomic_group_begin(void) { num_pending = 0; }

void atomic_group_commit(void) {
    int n = num_pending;
    num_pending = -1;
    for (int i = 0; i < n; i++) rename_into_place(&pending[i]);
}
