// tokenizer_ids: our tokenizer's side of tests/oracle_tokenizer.py.
//
//   build/tests/tokenizer_ids DIR IN.json OUT.json
//
// IN.json is {"texts": ["...", ...], "ids": [[...], ...]} (the ids another tokenizer gave the
// texts). OUT.json gets {"vocab_size": n, "eot": id, "ids": [[our ids of each text], ...],
// "decoded": ["hex of our decode of the other tokenizer's ids", ...], "roundtrip": [true if
// decoding our ids gives back the text's bytes, ...]}. Decodes are written as hex: they need not
// be UTF-8.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "base/log.h"
#include "data/tokenizer.h"

static char *hex(const char *s, size_t n) {
    char *out = malloc_or_die(2 * n + 1);
    for (size_t i = 0; i < n; i++) snprintf(out + 2 * i, 3, "%02x", (unsigned char)s[i]);
    out[2 * n] = '\0';
    return out;
}

int main(int argc, char **argv) {
    if (argc != 4) fatal("usage: %s TOKENIZER_DIR IN.json OUT.json", argv[0]);
    Tokenizer *t = tokenizer_load(argv[1]);
    size_t len;
    char *text = read_file_or_die(argv[2], &len);
    cJSON *in = cJSON_ParseWithLength(text, len);
    const cJSON *texts = cJSON_GetObjectItemCaseSensitive(in, "texts");
    const cJSON *their_ids = cJSON_GetObjectItemCaseSensitive(in, "ids");
    if (!cJSON_IsArray(texts) || !cJSON_IsArray(their_ids)) fatal("%s: expected {\"texts\": [...], \"ids\": [...]}", argv[2]);

    cJSON *out = cJSON_CreateObject(), *ids = cJSON_AddArrayToObject(out, "ids");
    cJSON *decoded = cJSON_AddArrayToObject(out, "decoded"), *roundtrip = cJSON_AddArrayToObject(out, "roundtrip");
    cJSON_AddNumberToObject(out, "vocab_size", tokenizer_vocab_size(t));
    cJSON_AddNumberToObject(out, "eot", tokenizer_eot(t));
    const cJSON *s, *theirs = their_ids->child;
    cJSON_ArrayForEach(s, texts) {
        const char *str = cJSON_GetStringValue(s);
        int *ours, n = tokenizer_encode(t, str, strlen(str), &ours);
        cJSON_AddItemToArray(ids, cJSON_CreateIntArray(ours, n));
        char *back = tokenizer_decode(t, ours, n);
        cJSON_AddItemToArray(roundtrip, cJSON_CreateBool(strcmp(back, str) == 0));
        free(back);
        free(ours);

        int m = cJSON_GetArraySize(theirs), *other = malloc_or_die(((size_t)m + 1) * sizeof(int)), k = 0;
        const cJSON *id;
        cJSON_ArrayForEach(id, theirs) other[k++] = id->valueint;
        char *dec = tokenizer_decode(t, other, m), *h = hex(dec, strlen(dec));
        cJSON_AddItemToArray(decoded, cJSON_CreateString(h));
        free(h);
        free(dec);
        free(other);
        theirs = theirs ? theirs->next : NULL;
    }
    char *json = cJSON_PrintUnformatted(out);
    FILE *f = fopen(argv[3], "w");
    if (!f || fputs(json, f) < 0 || fclose(f) != 0) fatal("cannot write %s", argv[3]);
    free(json);
    cJSON_Delete(out);
    cJSON_Delete(in);
    free(text);
    tokenizer_free(t);
    return 0;
}
