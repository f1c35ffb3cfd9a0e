// fuzz_safetensors.c: a libFuzzer harness for the safetensors checks in common/model/checkpoint.c.
// Each input is a whole file. Whatever the bytes, safetensors_parse_bytes must either refuse
// them with a message or accept them, and then every tensor it accepted must lie inside the
// input: we read each one (converting the float types), and AddressSanitizer stops us at the
// first byte outside. Not part of `make test`; run it by hand:
//
//   clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
//       -Icommon tests/fuzz/fuzz_safetensors.c common/model/checkpoint.c common/base/log.c \
//       -lcjson -lm -o build/fuzz_safetensors
//   mkdir -p build/fuzz_corpus && cp ../shared/fixtures/lm-buddy-tiny_gpt2/model.safetensors build/fuzz_corpus/
//   build/fuzz_safetensors -max_total_time=300 -dict=tests/fuzz/safetensors.dict build/fuzz_corpus
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/checkpoint.h"

// checkpoint.c's one call into layout.c (reading config.json) is never reached from here; this
// stand-in saves linking the model and its ops into the fuzzer.
int gpt_padded_vocab(int vocab_size) { return (vocab_size + 127) / 128 * 128; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint8_t sink;  // reads of non-float tensors go here, so they are not optimised away

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    SafeTensors st;
    char err[512];
    if (safetensors_parse_bytes(&st, data, size, err, sizeof err) != 0) {
        if (err[0] == '\0') abort();  // a refusal must say why
        return 0;
    }
    for (int i = 0; i < st.num_tensors; i++) {
        const SafeTensor *t = &st.tensors[i];
        if (t->end - t->begin != t->numel * (uint64_t)t->dtype_bytes) abort();
        if (st.data_start + t->end > size) abort();  // the promise the checks make
        if (safetensors_find(&st, t->name) != t) abort();  // names are unique
        const uint8_t *raw = data + st.data_start + t->begin;
        float *out = malloc(t->numel ? (size_t)t->numel * sizeof(float) : 1);
        if (safetensors_to_float(out, raw, t->dtype, (size_t)t->numel) != 0) {
            for (uint64_t j = 0; j < t->end - t->begin; j++) sink ^= raw[j];  // touch its bytes anyway
        }
        free(out);
        char shape[256];
        safetensors_shape_str(shape, sizeof shape, t->ndim, t->shape);
    }
    (void)safetensors_metadata(&st, "format");
    safetensors_close(&st);
    return 0;
}
