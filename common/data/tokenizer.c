// tokenizer.c: the byte tokenizer, GPT-2's byte-level BPE and Hugging Face's tokenizer.json (see tokenizer.h).
//
// How GPT-2 turns text into ids, in the order this file does it:
//   1. Pre-tokenise: cut the text into chunks with GPT-2's regular expression
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (contractions, words with their leading space, numbers, runs of punctuation, whitespace).
//      BPE never merges across two chunks. The regex is written out by hand below
//      (next_pretoken), with Unicode letter/number tables at the end of this file.
//   2. Start each chunk as its bytes, one token per byte (GPT-2's vocabulary has all 256).
//   3. Repeatedly merge the adjacent pair of tokens that comes first in the merges file
//      (vocab.bpe / merges.txt: line k holds the pair of rank k) until no pair can merge.
// Decoding is the reverse of step 2 only: concatenate the bytes of each token.
//
// The vocabulary files write each token's bytes as printable Unicode characters (GPT-2's
// "bytes_to_unicode": the space byte 0x20 is written "Ġ", newline "Ċ", ...). We turn them back
// into raw bytes while loading, so everything after loading works on plain bytes.
#define _POSIX_C_SOURCE 200809L
#include "tokenizer.h"

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"

// ---------------------------------------------------------------------------------------------
// UTF-8 and Unicode character classes
// ---------------------------------------------------------------------------------------------

// Decode one UTF-8 character starting at s[i] (i < n). Returns its length in bytes and sets *cp.
// A byte that does not start a valid, shortest-form character is returned as a 1-byte
// "character" with *cp = -1: the pre-tokeniser treats it as punctuation, so even invalid text
// still encodes (and decodes back byte for byte).
static int utf8_decode(const unsigned char *s, size_t n, size_t i, int32_t *cp) {
    unsigned b = s[i];
    int len;
    int32_t c, min;
    if (b < 0x80) { *cp = (int32_t)b; return 1; }
    else if ((b & 0xE0) == 0xC0) { len = 2; c = b & 0x1F; min = 0x80; }
    else if ((b & 0xF0) == 0xE0) { len = 3; c = b & 0x0F; min = 0x800; }
    else if ((b & 0xF8) == 0xF0) { len = 4; c = b & 0x07; min = 0x10000; }
    else { *cp = -1; return 1; }  // a continuation byte or 0xF8..0xFF cannot start a character
    if (i + (size_t)len > n) { *cp = -1; return 1; }  // cut off by the end of the text
    for (int k = 1; k < len; k++) {
        unsigned cont = s[i + (size_t)k];
        if ((cont & 0xC0) != 0x80) { *cp = -1; return 1; }
        c = (c << 6) | (int32_t)(cont & 0x3F);
    }
    // overlong forms, UTF-16 surrogates and values past U+10FFFF are not valid UTF-8
    if (c < min || (c >= 0xD800 && c <= 0xDFFF) || c > 0x10FFFF) { *cp = -1; return 1; }
    *cp = c;
    return len;
}

int utf8_is_valid(const char *s, size_t n, size_t *bad_offset) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        int len = utf8_decode(u, n, i, &cp);
        if (cp < 0) {
            if (bad_offset) *bad_offset = i;
            return 0;
        }
        i += (size_t)len;
    }
    return 1;
}

typedef struct { int32_t lo, hi; } CodeRange;  // an inclusive range of code points
// \p{L} and \p{N}, defined (generated) at the end of this file
static const CodeRange kLetterRanges[684];
static const CodeRange kNumberRanges[146];

static int in_ranges(int32_t cp, const CodeRange *r, int count) {
    int lo = 0, hi = count - 1;  // binary search: the ranges are sorted and disjoint
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < r[mid].lo) hi = mid - 1;
        else if (cp > r[mid].hi) lo = mid + 1;
        else return 1;
    }
    return 0;
}

// \s of the Unicode regex GPT-2 used (the White_Space property)
static int is_unicode_space(int32_t cp) {
    return (cp >= 9 && cp <= 13) || cp == 32 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
           cp == 0x205F || cp == 0x3000;
}

typedef enum { CHAR_LETTER, CHAR_NUMBER, CHAR_SPACE, CHAR_OTHER } CharClass;

static CharClass char_class(int32_t cp) {
    if (cp < 0) return CHAR_OTHER;  // an invalid byte
    if (cp < 128) {                 // ASCII fast path: most text never reaches the tables
        if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CHAR_LETTER;
        if (cp >= '0' && cp <= '9') return CHAR_NUMBER;
        return is_unicode_space(cp) ? CHAR_SPACE : CHAR_OTHER;
    }
    if (is_unicode_space(cp)) return CHAR_SPACE;
    if (in_ranges(cp, kLetterRanges, (int)(sizeof kLetterRanges / sizeof kLetterRanges[0])))
        return CHAR_LETTER;
    if (in_ranges(cp, kNumberRanges, (int)(sizeof kNumberRanges / sizeof kNumberRanges[0])))
        return CHAR_NUMBER;
    return CHAR_OTHER;
}

// class and byte length of the character at s[i]
static CharClass class_at(const unsigned char *s, size_t n, size_t i, int *len) {
    int32_t cp;
    *len = utf8_decode(s, n, i, &cp);
    return char_class(cp);
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenisation: GPT-2's regex, one alternative at a time, in the regex's order
// ---------------------------------------------------------------------------------------------

// 's 't 're 've 'm 'll 'd (lower case only, as in GPT-2): length of the match at s[i], or 0
static size_t contraction_length(const unsigned char *s, size_t n, size_t i) {
    if (s[i] != '\'' || i + 1 >= n) return 0;
    unsigned char a = s[i + 1], b = i + 2 < n ? s[i + 2] : 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

// end of the run of characters of class cls that starts at s[i]
static size_t end_of_run(const unsigned char *s, size_t n, size_t i, CharClass cls) {
    while (i < n) {
        int len;
        if (class_at(s, n, i, &len) != cls) break;
        i += (size_t)len;
    }
    return i;
}

// `\s+(?!\S)|\s+` at s[i]: a run of whitespace, but when a non-space follows the run, its last
// whitespace character is left over (it becomes the leading space of the next word: "a  b" ->
// "a", " ", " b"). A single whitespace character before a non-space is taken as it is.
static size_t end_of_whitespace(const unsigned char *s, size_t n, size_t i) {
    size_t last_start = i, j = i;
    int count = 0;
    while (j < n) {
        int len;
        if (class_at(s, n, j, &len) != CHAR_SPACE) break;
        last_start = j;
        j += (size_t)len;
        count++;
    }
    if (j == n || count == 1) return j;
    return last_start;
}

// The end of the pre-token that starts at s[i] (i < n).
static size_t next_pretoken(const unsigned char *s, size_t n, size_t i) {
    size_t k = contraction_length(s, n, i);
    if (k) return i + k;
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional single space, then a run of one class
    size_t start = (s[i] == ' ' && i + 1 < n) ? i + 1 : i;
    int len;
    CharClass cls = class_at(s, n, start, &len);
    if (cls != CHAR_SPACE) return end_of_run(s, n, start, cls);
    return end_of_whitespace(s, n, i);
}

// ---------------------------------------------------------------------------------------------
// Two small hash tables (open addressing, linear probing)
// ---------------------------------------------------------------------------------------------

// (left id, right id) -> the merge's rank and the id of the merged token
typedef struct { uint64_t key; int rank, merged; } MergeSlot;  // rank -1 = empty slot
typedef struct { MergeSlot *slots; size_t mask; } MergeTable;

static uint64_t pair_key(int left, int right) { return ((uint64_t)(uint32_t)left << 32) | (uint32_t)right; }
static size_t hash_u64(uint64_t x) { return (size_t)((x * 0x9E3779B97F4A7C15ull) >> 17); }

static void merge_table_init(MergeTable *m, size_t expected) {
    size_t cap = 16;
    while (cap < 2 * expected) cap *= 2;  // at most half full: probes stay short
    m->slots = malloc_or_die(cap * sizeof *m->slots);
    for (size_t i = 0; i < cap; i++) m->slots[i].rank = -1;
    m->mask = cap - 1;
}

// the slot holding (left, right), or the empty slot where it would go
static MergeSlot *merge_table_slot(const MergeTable *m, int left, int right) {
    uint64_t key = pair_key(left, right);
    size_t i = hash_u64(key) & m->mask;
    while (m->slots[i].rank >= 0 && m->slots[i].key != key) i = (i + 1) & m->mask;
    return &m->slots[i];
}

// token bytes -> id; used while loading only (to find the ids of the merges' tokens)
typedef struct { const char *bytes; int len, id; } VocabSlot;  // bytes NULL = empty slot
typedef struct { VocabSlot *slots; size_t mask; } VocabTable;

static VocabSlot *vocab_table_slot(const VocabTable *v, const char *s, int len) {
    size_t i = (size_t)hash_bytes(s, (size_t)len) & v->mask;
    while (v->slots[i].bytes &&
           !(v->slots[i].len == len && memcmp(v->slots[i].bytes, s, (size_t)len) == 0))
        i = (i + 1) & v->mask;
    return &v->slots[i];
}

static int vocab_table_find(const VocabTable *v, const char *s, int len) {
    VocabSlot *slot = vocab_table_slot(v, s, len);
    return slot->bytes ? slot->id : -1;
}

// ---------------------------------------------------------------------------------------------
// The tokenizer
// ---------------------------------------------------------------------------------------------

typedef struct HfPipeline HfPipeline;

struct Tokenizer {
    int is_bpe;
    char *name;          // "byte" or the directory
    int vocab_size, eot;
    char *token_bytes;   // every token's bytes back to back
    int *token_offset;   // token id's bytes are token_bytes[token_offset[id] .. token_offset[id+1])
    int byte_token[256]; // id of the one-byte token for each byte (-1: the vocabulary has none)
    MergeTable merges;   // BPE only
    int *added_ids;      // the added tokens (CodeGen's runs of spaces and tabs, Llama's special
    int added_count;     // tokens), matched in the text before BPE
    unsigned char starts_added[256];  // 1: some added token starts with this byte
    HfPipeline *hf;      // read from tokenizer.json (see there); NULL for GPT-2's files
};

static const char kEndOfText[] = "<|endoftext|>";

static Tokenizer *byte_tokenizer(void) {
    Tokenizer *t = calloc_or_die(1, sizeof *t);
    t->name = copy_string_or_die("byte");
    t->vocab_size = 257;
    t->eot = 256;
    int eot_len = (int)strlen(kEndOfText);
    t->token_bytes = malloc_or_die(256 + (size_t)eot_len);
    t->token_offset = malloc_or_die(258 * sizeof(int));
    for (int b = 0; b < 256; b++) {
        t->token_bytes[b] = (char)b;
        t->token_offset[b] = b;
        t->byte_token[b] = b;
    }
    memcpy(t->token_bytes + 256, kEndOfText, (size_t)eot_len);  // decode shows EOT as text
    t->token_offset[256] = 256;
    t->token_offset[257] = 256 + eot_len;
    return t;
}

// ---- GPT-2's printable stand-ins for bytes (bytes_to_unicode in OpenAI's encoder.py) ----------

// Bytes that are printable (! .. ~, ¡ .. ¬, ® .. ÿ) stand for themselves; the other 68 bytes are
// written as U+0100, U+0101, ... in byte order. unicode_to_byte(cp) undoes that (-1: not a byte).
static int byte_is_printable(int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static int unicode_to_byte(int32_t cp) {
    if (cp >= 0 && cp < 256) return byte_is_printable(cp) ? cp : -1;
    int k = cp - 256;  // the k-th non-printable byte
    for (int b = 0; b < 256; b++)
        if (!byte_is_printable(b) && k-- == 0) return b;
    return -1;
}

// Turn a vocabulary string into raw bytes, appended at out (room for strlen(s) bytes: each
// stand-in character is at least one byte). Returns the byte count, or -1 for a character that
// stands for no byte.
static int stand_ins_to_bytes(const char *s, char *out) {
    const unsigned char *u = (const unsigned char *)s;
    size_t n = strlen(s);
    int count = 0;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        i += (size_t)utf8_decode(u, n, i, &cp);
        int b = unicode_to_byte(cp);
        if (b < 0) return -1;
        out[count++] = (char)b;
    }
    return count;
}

// ---- loading the vocabulary (encoder.json / vocab.json: {"token": id, ...}) ------------------

static cJSON *parse_json_file_or_die(const char *path) {
    size_t len;
    char *text = read_file_or_die(path, &len);
    cJSON *json = cJSON_ParseWithLength(text, len);
    if (!json) {
        const char *at = cJSON_GetErrorPtr();
        fatal("%s: not valid JSON (near byte %ld)", path, at ? (long)(at - text) : -1L);
    }
    free(text);
    return json;
}

// Fills t's tokens from {"token": id, ...} (ids exactly 0..n-1) and table (bytes -> id). stand_ins:
// the tokens are written with GPT-2's byte stand-ins (turned into raw bytes); else kept as they are.
static void vocab_from_json(Tokenizer *t, const cJSON *json, const char *path, VocabTable *table,
                            int stand_ins) {
    if (!cJSON_IsObject(json)) fatal("%s: expected a JSON object {\"token\": id, ...}", path);
    int n = cJSON_GetArraySize(json);
    if (n < 1) fatal("%s: the vocabulary is empty", path);

    // ids must be exactly 0..n-1: first find where each id's string is
    const char **string_of_id = calloc_or_die((size_t)n, sizeof *string_of_id);
    size_t total = 0;
    for (cJSON *item = json->child; item; item = item->next) {
        double v = cJSON_IsNumber(item) ? item->valuedouble : -1;
        if (v < 0 || v >= n || v != (int)v)
            fatal("%s: token \"%s\" has id %s; expected an integer id 0..%d", path, item->string,
                  cJSON_IsNumber(item) ? "out of range" : "that is not a number", n - 1);
        if (string_of_id[(int)v]) fatal("%s: id %d is given to two tokens", path, (int)v);
        string_of_id[(int)v] = item->string;
        total += strlen(item->string);
    }

    t->vocab_size = n;
    t->token_bytes = malloc_or_die(total);
    t->token_offset = malloc_or_die(((size_t)n + 1) * sizeof(int));
    size_t cap = 16;
    while (cap < 2 * (size_t)n) cap *= 2;
    table->slots = calloc_or_die(cap, sizeof *table->slots);
    table->mask = cap - 1;
    int offset = 0;
    for (int id = 0; id < n; id++) {
        char *out = t->token_bytes + offset;
        int len = stand_ins ? stand_ins_to_bytes(string_of_id[id], out) : (int)strlen(string_of_id[id]);
        if (!stand_ins) memcpy(out, string_of_id[id], (size_t)len);
        if (len < 0) fatal("%s: token \"%s\" (id %d) has a character that stands for no byte", path,
                           string_of_id[id], id);
        t->token_offset[id] = offset;
        offset += len;
        VocabSlot *slot = vocab_table_slot(table, out, len);
        if (slot->bytes) fatal("%s: token \"%s\" (id %d) appears twice", path, string_of_id[id], id);
        *slot = (VocabSlot){out, len, id};
    }
    t->token_offset[n] = offset;
    free(string_of_id);

    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->byte_token[b] = vocab_table_find(table, &c, 1);
    }
    t->eot = vocab_table_find(table, kEndOfText, (int)strlen(kEndOfText));
}

static void load_vocab(Tokenizer *t, const char *path, VocabTable *table) {
    cJSON *json = parse_json_file_or_die(path);
    vocab_from_json(t, json, path, table, 1);
    cJSON_Delete(json);
}

// ---- loading the merges (vocab.bpe / merges.txt: "#version" line, then "left right" per line) -

// the id of a merges-file token (written with stand-ins if stand_ins), or a fatal error naming the line
static int merge_part_id(const VocabTable *vocab, const char *part, int stand_ins, const char *path,
                         int line) {
    char *bytes = malloc_or_die(strlen(part) + 1);
    int len = stand_ins ? stand_ins_to_bytes(part, bytes) : (int)strlen(part);
    if (!stand_ins) memcpy(bytes, part, (size_t)len);
    if (len < 0) fatal("%s line %d: \"%s\" has a character that stands for no byte", path, line, part);
    int id = vocab_table_find(vocab, bytes, len);
    free(bytes);
    if (id < 0) fatal("%s line %d: token \"%s\" is not in the vocabulary", path, line, part);
    return id;
}

// Merge of rank `rank`: "left right" (tokens as the file writes them; pieces/offsets/vocab are the
// tokens as the model sees them). The merged token must be in the vocabulary.
static void add_merge(MergeTable *merges, const char *pieces, const int *offsets,
                      const VocabTable *vocab, int stand_ins, const char *left_text,
                      const char *right_text, int rank, const char *path, int line_no) {
    int left = merge_part_id(vocab, left_text, stand_ins, path, line_no);
    int right = merge_part_id(vocab, right_text, stand_ins, path, line_no);
    // the merged token = left's bytes followed by right's bytes
    int llen = offsets[left + 1] - offsets[left], rlen = offsets[right + 1] - offsets[right];
    char *both = malloc_or_die((size_t)(llen + rlen));
    memcpy(both, pieces + offsets[left], (size_t)llen);
    memcpy(both + llen, pieces + offsets[right], (size_t)rlen);
    int merged = vocab_table_find(vocab, both, llen + rlen);
    free(both);
    if (merged < 0)
        fatal("%s line %d: the merge \"%s %s\" makes a token that is not in the vocabulary", path,
              line_no, left_text, right_text);
    MergeSlot *slot = merge_table_slot(merges, left, right);
    if (slot->rank >= 0)
        fatal("%s line %d: the merge \"%s %s\" appears twice", path, line_no, left_text, right_text);
    *slot = (MergeSlot){pair_key(left, right), rank, merged};
}

static void load_merges(Tokenizer *t, const char *path, const VocabTable *vocab) {
    char *text = read_file_or_die(path, NULL);
    int lines = 1;
    for (char *p = text; *p; p++) lines += *p == '\n';
    merge_table_init(&t->merges, (size_t)lines);

    int rank = 0, line_no = 0;
    for (char *line = text, *next; line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        line_no++;
        size_t len = strlen(line);
        if (len && line[len - 1] == '\r') line[--len] = '\0';  // files written on Windows
        if (len == 0 || (line_no == 1 && strncmp(line, "#version", 8) == 0)) continue;

        char *space = strchr(line, ' ');
        if (!space || space == line || !space[1] || strchr(space + 1, ' '))
            fatal("%s line %d: expected two tokens separated by one space, found \"%s\"", path,
                  line_no, line);
        *space = '\0';
        add_merge(&t->merges, t->token_bytes, t->token_offset, vocab, 1, line, space + 1, rank++,
                  path, line_no);
    }
    free(text);
}

static int file_exists(const char *dir, const char *name, char *path, size_t cap) {
    snprintf(path, cap, "%s/%s", dir, name);
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

// GPT-2's files are read where they are, so a directory that also has tokenizer.json (phi-1_5's)
// keeps GPT-2's rule that a literal "<|endoftext|>" in the text is text
static int has_gpt2_files(const char *dir) {
    char path[4096];
    return file_exists(dir, "encoder.json", path, sizeof path) || file_exists(dir, "vocab.bpe", path, sizeof path) ||
           file_exists(dir, "vocab.json", path, sizeof path) || file_exists(dir, "merges.txt", path, sizeof path);
}

// Which layout the directory has: sets the two file paths, or a fatal error saying what is missing.
static void find_tokenizer_files(const char *dir, char *vocab, char *merges, size_t cap) {
    struct stat st;
    if (stat(dir, &st) != 0) fatal("tokenizer_path %s: no such directory", dir);
    if (!S_ISDIR(st.st_mode))
        fatal("tokenizer_path %s is not a directory (expected a directory holding encoder.json + "
              "vocab.bpe or vocab.json + merges.txt)", dir);
    static const char *layouts[2][2] = {{"encoder.json", "vocab.bpe"}, {"vocab.json", "merges.txt"}};
    for (int k = 0; k < 2; k++) {
        int has_vocab = file_exists(dir, layouts[k][0], vocab, cap);
        int has_merges = file_exists(dir, layouts[k][1], merges, cap);
        if (has_vocab && has_merges) return;
        if (has_vocab || has_merges)
            fatal("tokenizer directory %s has %s but not %s/%s", dir,
                  layouts[k][has_vocab ? 0 : 1], dir, layouts[k][has_vocab ? 1 : 0]);
    }
    fatal("tokenizer directory %s has neither encoder.json + vocab.bpe nor vocab.json + merges.txt",
          dir);
}

// ---- added tokens (phi-1_5's CodeGen tokenizer: runs of 2..31 spaces and 2..9 tabs) -------------

// from now on, encode finds the token with this id wherever its text occurs
static void match_added_token(Tokenizer *t, int id, const char *text) {
    t->added_ids = realloc(t->added_ids, ((size_t)t->added_count + 1) * sizeof *t->added_ids);
    if (!t->added_ids) fatal("out of host memory");
    t->added_ids[t->added_count++] = id;
    t->starts_added[(unsigned char)text[0]] = 1;
}

// One added token: its raw text (not GPT-2's byte stand-ins) and id. Ids below the vocabulary's
// size must name that token already (tokenizer.json lists <|endoftext|> again); the others must
// follow the vocabulary without a gap, as Hugging Face appends them.
static void add_token(Tokenizer *t, const char *path, const char *text, double id) {
    int len = (int)strlen(text), tlen;
    if (id >= 0 && id < t->vocab_size && id == (int)id) {
        const char *have = tokenizer_token_bytes(t, (int)id, &tlen);
        if (tlen == len && memcmp(have, text, (size_t)len) == 0) return;
        fatal("%s: added token \"%s\" has id %d, which the vocabulary gives to another token", path, text, (int)id);
    }
    if (id != t->vocab_size)
        fatal("%s: added token \"%s\" has id %g; expected %d (added tokens follow the vocabulary, in order)",
              path, text, id, t->vocab_size);
    if (!len) fatal("%s: added token %d is empty", path, (int)id);
    int end = t->token_offset[t->vocab_size];
    t->token_bytes = realloc(t->token_bytes, (size_t)end + (size_t)len);
    t->token_offset = realloc(t->token_offset, ((size_t)t->vocab_size + 2) * sizeof(int));
    if (!t->token_bytes || !t->token_offset) fatal("out of host memory");
    memcpy(t->token_bytes + end, text, (size_t)len);
    t->token_offset[++t->vocab_size] = end + len;
    match_added_token(t, (int)id, text);
}

typedef struct { double id; const char *text; int normalized, strip; } AddedToken;

static int by_id(const void *a, const void *b) {
    double x = ((const AddedToken *)a)->id, y = ((const AddedToken *)b)->id;
    return (x > y) - (x < y);
}

// added_tokens.json {"text": id, ...}, or else tokenizer.json's "added_tokens": [{"id": n,
// "content": "text"}, ...]; either may list them in any order
static void load_added_tokens(Tokenizer *t, const char *dir) {
    char path[4096];
    bool plain = file_exists(dir, "added_tokens.json", path, sizeof path);
    if (!plain && !file_exists(dir, "tokenizer.json", path, sizeof path)) return;
    cJSON *json = parse_json_file_or_die(path);
    const cJSON *list = plain ? json : cJSON_GetObjectItemCaseSensitive(json, "added_tokens");
    int n = 0;
    AddedToken *added = calloc_or_die((size_t)cJSON_GetArraySize(list) + 1, sizeof *added);
    for (const cJSON *e = list ? list->child : NULL; e; e = e->next, n++) {
        const cJSON *id = plain ? e : cJSON_GetObjectItemCaseSensitive(e, "id");
        added[n].text = plain ? e->string : cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "content"));
        if (!cJSON_IsNumber(id) || !added[n].text)
            fatal("%s: expected %s", path, plain ? "{\"token\": id, ...}" : "\"added_tokens\": [{\"id\": n, \"content\": \"text\"}, ...]");
        added[n].id = id->valuedouble;
    }
    qsort(added, (size_t)n, sizeof *added, by_id);
    for (int i = 0; i < n; i++) add_token(t, path, added[i].text, added[i].id);
    free(added);
    cJSON_Delete(json);
}

// ---- Hugging Face's tokenizer.json (the Llama family) -------------------------------------------
//
// tokenizer.json describes a pipeline, and encode runs it in Hugging Face's order:
//   1. cut the text at added tokens (leftmost, then longest): each becomes its id directly;
//   2. normalize each piece in between (Prepend, Replace: Llama-2's "▁" for spaces), and cut it at
//      the added tokens the file marks "normalized" (as the normalizer writes them: "▁<s>");
//   3. pre-tokenize it into words: Metaspace (Llama-2: spaces become "▁", one is prepended, a word
//      starts at each "▁"), Split (Llama-3's or GPT-2's pattern), ByteLevel (a prefix space,
//      GPT-2's pattern, and the word seen as bytes);
//   4. BPE each word: its characters (byte-level: its bytes) are the first symbols; a character
//      missing from the vocabulary becomes its bytes' "<0xNN>" tokens (byte_fallback) or the
//      unknown token; then merge as GPT-2 does (ignore_merges: a word that is a token is that token).
// The model's view of a token (piece) can differ from its text: Llama-2's "▁the" is " the".
// Decoding concatenates each token's text after the decoder's per-token steps (ByteLevel's
// stand-ins to bytes, Replace "▁" -> " ", ByteFallback "<0x0A>" -> "\n", Metaspace), then
// applies the steps that see the whole text: Metaspace drops the first token's "▁", Strip
// removes the space the normalizer prepended. Bytes that are not UTF-8 come back as they are
// (Hugging Face writes U+FFFD), so decode(encode(text)) gives back the text.
// The post-processor (adding <s> or <|begin_of_text|>) is not applied: as for GPT-2, the data
// loader adds the tokens a sequence needs.

enum { MAX_STEPS = 8, STRIP_LEFT = 1, STRIP_RIGHT = 2 };
typedef struct { char *s; size_t len, cap; } Bytes;  // growable bytes, for the texts the pipeline makes
typedef enum { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER } PrependScheme;
typedef enum { NORM_PREPEND, NORM_REPLACE } NormKind;
typedef struct { NormKind kind; char *text, *with; } NormStep;
typedef enum { PRE_METASPACE, PRE_SPLIT_GPT2, PRE_SPLIT_LLAMA3, PRE_BYTE_LEVEL } PreKind;
typedef struct {
    PreKind kind;
    char *replacement;  // Metaspace
    PrependScheme prepend;
    int split, add_prefix_space, use_regex;
} PreStep;
typedef enum { DEC_BYTE_LEVEL, DEC_REPLACE, DEC_BYTE_FALLBACK, DEC_FUSE, DEC_STRIP, DEC_METASPACE } DecKind;
typedef struct {
    DecKind kind;
    char *text, *with;  // Replace text with; Strip's character; Metaspace's replacement
    int start, stop;    // Strip: at most this many at the start / the end
    PrependScheme prepend;
} DecStep;

struct HfPipeline {
    NormStep norm[MAX_STEPS];
    PreStep pre[MAX_STEPS];
    DecStep dec[MAX_STEPS];
    int n_norm, n_pre, n_dec;
    int byte_level;      // the model sees bytes (a ByteLevel pre-tokenizer); else UTF-8 characters
    int byte_fallback, unk, fuse_unk, ignore_merges;  // unk: the unknown token's id, or -1
    char *piece;         // each token as the model sees it (see above), back to back
    int *piece_offset;
    VocabTable pieces;   // piece -> id
    char *source;        // each token as tokenizer.json writes it (the decoder's input)
    int *source_offset;
    // per added token (as t->added_ids): matched in the normalized text (1) or the raw text (0),
    // and the text matched: the token's own, or as the normalizer writes it (Llama-2: "▁<s>")
    unsigned char *added_normalized;
    unsigned char *added_strip;  // STRIP_LEFT | STRIP_RIGHT: the whitespace before / after goes with it
    Bytes *added_match;
    int n_added;
};

static const char *json_type(const cJSON *obj) {
    return cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(obj, "type"));
}

// a string member, or NULL; a member that is there but not a string (nor null) is an error
static char *json_string_or_null(const cJSON *obj, const char *key, const char *path, const char *what) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) return NULL;
    if (!cJSON_IsString(v)) fatal("%s: %s \"%s\": expected a string", path, what, key);
    return copy_string_or_die(v->valuestring);
}

static int json_bool(const cJSON *obj, const char *key, int fallback) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : fallback;
}

// Replace's {"pattern": {"String": "x"}, "content": "y"}; a regular expression is refused
static void replace_pattern(const cJSON *obj, const char *path, const char *what, char **text, char **with) {
    const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(obj, "pattern");
    const char *s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(pattern, "String"));
    if (!s || !*s)
        fatal("%s: %s Replace: expected {\"pattern\": {\"String\": \"...\"}} (a regular expression "
              "is not implemented)", path, what);
    *text = copy_string_or_die(s);
    *with = json_string_or_null(obj, "content", path, what);
    if (!*with) fatal("%s: %s Replace has no \"content\"", path, what);
}

// Metaspace's prepend_scheme, or its older add_prefix_space
static PrependScheme prepend_scheme(const cJSON *obj, const char *path, const char *what) {
    const char *s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(obj, "prepend_scheme"));
    if (!s) return json_bool(obj, "add_prefix_space", 1) ? PREPEND_ALWAYS : PREPEND_NEVER;
    if (!strcmp(s, "always")) return PREPEND_ALWAYS;
    if (!strcmp(s, "first")) return PREPEND_FIRST;
    if (!strcmp(s, "never")) return PREPEND_NEVER;
    fatal("%s: %s Metaspace prepend_scheme \"%s\": expected always, first or never", path, what, s);
}

// the steps of a normalizer, pre-tokenizer or decoder: itself, or the members of its Sequence
static int sequence_members(const cJSON *obj, const char *list_key, const cJSON **out, const char *path, const char *what) {
    const char *type = json_type(obj);
    if (!type) fatal("%s: %s has no \"type\"", path, what);
    if (strcmp(type, "Sequence")) { out[0] = obj; return 1; }
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(obj, list_key)) {
        if (n == MAX_STEPS) fatal("%s: %s Sequence has more than %d steps", path, what, MAX_STEPS);
        if (json_type(e) && !strcmp(json_type(e), "Sequence")) fatal("%s: %s: a Sequence inside a Sequence is not implemented", path, what);
        out[n++] = e;
    }
    return n;
}

static void parse_normalizer(HfPipeline *hf, const cJSON *obj, const char *path) {
    if (!obj || cJSON_IsNull(obj)) return;
    const cJSON *steps[MAX_STEPS];
    hf->n_norm = sequence_members(obj, "normalizers", steps, path, "normalizer");
    for (int k = 0; k < hf->n_norm; k++) {
        const char *type = json_type(steps[k]);
        NormStep *n = &hf->norm[k];
        if (type && !strcmp(type, "Prepend")) {
            n->kind = NORM_PREPEND;
            n->text = json_string_or_null(steps[k], "prepend", path, "normalizer Prepend");
            if (!n->text) fatal("%s: normalizer Prepend has no \"prepend\"", path);
        } else if (type && !strcmp(type, "Replace")) {
            n->kind = NORM_REPLACE;
            replace_pattern(steps[k], path, "normalizer", &n->text, &n->with);
        } else {
            fatal("%s: normalizer type \"%s\" is not one this tokenizer implements (Prepend, Replace, "
                  "Sequence)", path, type ? type : "(none)");
        }
    }
}

// the Split pre-tokenizer's regular expression: only those written out in C above are accepted
static PreKind split_pattern(const cJSON *obj, const char *path) {
    static const char kLlama3[] =
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    static const char kGpt2[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
    const char *re = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(obj, "pattern"), "Regex"));
    const char *behavior = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(obj, "behavior"));
    if (!behavior || strcmp(behavior, "Isolated") || json_bool(obj, "invert", 0))
        fatal("%s: pre_tokenizer Split: behavior \"%s\"%s is not implemented (expected Isolated, "
              "invert false)", path, behavior ? behavior : "(none)", json_bool(obj, "invert", 0) ? " inverted" : "");
    if (re && !strcmp(re, kLlama3)) return PRE_SPLIT_LLAMA3;
    if (re && !strcmp(re, kGpt2)) return PRE_SPLIT_GPT2;
    fatal("%s: pre_tokenizer Split pattern \"%s\" is not one this tokenizer implements (Llama-3's "
          "or GPT-2's regular expression)", path, re ? re : "(not a Regex)");
}

static void parse_pre_tokenizer(HfPipeline *hf, const cJSON *obj, const char *path) {
    if (!obj || cJSON_IsNull(obj)) return;
    const cJSON *steps[MAX_STEPS];
    hf->n_pre = sequence_members(obj, "pretokenizers", steps, path, "pre_tokenizer");
    for (int k = 0; k < hf->n_pre; k++) {
        const char *type = json_type(steps[k]);
        PreStep *p = &hf->pre[k];
        if (type && !strcmp(type, "Metaspace")) {
            p->kind = PRE_METASPACE;
            p->replacement = json_string_or_null(steps[k], "replacement", path, "pre_tokenizer Metaspace");
            if (!p->replacement || !*p->replacement) fatal("%s: pre_tokenizer Metaspace has no \"replacement\"", path);
            p->prepend = prepend_scheme(steps[k], path, "pre_tokenizer");
            p->split = json_bool(steps[k], "split", 1);
        } else if (type && !strcmp(type, "Split")) {
            p->kind = split_pattern(steps[k], path);
        } else if (type && !strcmp(type, "ByteLevel")) {
            p->kind = PRE_BYTE_LEVEL;
            p->add_prefix_space = json_bool(steps[k], "add_prefix_space", 1);
            p->use_regex = json_bool(steps[k], "use_regex", 1);
            hf->byte_level = 1;
        } else {
            fatal("%s: pre_tokenizer type \"%s\" is not one this tokenizer implements (Metaspace, "
                  "Split, ByteLevel, Sequence)", path, type ? type : "(none)");
        }
    }
}

static void parse_decoder(HfPipeline *hf, const cJSON *obj, const char *path) {
    if (!obj || cJSON_IsNull(obj))
        fatal("%s: \"decoder\" is null (tokens joined by spaces): not implemented", path);
    const cJSON *steps[MAX_STEPS];
    hf->n_dec = sequence_members(obj, "decoders", steps, path, "decoder");
    int fused = 0;
    for (int k = 0; k < hf->n_dec; k++) {
        const char *type = json_type(steps[k]);
        DecStep *d = &hf->dec[k];
        if (type && !strcmp(type, "ByteLevel")) {
            d->kind = DEC_BYTE_LEVEL;
            fused = 1;  // it returns the whole text as one string
        } else if (type && !strcmp(type, "Replace")) {
            d->kind = DEC_REPLACE;
            replace_pattern(steps[k], path, "decoder", &d->text, &d->with);
        } else if (type && !strcmp(type, "ByteFallback")) {
            d->kind = DEC_BYTE_FALLBACK;
        } else if (type && !strcmp(type, "Fuse")) {
            d->kind = DEC_FUSE;
            fused = 1;
        } else if (type && !strcmp(type, "Strip")) {
            d->kind = DEC_STRIP;
            d->text = json_string_or_null(steps[k], "content", path, "decoder Strip");
            const cJSON *start = cJSON_GetObjectItemCaseSensitive(steps[k], "start");
            const cJSON *stop = cJSON_GetObjectItemCaseSensitive(steps[k], "stop");
            if (!d->text || !cJSON_IsNumber(start) || !cJSON_IsNumber(stop))
                fatal("%s: decoder Strip: expected \"content\", \"start\" and \"stop\"", path);
            // before the tokens are fused it would strip every token: not implemented
            if (!fused) fatal("%s: decoder Strip before Fuse is not implemented", path);
            d->start = start->valueint, d->stop = stop->valueint;
        } else if (type && !strcmp(type, "Metaspace")) {
            d->kind = DEC_METASPACE;
            d->text = json_string_or_null(steps[k], "replacement", path, "decoder Metaspace");
            if (!d->text || !*d->text) fatal("%s: decoder Metaspace has no \"replacement\"", path);
            d->prepend = prepend_scheme(steps[k], path, "decoder");
            if (fused) fatal("%s: decoder Metaspace after Fuse is not implemented", path);
        } else {
            fatal("%s: decoder type \"%s\" is not one this tokenizer implements (ByteLevel, Replace, "
                  "ByteFallback, Fuse, Strip, Metaspace, Sequence)", path, type ? type : "(none)");
        }
    }
}


static void bytes_append(Bytes *b, const void *s, size_t n) {
    size_t need = b->len + n + 1;
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < need) cap *= 2;
        char *grown = realloc(b->s, cap);
        if (!grown) fatal("out of host memory");
        b->s = grown, b->cap = cap;
    }
    if (n) memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

// s with every (non-overlapping, left to right) occurrence of from replaced by to, into out
static void replace_all(const char *s, size_t n, const char *from, const char *to, Bytes *out) {
    size_t flen = strlen(from), tlen = strlen(to);
    for (size_t i = 0; i < n;) {
        if (i + flen <= n && memcmp(s + i, from, flen) == 0) {
            bytes_append(out, to, tlen);
            i += flen;
        } else {
            bytes_append(out, s + i, 1);
            i++;
        }
    }
}

// the normalizer's steps (Prepend, Replace) on s, appended to out
static void normalize_text(const HfPipeline *hf, const char *s, size_t n, Bytes *out) {
    Bytes text = {0};
    bytes_append(&text, s, n);
    for (int k = 0; k < hf->n_norm; k++) {
        Bytes next = {0};
        bytes_append(&next, "", 0);
        if (hf->norm[k].kind == NORM_PREPEND) {
            if (text.len) bytes_append(&next, hf->norm[k].text, strlen(hf->norm[k].text));
            bytes_append(&next, text.s, text.len);
        } else {
            replace_all(text.s, text.len, hf->norm[k].text, hf->norm[k].with, &next);
        }
        free(text.s);
        text = next;
    }
    bytes_append(out, text.s, text.len);
    free(text.s);
}

// "<0xNN>" -> NN, else -1
static int byte_fallback_value(const char *s, size_t n) {
    if (n != 6 || strncmp(s, "<0x", 3) || s[5] != '>') return -1;
    int v = 0;
    for (int k = 3; k < 5; k++) {
        char c = s[k];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = 16 * v + d;
    }
    return v;
}

// A token's text as the decoder makes it, from its source (as tokenizer.json writes it), with
// the steps that work token by token; first: the token begins the decoded text (Metaspace drops
// its replacement characters there).
static void decode_source(const HfPipeline *hf, const char *src, size_t n, int first, Bytes *out) {
    Bytes cur = {0};
    bytes_append(&cur, src, n);
    for (int k = 0; k < hf->n_dec; k++) {
        const DecStep *d = &hf->dec[k];
        Bytes next = {0};
        bytes_append(&next, "", 0);
        if (d->kind == DEC_BYTE_LEVEL) {
            // a token with a character that stands for no byte stays as it is (as in Hugging Face)
            char *bytes = malloc_or_die(cur.len + 1);
            int len = stand_ins_to_bytes(cur.s, bytes);
            if (len >= 0) bytes_append(&next, bytes, (size_t)len);
            else bytes_append(&next, cur.s, cur.len);
            free(bytes);
        } else if (d->kind == DEC_REPLACE) {
            replace_all(cur.s, cur.len, d->text, d->with, &next);
        } else if (d->kind == DEC_BYTE_FALLBACK && byte_fallback_value(cur.s, cur.len) >= 0) {
            char b = (char)byte_fallback_value(cur.s, cur.len);
            bytes_append(&next, &b, 1);
        } else if (d->kind == DEC_METASPACE) {
            int drop = first && d->prepend != PREPEND_NEVER;
            replace_all(cur.s, cur.len, d->text, drop ? "" : " ", &next);
        } else {  // Fuse and Strip work on the whole text (tokenizer_decode); ByteFallback otherwise
            bytes_append(&next, cur.s, cur.len);
        }
        free(cur.s);
        cur = next;
    }
    bytes_append(out, cur.s, cur.len);
    free(cur.s);
}

// tokenizer.json's "merges": ["left right", ...] or, since tokenizers 0.20, [["left", "right"], ...]
static void hf_merges(Tokenizer *t, const cJSON *merges, const char *path) {
    HfPipeline *hf = t->hf;
    merge_table_init(&t->merges, (size_t)cJSON_GetArraySize(merges));
    int rank = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, merges) {
        char *left, *right;
        if (cJSON_IsString(e)) {
            left = copy_string_or_die(e->valuestring);
            char *space = strchr(left, ' ');
            if (!space || space == left || !space[1] || strchr(space + 1, ' '))
                fatal("%s: merge %d: expected two tokens separated by one space, found \"%s\"", path, rank, e->valuestring);
            *space = '\0';
            right = space + 1;
        } else if (cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) && cJSON_IsString(e->child->next)) {
            size_t ll = strlen(e->child->valuestring);
            left = malloc_or_die(ll + strlen(e->child->next->valuestring) + 2);
            strcpy(left, e->child->valuestring);
            right = left + ll + 1;
            strcpy(right, e->child->next->valuestring);
        } else {
            fatal("%s: merge %d: expected \"left right\" or [\"left\", \"right\"]", path, rank);
        }
        add_merge(&t->merges, hf->piece, hf->piece_offset, &hf->pieces, hf->byte_level, left, right,
                  rank, path, rank + 1);
        rank++;
        free(left);
    }
}

// tokenizer.json's "added_tokens": Llama's special tokens. Ids inside the vocabulary must name the
// same token there; the others follow it. All are matched in the text, as Hugging Face does: in
// the raw text, or (marked "normalized", with a normalizer) in the normalized text.
static void hf_added_tokens(Tokenizer *t, const cJSON *list, const char *path) {
    int n = 0;
    AddedToken *added = calloc_or_die((size_t)cJSON_GetArraySize(list) + 1, sizeof *added);
    const cJSON *e;
    cJSON_ArrayForEach(e, list) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        added[n].text = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "content"));
        if (!cJSON_IsNumber(id) || !added[n].text || !*added[n].text)
            fatal("%s: expected \"added_tokens\": [{\"id\": n, \"content\": \"text\"}, ...]", path);
        if (json_bool(e, "single_word", 0))
            fatal("%s: added token \"%s\" has single_word true, which is not implemented", path, added[n].text);
        added[n].strip = (json_bool(e, "lstrip", 0) ? STRIP_LEFT : 0) | (json_bool(e, "rstrip", 0) ? STRIP_RIGHT : 0);
        added[n].normalized = json_bool(e, "normalized", 0);
        added[n++].id = id->valuedouble;
    }
    qsort(added, (size_t)n, sizeof *added, by_id);
    t->hf->added_normalized = calloc_or_die((size_t)n + 1, 1);
    t->hf->added_strip = calloc_or_die((size_t)n + 1, 1);
    t->hf->added_match = calloc_or_die((size_t)n + 1, sizeof(Bytes));
    t->hf->n_added = n;
    for (int i = 0; i < n; i++) {
        int normalized = added[i].normalized && t->hf->n_norm;
        t->hf->added_normalized[i] = (unsigned char)normalized;
        t->hf->added_strip[i] = (unsigned char)added[i].strip;
        if (normalized) normalize_text(t->hf, added[i].text, strlen(added[i].text), &t->hf->added_match[i]);
        else bytes_append(&t->hf->added_match[i], added[i].text, strlen(added[i].text));
        if (t->hf->added_match[i].len) t->starts_added[(unsigned char)t->hf->added_match[i].s[0]] = 1;
        int id = (int)added[i].id;
        if (added[i].id >= 0 && id < t->vocab_size && added[i].id == id) {
            int len = t->hf->source_offset[id + 1] - t->hf->source_offset[id];
            if (len != (int)strlen(added[i].text) || memcmp(t->hf->source + t->hf->source_offset[id], added[i].text, (size_t)len))
                fatal("%s: added token \"%s\" has id %d, which the vocabulary gives to another token", path, added[i].text, id);
            match_added_token(t, id, added[i].text);
            continue;
        }
        if (added[i].id != t->vocab_size)
            fatal("%s: added token \"%s\" has id %g; expected %d (added tokens follow the vocabulary, in order)",
                  path, added[i].text, added[i].id, t->vocab_size);
        Bytes text = {0};
        decode_source(t->hf, added[i].text, strlen(added[i].text), 0, &text);
        add_token(t, path, text.s, added[i].id);  // its text as decoded; matched as written
        t->starts_added[(unsigned char)added[i].text[0]] = 1;
        free(text.s);
        // the source, for a first token
        int end = t->hf->source_offset[id];
        size_t len = strlen(added[i].text);
        t->hf->source = realloc(t->hf->source, (size_t)end + len);
        t->hf->source_offset = realloc(t->hf->source_offset, ((size_t)id + 2) * sizeof(int));
        if (!t->hf->source || !t->hf->source_offset) fatal("out of host memory");
        memcpy(t->hf->source + end, added[i].text, len);
        t->hf->source_offset[id + 1] = end + (int)len;
    }
    free(added);
}

// The end-of-text id: tokenizer_config.json's eos_token where the directory has one, else the
// first of Llama-2's, Llama-3's and GPT-2's names that is a token; -1 if none is.
static int hf_eot(const Tokenizer *t, const char *dir) {
    char path[4096];
    if (file_exists(dir, "tokenizer_config.json", path, sizeof path)) {
        cJSON *config = parse_json_file_or_die(path);
        const cJSON *eos = cJSON_GetObjectItemCaseSensitive(config, "eos_token");
        const char *name = cJSON_IsString(eos) ? eos->valuestring
                         : cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(eos, "content"));
        int id = -1;
        for (int k = 0; name && k < t->added_count && id < 0; k++) {
            int a = t->added_ids[k], len = t->hf->source_offset[a + 1] - t->hf->source_offset[a];
            if (len == (int)strlen(name) && !memcmp(t->hf->source + t->hf->source_offset[a], name, (size_t)len)) id = a;
        }
        if (name && id < 0) fatal("%s: eos_token \"%s\" is not one of the added tokens of %s/tokenizer.json", path, name, dir);
        cJSON_Delete(config);
        if (name) return id;
    }
    static const char *names[] = {"</s>", "<|end_of_text|>", "<|endoftext|>"};
    for (int n = 0; n < 3; n++)
        for (int k = 0; k < t->added_count; k++) {
            int a = t->added_ids[k], len = t->hf->source_offset[a + 1] - t->hf->source_offset[a];
            if (len == (int)strlen(names[n]) && !memcmp(t->hf->source + t->hf->source_offset[a], names[n], (size_t)len)) return a;
        }
    return -1;
}

static void hf_model(Tokenizer *t, const cJSON *model, const char *path) {
    HfPipeline *hf = t->hf;
    const char *type = json_type(model);
    if (!type || strcmp(type, "BPE"))
        fatal("%s: model type \"%s\" is not one this tokenizer implements (BPE)", path, type ? type : "(none)");
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble != 0) fatal("%s: BPE dropout is not implemented", path);
    static const char *affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++) {
        char *a = json_string_or_null(model, affixes[k], path, "model");
        if (a && *a) fatal("%s: BPE %s \"%s\" is not implemented", path, affixes[k], a);
        free(a);
    }
    hf->byte_fallback = json_bool(model, "byte_fallback", 0);
    hf->fuse_unk = json_bool(model, "fuse_unk", 0);
    hf->ignore_merges = json_bool(model, "ignore_merges", 0);

    // the vocabulary as the model sees it (byte-level: raw bytes), kept for encode
    vocab_from_json(t, cJSON_GetObjectItemCaseSensitive(model, "vocab"), path, &hf->pieces, hf->byte_level);
    hf->piece = t->token_bytes, hf->piece_offset = t->token_offset;
    // as the file writes it, and as it decodes
    int n = t->vocab_size;
    hf->source_offset = malloc_or_die(((size_t)n + 1) * sizeof(int));
    t->token_offset = malloc_or_die(((size_t)n + 1) * sizeof(int));
    const char **string_of_id = calloc_or_die((size_t)n, sizeof *string_of_id);
    const cJSON *item;
    cJSON_ArrayForEach(item, cJSON_GetObjectItemCaseSensitive(model, "vocab")) string_of_id[item->valueint] = item->string;
    Bytes source = {0}, text = {0};
    for (int id = 0; id < n; id++) {
        hf->source_offset[id] = (int)source.len;
        t->token_offset[id] = (int)text.len;
        bytes_append(&source, string_of_id[id], strlen(string_of_id[id]));
        decode_source(hf, string_of_id[id], strlen(string_of_id[id]), 0, &text);
    }
    hf->source_offset[n] = (int)source.len;
    t->token_offset[n] = (int)text.len;
    hf->source = source.s ? source.s : calloc_or_die(1, 1);
    t->token_bytes = text.s ? text.s : calloc_or_die(1, 1);
    free(string_of_id);

    for (int b = 0; b < 256; b++) {
        char name[8], c = (char)b;
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_token[b] = hf->byte_level ? vocab_table_find(&hf->pieces, &c, 1)
                                          : vocab_table_find(&hf->pieces, name, 6);
    }
    char *unk = json_string_or_null(model, "unk_token", path, "model");
    hf->unk = unk ? vocab_table_find(&hf->pieces, unk, (int)strlen(unk)) : -1;
    if (unk && hf->unk < 0) fatal("%s: unk_token \"%s\" is not in the vocabulary", path, unk);
    free(unk);
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsArray(merges)) fatal("%s: model has no \"merges\" list", path);
    hf_merges(t, merges, path);
}

// A directory holding tokenizer.json and none of GPT-2's files (Llama-2's, Llama-3's)
static void load_hf_tokenizer(Tokenizer *t, const char *dir, const char *path) {
    cJSON *json = parse_json_file_or_die(path);
    t->hf = calloc_or_die(1, sizeof *t->hf);
    parse_normalizer(t->hf, cJSON_GetObjectItemCaseSensitive(json, "normalizer"), path);
    parse_pre_tokenizer(t->hf, cJSON_GetObjectItemCaseSensitive(json, "pre_tokenizer"), path);
    parse_decoder(t->hf, cJSON_GetObjectItemCaseSensitive(json, "decoder"), path);
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(json, "model");
    if (!cJSON_IsObject(model)) fatal("%s: no \"model\" object", path);
    hf_model(t, model, path);
    hf_added_tokens(t, cJSON_GetObjectItemCaseSensitive(json, "added_tokens"), path);
    t->eot = hf_eot(t, dir);
    cJSON_Delete(json);
}

static void free_hf(HfPipeline *hf) {
    if (!hf) return;
    for (int k = 0; k < hf->n_norm; k++) free(hf->norm[k].text), free(hf->norm[k].with);
    for (int k = 0; k < hf->n_pre; k++) free(hf->pre[k].replacement);
    for (int k = 0; k < hf->n_dec; k++) free(hf->dec[k].text), free(hf->dec[k].with);
    free(hf->piece);
    free(hf->piece_offset);
    free(hf->pieces.slots);
    free(hf->source);
    free(hf->source_offset);
    for (int k = 0; hf->added_match && k < hf->n_added; k++) free(hf->added_match[k].s);
    free(hf->added_match);
    free(hf->added_normalized);
    free(hf->added_strip);
    free(hf);
}

// The added token that starts at s[i], the longest if several do, or -1. normalized: 0 or 1 looks
// only at the tokens tokenizer.json matches in the raw or the normalized text; -1 at all.
static int added_token_at(const Tokenizer *t, const unsigned char *s, size_t n, size_t i,
                          int normalized, int *len) {
    int best = -1;
    *len = 0;
    if (!t->starts_added[s[i]]) return -1;
    for (int k = 0; k < t->added_count; k++) {
        int id = t->added_ids[k], l;
        const char *text;
        if (t->hf) {  // tokenizer.json: as the file writes it, which may decode otherwise
            if (normalized >= 0 && t->hf->added_normalized[k] != normalized) continue;
            text = t->hf->added_match[k].s, l = (int)t->hf->added_match[k].len;
        } else {
            text = t->token_bytes + t->token_offset[id], l = t->token_offset[id + 1] - t->token_offset[id];
        }
        if (l > *len && (size_t)l <= n - i && memcmp(s + i, text, (size_t)l) == 0)
            best = id, *len = l;
    }
    return best;
}

Tokenizer *tokenizer_load(const char *path) {
    if (!path || !*path) return byte_tokenizer();
    Tokenizer *t = calloc_or_die(1, sizeof *t);
    t->is_bpe = 1;
    t->name = copy_string_or_die(path);
    char vocab_path[4096], merges_path[4096];
    if (!has_gpt2_files(path) && file_exists(path, "tokenizer.json", vocab_path, sizeof vocab_path)) {
        load_hf_tokenizer(t, path, vocab_path);
        return t;
    }
    find_tokenizer_files(path, vocab_path, merges_path, sizeof vocab_path);
    VocabTable vocab;
    load_vocab(t, vocab_path, &vocab);
    load_merges(t, merges_path, &vocab);
    free(vocab.slots);
    load_added_tokens(t, path);
    return t;
}

void tokenizer_free(Tokenizer *t) {
    if (!t) return;
    free(t->name);
    free(t->token_bytes);
    free(t->token_offset);
    free(t->merges.slots);
    free(t->added_ids);
    free_hf(t->hf);
    free(t);
}

int tokenizer_vocab_size(const Tokenizer *t) { return t->vocab_size; }
int tokenizer_eot(const Tokenizer *t) { return t->eot; }
int tokenizer_is_bpe(const Tokenizer *t) { return t->is_bpe; }
const char *tokenizer_name(const Tokenizer *t) { return t->name; }

// ---------------------------------------------------------------------------------------------
// BPE on one pre-token
// ---------------------------------------------------------------------------------------------
//
// The textbook loop ("find the best pair, merge it, rescan") costs O(n^2) on an n-byte chunk, and a
// chunk can be a whole megabyte of letters. Instead the symbols sit in a linked list and every
// mergeable adjacent pair sits in a min-heap keyed by (rank, position). Popping the heap gives
// the same merge GPT-2 would do next: the lowest rank, leftmost first (GPT-2 merges every
// occurrence of the best pair left to right in one sweep, which is the same order). A heap entry
// whose symbols have changed since it was pushed is stale and skipped. O(n log n) per chunk.
// (Identical to GPT-2 for merges files where a merged token's pairs rank after the merge that
// made it -- true of every BPE-trained file, GPT-2's included.)

typedef struct { int rank, pos, left, right; } Candidate;  // pair (left, right) at symbol pos

typedef struct {
    int *id, *prev, *next;  // the symbols of the chunk as a doubly linked list (-1 = none)
    Candidate *heap;
    int heap_size;
    size_t cap;             // symbols the arrays have room for (heap: 3x, see bpe_chunk)
} BpeScratch;

static int candidate_before(Candidate a, Candidate b) {
    return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static void heap_push(BpeScratch *w, Candidate c) {
    int i = w->heap_size++;
    while (i > 0 && candidate_before(c, w->heap[(i - 1) / 2])) {  // sift up
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = c;
}

static Candidate heap_pop(BpeScratch *w) {
    Candidate top = w->heap[0], last = w->heap[--w->heap_size];
    int i = 0;
    for (;;) {  // sift the last element down from the root
        int child = 2 * i + 1;
        if (child >= w->heap_size) break;
        if (child + 1 < w->heap_size && candidate_before(w->heap[child + 1], w->heap[child])) child++;
        if (!candidate_before(w->heap[child], last)) break;
        w->heap[i] = w->heap[child];
        i = child;
    }
    if (w->heap_size > 0) w->heap[i] = last;
    return top;
}

// push the pair starting at symbol pos, if there is one and it can merge
static void push_pair(const Tokenizer *t, BpeScratch *w, int pos) {
    if (pos < 0 || w->next[pos] < 0) return;
    int left = w->id[pos], right = w->id[w->next[pos]];
    const MergeSlot *slot = merge_table_slot(&t->merges, left, right);
    if (slot->rank >= 0) heap_push(w, (Candidate){slot->rank, pos, left, right});
}

static void scratch_reserve(BpeScratch *w, size_t n) {
    if (n <= w->cap) return;
    w->cap = n;
    free(w->id); free(w->prev); free(w->next); free(w->heap);
    w->id = malloc_or_die(n * sizeof(int));
    w->prev = malloc_or_die(n * sizeof(int));
    w->next = malloc_or_die(n * sizeof(int));
    // every merge pushes at most 2 new pairs on top of the n-1 initial ones
    w->heap = malloc_or_die(3 * n * sizeof(Candidate));
}

static int byte_id_or_die(const Tokenizer *t, unsigned char b) {
    int id = t->byte_token[b];
    if (id < 0) fatal("tokenizer %s has no token for the byte 0x%02X", t->name, b);
    return id;
}

// Merge the n symbols w->id[0..n) (n >= 1), appending the ids at out; returns how many.
static int bpe_merge(const Tokenizer *t, BpeScratch *w, int n, int *out) {
    w->heap_size = 0;
    for (int i = 0; i < n; i++) {
        w->prev[i] = i - 1;
        w->next[i] = i + 1 < n ? i + 1 : -1;
    }
    for (int i = 0; i + 1 < n; i++) push_pair(t, w, i);

    while (w->heap_size > 0) {
        Candidate c = heap_pop(w);
        int right = w->next[c.pos];
        // stale? (pos was merged away into its left neighbour: its id is then -1, see below)
        if (w->id[c.pos] != c.left || right < 0 || w->id[right] != c.right) continue;
        // merge: pos becomes the merged token, its right neighbour leaves the list
        w->id[c.pos] = merge_table_slot(&t->merges, c.left, c.right)->merged;
        w->id[right] = -1;
        w->next[c.pos] = w->next[right];
        if (w->next[right] >= 0) w->prev[w->next[right]] = c.pos;
        push_pair(t, w, w->prev[c.pos]);
        push_pair(t, w, c.pos);
    }
    int count = 0;
    for (int i = 0; i >= 0; i = w->next[i]) out[count++] = w->id[i];
    return count;
}

// BPE-encode the n bytes of one chunk, appending the ids at out; returns how many.
static int bpe_chunk(const Tokenizer *t, const unsigned char *s, int n, BpeScratch *w, int *out) {
    if (n == 1) { out[0] = byte_id_or_die(t, s[0]); return 1; }
    scratch_reserve(w, (size_t)n);
    for (int i = 0; i < n; i++) w->id[i] = byte_id_or_die(t, s[i]);
    return bpe_merge(t, w, n, out);
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json's encode pipeline (see "Hugging Face's tokenizer.json" above)
// ---------------------------------------------------------------------------------------------

// Llama-3's split pattern, one alternative at a time, in the pattern's order:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// Unlike GPT-2's: contractions in any case, a word may take one leading character that is not a
// letter, digit or line break ("(hello", "\tfoo"), numbers go in groups of up to three digits,
// punctuation keeps the line breaks after it, and a run of whitespace ending in line breaks is
// one pre-token.

// 's 't 're 've 'm 'll 'd in either case: length of the match at s[i], or 0
static size_t contraction_length_any_case(const unsigned char *s, size_t n, size_t i) {
    if (s[i] != '\'' || i + 1 >= n) return 0;
    int a = s[i + 1] | 0x20, b = i + 2 < n ? s[i + 2] | 0x20 : 0;  // ASCII letters to lower case
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

static int is_line_break(unsigned char c) { return c == '\r' || c == '\n'; }

static size_t next_pretoken_llama3(const unsigned char *s, size_t n, size_t i) {
    size_t k = contraction_length_any_case(s, n, i);
    if (k) return i + k;
    int len, next_len;
    CharClass cls = class_at(s, n, i, &len);
    if (cls == CHAR_LETTER) return end_of_run(s, n, i, CHAR_LETTER);
    // [^\r\n\p{L}\p{N}]\p{L}+: one other character (space, tab, punctuation) before a word
    if (cls != CHAR_NUMBER && !is_line_break(s[i]) && i + (size_t)len < n &&
        class_at(s, n, i + (size_t)len, &next_len) == CHAR_LETTER)
        return end_of_run(s, n, i + (size_t)len, CHAR_LETTER);
    if (cls == CHAR_NUMBER) {  // \p{N}{1,3}
        size_t j = i;
        for (int count = 0; count < 3 && j < n && class_at(s, n, j, &len) == CHAR_NUMBER; count++) j += (size_t)len;
        return j;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    size_t start = (s[i] == ' ' && i + 1 < n) ? i + 1 : i;
    if (class_at(s, n, start, &len) == CHAR_OTHER) {
        size_t j = end_of_run(s, n, start, CHAR_OTHER);
        while (j < n && is_line_break(s[j])) j++;
        return j;
    }
    // `\s*[\r\n]+`: the whitespace up to its last line break, if it has one
    size_t j = i, after_break = 0;
    while (j < n && class_at(s, n, j, &len) == CHAR_SPACE) {
        j += (size_t)len;
        if (is_line_break(s[j - 1])) after_break = j;
    }
    if (after_break) return after_break;
    return end_of_whitespace(s, n, i);  // `\s+(?!\S)|\s+`, as in GPT-2's pattern
}

// Words: texts back to back; word k is text[end[k-1] .. end[k]) (end[-1] = 0); at_start[k]: the
// word begins the text being encoded (Metaspace's "first" prepend scheme asks)
typedef struct { Bytes text; size_t *end; int *at_start; size_t count, cap; } Words;

static void words_add(Words *w, const char *s, size_t n, int at_start) {
    if (n == 0) return;
    if (w->count == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 16;
        w->end = realloc(w->end, w->cap * sizeof *w->end);
        w->at_start = realloc(w->at_start, w->cap * sizeof *w->at_start);
        if (!w->end || !w->at_start) fatal("out of host memory");
    }
    bytes_append(&w->text, s, n);
    w->end[w->count] = w->text.len;
    w->at_start[w->count++] = at_start;
}

static void words_free(Words *w) { free(w->text.s); free(w->end); free(w->at_start); }

static const char *word_at(const Words *w, size_t k, size_t *len) {
    size_t begin = k ? w->end[k - 1] : 0;
    *len = w->end[k] - begin;
    return w->text.s + begin;
}

// Metaspace: spaces become the replacement, which is prepended (if the word does not start with
// it already) and, with split, begins each new word
static void metaspace_words(const PreStep *p, const char *s, size_t n, int at_start, Words *out) {
    Bytes b = {0};
    size_t rlen = strlen(p->replacement);
    int prepend = p->prepend == PREPEND_ALWAYS || (p->prepend == PREPEND_FIRST && at_start);
    // a word that starts with a space starts with the replacement already: none is prepended
    if (prepend && !(n >= 1 && s[0] == ' ') && !(n >= rlen && memcmp(s, p->replacement, rlen) == 0))
        bytes_append(&b, p->replacement, rlen);
    replace_all(s, n, " ", p->replacement, &b);
    bytes_append(&b, "", 0);
    size_t begin = 0;
    for (size_t i = 1; p->split && i + rlen <= b.len; i++)
        if (memcmp(b.s + i, p->replacement, rlen) == 0) {
            words_add(out, b.s + begin, i - begin, at_start && begin == 0);
            begin = i;
        }
    words_add(out, b.s + begin, b.len - begin, at_start && begin == 0);
    free(b.s);
}

static void split_words(size_t (*next)(const unsigned char *, size_t, size_t), const char *s,
                        size_t n, int at_start, Words *out) {
    for (size_t i = 0; i < n;) {
        size_t end = next((const unsigned char *)s, n, i);
        words_add(out, s + i, end - i, at_start && i == 0);
        i = end;
    }
}

static void pre_tokenize_step(const PreStep *p, const Words *in, Words *out) {
    for (size_t k = 0; k < in->count; k++) {
        size_t n;
        const char *s = word_at(in, k, &n);
        int at_start = in->at_start[k];
        if (p->kind == PRE_METASPACE) metaspace_words(p, s, n, at_start, out);
        else if (p->kind == PRE_SPLIT_LLAMA3) split_words(next_pretoken_llama3, s, n, at_start, out);
        else if (p->kind == PRE_SPLIT_GPT2) split_words(next_pretoken, s, n, at_start, out);
        else {  // ByteLevel
            Bytes b = {0};
            if (p->add_prefix_space && (n == 0 || s[0] != ' ')) bytes_append(&b, " ", 1);
            bytes_append(&b, s, n);
            if (p->use_regex) split_words(next_pretoken, b.s, b.len, at_start, out);
            else words_add(out, b.s, b.len, at_start);
            free(b.s);
        }
    }
}

// Growable ids
typedef struct { int *v; size_t n, cap; } Ids;

static void ids_reserve(Ids *ids, size_t more) {
    if (ids->n + more <= ids->cap) return;
    while (ids->n + more > ids->cap) ids->cap = ids->cap ? 2 * ids->cap : 64;
    ids->v = realloc(ids->v, ids->cap * sizeof *ids->v);
    if (!ids->v) fatal("out of host memory");
}

// One word's first symbols, as Hugging Face's BPE makes them: each character that is a token;
// else its bytes' "<0xNN>" tokens (byte_fallback, when all are there); else the unknown token
// (one for a run of them with fuse_unk; a character is dropped when there is no unknown token).
static int first_symbols(const Tokenizer *t, const unsigned char *s, size_t n, int *sym) {
    const HfPipeline *hf = t->hf;
    int count = 0, unk_pending = 0;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        int len = hf->byte_level ? 1 : utf8_decode(s, n, i, &cp);
        int id = vocab_table_find(&hf->pieces, (const char *)s + i, len), fallback = hf->byte_fallback;
        for (int k = 0; k < len && fallback; k++) fallback = t->byte_token[s[i + (size_t)k]] >= 0;
        if (id >= 0) {
            if (unk_pending) sym[count++] = hf->unk, unk_pending = 0;
            sym[count++] = id;
        } else if (fallback) {  // (a pending unknown token waits, as in Hugging Face)
            for (int k = 0; k < len; k++) sym[count++] = t->byte_token[s[i + (size_t)k]];
        } else if (hf->unk >= 0) {
            if (unk_pending && !hf->fuse_unk) sym[count++] = hf->unk;
            unk_pending = 1;
        }
        i += (size_t)len;
    }
    if (unk_pending) sym[count++] = hf->unk;
    return count;
}

static void bpe_word(const Tokenizer *t, const char *s, size_t n, BpeScratch *w, Ids *out) {
    ids_reserve(out, n);
    int whole = t->hf->ignore_merges ? vocab_table_find(&t->hf->pieces, s, (int)n) : -1;
    if (whole >= 0) {
        out->v[out->n++] = whole;
        return;
    }
    scratch_reserve(w, n);
    int count = first_symbols(t, (const unsigned char *)s, n, w->id);
    if (count > 0) out->n += (size_t)bpe_merge(t, w, count, out->v + out->n);
}

// the added token's STRIP_LEFT | STRIP_RIGHT
static int added_strip(const Tokenizer *t, int id) {
    for (int k = 0; k < t->added_count; k++)
        if (t->added_ids[k] == id) return t->hf->added_strip[k];
    return 0;
}

// pre-tokenize and BPE normalized text
static void hf_encode_normalized(const Tokenizer *t, const char *s, size_t n, int at_start, BpeScratch *w, Ids *out) {
    const HfPipeline *hf = t->hf;
    Words words = {0};
    words_add(&words, s, n, at_start);
    for (int k = 0; k < hf->n_pre; k++) {
        Words next = {0};
        pre_tokenize_step(&hf->pre[k], &words, &next);
        words_free(&words);
        words = next;
    }
    for (size_t k = 0; k < words.count; k++) {
        size_t len;
        const char *word = word_at(&words, k, &len);
        bpe_word(t, word, len, w, out);
    }
    words_free(&words);
}

// Cut s[0..n) at the added tokens of one kind (normalized: see added_token_at), leftmost then
// longest: a token becomes its id, and each piece between goes to then(). at_start: s begins the
// text being encoded.
static void split_at_added(const Tokenizer *t, const char *s, size_t n, int normalized, int at_start,
                           void (*then)(const Tokenizer *, const char *, size_t, int, BpeScratch *, Ids *),
                           BpeScratch *w, Ids *out) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t piece = i;
        int added = -1, added_len = 0;
        while (piece < n && (added = added_token_at(t, u, n, piece, normalized, &added_len)) < 0) piece++;
        int strip = added >= 0 ? added_strip(t, added) : 0;
        size_t before = piece;  // lstrip: the whitespace before the token goes with it
        while ((strip & STRIP_LEFT) && before > i) {
            size_t start = before - 1;
            while (start > i && (u[start] & 0xC0) == 0x80) start--;  // back to the character's first byte
            int len;
            if (class_at(u, before, start, &len) != CHAR_SPACE) break;
            before = start;
        }
        if (before > i) then(t, s + i, before - i, at_start && i == 0, w, out);
        i = piece;
        if (added >= 0) {
            ids_reserve(out, 1);
            out->v[out->n++] = added;
            i += (size_t)added_len;
            int len;  // rstrip: and the whitespace after it
            while ((strip & STRIP_RIGHT) && i < n && class_at(u, n, i, &len) == CHAR_SPACE) i += (size_t)len;
        }
    }
}

// normalize the text between two raw-text added tokens, then cut it at the normalized-text ones
static void hf_encode_piece(const Tokenizer *t, const char *s, size_t n, int at_start, BpeScratch *w, Ids *out) {
    Bytes text = {0};
    normalize_text(t->hf, s, n, &text);
    split_at_added(t, text.s, text.len, 1, at_start, hf_encode_normalized, w, out);
    free(text.s);
}

// Hugging Face's order: the added tokens matched in the raw text first, then the pieces between
// normalized and searched for the tokens matched in normalized text (Llama-2's <s> is one: in
// "<s>Hi" the normalizer's "▁" comes before it, "▁<s>Hi"). Without a normalizer both are the same.
static int hf_encode(const Tokenizer *t, const unsigned char *s, size_t len, int **ids) {
    Ids out = {0};
    ids_reserve(&out, 1);
    BpeScratch w = {0};
    if (t->hf->n_norm) split_at_added(t, (const char *)s, len, 0, 1, hf_encode_piece, &w, &out);
    else split_at_added(t, (const char *)s, len, -1, 1, hf_encode_normalized, &w, &out);
    free(w.id); free(w.prev); free(w.next); free(w.heap);
    *ids = out.v;
    return (int)out.n;
}

// Decoding's whole-text steps: the first token as it decodes at the start (Metaspace), and Strip
static char *hf_decode(const Tokenizer *t, const int *ids, int n) {
    const HfPipeline *hf = t->hf;
    Bytes text = {0};
    bytes_append(&text, "", 0);
    for (int i = 0; i < n; i++) {
        int len;
        const char *bytes = tokenizer_token_bytes(t, ids[i], &len);
        if (i == 0) decode_source(hf, hf->source + hf->source_offset[ids[0]],
                                  (size_t)(hf->source_offset[ids[0] + 1] - hf->source_offset[ids[0]]), 1, &text);
        else bytes_append(&text, bytes, (size_t)len);
    }
    for (int k = 0; k < hf->n_dec; k++) {
        const DecStep *d = &hf->dec[k];
        if (d->kind != DEC_STRIP) continue;
        size_t c = strlen(d->text), begin = 0, end = text.len;
        for (int r = 0; r < d->start && begin + c <= end && !memcmp(text.s + begin, d->text, c); r++) begin += c;
        for (int r = 0; r < d->stop && end >= begin + c && !memcmp(text.s + end - c, d->text, c); r++) end -= c;
        memmove(text.s, text.s + begin, end - begin);
        text.len = end - begin;
        text.s[text.len] = '\0';
    }
    return text.s;
}

int tokenizer_encode(const Tokenizer *t, const char *text, size_t len, int **ids) {
    if (len > (size_t)0x7fffffff) fatal("tokenizer_encode: text of %zu bytes is too long", len);
    if (t->hf) return hf_encode(t, (const unsigned char *)text, len, ids);
    int *out = malloc_or_die(len * sizeof(int));  // never more ids than bytes
    const unsigned char *s = (const unsigned char *)text;
    int count = 0;
    if (!t->is_bpe) {
        for (size_t i = 0; i < len; i++) out[count++] = s[i];
    } else {
        // as Hugging Face does: the text is cut at added tokens first (leftmost, then longest),
        // and the pieces between them are pre-tokenized and BPE'd on their own
        BpeScratch w = {0};
        for (size_t i = 0; i < len;) {
            size_t piece = i;
            int added = -1, added_len = 0;
            while (piece < len && (added = added_token_at(t, s, len, piece, -1, &added_len)) < 0) piece++;
            while (i < piece) {
                size_t end = next_pretoken(s, piece, i);
                count += bpe_chunk(t, s + i, (int)(end - i), &w, out + count);
                i = end;
            }
            if (added >= 0) out[count++] = added, i += (size_t)added_len;
        }
        free(w.id); free(w.prev); free(w.next); free(w.heap);
    }
    *ids = out;
    return count;
}

const char *tokenizer_token_bytes(const Tokenizer *t, int id, int *len) {
    if (id < 0 || id >= t->vocab_size)
        fatal("token id %d is outside the vocabulary of tokenizer %s (0..%d)", id, t->name,
              t->vocab_size - 1);
    *len = t->token_offset[id + 1] - t->token_offset[id];
    return t->token_bytes + t->token_offset[id];
}

char *tokenizer_decode(const Tokenizer *t, const int *ids, int n) {
    if (t->hf) return hf_decode(t, ids, n);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        int len;
        tokenizer_token_bytes(t, ids[i], &len);  // also checks the id
        total += (size_t)len;
    }
    char *text = malloc_or_die(total + 1), *p = text;
    for (int i = 0; i < n; i++) {
        int len;
        const char *bytes = tokenizer_token_bytes(t, ids[i], &len);
        memcpy(p, bytes, (size_t)len);
        p += len;
    }
    *p = '\0';
    return text;
}

// ---------------------------------------------------------------------------------------------
// Unicode tables: \p{L} (letters) and \p{N} (numbers) as sorted ranges of code points.
// Generated with the Python `regex` module (the one OpenAI's GPT-2 encoder.py uses), Unicode 16:
//   for each pattern in (r"\p{L}", r"\p{N}"): the runs of code points cp (surrogates excluded)
//   with regex.match(pattern, chr(cp)), written as {first, last}.
// Limits: characters added to Unicode after version 16 count as punctuation; the npm
// gpt-3-encoder the fixtures come from (JavaScript's Unicode tables) may classify a handful of
// very new characters differently. Whitespace follows Python's regex (White_Space, no U+FEFF).
// ---------------------------------------------------------------------------------------------
static const CodeRange kLetterRanges[684] = {
    {0x41,0x5A}, {0x61,0x7A}, {0xAA,0xAA}, {0xB5,0xB5}, {0xBA,0xBA}, {0xC0,0xD6}, {0xD8,0xF6},
    {0xF8,0x2C1}, {0x2C6,0x2D1}, {0x2E0,0x2E4}, {0x2EC,0x2EC}, {0x2EE,0x2EE}, {0x370,0x374},
    {0x376,0x377}, {0x37A,0x37D}, {0x37F,0x37F}, {0x386,0x386}, {0x388,0x38A}, {0x38C,0x38C},
    {0x38E,0x3A1}, {0x3A3,0x3F5}, {0x3F7,0x481}, {0x48A,0x52F}, {0x531,0x556}, {0x559,0x559},
    {0x560,0x588}, {0x5D0,0x5EA}, {0x5EF,0x5F2}, {0x620,0x64A}, {0x66E,0x66F}, {0x671,0x6D3},
    {0x6D5,0x6D5}, {0x6E5,0x6E6}, {0x6EE,0x6EF}, {0x6FA,0x6FC}, {0x6FF,0x6FF}, {0x710,0x710},
    {0x712,0x72F}, {0x74D,0x7A5}, {0x7B1,0x7B1}, {0x7CA,0x7EA}, {0x7F4,0x7F5}, {0x7FA,0x7FA},
    {0x800,0x815}, {0x81A,0x81A}, {0x824,0x824}, {0x828,0x828}, {0x840,0x858}, {0x860,0x86A},
    {0x870,0x887}, {0x889,0x88F}, {0x8A0,0x8C9}, {0x904,0x939}, {0x93D,0x93D}, {0x950,0x950},
    {0x958,0x961}, {0x971,0x980}, {0x985,0x98C}, {0x98F,0x990}, {0x993,0x9A8}, {0x9AA,0x9B0},
    {0x9B2,0x9B2}, {0x9B6,0x9B9}, {0x9BD,0x9BD}, {0x9CE,0x9CE}, {0x9DC,0x9DD}, {0x9DF,0x9E1},
    {0x9F0,0x9F1}, {0x9FC,0x9FC}, {0xA05,0xA0A}, {0xA0F,0xA10}, {0xA13,0xA28}, {0xA2A,0xA30},
    {0xA32,0xA33}, {0xA35,0xA36}, {0xA38,0xA39}, {0xA59,0xA5C}, {0xA5E,0xA5E}, {0xA72,0xA74},
    {0xA85,0xA8D}, {0xA8F,0xA91}, {0xA93,0xAA8}, {0xAAA,0xAB0}, {0xAB2,0xAB3}, {0xAB5,0xAB9},
    {0xABD,0xABD}, {0xAD0,0xAD0}, {0xAE0,0xAE1}, {0xAF9,0xAF9}, {0xB05,0xB0C}, {0xB0F,0xB10},
    {0xB13,0xB28}, {0xB2A,0xB30}, {0xB32,0xB33}, {0xB35,0xB39}, {0xB3D,0xB3D}, {0xB5C,0xB5D},
    {0xB5F,0xB61}, {0xB71,0xB71}, {0xB83,0xB83}, {0xB85,0xB8A}, {0xB8E,0xB90}, {0xB92,0xB95},
    {0xB99,0xB9A}, {0xB9C,0xB9C}, {0xB9E,0xB9F}, {0xBA3,0xBA4}, {0xBA8,0xBAA}, {0xBAE,0xBB9},
    {0xBD0,0xBD0}, {0xC05,0xC0C}, {0xC0E,0xC10}, {0xC12,0xC28}, {0xC2A,0xC39}, {0xC3D,0xC3D},
    {0xC58,0xC5A}, {0xC5C,0xC5D}, {0xC60,0xC61}, {0xC80,0xC80}, {0xC85,0xC8C}, {0xC8E,0xC90},
    {0xC92,0xCA8}, {0xCAA,0xCB3}, {0xCB5,0xCB9}, {0xCBD,0xCBD}, {0xCDC,0xCDE}, {0xCE0,0xCE1},
    {0xCF1,0xCF2}, {0xD04,0xD0C}, {0xD0E,0xD10}, {0xD12,0xD3A}, {0xD3D,0xD3D}, {0xD4E,0xD4E},
    {0xD54,0xD56}, {0xD5F,0xD61}, {0xD7A,0xD7F}, {0xD85,0xD96}, {0xD9A,0xDB1}, {0xDB3,0xDBB},
    {0xDBD,0xDBD}, {0xDC0,0xDC6}, {0xE01,0xE30}, {0xE32,0xE33}, {0xE40,0xE46}, {0xE81,0xE82},
    {0xE84,0xE84}, {0xE86,0xE8A}, {0xE8C,0xEA3}, {0xEA5,0xEA5}, {0xEA7,0xEB0}, {0xEB2,0xEB3},
    {0xEBD,0xEBD}, {0xEC0,0xEC4}, {0xEC6,0xEC6}, {0xEDC,0xEDF}, {0xF00,0xF00}, {0xF40,0xF47},
    {0xF49,0xF6C}, {0xF88,0xF8C}, {0x1000,0x102A}, {0x103F,0x103F}, {0x1050,0x1055},
    {0x105A,0x105D}, {0x1061,0x1061}, {0x1065,0x1066}, {0x106E,0x1070}, {0x1075,0x1081},
    {0x108E,0x108E}, {0x10A0,0x10C5}, {0x10C7,0x10C7}, {0x10CD,0x10CD}, {0x10D0,0x10FA},
    {0x10FC,0x1248}, {0x124A,0x124D}, {0x1250,0x1256}, {0x1258,0x1258}, {0x125A,0x125D},
    {0x1260,0x1288}, {0x128A,0x128D}, {0x1290,0x12B0}, {0x12B2,0x12B5}, {0x12B8,0x12BE},
    {0x12C0,0x12C0}, {0x12C2,0x12C5}, {0x12C8,0x12D6}, {0x12D8,0x1310}, {0x1312,0x1315},
    {0x1318,0x135A}, {0x1380,0x138F}, {0x13A0,0x13F5}, {0x13F8,0x13FD}, {0x1401,0x166C},
    {0x166F,0x167F}, {0x1681,0x169A}, {0x16A0,0x16EA}, {0x16F1,0x16F8}, {0x1700,0x1711},
    {0x171F,0x1731}, {0x1740,0x1751}, {0x1760,0x176C}, {0x176E,0x1770}, {0x1780,0x17B3},
    {0x17D7,0x17D7}, {0x17DC,0x17DC}, {0x1820,0x1878}, {0x1880,0x1884}, {0x1887,0x18A8},
    {0x18AA,0x18AA}, {0x18B0,0x18F5}, {0x1900,0x191E}, {0x1950,0x196D}, {0x1970,0x1974},
    {0x1980,0x19AB}, {0x19B0,0x19C9}, {0x1A00,0x1A16}, {0x1A20,0x1A54}, {0x1AA7,0x1AA7},
    {0x1B05,0x1B33}, {0x1B45,0x1B4C}, {0x1B83,0x1BA0}, {0x1BAE,0x1BAF}, {0x1BBA,0x1BE5},
    {0x1C00,0x1C23}, {0x1C4D,0x1C4F}, {0x1C5A,0x1C7D}, {0x1C80,0x1C8A}, {0x1C90,0x1CBA},
    {0x1CBD,0x1CBF}, {0x1CE9,0x1CEC}, {0x1CEE,0x1CF3}, {0x1CF5,0x1CF6}, {0x1CFA,0x1CFA},
    {0x1D00,0x1DBF}, {0x1E00,0x1F15}, {0x1F18,0x1F1D}, {0x1F20,0x1F45}, {0x1F48,0x1F4D},
    {0x1F50,0x1F57}, {0x1F59,0x1F59}, {0x1F5B,0x1F5B}, {0x1F5D,0x1F5D}, {0x1F5F,0x1F7D},
    {0x1F80,0x1FB4}, {0x1FB6,0x1FBC}, {0x1FBE,0x1FBE}, {0x1FC2,0x1FC4}, {0x1FC6,0x1FCC},
    {0x1FD0,0x1FD3}, {0x1FD6,0x1FDB}, {0x1FE0,0x1FEC}, {0x1FF2,0x1FF4}, {0x1FF6,0x1FFC},
    {0x2071,0x2071}, {0x207F,0x207F}, {0x2090,0x209C}, {0x2102,0x2102}, {0x2107,0x2107},
    {0x210A,0x2113}, {0x2115,0x2115}, {0x2119,0x211D}, {0x2124,0x2124}, {0x2126,0x2126},
    {0x2128,0x2128}, {0x212A,0x212D}, {0x212F,0x2139}, {0x213C,0x213F}, {0x2145,0x2149},
    {0x214E,0x214E}, {0x2183,0x2184}, {0x2C00,0x2CE4}, {0x2CEB,0x2CEE}, {0x2CF2,0x2CF3},
    {0x2D00,0x2D25}, {0x2D27,0x2D27}, {0x2D2D,0x2D2D}, {0x2D30,0x2D67}, {0x2D6F,0x2D6F},
    {0x2D80,0x2D96}, {0x2DA0,0x2DA6}, {0x2DA8,0x2DAE}, {0x2DB0,0x2DB6}, {0x2DB8,0x2DBE},
    {0x2DC0,0x2DC6}, {0x2DC8,0x2DCE}, {0x2DD0,0x2DD6}, {0x2DD8,0x2DDE}, {0x2E2F,0x2E2F},
    {0x3005,0x3006}, {0x3031,0x3035}, {0x303B,0x303C}, {0x3041,0x3096}, {0x309D,0x309F},
    {0x30A1,0x30FA}, {0x30FC,0x30FF}, {0x3105,0x312F}, {0x3131,0x318E}, {0x31A0,0x31BF},
    {0x31F0,0x31FF}, {0x3400,0x4DBF}, {0x4E00,0xA48C}, {0xA4D0,0xA4FD}, {0xA500,0xA60C},
    {0xA610,0xA61F}, {0xA62A,0xA62B}, {0xA640,0xA66E}, {0xA67F,0xA69D}, {0xA6A0,0xA6E5},
    {0xA717,0xA71F}, {0xA722,0xA788}, {0xA78B,0xA7DC}, {0xA7F1,0xA801}, {0xA803,0xA805},
    {0xA807,0xA80A}, {0xA80C,0xA822}, {0xA840,0xA873}, {0xA882,0xA8B3}, {0xA8F2,0xA8F7},
    {0xA8FB,0xA8FB}, {0xA8FD,0xA8FE}, {0xA90A,0xA925}, {0xA930,0xA946}, {0xA960,0xA97C},
    {0xA984,0xA9B2}, {0xA9CF,0xA9CF}, {0xA9E0,0xA9E4}, {0xA9E6,0xA9EF}, {0xA9FA,0xA9FE},
    {0xAA00,0xAA28}, {0xAA40,0xAA42}, {0xAA44,0xAA4B}, {0xAA60,0xAA76}, {0xAA7A,0xAA7A},
    {0xAA7E,0xAAAF}, {0xAAB1,0xAAB1}, {0xAAB5,0xAAB6}, {0xAAB9,0xAABD}, {0xAAC0,0xAAC0},
    {0xAAC2,0xAAC2}, {0xAADB,0xAADD}, {0xAAE0,0xAAEA}, {0xAAF2,0xAAF4}, {0xAB01,0xAB06},
    {0xAB09,0xAB0E}, {0xAB11,0xAB16}, {0xAB20,0xAB26}, {0xAB28,0xAB2E}, {0xAB30,0xAB5A},
    {0xAB5C,0xAB69}, {0xAB70,0xABE2}, {0xAC00,0xD7A3}, {0xD7B0,0xD7C6}, {0xD7CB,0xD7FB},
    {0xF900,0xFA6D}, {0xFA70,0xFAD9}, {0xFB00,0xFB06}, {0xFB13,0xFB17}, {0xFB1D,0xFB1D},
    {0xFB1F,0xFB28}, {0xFB2A,0xFB36}, {0xFB38,0xFB3C}, {0xFB3E,0xFB3E}, {0xFB40,0xFB41},
    {0xFB43,0xFB44}, {0xFB46,0xFBB1}, {0xFBD3,0xFD3D}, {0xFD50,0xFD8F}, {0xFD92,0xFDC7},
    {0xFDF0,0xFDFB}, {0xFE70,0xFE74}, {0xFE76,0xFEFC}, {0xFF21,0xFF3A}, {0xFF41,0xFF5A},
    {0xFF66,0xFFBE}, {0xFFC2,0xFFC7}, {0xFFCA,0xFFCF}, {0xFFD2,0xFFD7}, {0xFFDA,0xFFDC},
    {0x10000,0x1000B}, {0x1000D,0x10026}, {0x10028,0x1003A}, {0x1003C,0x1003D}, {0x1003F,0x1004D},
    {0x10050,0x1005D}, {0x10080,0x100FA}, {0x10280,0x1029C}, {0x102A0,0x102D0}, {0x10300,0x1031F},
    {0x1032D,0x10340}, {0x10342,0x10349}, {0x10350,0x10375}, {0x10380,0x1039D}, {0x103A0,0x103C3},
    {0x103C8,0x103CF}, {0x10400,0x1049D}, {0x104B0,0x104D3}, {0x104D8,0x104FB}, {0x10500,0x10527},
    {0x10530,0x10563}, {0x10570,0x1057A}, {0x1057C,0x1058A}, {0x1058C,0x10592}, {0x10594,0x10595},
    {0x10597,0x105A1}, {0x105A3,0x105B1}, {0x105B3,0x105B9}, {0x105BB,0x105BC}, {0x105C0,0x105F3},
    {0x10600,0x10736}, {0x10740,0x10755}, {0x10760,0x10767}, {0x10780,0x10785}, {0x10787,0x107B0},
    {0x107B2,0x107BA}, {0x10800,0x10805}, {0x10808,0x10808}, {0x1080A,0x10835}, {0x10837,0x10838},
    {0x1083C,0x1083C}, {0x1083F,0x10855}, {0x10860,0x10876}, {0x10880,0x1089E}, {0x108E0,0x108F2},
    {0x108F4,0x108F5}, {0x10900,0x10915}, {0x10920,0x10939}, {0x10940,0x10959}, {0x10980,0x109B7},
    {0x109BE,0x109BF}, {0x10A00,0x10A00}, {0x10A10,0x10A13}, {0x10A15,0x10A17}, {0x10A19,0x10A35},
    {0x10A60,0x10A7C}, {0x10A80,0x10A9C}, {0x10AC0,0x10AC7}, {0x10AC9,0x10AE4}, {0x10B00,0x10B35},
    {0x10B40,0x10B55}, {0x10B60,0x10B72}, {0x10B80,0x10B91}, {0x10C00,0x10C48}, {0x10C80,0x10CB2},
    {0x10CC0,0x10CF2}, {0x10D00,0x10D23}, {0x10D4A,0x10D65}, {0x10D6F,0x10D85}, {0x10E80,0x10EA9},
    {0x10EB0,0x10EB1}, {0x10EC2,0x10EC7}, {0x10F00,0x10F1C}, {0x10F27,0x10F27}, {0x10F30,0x10F45},
    {0x10F70,0x10F81}, {0x10FB0,0x10FC4}, {0x10FE0,0x10FF6}, {0x11003,0x11037}, {0x11071,0x11072},
    {0x11075,0x11075}, {0x11083,0x110AF}, {0x110D0,0x110E8}, {0x11103,0x11126}, {0x11144,0x11144},
    {0x11147,0x11147}, {0x11150,0x11172}, {0x11176,0x11176}, {0x11183,0x111B2}, {0x111C1,0x111C4},
    {0x111DA,0x111DA}, {0x111DC,0x111DC}, {0x11200,0x11211}, {0x11213,0x1122B}, {0x1123F,0x11240},
    {0x11280,0x11286}, {0x11288,0x11288}, {0x1128A,0x1128D}, {0x1128F,0x1129D}, {0x1129F,0x112A8},
    {0x112B0,0x112DE}, {0x11305,0x1130C}, {0x1130F,0x11310}, {0x11313,0x11328}, {0x1132A,0x11330},
    {0x11332,0x11333}, {0x11335,0x11339}, {0x1133D,0x1133D}, {0x11350,0x11350}, {0x1135D,0x11361},
    {0x11380,0x11389}, {0x1138B,0x1138B}, {0x1138E,0x1138E}, {0x11390,0x113B5}, {0x113B7,0x113B7},
    {0x113D1,0x113D1}, {0x113D3,0x113D3}, {0x11400,0x11434}, {0x11447,0x1144A}, {0x1145F,0x11461},
    {0x11480,0x114AF}, {0x114C4,0x114C5}, {0x114C7,0x114C7}, {0x11580,0x115AE}, {0x115D8,0x115DB},
    {0x11600,0x1162F}, {0x11644,0x11644}, {0x11680,0x116AA}, {0x116B8,0x116B8}, {0x11700,0x1171A},
    {0x11740,0x11746}, {0x11800,0x1182B}, {0x118A0,0x118DF}, {0x118FF,0x11906}, {0x11909,0x11909},
    {0x1190C,0x11913}, {0x11915,0x11916}, {0x11918,0x1192F}, {0x1193F,0x1193F}, {0x11941,0x11941},
    {0x119A0,0x119A7}, {0x119AA,0x119D0}, {0x119E1,0x119E1}, {0x119E3,0x119E3}, {0x11A00,0x11A00},
    {0x11A0B,0x11A32}, {0x11A3A,0x11A3A}, {0x11A50,0x11A50}, {0x11A5C,0x11A89}, {0x11A9D,0x11A9D},
    {0x11AB0,0x11AF8}, {0x11BC0,0x11BE0}, {0x11C00,0x11C08}, {0x11C0A,0x11C2E}, {0x11C40,0x11C40},
    {0x11C72,0x11C8F}, {0x11D00,0x11D06}, {0x11D08,0x11D09}, {0x11D0B,0x11D30}, {0x11D46,0x11D46},
    {0x11D60,0x11D65}, {0x11D67,0x11D68}, {0x11D6A,0x11D89}, {0x11D98,0x11D98}, {0x11DB0,0x11DDB},
    {0x11EE0,0x11EF2}, {0x11F02,0x11F02}, {0x11F04,0x11F10}, {0x11F12,0x11F33}, {0x11FB0,0x11FB0},
    {0x12000,0x12399}, {0x12480,0x12543}, {0x12F90,0x12FF0}, {0x13000,0x1342F}, {0x13441,0x13446},
    {0x13460,0x143FA}, {0x14400,0x14646}, {0x16100,0x1611D}, {0x16800,0x16A38}, {0x16A40,0x16A5E},
    {0x16A70,0x16ABE}, {0x16AD0,0x16AED}, {0x16B00,0x16B2F}, {0x16B40,0x16B43}, {0x16B63,0x16B77},
    {0x16B7D,0x16B8F}, {0x16D40,0x16D6C}, {0x16E40,0x16E7F}, {0x16EA0,0x16EB8}, {0x16EBB,0x16ED3},
    {0x16F00,0x16F4A}, {0x16F50,0x16F50}, {0x16F93,0x16F9F}, {0x16FE0,0x16FE1}, {0x16FE3,0x16FE3},
    {0x16FF2,0x16FF3}, {0x17000,0x18CD5}, {0x18CFF,0x18D1E}, {0x18D80,0x18DF2}, {0x1AFF0,0x1AFF3},
    {0x1AFF5,0x1AFFB}, {0x1AFFD,0x1AFFE}, {0x1B000,0x1B122}, {0x1B132,0x1B132}, {0x1B150,0x1B152},
    {0x1B155,0x1B155}, {0x1B164,0x1B167}, {0x1B170,0x1B2FB}, {0x1BC00,0x1BC6A}, {0x1BC70,0x1BC7C},
    {0x1BC80,0x1BC88}, {0x1BC90,0x1BC99}, {0x1D400,0x1D454}, {0x1D456,0x1D49C}, {0x1D49E,0x1D49F},
    {0x1D4A2,0x1D4A2}, {0x1D4A5,0x1D4A6}, {0x1D4A9,0x1D4AC}, {0x1D4AE,0x1D4B9}, {0x1D4BB,0x1D4BB},
    {0x1D4BD,0x1D4C3}, {0x1D4C5,0x1D505}, {0x1D507,0x1D50A}, {0x1D50D,0x1D514}, {0x1D516,0x1D51C},
    {0x1D51E,0x1D539}, {0x1D53B,0x1D53E}, {0x1D540,0x1D544}, {0x1D546,0x1D546}, {0x1D54A,0x1D550},
    {0x1D552,0x1D6A5}, {0x1D6A8,0x1D6C0}, {0x1D6C2,0x1D6DA}, {0x1D6DC,0x1D6FA}, {0x1D6FC,0x1D714},
    {0x1D716,0x1D734}, {0x1D736,0x1D74E}, {0x1D750,0x1D76E}, {0x1D770,0x1D788}, {0x1D78A,0x1D7A8},
    {0x1D7AA,0x1D7C2}, {0x1D7C4,0x1D7CB}, {0x1DF00,0x1DF1E}, {0x1DF25,0x1DF2A}, {0x1E030,0x1E06D},
    {0x1E100,0x1E12C}, {0x1E137,0x1E13D}, {0x1E14E,0x1E14E}, {0x1E290,0x1E2AD}, {0x1E2C0,0x1E2EB},
    {0x1E4D0,0x1E4EB}, {0x1E5D0,0x1E5ED}, {0x1E5F0,0x1E5F0}, {0x1E6C0,0x1E6DE}, {0x1E6E0,0x1E6E2},
    {0x1E6E4,0x1E6E5}, {0x1E6E7,0x1E6ED}, {0x1E6F0,0x1E6F4}, {0x1E6FE,0x1E6FF}, {0x1E7E0,0x1E7E6},
    {0x1E7E8,0x1E7EB}, {0x1E7ED,0x1E7EE}, {0x1E7F0,0x1E7FE}, {0x1E800,0x1E8C4}, {0x1E900,0x1E943},
    {0x1E94B,0x1E94B}, {0x1EE00,0x1EE03}, {0x1EE05,0x1EE1F}, {0x1EE21,0x1EE22}, {0x1EE24,0x1EE24},
    {0x1EE27,0x1EE27}, {0x1EE29,0x1EE32}, {0x1EE34,0x1EE37}, {0x1EE39,0x1EE39}, {0x1EE3B,0x1EE3B},
    {0x1EE42,0x1EE42}, {0x1EE47,0x1EE47}, {0x1EE49,0x1EE49}, {0x1EE4B,0x1EE4B}, {0x1EE4D,0x1EE4F},
    {0x1EE51,0x1EE52}, {0x1EE54,0x1EE54}, {0x1EE57,0x1EE57}, {0x1EE59,0x1EE59}, {0x1EE5B,0x1EE5B},
    {0x1EE5D,0x1EE5D}, {0x1EE5F,0x1EE5F}, {0x1EE61,0x1EE62}, {0x1EE64,0x1EE64}, {0x1EE67,0x1EE6A},
    {0x1EE6C,0x1EE72}, {0x1EE74,0x1EE77}, {0x1EE79,0x1EE7C}, {0x1EE7E,0x1EE7E}, {0x1EE80,0x1EE89},
    {0x1EE8B,0x1EE9B}, {0x1EEA1,0x1EEA3}, {0x1EEA5,0x1EEA9}, {0x1EEAB,0x1EEBB}, {0x20000,0x2A6DF},
    {0x2A700,0x2B81D}, {0x2B820,0x2CEAD}, {0x2CEB0,0x2EBE0}, {0x2EBF0,0x2EE5D}, {0x2F800,0x2FA1D},
    {0x30000,0x3134A}, {0x31350,0x33479},
};
static const CodeRange kNumberRanges[146] = {
    {0x30,0x39}, {0xB2,0xB3}, {0xB9,0xB9}, {0xBC,0xBE}, {0x660,0x669}, {0x6F0,0x6F9}, {0x7C0,0x7C9},
    {0x966,0x96F}, {0x9E6,0x9EF}, {0x9F4,0x9F9}, {0xA66,0xA6F}, {0xAE6,0xAEF}, {0xB66,0xB6F},
    {0xB72,0xB77}, {0xBE6,0xBF2}, {0xC66,0xC6F}, {0xC78,0xC7E}, {0xCE6,0xCEF}, {0xD58,0xD5E},
    {0xD66,0xD78}, {0xDE6,0xDEF}, {0xE50,0xE59}, {0xED0,0xED9}, {0xF20,0xF33}, {0x1040,0x1049},
    {0x1090,0x1099}, {0x1369,0x137C}, {0x16EE,0x16F0}, {0x17E0,0x17E9}, {0x17F0,0x17F9},
    {0x1810,0x1819}, {0x1946,0x194F}, {0x19D0,0x19DA}, {0x1A80,0x1A89}, {0x1A90,0x1A99},
    {0x1B50,0x1B59}, {0x1BB0,0x1BB9}, {0x1C40,0x1C49}, {0x1C50,0x1C59}, {0x2070,0x2070},
    {0x2074,0x2079}, {0x2080,0x2089}, {0x2150,0x2182}, {0x2185,0x2189}, {0x2460,0x249B},
    {0x24EA,0x24FF}, {0x2776,0x2793}, {0x2CFD,0x2CFD}, {0x3007,0x3007}, {0x3021,0x3029},
    {0x3038,0x303A}, {0x3192,0x3195}, {0x3220,0x3229}, {0x3248,0x324F}, {0x3251,0x325F},
    {0x3280,0x3289}, {0x32B1,0x32BF}, {0xA620,0xA629}, {0xA6E6,0xA6EF}, {0xA830,0xA835},
    {0xA8D0,0xA8D9}, {0xA900,0xA909}, {0xA9D0,0xA9D9}, {0xA9F0,0xA9F9}, {0xAA50,0xAA59},
    {0xABF0,0xABF9}, {0xFF10,0xFF19}, {0x10107,0x10133}, {0x10140,0x10178}, {0x1018A,0x1018B},
    {0x102E1,0x102FB}, {0x10320,0x10323}, {0x10341,0x10341}, {0x1034A,0x1034A}, {0x103D1,0x103D5},
    {0x104A0,0x104A9}, {0x10858,0x1085F}, {0x10879,0x1087F}, {0x108A7,0x108AF}, {0x108FB,0x108FF},
    {0x10916,0x1091B}, {0x109BC,0x109BD}, {0x109C0,0x109CF}, {0x109D2,0x109FF}, {0x10A40,0x10A48},
    {0x10A7D,0x10A7E}, {0x10A9D,0x10A9F}, {0x10AEB,0x10AEF}, {0x10B58,0x10B5F}, {0x10B78,0x10B7F},
    {0x10BA9,0x10BAF}, {0x10CFA,0x10CFF}, {0x10D30,0x10D39}, {0x10D40,0x10D49}, {0x10E60,0x10E7E},
    {0x10F1D,0x10F26}, {0x10F51,0x10F54}, {0x10FC5,0x10FCB}, {0x11052,0x1106F}, {0x110F0,0x110F9},
    {0x11136,0x1113F}, {0x111D0,0x111D9}, {0x111E1,0x111F4}, {0x112F0,0x112F9}, {0x11450,0x11459},
    {0x114D0,0x114D9}, {0x11650,0x11659}, {0x116C0,0x116C9}, {0x116D0,0x116E3}, {0x11730,0x1173B},
    {0x118E0,0x118F2}, {0x11950,0x11959}, {0x11BF0,0x11BF9}, {0x11C50,0x11C6C}, {0x11D50,0x11D59},
    {0x11DA0,0x11DA9}, {0x11DE0,0x11DE9}, {0x11F50,0x11F59}, {0x11FC0,0x11FD4}, {0x12400,0x1246E},
    {0x16130,0x16139}, {0x16A60,0x16A69}, {0x16AC0,0x16AC9}, {0x16B50,0x16B59}, {0x16B5B,0x16B61},
    {0x16D70,0x16D79}, {0x16E80,0x16E96}, {0x16FF4,0x16FF6}, {0x1CCF0,0x1CCF9}, {0x1D2C0,0x1D2D3},
    {0x1D2E0,0x1D2F3}, {0x1D360,0x1D378}, {0x1D7CE,0x1D7FF}, {0x1E140,0x1E149}, {0x1E2F0,0x1E2F9},
    {0x1E4F0,0x1E4F9}, {0x1E5F1,0x1E5FA}, {0x1E8C7,0x1E8CF}, {0x1E950,0x1E959}, {0x1EC71,0x1ECAB},
    {0x1ECAD,0x1ECAF}, {0x1ECB1,0x1ECB4}, {0x1ED01,0x1ED2D}, {0x1ED2F,0x1ED3D}, {0x1F100,0x1F10C},
    {0x1FBF0,0x1FBF9},
};
