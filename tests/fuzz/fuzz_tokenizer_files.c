// fuzz_tokenizer_files: any bytes as a tokenizer directory. The input is split at the first
// "\n@@\n" into vocab.json and merges.txt, written to a private temp directory and loaded:
// either a clean fatal() or a tokenizer that encodes and decodes text back. -detect_leaks=0.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "data/tokenizer.h"
#include "fuzz_common.h"

static char g_dir[64];

static void write_file(const char *name, const uint8_t *data, size_t size) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_dir[0]) {
        snprintf(g_dir, sizeof g_dir, "/tmp/fuzz_tok_%d", (int)getpid());
        char cmd[96];
        snprintf(cmd, sizeof cmd, "mkdir -p %s", g_dir);
        if (system(cmd) != 0) abort();
    }
    const uint8_t *sep = NULL;
    for (size_t i = 0; i + 4 <= size; i++)
        if (!memcmp(data + i, "\n@@\n", 4)) { sep = data + i; break; }
    size_t vocab_size = sep ? (size_t)(sep - data) : size;
    write_file("vocab.json", data, vocab_size);
    write_file("merges.txt", sep ? sep + 4 : data, sep ? size - vocab_size - 4 : 0);

    if (setjmp(fuzz_on_fatal)) return 0;  // a clean error for bad files: fine
    Tokenizer *t = tokenizer_load(g_dir);
    // encoding may fail cleanly (a byte with no token); when it works it must round-trip
    const char *text = "hello world, it's 2024 \xE6\x9D\xB1 \xF0\x9F\x9A\x80  \n\n";
    int *ids;
    int n = tokenizer_encode(t, text, strlen(text), &ids);
    char *back = tokenizer_decode(t, ids, n);
    if (strcmp(back, text) != 0) abort();
    free(back);
    free(ids);
    tokenizer_free(t);
    return 0;
}
