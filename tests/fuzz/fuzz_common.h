// fuzz_common.h: what the harnesses share (see fuzz_log.c).
#ifndef FUZZ_COMMON_H
#define FUZZ_COMMON_H
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

extern jmp_buf fuzz_on_fatal;  // fatal() longjmps here
extern int fuzz_fatal_count;

// Where the GPT-2 tokenizer is: $FUZZ_TOKENIZER or the fixture path seen from the repo root.
static inline const char *fuzz_tokenizer_dir(void) {
    const char *dir = getenv("FUZZ_TOKENIZER");
    return dir ? dir : "../shared/fixtures/gpt2-tokenizer";
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
#endif
