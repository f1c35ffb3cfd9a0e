// tokenize: see what the model is trained on.
//
//   build/tokenize [--data FILE] [--tokenizer DIR] [--record I]      one record, token by token
//   build/tokenize --text "Hello world" [--tokenizer DIR]             any text
//   build/tokenize --batch B --global-batch G [--slices R --slice r]  one rank's slice of a batch
//   build/tokenize --write-synthetic FILE                             the built-in set as JSON
//
// A record is shown as its fields, then every token with its id and text, then the counts. The
// prompt tokens carry no loss (the model is not trained to predict them): they are drawn dim on a
// terminal, and in [brackets] in the one-line view.
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "data/alpaca.h"
#include "data/synthetic.h"
#include "data/tokenizer.h"

typedef struct {
    const char *data, *tokenizer, *text, *write_synthetic, *split, *color;
    int max_seq_len, always_input_template, global_batch, slices, slice, epoch;
    long record, batch;
    double val_fraction;
    unsigned long long seed;
} Options;

static void usage(void) {
    printf(
        "usage: build/tokenize [options]\n"
        "  --data FILE              alpaca JSON file (default \"\": the built-in synthetic set)\n"
        "  --tokenizer DIR          GPT-2 tokenizer directory (default \"\": the byte tokenizer)\n"
        "  --max-seq-len N          cut sequences at N tokens (default 256)\n"
        "  --record I               which record of the split to show (default 0)\n"
        "  --split train|val        which split (default train)\n"
        "  --val-fraction F         share of records held out (default 0: record I = file record I)\n"
        "  --always-input-template  the tutorial's quirk: \"### Input:\" even when input is empty\n"
        "  --text STRING            tokenise STRING instead of showing a record\n"
        "  --batch B                show global batch B (with --global-batch, --slices, --slice,\n"
        "                           --seed, --epoch; defaults 8, 1, 0, 1234, 0)\n"
        "  --write-synthetic FILE   write the built-in synthetic set as alpaca JSON and exit\n"
        "  --color auto|always|never  dim the masked prompt (default auto: when stdout is a tty)\n");
}

// ---- command line ------------------------------------------------------------------------------

static long parse_long(const char *flag, const char *value) {
    char *end;
    long v = strtol(value, &end, 10);
    if (!*value || *end) fatal("%s expects an integer, got \"%s\"", flag, value);
    return v;
}

static double parse_double(const char *flag, const char *value) {
    char *end;
    double v = strtod(value, &end);
    if (!*value || *end) fatal("%s expects a number, got \"%s\"", flag, value);
    return v;
}

static Options parse_options(int argc, char **argv) {
    Options o = {.data = "", .tokenizer = "", .split = "train", .color = "auto", .max_seq_len = 256,
                 .global_batch = 8, .slices = 1, .batch = -1, .seed = 1234};
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i];
        if (!strcmp(flag, "--help") || !strcmp(flag, "-h")) { usage(); exit(0); }
        if (!strcmp(flag, "--always-input-template")) { o.always_input_template = 1; continue; }
        if (i + 1 >= argc) fatal("%s needs a value (see --help)", flag);
        const char *v = argv[++i];
        if (!strcmp(flag, "--data")) o.data = v;
        else if (!strcmp(flag, "--tokenizer")) o.tokenizer = v;
        else if (!strcmp(flag, "--text")) o.text = v;
        else if (!strcmp(flag, "--write-synthetic")) o.write_synthetic = v;
        else if (!strcmp(flag, "--split")) o.split = v;
        else if (!strcmp(flag, "--color")) o.color = v;
        else if (!strcmp(flag, "--max-seq-len")) o.max_seq_len = (int)parse_long(flag, v);
        else if (!strcmp(flag, "--record")) o.record = parse_long(flag, v);
        else if (!strcmp(flag, "--batch")) o.batch = parse_long(flag, v);
        else if (!strcmp(flag, "--global-batch")) o.global_batch = (int)parse_long(flag, v);
        else if (!strcmp(flag, "--slices")) o.slices = (int)parse_long(flag, v);
        else if (!strcmp(flag, "--slice")) o.slice = (int)parse_long(flag, v);
        else if (!strcmp(flag, "--epoch")) o.epoch = (int)parse_long(flag, v);
        else if (!strcmp(flag, "--seed")) o.seed = (unsigned long long)parse_long(flag, v);
        else if (!strcmp(flag, "--val-fraction")) o.val_fraction = parse_double(flag, v);
        else fatal("unknown option %s (see --help)", flag);
    }
    if (strcmp(o.split, "train") && strcmp(o.split, "val"))
        fatal("--split must be train or val, got \"%s\"", o.split);
    if (strcmp(o.color, "auto") && strcmp(o.color, "always") && strcmp(o.color, "never"))
        fatal("--color must be auto, always or never, got \"%s\"", o.color);
    return o;
}

// ---- printing tokens -----------------------------------------------------------------------------

static int g_color;  // ANSI colours on?
#define DIM (g_color ? "\033[2m" : "")
#define BOLD (g_color ? "\033[1m" : "")
#define RESET (g_color ? "\033[0m" : "")

// A token's bytes, readable: escapes for control characters and quotes; bytes that are only part
// of a UTF-8 character (GPT-2 splits rare characters over several tokens) as \xNN.
static void print_token_text(const Tokenizer *t, int id) {
    int len;
    const char *s = tokenizer_token_bytes(t, id, &len);
    int whole_chars = utf8_is_valid(s, (size_t)len, NULL);
    for (int i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') fputs("\\n", stdout);
        else if (c == '\t') fputs("\\t", stdout);
        else if (c == '\r') fputs("\\r", stdout);
        else if (c == '\\' || c == '"') printf("\\%c", c);
        else if (c < 0x20 || c == 0x7F || (c >= 0x80 && !whole_chars)) printf("\\x%02X", c);
        else putchar(c);
    }
}

static void print_field(const char *name, const char *value) {
    printf("%s%-12s%s %s\n", BOLD, name, RESET, *value ? value : "(empty)");
}

// The one-line view: [prompt tokens] in brackets (no loss), then the response tokens split by |.
static void print_token_line(const Tokenizer *t, const int *ids, int len, int prompt_len) {
    printf("%s[", DIM);
    for (int i = 0; i < len; i++) {
        if (i == prompt_len) printf("]%s ", RESET);
        else if (i > 0) putchar('|');
        print_token_text(t, ids[i]);
    }
    printf("%s\n", prompt_len >= len ? "]" : "");
    printf("%s", RESET);
}

static void print_token_table(const Tokenizer *t, const int *ids, int len, int prompt_len) {
    printf("\n%s  pos      id  loss  token%s\n", BOLD, RESET);
    for (int i = 0; i < len; i++) {
        // the model predicts token i from tokens 0..i-1: it is trained on it unless it is prompt
        int trained = i >= prompt_len && i > 0;
        printf("%s%5d  %6d  %-4s  \"", trained ? "" : DIM, i, ids[i], trained ? "yes" : "-");
        print_token_text(t, ids[i]);
        printf("\"%s%s\n", ids[i] == tokenizer_eot(t) && i == len - 1 ? "  (end of text)" : "", RESET);
    }
}

static void show_record(const Dataset *d, const Tokenizer *t, const Options *o, int split) {
    if (o->record < 0 || o->record >= dataset_size(d, split))
        fatal("%s: --record %ld does not exist: the %s split has %d records (0..%d)", dataset_path(d),
              o->record, o->split, dataset_size(d, split), dataset_size(d, split) - 1);
    const AlpacaRecord *r = dataset_record(d, split, o->record);
    const int *ids;
    int prompt_len, len = dataset_tokens(d, split, o->record, &ids, &prompt_len);
    AlpacaTokens full;  // again without the cut, to say how much the cut removed
    alpaca_tokenize(r, t, 1 << 30, o->always_input_template, &full);

    printf("%s: record %ld of the %s split (record %ld of the file)\n", dataset_path(d), o->record,
           o->split, dataset_file_index(d, split, o->record));
    printf("tokenizer: %s (vocabulary %d, end-of-text %d), max_seq_len %d\n\n", tokenizer_name(t),
           tokenizer_vocab_size(t), tokenizer_eot(t), dataset_max_seq_len(d));
    print_field("instruction", r->instruction);
    print_field("input", r->input);
    print_field("output", r->output);
    printf("\n");
    print_token_line(t, ids, len, prompt_len);
    print_token_table(t, ids, len, prompt_len);

    int has_eot = len == full.text_len + 1;  // end-of-text is appended only when the text fits
    printf("\n%d tokens: %d prompt (no loss) + %d response%s", len, prompt_len,
           len - prompt_len - has_eot, has_eot ? " + 1 end-of-text" : "");
    if (full.text_len >= dataset_max_seq_len(d))
        printf("; cut at max_seq_len %d: %d of %d text tokens kept, no end-of-text",
               dataset_max_seq_len(d), len, full.text_len);
    printf("\ntrained on %d tokens (the response%s)\n", len - (prompt_len > 1 ? prompt_len : 1),
           has_eot ? " and end-of-text" : "");
    free(full.ids);
}

static void show_text(const Tokenizer *t, const char *text) {
    int *ids;
    int n = tokenizer_encode(t, text, strlen(text), &ids);
    printf("tokenizer: %s, %zu bytes -> %d tokens\n", tokenizer_name(t), strlen(text), n);
    for (int i = 0; i < n; i++) {
        printf("%5d  %6d  \"", i, ids[i]);
        print_token_text(t, ids[i]);
        printf("\"\n");
    }
    free(ids);
}

static void print_ids(const char *label, const int *v, int T) {
    printf("    %s", label);
    for (int t = 0; t < T; t++) printf(" %d", v[t]);
    printf("\n");
}

static void show_batch(const Dataset *d, const Options *o, int split) {
    Batch b = {0};
    dataset_get_batch(d, split, o->seed, o->epoch, o->batch, o->global_batch, o->slice, o->slices, &b);
    printf("%s, %s split, seed %llu, epoch %d: global batch %ld of %ld, slice %d of %d\n",
           dataset_path(d), o->split, o->seed, o->epoch, o->batch,
           dataset_batches_per_epoch(d, split, o->global_batch), o->slice, o->slices);
    printf("rows %d, T %d, targets with loss: %ld here, %ld in the global batch (the loss divides "
           "by this)\n", b.rows, b.T, b.n_targets_local, b.n_targets_global);
    for (int r = 0; r < b.rows; r++) {
        printf("  row %d (global row %d)\n", r, o->slice * b.rows + r);
        print_ids("inputs: ", b.inputs + (size_t)r * b.T, b.T);
        print_ids("targets:", b.targets + (size_t)r * b.T, b.T);
    }
    batch_free(&b);
}

int main(int argc, char **argv) {
    Options o = parse_options(argc, argv);
    g_color = !strcmp(o.color, "always") || (!strcmp(o.color, "auto") && isatty(STDOUT_FILENO));

    if (o.write_synthetic) {
        int n;
        AlpacaRecord *records = synthetic_generate(&n);
        alpaca_write_file(o.write_synthetic, records, n);
        printf("wrote %d synthetic records to %s\n", n, o.write_synthetic);
        alpaca_free_records(records, n);
        return 0;
    }

    Tokenizer *t = tokenizer_load(o.tokenizer);
    if (o.text) {
        show_text(t, o.text);
    } else {
        DatasetOptions opt = {o.data, t, o.max_seq_len, o.always_input_template, o.val_fraction, synthetic_generate};
        Dataset *d = dataset_load(&opt);
        int split = strcmp(o.split, "val") == 0 ? SPLIT_VAL : SPLIT_TRAIN;
        if (o.batch >= 0) show_batch(d, &o, split);
        else show_record(d, t, &o, split);
        dataset_free(d);
    }
    tokenizer_free(t);
    return 0;
}
