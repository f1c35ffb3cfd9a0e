// fuzz_bpe: any bytes -> GPT-2 BPE ids -> bytes must give the input back, with every id in the
// vocabulary; the byte tokenizer too. Never calls fatal() on any input (leak checks stay on).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/tokenizer.h"
#include "fuzz_common.h"

static void check_round_trip(const Tokenizer *t, const uint8_t *data, size_t size) {
    int *ids;
    int n = tokenizer_encode(t, (const char *)data, size, &ids);
    if ((size_t)n > size) abort();
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tokenizer_vocab_size(t)) abort();
        int len;
        const char *bytes = tokenizer_token_bytes(t, ids[i], &len);
        if (len <= 0 || at + (size_t)len > size || memcmp(bytes, data + at, (size_t)len) != 0) abort();
        at += (size_t)len;
    }
    if (at != size) abort();
    char *text = tokenizer_decode(t, ids, n);
    if (memcmp(text, data, size) != 0 || text[size] != '\0') abort();
    free(text);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static Tokenizer *gpt2, *bytes;
    if (!gpt2) {
        if (setjmp(fuzz_on_fatal)) { fprintf(stderr, "cannot load %s\n", fuzz_tokenizer_dir()); abort(); }
        gpt2 = tokenizer_load(fuzz_tokenizer_dir());
        bytes = tokenizer_load("");
    }
    if (setjmp(fuzz_on_fatal)) abort();  // encode/decode must not fail on any bytes
    check_round_trip(gpt2, data, size);
    check_round_trip(bytes, data, size);
    return 0;
}
