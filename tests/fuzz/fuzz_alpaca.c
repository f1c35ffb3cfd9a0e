// fuzz_alpaca: any bytes as an alpaca JSON file. Either a clean fatal() (caught here) or records
// whose prompt + output tokenise into a well-formed training sequence. Run with -detect_leaks=0:
// a fatal() leaves the parse tree behind, as exit() would.
#include <stdlib.h>
#include <string.h>

#include "data/alpaca.h"
#include "data/tokenizer.h"
#include "fuzz_common.h"

static void check_record(const AlpacaRecord *r, const Tokenizer *t, int max_seq_len, int quirk) {
    AlpacaTokens seq;
    alpaca_tokenize(r, t, max_seq_len, quirk, &seq);
    if (seq.len < 1 || seq.len > max_seq_len || seq.prompt_len < 0 || seq.prompt_len > seq.len) abort();
    int fits = seq.text_len < max_seq_len;
    if (fits != (seq.len == seq.text_len + 1) || (fits && seq.ids[seq.len - 1] != tokenizer_eot(t))) abort();
    if (fits) {  // the sequence without the end-of-text decodes to prompt + output
        char *prompt = alpaca_format_prompt(r, quirk), *text = tokenizer_decode(t, seq.ids, seq.len - 1);
        size_t pl = strlen(prompt);
        if (strncmp(text, prompt, pl) != 0 || strcmp(text + pl, r->output) != 0) abort();
        free(prompt);
        free(text);
    }
    free(seq.ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static Tokenizer *gpt2, *bytes;
    if (!gpt2) {
        if (setjmp(fuzz_on_fatal)) abort();
        gpt2 = tokenizer_load(fuzz_tokenizer_dir());
        bytes = tokenizer_load("");
    }
    if (setjmp(fuzz_on_fatal)) return 0;  // a clean error for a bad file: fine
    int n;
    AlpacaRecord *records = alpaca_parse((const char *)data, size, "fuzz.json", &n);
    if (setjmp(fuzz_on_fatal)) abort();  // once parsed, tokenising must not fail
    for (int i = 0; i < n && i < 64; i++) {
        check_record(&records[i], gpt2, 64, i & 1);
        check_record(&records[i], bytes, 300, 0);
    }
    alpaca_free_records(records, n);
    return 0;
}
