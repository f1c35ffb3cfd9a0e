// test_tokenizer: the byte tokenizer and GPT-2 BPE against ids made by an independent encoder
// (npm gpt-3-encoder), both file layouts, round trips of real data, UTF-8 edge cases, speed.
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "check.h"
#include "data/alpaca.h"
#include "data/tokenizer.h"

#define FIXTURES "../shared/fixtures/"
#define OPENAI_DIR FIXTURES "gpt2-tokenizer"       // encoder.json + vocab.bpe
#define HF_DIR FIXTURES "lm-buddy-fake_gpt2"       // vocab.json + merges.txt
#define TINY_DIR FIXTURES "lm-buddy-tiny_gpt2"     // a 21-token toy vocabulary

static const char *kAlpacaFiles[] = {
    FIXTURES "alpaca/rasbt-LLMs-from-scratch_instruction-data.json",
    FIXTURES "alpaca/rasbt-LLMs-from-scratch_instruction-examples.json",
    FIXTURES "alpaca/stanford-alpaca-first200_from_Niveditha-12-FineTuning.json",
    FIXTURES "alpaca/LLaMA-Factory_alpaca_en_demo.json",
};

// encode, decode, and say whether the text came back byte for byte
static int round_trips(const Tokenizer *t, const char *text, size_t len) {
    int *ids;
    int n = tokenizer_encode(t, text, len, &ids);
    char *back = tokenizer_decode(t, ids, n);
    int same = strlen(back) == len && memcmp(back, text, len) == 0;
    // text with NUL bytes: strlen stops early, so compare the token bytes one by one instead
    if (memchr(text, 0, len)) {
        size_t at = 0;
        same = 1;
        for (int i = 0; i < n && same; i++) {
            int tlen;
            const char *bytes = tokenizer_token_bytes(t, ids[i], &tlen);
            same = at + (size_t)tlen <= len && memcmp(bytes, text + at, (size_t)tlen) == 0;
            at += (size_t)tlen;
        }
        same = same && at == len;
    }
    free(back);
    free(ids);
    return same;
}

static int same_ids(const int *a, int na, const int *b, int nb) {
    return na == nb && memcmp(a, b, (size_t)na * sizeof(int)) == 0;
}

static void test_byte_tokenizer(void) {
    Tokenizer *t = tokenizer_load("");
    CHECK(tokenizer_vocab_size(t) == 257, "vocab %d", tokenizer_vocab_size(t));
    CHECK(tokenizer_eot(t) == 256, "eot %d", tokenizer_eot(t));
    CHECK(!tokenizer_is_bpe(t), "byte tokenizer says it is BPE");
    const char *text = "h\xC3\xA9!";  // "hé!"
    int *ids;
    int n = tokenizer_encode(t, text, strlen(text), &ids);
    int want[] = {'h', 0xC3, 0xA9, '!'};
    CHECK(same_ids(ids, n, want, 4), "byte ids of \"hé!\" (n=%d)", n);
    free(ids);
    int eot = 256;
    char *s = tokenizer_decode(t, &eot, 1);
    CHECK(strcmp(s, "<|endoftext|>") == 0, "eot decodes to \"%s\"", s);
    free(s);
    Tokenizer *from_null = tokenizer_load(NULL);
    CHECK(tokenizer_vocab_size(from_null) == 257, "NULL path gives vocab %d", tokenizer_vocab_size(from_null));
    tokenizer_free(from_null);
    tokenizer_free(t);
}

// The 14 reference cases: same ids from both layouts, and decode gives the text back.
static void test_reference_cases(const Tokenizer *openai, const Tokenizer *hf) {
    char *json = read_file_or_die(FIXTURES "reference/gpt2_bpe_cases.json", NULL);
    cJSON *root = cJSON_Parse(json);
    cJSON *cases = cJSON_GetObjectItem(root, "cases");
    CHECK(cJSON_GetArraySize(cases) == 14, "%d cases", cJSON_GetArraySize(cases));
    int index = 0;
    for (cJSON *c = cases ? cases->child : NULL; c; c = c->next, index++) {
        const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
        cJSON *want_json = cJSON_GetObjectItem(c, "ids");
        int n_want = cJSON_GetArraySize(want_json), *want = malloc(sizeof(int) * (size_t)n_want);
        for (int i = 0; i < n_want; i++) want[i] = cJSON_GetArrayItem(want_json, i)->valueint;

        const Tokenizer *layouts[2] = {openai, hf};
        for (int l = 0; l < 2; l++) {
            int *ids;
            int n = tokenizer_encode(layouts[l], text, strlen(text), &ids);
            CHECK(same_ids(ids, n, want, n_want), "case %d (%s layout): %d ids, want %d: \"%.40s\"",
                  index, l ? "HF" : "OpenAI", n, n_want, text);
            char *back = tokenizer_decode(layouts[l], want, n_want);
            CHECK(strcmp(back, text) == 0, "case %d decodes to \"%.40s\"", index, back);
            free(back);
            free(ids);
        }
        free(want);
    }
    cJSON_Delete(root);
    free(json);
}

static void test_bpe_basics(const Tokenizer *t) {
    CHECK(tokenizer_vocab_size(t) == 50257, "vocab %d", tokenizer_vocab_size(t));
    CHECK(tokenizer_eot(t) == 50256, "eot %d", tokenizer_eot(t));
    int *ids;
    int n = tokenizer_encode(t, "Hello world", 11, &ids);
    CHECK(n == 2 && ids[0] == 15496 && ids[1] == 995, "Hello world -> %d ids", n);
    free(ids);
    int len;
    const char *bytes = tokenizer_token_bytes(t, 995, &len);
    CHECK(len == 6 && memcmp(bytes, " world", 6) == 0, "token 995 is \"%.*s\"", len, bytes);
    // 🚀 = F0 9F 9A 80 is several tokens, the first holding part of the character: streaming
    // decode must print bytes, not characters
    n = tokenizer_encode(t, "\xF0\x9F\x9A\x80", 4, &ids);
    CHECK(n >= 2, "rocket -> %d tokens", n);
    int first_len;
    tokenizer_token_bytes(t, ids[0], &first_len);
    CHECK(first_len > 0 && first_len < 4, "first rocket token has %d bytes", first_len);
    free(ids);
    CHECK(tokenizer_encode(t, "", 0, &ids) == 0, "empty text gives ids");
    free(ids);
    // pre-tokeniser corners: contractions, runs of spaces before a word, trailing spaces, digits
    const char *corners[] = {"don't we'll they're I'M 'sa", "a   b", "x  ", "\t\tfoo", "12345 678",
                             "\xC2\xA0\xC2\xA0word", "\xE3\x80\x80x", "\xEF\xBB\xBFhi", "a\r\n\r\nb"};
    for (size_t k = 0; k < sizeof corners / sizeof corners[0]; k++)
        CHECK(round_trips(t, corners[k], strlen(corners[k])), "round trip of \"%s\"", corners[k]);
    int *a, *b;
    int na = tokenizer_encode(t, "a   b", 5, &a);
    int want[] = {64, 220, 220, 275};  // "a", " ", " ", " b"  (GPT-2: \s+(?!\S) leaves one space)
    CHECK(same_ids(a, na, want, 4), "\"a   b\" -> %d ids", na);
    int nb = tokenizer_encode(t, "don't", 5, &b);
    int want2[] = {9099, 470};  // "don", "'t"
    CHECK(same_ids(b, nb, want2, 2), "\"don't\" -> %d ids (%d %d)", nb, b[0], nb > 1 ? b[1] : -1);
    free(a);
    free(b);
}

// Invalid UTF-8 and random bytes still encode and decode back byte for byte.
static void test_any_bytes_round_trip(const Tokenizer *t) {
    const char *bad[] = {"\xC0\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80", "abc\xE2\x82", "\xFF\xFE x",
                         "\x80\x80 \x80"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++)
        CHECK(round_trips(t, bad[k], strlen(bad[k])), "round trip of invalid UTF-8 #%zu", k);
    uint64_t state = 12345;
    char buf[512];
    int ok = 1;
    for (int trial = 0; trial < 200; trial++) {
        for (size_t i = 0; i < sizeof buf; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            buf[i] = (char)(state >> 56);
        }
        ok &= round_trips(t, buf, sizeof buf);
    }
    CHECK(ok, "random bytes round trip");
}

static void test_utf8_validation(void) {
    size_t bad = 99;
    const char *good = "h\xC3\xA9 \xF0\x9F\x9A\x80 \xE6\x9D\xB1";  // hé 🚀 東
    CHECK(utf8_is_valid(good, strlen(good), &bad), "valid text rejected");
    CHECK(!utf8_is_valid("ab\xC0\x80", 4, &bad) && bad == 2, "overlong NUL (bad=%zu)", bad);
    CHECK(!utf8_is_valid("\xED\xA0\x80", 3, &bad) && bad == 0, "surrogate");
    CHECK(!utf8_is_valid("\xF4\x90\x80\x80", 4, &bad), "above U+10FFFF");
    CHECK(!utf8_is_valid("x\xE2\x82", 3, &bad) && bad == 1, "cut-off character");
    CHECK(!utf8_is_valid("\x80", 1, &bad), "lone continuation byte");
    CHECK(utf8_is_valid("", 0, &bad), "empty text");
}

// Every record of the four alpaca fixtures: both layouts give the same ids, decode gives it back.
static void test_alpaca_round_trips(const Tokenizer *openai, const Tokenizer *hf) {
    for (int f = 0; f < 4; f++) {
        int n;
        AlpacaRecord *records = alpaca_read_file(kAlpacaFiles[f], &n);
        int bad_trip = 0, bad_layout = 0;
        for (int i = 0; i < n; i++) {
            char *prompt = alpaca_format_prompt(&records[i], 0);
            const char *texts[] = {prompt, records[i].output, records[i].instruction, records[i].input};
            for (int k = 0; k < 4; k++) {
                size_t len = strlen(texts[k]);
                bad_trip += !round_trips(openai, texts[k], len);
                int *a, *b;
                int na = tokenizer_encode(openai, texts[k], len, &a);
                int nb = tokenizer_encode(hf, texts[k], len, &b);
                bad_layout += !same_ids(a, na, b, nb);
                free(a);
                free(b);
            }
            free(prompt);
        }
        CHECK(bad_trip == 0, "%s: %d texts do not round-trip", kAlpacaFiles[f], bad_trip);
        CHECK(bad_layout == 0, "%s: %d texts differ between layouts", kAlpacaFiles[f], bad_layout);
        alpaca_free_records(records, n);
    }
}

// The toy 21-token tokenizer: a vocabulary without all 256 bytes still loads and merges.
static void test_tiny_vocab(void) {
    Tokenizer *t = tokenizer_load(TINY_DIR);
    CHECK(tokenizer_vocab_size(t) == 21, "tiny vocab %d", tokenizer_vocab_size(t));
    CHECK(tokenizer_eot(t) == 20, "tiny eot %d", tokenizer_eot(t));
    int *ids;
    int n = tokenizer_encode(t, "lower lowest", 12, &ids);
    // merges: "Ġ l", "Ġl o", "Ġlo w", "e r". "Ġlowest" is in the vocabulary but no merge makes
    // it, so BPE stops at " low" + e s t
    int want[] = {0, 1, 2, 15, 14, 3, 5, 6};  // l o w er | " low" e s t
    CHECK(same_ids(ids, n, want, 8), "tiny: \"lower lowest\" -> %d ids", n);
    free(ids);
    tokenizer_free(t);
}

// ~1 MB of real English (the LLaMA-Factory answers, repeated), plus two worst cases for BPE: one
// 1 MB "word" and 1 MB of spaces. The timings are printed; the bound is generous on purpose.
static void test_speed(const Tokenizer *t) {
    int n;
    AlpacaRecord *records = alpaca_read_file(kAlpacaFiles[3], &n);
    size_t cap = 1 << 20, len = 0;
    char *text = malloc(cap + 1);
    for (int i = 0; len < cap; i = (i + 1) % n) {
        size_t l = strlen(records[i].output);
        if (len + l + 1 > cap) l = cap - len - 1;
        memcpy(text + len, records[i].output, l);
        len += l;
        text[len++] = '\n';
    }
    alpaca_free_records(records, n);

    int *ids;
    double t0 = wall_seconds();
    int count = tokenizer_encode(t, text, len, &ids);
    double seconds = wall_seconds() - t0;
    printf("encode speed: %.2f MB of English -> %d tokens in %.3f s (%.1f MB/s)\n", len / 1e6, count,
           seconds, len / 1e6 / seconds);
    CHECK(seconds < 5.0, "encoding 1 MB took %.2f s", seconds);
    CHECK(round_trips(t, text, len), "1 MB text round trip");
    free(ids);

    const char fill[2] = {'a', ' '};
    for (int k = 0; k < 2; k++) {
        memset(text, fill[k], len);
        t0 = wall_seconds();
        count = tokenizer_encode(t, text, len, &ids);
        seconds = wall_seconds() - t0;
        printf("encode speed: 1 MB of '%c' -> %d tokens in %.3f s\n", fill[k], count, seconds);
        CHECK(seconds < 5.0, "1 MB of '%c' took %.2f s", fill[k], seconds);
        char *back = tokenizer_decode(t, ids, count);
        CHECK(strlen(back) == len && memcmp(back, text, len) == 0, "1 MB of '%c' round trip", fill[k]);
        free(back);
        free(ids);
    }
    free(text);
}

int main(void) {
    test_byte_tokenizer();
    test_utf8_validation();
    double t0 = wall_seconds();
    Tokenizer *openai = tokenizer_load(OPENAI_DIR);
    Tokenizer *hf = tokenizer_load(HF_DIR);
    printf("loading both GPT-2 tokenizers took %.3f s\n", wall_seconds() - t0);
    test_bpe_basics(openai);
    test_bpe_basics(hf);
    test_reference_cases(openai, hf);
    test_any_bytes_round_trip(openai);
    test_alpaca_round_trips(openai, hf);
    test_tiny_vocab();
    test_speed(openai);
    tokenizer_free(openai);
    tokenizer_free(hf);
    return test_summary("test_tokenizer");
}
