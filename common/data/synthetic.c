// synthetic.c: the built-in instruction set (see synthetic.h).
//
// Design notes: the byte-level model reads the ~190-byte Alpaca template before every record,
// so instructions are short and fixed per task, inputs are 3..9 digits and answers 1..5 bytes.
// Each task is a simple rule applied to the input, so a model that learned the rule answers
// inputs it never saw.
#define _POSIX_C_SOURCE 200809L
#include "synthetic.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/numbers.h"

static int random_between(uint64_t *state, int lo, int hi) {  // inclusive
    return lo + (int)(rng_next(state) % (uint64_t)(hi - lo + 1));
}

// ---- the tasks: each writes a random input and its answer (buffers of 16 bytes) ----------------
//
// Why digits: the template around the input is ~170 bytes of English, and the model must find the
// 3..9 input bytes in it. Digits occur nowhere else in the prompt, so one attention head can pick
// them out by what they are; letters would hide among the template's own letters, and the model
// then has to learn where they are instead, which takes many times longer (we measured: copying
// letters stayed near 0% after twice this budget while the digit tasks reached 99%).

static void random_digits(uint64_t *rng, int min_len, int max_len, char *digits) {
    int len = random_between(rng, min_len, max_len);
    for (int i = 0; i < len; i++) digits[i] = (char)('0' + random_between(rng, 0, 9));
    digits[len] = '\0';
}

// distinct digits, so that the sorted answer has no repeats to count
static void random_distinct_digits(uint64_t *rng, int min_len, int max_len, char *digits) {
    char pool[] = "0123456789";
    int len = random_between(rng, min_len, max_len);
    for (int i = 0; i < len; i++) {  // a partial Fisher-Yates shuffle of the ten digits
        int j = random_between(rng, i, 9);
        char c = pool[i];
        pool[i] = pool[j];
        pool[j] = c;
    }
    memcpy(digits, pool, (size_t)len);
    digits[len] = '\0';
}

static int compare_chars(const void *a, const void *b) {
    return *(const char *)a - *(const char *)b;
}

static void task_sort(uint64_t *rng, char *input, char *answer) {
    random_distinct_digits(rng, 3, 5, input);
    strcpy(answer, input);
    qsort(answer, strlen(answer), 1, compare_chars);
}

// an input of 4..6 digits and, as the answer, its largest digit (or its smallest)
static void extreme_digit_task(uint64_t *rng, char *input, char *answer, bool largest) {
    random_digits(rng, 4, 6, input);
    char best = input[0];
    for (const char *c = input; *c; c++)
        if (largest ? *c > best : *c < best) best = *c;
    answer[0] = best;
    answer[1] = '\0';
}

static void task_largest(uint64_t *rng, char *input, char *answer) {
    extreme_digit_task(rng, input, answer, true);
}

static void task_smallest(uint64_t *rng, char *input, char *answer) {
    extreme_digit_task(rng, input, answer, false);
}

static void task_count(uint64_t *rng, char *input, char *answer) {
    random_digits(rng, 3, 9, input);
    snprintf(answer, 16, "%d", (int)strlen(input));
}

typedef struct {
    const char *instruction;
    void (*make)(uint64_t *rng, char *input, char *answer);
} Task;

static const Task kTasks[] = {
    {"Sort the digits.", task_sort},
    {"Find the largest digit.", task_largest},
    {"Find the smallest digit.", task_smallest},
    {"Count the digits.", task_count},
};
enum { N_TASKS = sizeof kTasks / sizeof kTasks[0] };

// ---- no input twice: a small set of the strings used so far (open addressing) ------------------

typedef struct {
    char (*slots)[16];  // "" = empty
    size_t mask;
} InputSet;

// adds s; returns 0 if it was already there
static int input_set_add(InputSet *set, const char *s) {
    size_t i = (size_t)hash_bytes(s, strlen(s)) & set->mask;
    while (set->slots[i][0]) {
        if (strcmp(set->slots[i], s) == 0) return 0;
        i = (i + 1) & set->mask;
    }
    strcpy(set->slots[i], s);
    return 1;
}

AlpacaRecord *synthetic_generate(int *n_records) {
    enum { CAPACITY = 4 * 8192 };  // a power of two, well above SYNTHETIC_RECORDS
    InputSet used = {calloc_or_die(CAPACITY, sizeof *used.slots), CAPACITY - 1};
    uint64_t rng = 20241117;  // fixed: the set is the same everywhere (SC24 was in Nov 2024)
    AlpacaRecord *records = malloc_or_die(SYNTHETIC_RECORDS * sizeof *records);

    for (int k = 0; k < SYNTHETIC_RECORDS; k++) {
        const Task *task = &kTasks[k % N_TASKS];
        char input[16], answer[16];
        do task->make(&rng, input, answer);
        while (!input_set_add(&used, input));  // draw again until the input is new
        records[k].instruction = copy_string_or_die(task->instruction);
        records[k].input = copy_string_or_die(input);
        records[k].output = copy_string_or_die(answer);
    }
    free(used.slots);
    *n_records = SYNTHETIC_RECORDS;
    return records;
}
