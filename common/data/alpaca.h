// alpaca.h: instruction data -> prompt template -> tokens + loss mask -> global batches.
//
// This is the SC24 tutorial's data recipe (data/alpaca/prepare.py + its collator), step by step:
//   1. an alpaca record {instruction, input, output} becomes the text
//        prompt = the Alpaca template around instruction (and input), text = prompt + output;
//   2. text -> tokens, cut at max_seq_len; end-of-text appended when there is room;
//   3. the first len(tokens(prompt)) tokens carry no loss: the model learns to answer, not to ask;
//   4. a global batch of sequences is padded on the right to a common length (a multiple of 8),
//      and shifted by one: inputs = tokens[0..n-2], targets = tokens[1..n-1]; pads and prompt
//      positions get target -1 (no loss);
//   5. the loss is the mean over every target of the *global* batch, so each rank gets
//      n_targets_global to divide by, whatever its slice holds.
// The sample order is a function of (seed, epoch) only: 1, 2 or 4 ranks see the same global
// batches, each rank taking its own slice of rows.
#ifndef ALPACA_H
#define ALPACA_H

#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

// One record. Every field is a malloc'd NUL-terminated UTF-8 string ("" when input is absent).
typedef struct {
    char *instruction, *input, *output;
} AlpacaRecord;

// ---- records -----------------------------------------------------------------------------------

// Parse an alpaca JSON array held in memory; `source` names it in error messages (the file).
// Every problem is a fatal() naming source, record index and field: not JSON, not an array,
// empty, a record that is not an object, missing instruction/output, a field that is not a
// string, a field that is not valid UTF-8. Returns *n_records malloc'd records.
AlpacaRecord *alpaca_parse(const char *json, size_t len, const char *source, int *n_records);
AlpacaRecord *alpaca_read_file(const char *path, int *n_records);  // read + alpaca_parse
void alpaca_free_records(AlpacaRecord *records, int n);
// Write records as a pretty-printed alpaca JSON array (fatal() if the file cannot be written).
void alpaca_write_file(const char *path, const AlpacaRecord *records, int n);

// The Alpaca prompt for a record, malloc'd. With-input template when the record has an input
// or when always_input_template is set (the tutorial's quirk: it tested the Python builtin
// `input` instead of the field, so every record got "### Input:\n\n" even when empty).
char *alpaca_format_prompt(const AlpacaRecord *r, int always_input_template);

// A record as training tokens: ids[0..len) = tokens(prompt + output) cut at max_seq_len, then
// end-of-text when len < max_seq_len; ids[0..prompt_len) carry no loss. text_len = the token
// count of prompt + output before the cut (text_len + 1 > max_seq_len: the record was cut).
typedef struct {
    int *ids;  // malloc'd, len entries
    int len, prompt_len, text_len;
} AlpacaTokens;
void alpaca_tokenize(const AlpacaRecord *r, const Tokenizer *tok, int max_seq_len,
                     int always_input_template, AlpacaTokens *out);

// ---- the dataset: records + their tokens, split into train (0) and validation (1) ----------------

enum { SPLIT_TRAIN = 0, SPLIT_VAL = 1 };

typedef struct Dataset Dataset;

typedef struct {
    const char *data_path;      // alpaca JSON file; "" or NULL -> the built-in synthetic set
    const Tokenizer *tok;       // borrowed: must outlive the dataset
    int max_seq_len;            // >= 2 (tutorial: 256)
    int always_input_template;  // the tutorial's quirk (see alpaca_format_prompt); default 0
    double val_fraction;        // in [0, 1): this share of the records is held out
    // the records when data_path is empty: the built-in set (synthetic.h's synthetic_generate),
    // malloc'd as alpaca_read_file's
    AlpacaRecord *(*builtin)(int *n_records);
} DatasetOptions;

// Reads and tokenises every record (fatal() on any bad input). The validation records are
// chosen by a fixed shuffle that does not depend on the training seed, so the held-out set is
// the same in every run; each split keeps the file's order. The caller frees with dataset_free.
Dataset *dataset_load(const DatasetOptions *opt);
void dataset_free(Dataset *d);

int dataset_size(const Dataset *d, int split);  // records in the split
// Record i of the split (0 <= i < dataset_size), owned by the dataset.
const AlpacaRecord *dataset_record(const Dataset *d, int split, long i);
// Its training tokens (owned by the dataset): returns the count, sets *ids and *prompt_len.
int dataset_tokens(const Dataset *d, int split, long i, const int **ids, int *prompt_len);
// Its index in the file (or in the synthetic set), for messages.
long dataset_file_index(const Dataset *d, int split, long i);
int dataset_max_seq_len(const Dataset *d);
const char *dataset_path(const Dataset *d);  // the file, or "(synthetic)"

// ---- global batches ------------------------------------------------------------------------------

// One rank's slice of a global batch: inputs and targets are row-major (rows, T) host arrays.
// inputs: token ids, right-padded with 0. targets: the next token, or -1 (no loss) on prompt
// positions and pads. n_targets_local counts targets >= 0 in this slice, n_targets_global in the
// WHOLE global batch (every slice): divide the summed loss by n_targets_global.
// Start with `Batch b = {0};`: dataset_get_batch allocates on first use and reuses after;
// batch_free releases.
typedef struct {
    int rows, T;
    int *inputs, *targets;
    long n_targets_local, n_targets_global;
    size_t capacity;  // ints allocated in inputs and in targets
} Batch;

// Global batches per epoch of the split; the last partial batch is dropped.
long dataset_batches_per_epoch(const Dataset *d, int split, int global_batch);

// Global batch b (0-based) of `epoch`: the records order[b*G .. (b+1)*G) of a shuffle that depends
// only on (seed, epoch, split), G = global_batch. T = the longest training row of the global
// batch (sequence length - 1) rounded up to a multiple of 8 (at least 8), at most max_seq_len:
// the same in every slice. This process gets rows [slice*G/nslices, (slice+1)*G/nslices) of it;
// G % nslices must be 0 (else a fatal() error saying so).
void dataset_get_batch(const Dataset *d, int split, uint64_t seed, int epoch, long b,
                       int global_batch, int slice, int nslices, Batch *out);
// The epoch's sample order itself: order[k] = the split index (for dataset_record) of the k-th
// sample; order has dataset_size(d, split) entries, allocated by the caller.
void dataset_epoch_order(const Dataset *d, int split, uint64_t seed, int epoch, int *order);
void batch_free(Batch *b);

#endif
