// synthetic.h: the workbook's own instruction data set, generated in memory (no downloads).
//
// Small tasks that a tiny byte-level GPT learns in a few minutes on a CPU, each with one fixed
// instruction and a short exact answer, so a stage can measure exact-answer accuracy:
//   "Sort the digits."          5203    -> 0235
//   "Find the largest digit."   41871   -> 8
//   "Find the smallest digit."  41871   -> 1
//   "Count the digits."         900417  -> 6
// The inputs come from a fixed-seed generator: every run, every machine, the same records in the
// same order. No input string occurs twice in the whole set, so however the records are split,
// no validation input was seen in training.
#ifndef SYNTHETIC_H
#define SYNTHETIC_H

#include "alpaca.h"

enum { SYNTHETIC_RECORDS = 8000 };  // 2000 per task, tasks interleaved

// The records (malloc'd; free with alpaca_free_records); *n_records = SYNTHETIC_RECORDS.
AlpacaRecord *synthetic_generate(int *n_records);

#endif
