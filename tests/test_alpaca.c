// test_alpaca: the data recipe on the four real alpaca fixtures and on the synthetic set.
// Expected numbers come from outside this code: record counts and cut records from
// fixtures/README.md, the token ids of record 0 from fixtures/reference (PyTorch + npm
// gpt-3-encoder), the per-file loss-target totals from OpenAI's reference BPE in Python.
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "check.h"
#include "data/alpaca.h"
#include "data/synthetic.h"
#include "data/tokenizer.h"

#define FIXTURES "../shared/fixtures/"
#define ALPACA FIXTURES "alpaca/"

typedef struct {
    const char *path;
    int records;        // fixtures/README.md
    int cut_at_256;     // records whose tokens + EOS exceed 256 (README: 322 and 7)
    long targets_256;   // tokens with loss over the whole file at max_seq_len 256 (Python reference)
} Fixture;

static const Fixture kFixtures[] = {
    {ALPACA "rasbt-LLMs-from-scratch_instruction-data.json", 1100, 0, 14439},
    {ALPACA "rasbt-LLMs-from-scratch_instruction-examples.json", 200, 0, 2256},
    {ALPACA "stanford-alpaca-first200_from_Niveditha-12-FineTuning.json", 200, 7, 9701},
    {ALPACA "LLaMA-Factory_alpaca_en_demo.json", 999, 322, 112307},
};
#define STANFORD (kFixtures[2].path)
#define LLAMA_FACTORY (kFixtures[3].path)

static Dataset *load(const char *path, const Tokenizer *tok, int max_seq_len, int quirk, double val) {
    DatasetOptions opt = {path, tok, max_seq_len, quirk, val, synthetic_generate};
    return dataset_load(&opt);
}

static int *json_ints(const cJSON *array, int *n) {
    *n = cJSON_GetArraySize(array);
    int *v = malloc(sizeof(int) * (size_t)(*n + 1));
    for (int i = 0; i < *n; i++) v[i] = cJSON_GetArrayItem(array, i)->valueint;
    return v;
}

static void test_record_counts(void) {
    for (int f = 0; f < 4; f++) {
        int n;
        AlpacaRecord *r = alpaca_read_file(kFixtures[f].path, &n);
        CHECK(n == kFixtures[f].records, "%s: %d records, want %d", kFixtures[f].path, n,
              kFixtures[f].records);
        alpaca_free_records(r, n);
    }
}

// Record 0 of the Stanford file against the PyTorch reference's input_ids/targets (which are
// prompt + response tokens, shifted, without EOS), and the mask against the prompt's own ids.
static void test_stanford_record0(const Tokenizer *gpt2) {
    char *json = read_file_or_die(FIXTURES "reference/fake_gpt2_forward.json", NULL);
    cJSON *ref = cJSON_Parse(json);
    int n_in, n_tg;
    int *ref_inputs = json_ints(cJSON_GetObjectItem(ref, "input_ids"), &n_in);
    int *ref_targets = json_ints(cJSON_GetObjectItem(ref, "targets"), &n_tg);
    char *cases_json = read_file_or_die(FIXTURES "reference/gpt2_bpe_cases.json", NULL);
    cJSON *cases_root = cJSON_Parse(cases_json);
    cJSON *cases = cJSON_GetObjectItem(cases_root, "cases");
    const char *ref_prompt = cJSON_GetObjectItem(cJSON_GetArrayItem(cases, 4), "text")->valuestring;
    int n_prompt;
    free(json_ints(cJSON_GetObjectItem(cJSON_GetArrayItem(cases, 4), "ids"), &n_prompt));

    Dataset *d = load(STANFORD, gpt2, 256, 0, 0.0);
    const AlpacaRecord *r = dataset_record(d, SPLIT_TRAIN, 0);
    CHECK(strcmp(r->instruction, "Give three tips for staying healthy.") == 0, "record 0 is \"%s\"",
          r->instruction);
    char *prompt = alpaca_format_prompt(r, 0);
    CHECK(strcmp(prompt, ref_prompt) == 0, "no-input template differs from the reference:\n%s", prompt);
    free(prompt);

    const int *ids;
    int prompt_len, len = dataset_tokens(d, SPLIT_TRAIN, 0, &ids, &prompt_len);
    CHECK(n_in == 81 && len == n_in + 2, "record 0: %d tokens, reference %d inputs (+ last + EOS)",
          len, n_in);
    int same = len == n_in + 2;
    for (int i = 0; same && i < n_in; i++) same = ids[i] == ref_inputs[i] && ids[i + 1] == ref_targets[i];
    CHECK(same, "record 0 token ids differ from fake_gpt2_forward.json");
    CHECK(ids[len - 1] == 50256, "record 0 ends with %d, not EOS", ids[len - 1]);
    CHECK(prompt_len == n_prompt, "record 0: %d masked prompt tokens, the prompt has %d", prompt_len,
          n_prompt);

    // the same record as a training row: targets = reference targets past the prompt, then EOS
    Batch b = {0};
    int *order = malloc(sizeof(int) * (size_t)dataset_size(d, SPLIT_TRAIN));
    dataset_epoch_order(d, SPLIT_TRAIN, 7, 0, order);
    int k = 0;
    while (order[k] != 0) k++;  // where record 0 lands in epoch 0 of seed 7
    dataset_get_batch(d, SPLIT_TRAIN, 7, 0, k, 1, 0, 1, &b);
    int ok = b.T >= n_in + 1 && b.T % 8 == 0;
    for (int t = 0; ok && t < n_in; t++)
        ok = b.inputs[t] == ref_inputs[t] && b.targets[t] == (t + 1 >= n_prompt ? ref_targets[t] : -1);
    ok = ok && b.inputs[n_in] == ref_targets[n_in - 1] && b.targets[n_in] == 50256;
    for (int t = n_in + 1; ok && t < b.T; t++) ok = b.inputs[t] == 0 && b.targets[t] == -1;
    CHECK(ok, "record 0 as a training row (T=%d)", b.T);
    CHECK(b.n_targets_local == n_in + 1 - (n_prompt - 1), "record 0: %ld targets with loss",
          b.n_targets_local);
    batch_free(&b);
    free(order);
    dataset_free(d);
    free(ref_inputs);
    free(ref_targets);
    cJSON_Delete(ref);
    free(json);
    cJSON_Delete(cases_root);
    free(cases_json);
}

// Every row of every batch: inputs = the record's tokens, targets = the next token exactly on the
// response and EOS positions, -1 elsewhere; counts add up; T a multiple of 8 >= the longest row.
// Returns the loss targets of the epoch.
static long check_epoch_rows(const Dataset *d, int split, uint64_t seed, int G, const char *what) {
    int n = dataset_size(d, split);
    int *order = malloc(sizeof(int) * (size_t)n);
    dataset_epoch_order(d, split, seed, 0, order);
    long total = 0, bad_rows = 0, bad_counts = 0, bad_T = 0;
    Batch b = {0};
    for (long batch = 0; batch < dataset_batches_per_epoch(d, split, G); batch++) {
        dataset_get_batch(d, split, seed, 0, batch, G, 0, 1, &b);
        long count = 0;
        int longest = 0;
        for (int r = 0; r < G; r++) {
            const int *ids, *in = b.inputs + (size_t)r * b.T, *tg = b.targets + (size_t)r * b.T;
            int prompt_len, len = dataset_tokens(d, split, order[batch * G + r], &ids, &prompt_len);
            if (len - 1 > longest) longest = len - 1;
            int ok = 1;
            for (int t = 0; t < b.T; t++) {
                int want_in = t < len - 1 ? ids[t] : 0;
                int want_tg = t < len - 1 && t + 1 >= prompt_len ? ids[t + 1] : -1;
                ok &= in[t] == want_in && tg[t] == want_tg;
                count += tg[t] >= 0;
            }
            bad_rows += !ok;
        }
        bad_counts += count != b.n_targets_global || count != b.n_targets_local;
        bad_T += b.T % 8 != 0 || b.T < longest || b.T > dataset_max_seq_len(d);
        total += count;
    }
    CHECK(bad_rows == 0, "%s: %ld rows differ from their record's tokens and mask", what, bad_rows);
    CHECK(bad_counts == 0, "%s: %ld batches miscount their targets", what, bad_counts);
    CHECK(bad_T == 0, "%s: %ld batches with a wrong T", what, bad_T);
    batch_free(&b);
    free(order);
    return total;
}

// Loss on every response token and the EOS, none on the prompt: for records that are not cut,
// the targets with loss are exactly tokens(output) + 1.
static void check_response_targets(const Dataset *d, const Tokenizer *tok, const char *what) {
    int bad = 0;
    for (long i = 0; i < dataset_size(d, SPLIT_TRAIN); i++) {
        const int *ids;
        int prompt_len, len = dataset_tokens(d, SPLIT_TRAIN, i, &ids, &prompt_len);
        if (ids[len - 1] != tokenizer_eot(tok)) continue;  // cut: no EOS
        const AlpacaRecord *r = dataset_record(d, SPLIT_TRAIN, i);
        int *out_ids;
        int n_out = tokenizer_encode(tok, r->output, strlen(r->output), &out_ids);
        bad += len - prompt_len != n_out + 1 ||
               memcmp(ids + prompt_len, out_ids, sizeof(int) * (size_t)n_out) != 0;
        free(out_ids);
    }
    CHECK(bad == 0, "%s: %d records whose loss targets are not exactly response + EOS", what, bad);
}

static void test_masks_and_truncation(const Tokenizer *gpt2) {
    for (int f = 0; f < 4; f++) {
        Dataset *d = load(kFixtures[f].path, gpt2, 256, 0, 0.0);
        int cut = 0, too_long = 0;
        for (long i = 0; i < dataset_size(d, SPLIT_TRAIN); i++) {
            const int *ids;
            int prompt_len, len = dataset_tokens(d, SPLIT_TRAIN, i, &ids, &prompt_len);
            too_long += len > 256;
            if (ids[len - 1] != 50256) cut += 1, too_long += len != 256;  // cut rows are full
        }
        CHECK(cut == kFixtures[f].cut_at_256, "%s: %d records cut at 256, want %d", kFixtures[f].path,
              cut, kFixtures[f].cut_at_256);
        CHECK(too_long == 0, "%s: %d sequences of a wrong length", kFixtures[f].path, too_long);
        long targets = check_epoch_rows(d, SPLIT_TRAIN, 1234, 8, kFixtures[f].path);
        // every record in one batch: all the file's targets (batches_per_epoch drops nothing)
        Batch all = {0};
        dataset_get_batch(d, SPLIT_TRAIN, 1, 0, 0, dataset_size(d, SPLIT_TRAIN), 0, 1, &all);
        CHECK(all.n_targets_global == kFixtures[f].targets_256, "%s: %ld loss targets, want %ld",
              kFixtures[f].path, all.n_targets_global, kFixtures[f].targets_256);
        CHECK(targets <= all.n_targets_global, "%s: epoch has more targets than the file",
              kFixtures[f].path);
        batch_free(&all);
        check_response_targets(d, gpt2, kFixtures[f].path);
        dataset_free(d);
    }
    // LLaMA-Factory at 128: many more records cut, and none longer than 128
    Dataset *d = load(LLAMA_FACTORY, gpt2, 128, 0, 0.0);
    int cut = 0, longer = 0;
    for (long i = 0; i < dataset_size(d, SPLIT_TRAIN); i++) {
        const int *ids;
        int prompt_len, len = dataset_tokens(d, SPLIT_TRAIN, i, &ids, &prompt_len);
        cut += ids[len - 1] != 50256;
        longer += len > 128;
    }
    CHECK(cut == 591 && longer == 0, "LLaMA-Factory at 128: %d cut (want 591), %d too long", cut, longer);
    check_epoch_rows(d, SPLIT_TRAIN, 99, 16, "LLaMA-Factory at 128");
    dataset_free(d);
}

// Slices 0..R-1 of a global batch, stacked, are the 1-slice batch; every slice knows the same T
// and the same global target count.
static void test_slices(const Tokenizer *tok, const char *path, const char *what) {
    Dataset *d = load(path, tok, 256, 0, 0.1);
    const int G = 8;
    Batch whole = {0}, part = {0};
    int bad = 0;
    for (int split = 0; split < 2; split++) {
        for (int epoch = 0; epoch < 2; epoch++) {
            for (long batch = 0; batch < dataset_batches_per_epoch(d, split, G); batch++) {
                dataset_get_batch(d, split, 42, epoch, batch, G, 0, 1, &whole);
                for (int R = 2; R <= 4; R *= 2) {
                    long local_sum = 0;
                    for (int s = 0; s < R; s++) {
                        dataset_get_batch(d, split, 42, epoch, batch, G, s, R, &part);
                        size_t n = (size_t)part.rows * (size_t)part.T;
                        bad += part.rows != G / R || part.T != whole.T ||
                               part.n_targets_global != whole.n_targets_global ||
                               memcmp(part.inputs, whole.inputs + s * n, n * sizeof(int)) != 0 ||
                               memcmp(part.targets, whole.targets + s * n, n * sizeof(int)) != 0;
                        local_sum += part.n_targets_local;
                    }
                    bad += local_sum != whole.n_targets_global;
                }
            }
        }
    }
    CHECK(bad == 0, "%s: %d slices differ from their share of the global batch", what, bad);
    batch_free(&whole);
    batch_free(&part);
    dataset_free(d);
}

static int *epoch_order(const Dataset *d, uint64_t seed, int epoch) {
    int *order = malloc(sizeof(int) * (size_t)dataset_size(d, SPLIT_TRAIN));
    dataset_epoch_order(d, SPLIT_TRAIN, seed, epoch, order);
    return order;
}

static int same_order(const Dataset *d, uint64_t seed_a, int epoch_a, uint64_t seed_b, int epoch_b) {
    int *a = epoch_order(d, seed_a, epoch_a), *b = epoch_order(d, seed_b, epoch_b);
    int same = memcmp(a, b, sizeof(int) * (size_t)dataset_size(d, SPLIT_TRAIN)) == 0;
    free(a);
    free(b);
    return same;
}

static int is_permutation(const int *order, int n) {
    char *seen = calloc((size_t)n, 1);
    int ok = 1;
    for (int i = 0; ok && i < n; i++) ok = order[i] >= 0 && order[i] < n && !seen[order[i]]++;
    free(seen);
    return ok;
}

static void test_order_and_split(const Tokenizer *tok) {
    Dataset *d = load(kFixtures[0].path, tok, 256, 0, 0.1);
    CHECK(dataset_size(d, SPLIT_TRAIN) == 990 && dataset_size(d, SPLIT_VAL) == 110,
          "split 1100 at 0.1 -> %d + %d", dataset_size(d, SPLIT_TRAIN), dataset_size(d, SPLIT_VAL));
    int *order = epoch_order(d, 5, 3);
    CHECK(is_permutation(order, dataset_size(d, SPLIT_TRAIN)), "the order is not a permutation");
    free(order);
    CHECK(same_order(d, 5, 3, 5, 3), "the same (seed, epoch) gave two orders");
    CHECK(!same_order(d, 5, 3, 5, 4), "epochs 3 and 4 have the same order");
    CHECK(!same_order(d, 5, 3, 6, 3), "seeds 5 and 6 have the same order");
    CHECK(dataset_batches_per_epoch(d, SPLIT_TRAIN, 32) == 30, "990 / 32 -> %ld batches",
          dataset_batches_per_epoch(d, SPLIT_TRAIN, 32));
    // the splits are disjoint, cover the file, and keep the file order
    int covered = 0, ascending = 1;
    char *seen = calloc(1100, 1);
    for (int split = 0; split < 2; split++)
        for (long i = 0; i < dataset_size(d, split); i++) {
            long k = dataset_file_index(d, split, i);
            covered += !seen[k]++;
            if (i > 0) ascending &= k > dataset_file_index(d, split, i - 1);
        }
    CHECK(covered == 1100 && ascending, "splits cover %d records (ascending %d)", covered, ascending);
    free(seen);
    // the held-out set does not depend on anything but the file and the fraction
    Dataset *again = load(kFixtures[0].path, tok, 128, 1, 0.1);
    int same = 1;
    for (long i = 0; i < dataset_size(d, SPLIT_VAL); i++)
        same &= dataset_file_index(d, SPLIT_VAL, i) == dataset_file_index(again, SPLIT_VAL, i);
    CHECK(same, "the validation records changed with other options");
    dataset_free(again);
    dataset_free(d);
}

// The tutorial's quirk: the with-input template even for records without input.
static void test_quirk(const Tokenizer *gpt2) {
    AlpacaRecord r = {"Name a color.", "", "Red."};
    char *plain = alpaca_format_prompt(&r, 0), *quirk = alpaca_format_prompt(&r, 1);
    CHECK(strstr(plain, "### Input:") == NULL && strstr(plain, "Below is an instruction that "
          "describes a task. Write") == plain, "no-input template:\n%s", plain);
    CHECK(strstr(quirk, "paired with an input") != NULL &&
          strstr(quirk, "### Instruction:\nName a color.\n\n### Input:\n\n\n### Response:\n") != NULL,
          "quirk template:\n%s", quirk);
    AlpacaRecord with = {"Name a color.", "sky", "Blue."};
    char *a = alpaca_format_prompt(&with, 0), *b = alpaca_format_prompt(&with, 1);
    CHECK(strcmp(a, b) == 0 && strstr(a, "### Input:\nsky\n\n### Response:\n"), "with input:\n%s", a);
    free(plain); free(quirk); free(a); free(b);

    Dataset *d0 = load(STANFORD, gpt2, 256, 0, 0.0), *d1 = load(STANFORD, gpt2, 256, 1, 0.0);
    const int *ids0, *ids1;
    int p0, p1;
    dataset_tokens(d0, SPLIT_TRAIN, 0, &ids0, &p0);
    dataset_tokens(d1, SPLIT_TRAIN, 0, &ids1, &p1);
    CHECK(p1 > p0, "quirk prompt has %d tokens, plain %d", p1, p0);
    char *text = tokenizer_decode(gpt2, ids1, p1);
    CHECK(strstr(text, "### Input:\n\n\n### Response:\n") != NULL, "quirk prompt decodes to:\n%s", text);
    free(text);
    dataset_free(d0);
    dataset_free(d1);
}

// The byte tokenizer: tokens are the bytes of prompt + output, then 256.
static void test_byte_tokens(void) {
    Tokenizer *bytes = tokenizer_load("");
    Dataset *d = load(STANFORD, bytes, 100000, 0, 0.0);
    const AlpacaRecord *r = dataset_record(d, SPLIT_TRAIN, 3);
    char *prompt = alpaca_format_prompt(r, 0);
    const int *ids;
    int prompt_len, len = dataset_tokens(d, SPLIT_TRAIN, 3, &ids, &prompt_len);
    size_t pl = strlen(prompt), ol = strlen(r->output);
    int ok = len == (int)(pl + ol + 1) && prompt_len == (int)pl && ids[len - 1] == 256;
    for (size_t i = 0; ok && i < pl + ol; i++)
        ok = ids[i] == (unsigned char)(i < pl ? prompt[i] : r->output[i - pl]);
    CHECK(ok, "byte tokens of record 3 (len %d, prompt %d)", len, prompt_len);
    free(prompt);
    dataset_free(d);
    tokenizer_free(bytes);
}

// The synthetic set: deterministic, right answers, no input on both sides of the split, short.

// the first digit of `order` that occurs in s: the largest one when order runs 9..0
static char first_digit_in(const char *order, const char *s) {
    for (; *order; order++)
        if (strchr(s, *order)) return *order;
    return '?';
}

static int synthetic_answer_is_right(const AlpacaRecord *r) {
    char want[32];
    size_t n = strlen(r->input);
    if (n >= sizeof want) return 0;
    for (size_t i = 0; i < n; i++)
        if (!isdigit((unsigned char)r->input[i])) return 0;
    if (strcmp(r->instruction, "Sort the digits.") == 0) {
        strcpy(want, r->input);
        for (size_t i = 1; i < n; i++)  // insertion sort: a second, independent way to sort
            for (size_t j = i; j > 0 && want[j - 1] >= want[j]; j--) {
                if (want[j - 1] == want[j]) return 0;  // the digits to sort are distinct
                char c = want[j]; want[j] = want[j - 1]; want[j - 1] = c;
            }
    } else if (strcmp(r->instruction, "Find the largest digit.") == 0) {
        snprintf(want, sizeof want, "%c", first_digit_in("9876543210", r->input));
    } else if (strcmp(r->instruction, "Find the smallest digit.") == 0) {
        snprintf(want, sizeof want, "%c", first_digit_in("0123456789", r->input));
    } else if (strcmp(r->instruction, "Count the digits.") == 0) {
        snprintf(want, sizeof want, "%zu", n);
    } else {
        return 0;
    }
    return strcmp(want, r->output) == 0;
}

static void test_synthetic(void) {
    int n1, n2;
    AlpacaRecord *a = synthetic_generate(&n1), *b = synthetic_generate(&n2);
    int same = n1 == n2 && n1 == SYNTHETIC_RECORDS, right = 0;
    for (int i = 0; same && i < n1; i++)
        same = !strcmp(a[i].instruction, b[i].instruction) && !strcmp(a[i].input, b[i].input) &&
               !strcmp(a[i].output, b[i].output);
    for (int i = 0; i < n1; i++) right += synthetic_answer_is_right(&a[i]);
    CHECK(same, "two generations differ");
    CHECK(right == n1, "%d of %d synthetic answers are right", right, n1);
    alpaca_free_records(a, n1);
    alpaca_free_records(b, n2);

    Tokenizer *bytes = tokenizer_load("");
    Dataset *d = load("", bytes, 256, 0, 0.1);
    int n_val = (SYNTHETIC_RECORDS + 5) / 10;  // round(0.1 * records)
    CHECK(dataset_size(d, SPLIT_TRAIN) == SYNTHETIC_RECORDS - n_val && dataset_size(d, SPLIT_VAL) == n_val,
          "synthetic split %d + %d", dataset_size(d, SPLIT_TRAIN), dataset_size(d, SPLIT_VAL));
    CHECK(strcmp(dataset_path(d), "(synthetic)") == 0, "path %s", dataset_path(d));
    int overlap = 0, longest = 0, cut = 0;
    for (long i = 0; i < dataset_size(d, SPLIT_VAL); i++)
        for (long j = 0; j < dataset_size(d, SPLIT_TRAIN); j++)
            overlap += !strcmp(dataset_record(d, SPLIT_VAL, i)->input, dataset_record(d, SPLIT_TRAIN, j)->input);
    for (int split = 0; split < 2; split++)
        for (long i = 0; i < dataset_size(d, split); i++) {
            const int *ids;
            int p, len = dataset_tokens(d, split, i, &ids, &p);
            if (len > longest) longest = len;
            cut += ids[len - 1] != 256;
        }
    CHECK(overlap == 0, "%d validation inputs also appear in training", overlap);
    CHECK(cut == 0 && longest <= 240, "synthetic: %d cut, longest %d bytes", cut, longest);
    printf("synthetic set: %d train + %d validation records, longest sequence %d bytes\n",
           dataset_size(d, SPLIT_TRAIN), dataset_size(d, SPLIT_VAL), longest);
    check_epoch_rows(d, SPLIT_TRAIN, 3, 16, "synthetic");
    dataset_free(d);
    tokenizer_free(bytes);
}

int main(void) {
    Tokenizer *gpt2 = tokenizer_load(FIXTURES "gpt2-tokenizer");
    Tokenizer *hf = tokenizer_load(FIXTURES "lm-buddy-fake_gpt2");
    Tokenizer *bytes = tokenizer_load("");
    test_record_counts();
    test_stanford_record0(gpt2);
    test_masks_and_truncation(gpt2);
    test_order_and_split(gpt2);
    test_slices(gpt2, LLAMA_FACTORY, "LLaMA-Factory, GPT-2 BPE");
    test_slices(hf, STANFORD, "Stanford, HF layout");
    test_slices(bytes, kFixtures[1].path, "rasbt examples, bytes");
    test_quirk(gpt2);
    test_byte_tokens();
    test_synthetic();
    tokenizer_free(gpt2);
    tokenizer_free(hf);
    tokenizer_free(bytes);
    return test_summary("test_alpaca");
}
