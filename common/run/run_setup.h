// run_setup.h: what a training run is before its first step: the model's shape, the activations'
// flags, the dataset, how long the run is and how a global batch is cut, and the FLOPs a token
// costs (for MFU).
#ifndef RUN_SETUP_H
#define RUN_SETUP_H

#include <stdbool.h>

#include "config/config.h"
#include "data/alpaca.h"
#include "data/tokenizer.h"
#include "model/gpt.h"

// The model's shape: from the checkpoint's config.json when starting from one, else from the
// config keys; the vocabulary comes from the tokenizer (and must agree with a checkpoint's).
GPTConfig model_shape(const Config *cfg, const Tokenizer *tok);
// true when the run starts from init_from (not random_init, not resume)
bool starts_from_checkpoint(const Config *cfg);

// ACTS_* flags for acts_alloc: bf16 matmul inputs for a bf16 precision, recomputation for
// activation_checkpointing
int acts_flags(const Config *cfg);

// The dataset the config names (data_path, max_seq_len, template, validation share).
Dataset *load_dataset(const Config *cfg, const Tokenizer *tok);
// How long a run is: batches per epoch (an error if the training split makes none), the steps
// the learning-rate schedule spans (every epoch), and the steps the run takes. stop_iteration
// only ends the run early (as in the tutorial), so a run stopped and resumed follows the same
// schedule.
void plan_steps(const Config *cfg, const Dataset *data, long *batches_per_epoch, long *schedule_steps,
                long *total_steps);

// Prints the data line: records, and how a global batch is cut, e.g. "global batch 16 = 4 ranks x
// 2 micro-batches of 2 sequences" (row_groups: how many take different rows, named by `what`,
// e.g. "ranks"; 1: one process)
// the micro-batches a replica cuts its share of the global batch into: gradient_acc_steps, or
// in a pipeline num_microbatches (each stage refuses the other key's values other than 1)
int micro_batches_per_step(const Config *cfg);
void print_batch_plan(const Config *cfg, const Dataset *data, int row_groups, const char *what, long total_steps);

// Model FLOPs per token for forward + backward (6 per parameter per token for the matmuls a
// token runs through, plus attention's 12 * L * C * T), for MFU.
double flops_per_token(const GPTConfig *cfg, int T);

#endif
