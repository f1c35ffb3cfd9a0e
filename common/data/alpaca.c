// alpaca.c: the tutorial's data recipe (see alpaca.h for the steps).
#define _POSIX_C_SOURCE 200809L
#include "alpaca.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/numbers.h"
#include "base/trace.h"

// ---------------------------------------------------------------------------------------------
// Records: JSON -> AlpacaRecord, with an error for every way a file can be wrong
// ---------------------------------------------------------------------------------------------

static const char *json_type_name(const cJSON *item) {
    if (cJSON_IsString(item)) return "a string";
    if (cJSON_IsNumber(item)) return "a number";
    if (cJSON_IsBool(item)) return "a boolean";
    if (cJSON_IsNull(item)) return "null";
    if (cJSON_IsArray(item)) return "an array";
    if (cJSON_IsObject(item)) return "an object";
    return "something else";
}

// line and column of byte offset `at` in text, for "not JSON" messages
static void line_and_column(const char *text, size_t at, int *line, int *column) {
    *line = 1;
    *column = 1;
    for (size_t i = 0; i < at; i++) {
        if (text[i] == '\n') { (*line)++; *column = 1; }
        else (*column)++;
    }
}

// A copy of the record's string field `name`; required fields must exist, an absent optional
// field reads as "".
static char *string_field(const cJSON *record, const char *name, int required, const char *source,
                          int index) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(record, name);
    if (!item) {
        if (required) fatal("%s: record %d: missing field \"%s\"", source, index, name);
    } else if (!cJSON_IsString(item) || !item->valuestring) {
        fatal("%s: record %d: field \"%s\" must be a string, found %s", source, index, name,
              json_type_name(item));
    }
    const char *value = item ? item->valuestring : "";
    size_t len = strlen(value), bad;
    if (!utf8_is_valid(value, len, &bad))
        fatal("%s: record %d: field \"%s\" is not valid UTF-8 (bad byte 0x%02X at offset %zu)",
              source, index, name, (unsigned char)value[bad], bad);
    return copy_string_or_die(value);
}

AlpacaRecord *alpaca_parse(const char *json, size_t len, const char *source, int *n_records) {
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        size_t offset = at && at >= json && at <= json + len ? (size_t)(at - json) : 0;
        int line, column;
        line_and_column(json, offset, &line, &column);
        fatal("%s: not valid JSON (parse error at line %d, column %d)", source, line, column);
    }
    if (!cJSON_IsArray(root))
        fatal("%s: expected a JSON array of {\"instruction\", \"input\", \"output\"} records, "
              "found %s", source, json_type_name(root));
    int n = cJSON_GetArraySize(root);
    if (n == 0) fatal("%s: the dataset is empty (the array has no records)", source);

    AlpacaRecord *records = malloc_or_die((size_t)n * sizeof *records);
    int i = 0;
    for (const cJSON *item = root->child; item; item = item->next, i++) {
        if (!cJSON_IsObject(item))
            fatal("%s: record %d: expected an object with \"instruction\", \"input\", \"output\", "
                  "found %s", source, i, json_type_name(item));
        records[i].instruction = string_field(item, "instruction", 1, source, i);
        records[i].input = string_field(item, "input", 0, source, i);
        records[i].output = string_field(item, "output", 1, source, i);
    }
    cJSON_Delete(root);
    *n_records = n;
    return records;
}

AlpacaRecord *alpaca_read_file(const char *path, int *n_records) {
    size_t len;
    char *text = read_file_or_die(path, &len);
    AlpacaRecord *records = alpaca_parse(text, len, path, n_records);
    free(text);
    return records;
}

void alpaca_free_records(AlpacaRecord *records, int n) {
    if (!records) return;
    for (int i = 0; i < n; i++) {
        free(records[i].instruction);
        free(records[i].input);
        free(records[i].output);
    }
    free(records);
}

void alpaca_write_file(const char *path, const AlpacaRecord *records, int n) {
    cJSON *array = cJSON_CreateArray();
    for (int i = 0; i < n; i++) {
        cJSON *item = cJSON_CreateObject();
        cJSON_AddStringToObject(item, "instruction", records[i].instruction);
        cJSON_AddStringToObject(item, "input", records[i].input);
        cJSON_AddStringToObject(item, "output", records[i].output);
        cJSON_AddItemToArray(array, item);
    }
    char *text = cJSON_Print(array);
    if (!text) fatal("out of memory writing %s", path);
    FILE *f = fopen_or_die(path, "w");
    if (fputs(text, f) == EOF || fputc('\n', f) == EOF || fclose(f) != 0)
        fatal("cannot write %s", path);
    free(text);
    cJSON_Delete(array);
}

// ---------------------------------------------------------------------------------------------
// Prompt template and tokens
// ---------------------------------------------------------------------------------------------

// The "Alpaca-LoRA" template of the tutorial, word for word.
static const char kWithInput[] =
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n%s\n\n### Input:\n%s\n\n### Response:\n";
static const char kNoInput[] =
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n"
    "### Instruction:\n%s\n\n### Response:\n";

char *alpaca_format_prompt(const AlpacaRecord *r, int always_input_template) {
    int with_input = r->input[0] != '\0' || always_input_template;
    int len = with_input ? snprintf(NULL, 0, kWithInput, r->instruction, r->input)
                         : snprintf(NULL, 0, kNoInput, r->instruction);
    char *prompt = malloc_or_die((size_t)len + 1);
    if (with_input) snprintf(prompt, (size_t)len + 1, kWithInput, r->instruction, r->input);
    else snprintf(prompt, (size_t)len + 1, kNoInput, r->instruction);
    return prompt;
}

// As the tutorial: tokenise prompt + output as one text (so the tokens are exactly what GPT-2
// would make of the full text), cut at max_seq_len, append end-of-text if there is room, and
// mask as many leading tokens as the prompt alone has. (The tutorial found that count by
// tokenising the prompt with an EOS appended and subtracting one, which leaves one prompt token
// unmasked when the prompt alone fills max_seq_len; here the whole prompt stays masked.)
void alpaca_tokenize(const AlpacaRecord *r, const Tokenizer *tok, int max_seq_len,
                     int always_input_template, AlpacaTokens *out) {
    char *prompt = alpaca_format_prompt(r, always_input_template);
    size_t prompt_bytes = strlen(prompt), output_bytes = strlen(r->output);
    char *text = malloc_or_die(prompt_bytes + output_bytes + 1);
    memcpy(text, prompt, prompt_bytes);
    memcpy(text + prompt_bytes, r->output, output_bytes + 1);

    int *prompt_ids, *ids;
    int prompt_len = tokenizer_encode(tok, prompt, prompt_bytes, &prompt_ids);
    int text_len = tokenizer_encode(tok, text, prompt_bytes + output_bytes, &ids);
    free(prompt_ids);
    free(prompt);
    free(text);

    int len = text_len < max_seq_len ? text_len : max_seq_len;
    int *seq = malloc_or_die(((size_t)len + 1) * sizeof(int));
    memcpy(seq, ids, (size_t)len * sizeof(int));
    free(ids);
    if (len < max_seq_len) seq[len++] = tokenizer_eot(tok);

    out->ids = seq;
    out->len = len;
    out->prompt_len = prompt_len < len ? prompt_len : len;
    out->text_len = text_len;
}

// ---------------------------------------------------------------------------------------------
// The dataset
// ---------------------------------------------------------------------------------------------

struct Dataset {
    char *path;               // for messages: the file or "(synthetic)"
    AlpacaRecord *records;    // every record, in file order
    AlpacaTokens *tokens;     // tokens[k] belongs to records[k]
    int n_records, max_seq_len;
    int *split_records[2];    // the file indices of each split's records, ascending
    int split_size[2];
};

// Fisher-Yates shuffle of 0..n-1 into order[]. (The modulo's bias is below 1e-13 for any n here.)
static void shuffled_order(int n, uint64_t rng_state, int *order) {
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(rng_next(&rng_state) % (uint64_t)(i + 1));
        int tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
    }
}

// Hold out round(val_fraction * n) records chosen by a fixed shuffle; each split stays in file order.
static void split_records(Dataset *d, double val_fraction) {
    int n = d->n_records;
    int n_val = (int)(val_fraction * n + 0.5);
    if (n - n_val < 1)
        fatal("%s: val_fraction %g leaves no training records (of %d)", d->path, val_fraction, n);
    int *order = malloc_or_die((size_t)n * sizeof(int));
    shuffled_order(n, 0x5EED5EEDull, order);  // a constant: the held-out set never changes
    char *is_val = calloc_or_die((size_t)n, 1);
    for (int k = 0; k < n_val; k++) is_val[order[k]] = 1;
    free(order);

    for (int split = 0; split < 2; split++) {
        d->split_size[split] = split == SPLIT_VAL ? n_val : n - n_val;
        d->split_records[split] = malloc_or_die((size_t)d->split_size[split] * sizeof(int));
        int count = 0;
        for (int k = 0; k < n; k++)
            if (is_val[k] == (split == SPLIT_VAL)) d->split_records[split][count++] = k;
    }
    free(is_val);
}

Dataset *dataset_load(const DatasetOptions *opt) {
    int synthetic = !opt->data_path || !*opt->data_path;
    const char *name = synthetic ? "(synthetic)" : opt->data_path;
    if (opt->max_seq_len < 2) fatal("%s: max_seq_len must be at least 2, got %d", name, opt->max_seq_len);
    if (!(opt->val_fraction >= 0 && opt->val_fraction < 1))
        fatal("%s: val_fraction must be in [0, 1), got %g", name, opt->val_fraction);
    if (tokenizer_eot(opt->tok) < 0)
        fatal("tokenizer %s has no <|endoftext|> token, which the data needs", tokenizer_name(opt->tok));

    Dataset *d = calloc_or_die(1, sizeof *d);
    size_t name_len = strlen(name) + 1;
    d->path = memcpy(malloc_or_die(name_len), name, name_len);
    d->max_seq_len = opt->max_seq_len;
    if (synthetic && !opt->builtin) fatal("no data_path and no built-in data set to read instead");
    d->records = synthetic ? opt->builtin(&d->n_records) : alpaca_read_file(opt->data_path, &d->n_records);
    d->tokens = malloc_or_die((size_t)d->n_records * sizeof *d->tokens);
    for (int k = 0; k < d->n_records; k++)
        alpaca_tokenize(&d->records[k], opt->tok, opt->max_seq_len, opt->always_input_template,
                        &d->tokens[k]);
    split_records(d, opt->val_fraction);
    return d;
}

void dataset_free(Dataset *d) {
    if (!d) return;
    for (int k = 0; k < d->n_records; k++) free(d->tokens[k].ids);
    free(d->tokens);
    alpaca_free_records(d->records, d->n_records);
    free(d->split_records[0]);
    free(d->split_records[1]);
    free(d->path);
    free(d);
}

static void check_split(const Dataset *d, int split) {
    if (split != SPLIT_TRAIN && split != SPLIT_VAL)
        fatal("%s: split must be 0 (train) or 1 (validation), got %d", d->path, split);
}

// the file index of record i of the split, checked
static int file_index_or_die(const Dataset *d, int split, long i) {
    check_split(d, split);
    if (i < 0 || i >= d->split_size[split])
        fatal("%s: record %ld of the %s split does not exist (it has %d)", d->path, i,
              split == SPLIT_VAL ? "validation" : "training", d->split_size[split]);
    return d->split_records[split][i];
}

int dataset_size(const Dataset *d, int split) {
    check_split(d, split);
    return d->split_size[split];
}

const AlpacaRecord *dataset_record(const Dataset *d, int split, long i) {
    return &d->records[file_index_or_die(d, split, i)];
}

int dataset_tokens(const Dataset *d, int split, long i, const int **ids, int *prompt_len) {
    const AlpacaTokens *t = &d->tokens[file_index_or_die(d, split, i)];
    *ids = t->ids;
    *prompt_len = t->prompt_len;
    return t->len;
}

long dataset_file_index(const Dataset *d, int split, long i) { return file_index_or_die(d, split, i); }
int dataset_max_seq_len(const Dataset *d) { return d->max_seq_len; }
const char *dataset_path(const Dataset *d) { return d->path; }

// ---------------------------------------------------------------------------------------------
// Global batches
// ---------------------------------------------------------------------------------------------

long dataset_batches_per_epoch(const Dataset *d, int split, int global_batch) {
    check_split(d, split);
    if (global_batch < 1) fatal("global_batch_size must be at least 1, got %d", global_batch);
    return d->split_size[split] / global_batch;
}

// Targets with loss in one sequence: positions j = 1..len-1 that are not prompt (j >= prompt_len).
static long targets_with_loss(const AlpacaTokens *t) {
    int first = t->prompt_len > 1 ? t->prompt_len : 1;
    return t->len > first ? t->len - first : 0;
}

// Write one training row: inputs = ids[0..len-2], targets = ids[1..len-1] (-1 on prompt
// positions), both padded to T. Returns the number of targets with loss.
static long fill_row(const AlpacaTokens *t, int T, int *inputs, int *targets) {
    long count = 0;
    for (int pos = 0; pos < T; pos++) {
        int has_next = pos + 1 < t->len;  // position pos predicts token pos+1
        inputs[pos] = has_next ? t->ids[pos] : 0;
        targets[pos] = has_next && pos + 1 >= t->prompt_len ? t->ids[pos + 1] : -1;
        count += targets[pos] >= 0;
    }
    return count;
}

static void reserve_batch(Batch *out, size_t n) {
    if (n <= out->capacity) return;
    free(out->inputs);
    free(out->targets);
    out->inputs = malloc_or_die(n * sizeof(int));
    out->targets = malloc_or_die(n * sizeof(int));
    out->capacity = n;
}

// The sample order: a shuffle seeded by (seed, epoch, split) and nothing else -- not the rank, not
// the number of ranks -- so every layout walks through the same global batches.
void dataset_epoch_order(const Dataset *d, int split, uint64_t seed, int epoch, int *order) {
    check_split(d, split);
    uint64_t mix = seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)(uint32_t)epoch << 1 | (uint64_t)split);
    shuffled_order(d->split_size[split], mix, order);
}

void dataset_get_batch(const Dataset *d, int split, uint64_t seed, int epoch, long b,
                       int global_batch, int slice, int nslices, Batch *out) {
    int m0 = trace_mark();
    long n_batches = dataset_batches_per_epoch(d, split, global_batch);
    if (nslices < 1) fatal("the number of batch slices (ranks) must be at least 1, got %d", nslices);
    if (global_batch % nslices != 0)
        fatal("global_batch_size %d cannot be split evenly over %d ranks: make it a multiple of %d",
              global_batch, nslices, nslices);
    if (slice < 0 || slice >= nslices) fatal("batch slice %d out of range 0..%d", slice, nslices - 1);
    if (b < 0 || b >= n_batches)
        fatal("%s: batch %ld does not exist: the %s split has %ld batches of %d per epoch", d->path,
              b, split == SPLIT_VAL ? "validation" : "training", n_batches, global_batch);

    int *order = malloc_or_die((size_t)d->split_size[split] * sizeof(int));
    dataset_epoch_order(d, split, seed, epoch, order);
    const int *members = order + b * global_batch;  // positions in the split

    // T from the whole global batch, so that every slice agrees on it
    int longest = 0;
    long n_global = 0;
    for (int r = 0; r < global_batch; r++) {
        const AlpacaTokens *t = &d->tokens[d->split_records[split][members[r]]];
        if (t->len - 1 > longest) longest = t->len - 1;
        n_global += targets_with_loss(t);
    }
    int T = (longest + 7) / 8 * 8;
    if (T < 8) T = 8;
    if (T > d->max_seq_len) T = d->max_seq_len;

    int rows = global_batch / nslices;
    reserve_batch(out, (size_t)rows * (size_t)T);
    out->rows = rows;
    out->T = T;
    out->n_targets_local = 0;
    out->n_targets_global = n_global;
    for (int r = 0; r < rows; r++) {
        const AlpacaTokens *t = &d->tokens[d->split_records[split][members[slice * rows + r]]];
        out->n_targets_local += fill_row(t, T, out->inputs + (size_t)r * T, out->targets + (size_t)r * T);
    }
    free(order);
    trace_span("data load", TRACK_COMPUTE, m0, trace_mark(), NULL);
}

void batch_free(Batch *b) {
    free(b->inputs);
    free(b->targets);
    *b = (Batch){0};
}
