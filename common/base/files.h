// files.h: the run's output files, written so that a crash, a kill or a full disk never leaves
// half of one: each goes to <name>.tmp, is flushed to the disk, then renamed over <name>; rename()
// replaces the name in one step, so a reader sees the old file or the new one. Checkpoints,
// stats.json and trace.json are written this way; metrics.jsonl, which grows a line per step, is
// not, but its directory is made here too.
#ifndef FILES_H
#define FILES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define FILE_PATH_LEN 4096

// mkdir -p: creates dir and its missing ancestors; fatal when it cannot, or when a file has the name
void make_directories(const char *dir);
bool is_directory(const char *path);
// out (FILE_PATH_LEN bytes) = "<dir>/<name>"; fatal when it does not fit
void join_path(char *out, const char *dir, const char *name);

// One file being written. Every failure is fatal, and removes the temp file (and those of the
// group waiting to be renamed) first, so that nothing half-written is left behind.
typedef struct {
    FILE *f;
    char tmp[FILE_PATH_LEN], final[FILE_PATH_LEN], dir[FILE_PATH_LEN];
    uint64_t size;  // the whole file's bytes, for the message when the disk cannot take them
} AtomicFile;

// opens <dir>/<name>.tmp (creating dir if missing) for a file of `size` bytes
void atomic_open(AtomicFile *a, const char *dir, const char *name, uint64_t size);
void atomic_write(AtomicFile *a, const void *data, size_t bytes);
// flushes and syncs the file, then renames it into place (inside a group: at the group's commit)
void atomic_commit(AtomicFile *a);

// A group of files that replace the previous ones together (a checkpoint's): between begin and
// commit each file is written and synced but not renamed; commit renames them all at the end, so
// a failure while writing leaves every file of the previous group in place.
void atomic_group_begin(void);
void atomic_group_commit(void);

// Writes text and a newline to <dir>/<name> (creating dir if missing), atomically.
void write_text_file(const char *dir, const char *name, const char *text);

#endif
