// run_checkpoint.h: a training run's checkpoints: whether the run resumes, saving its state from
// the device, resuming it, starting from init_from, and the same for ranks that each hold a part
// of the model.
// checkpoint.h underneath reads and writes the files.
#ifndef RUN_CHECKPOINT_H
#define RUN_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "model/gpt.h"

// Decides whether the run resumes (cfg->resume) from what out_dir holds and the key resume:
//   auto   resume when out_dir holds a complete checkpoint of the same run (the keys that change
//          the numbers, run_checkpoint.c's RUN_KEYS, agree); start when it holds none; refuse
//          (fatal, naming the out_dir, the key, the saved value and the new one) when it holds
//          another run's or an incomplete one: it is never overwritten unasked
//   true   the same, but a directory without a checkpoint is an error too
//   false  start over: the run writes over what out_dir holds
// A training stage calls it right after config_load, on every rank.
void resolve_resume(Config *cfg);

// copies the device buffers to the host and writes model + optimizer state to out_dir; in a LoRA
// run (lora_rank > 0, layout and params the adapters': lora.h's lora_attach) the adapters alone, as
// PEFT's adapter_model.safetensors and adapter_config.json
void save_checkpoint(const Config *cfg, const ParamLayout *layout, const float *params,
                     const float *m, const float *v, long step);
// A plug-in's state that every checkpoint save_checkpoint writes keeps beside the step, in the
// optimizer file's atomic group (stage 02's FP8 amax histories): rows x cols floats, laid out by
// write(ctx, out) at each save, as tensor `name`; a resumed run reads it back with
// checkpoint_load_optimizer_extra (model/checkpoint.h). name NULL: none kept any more.
typedef void (*ExtraStateWriter)(const void *ctx, float *out);
void checkpoint_keep_extra(const char *name, int64_t rows, int64_t cols, ExtraStateWriter write, const void *ctx);
// loads model + optimizer state from out_dir; returns the step to continue from
long resume_checkpoint(const Config *cfg, const ParamLayout *layout, float *params, float *m, float *v);
// fills the device buffer params from init_from
void load_initial_weights(const Config *cfg, const ParamLayout *layout, float *params);
// A rank holding part of the model (a pipeline stage's blocks, an expert range) starts from a
// whole-model checkpoint laid out as `whole`, taking its own tensors by name: resuming (out_dir,
// with AdamW's moments; returns the step) or from init_from.
long load_checkpoint_part(const Config *cfg, const ParamLayout *part, const ParamLayout *whole, float *params,
                          float *m, float *v);
// And the other way: the ranks holding the parts of the model put the whole together. Each lays
// out its share of params, m and v (the tensors take accepts, all when NULL) in a whole-model
// buffer of zeros; sum(buf, n, sum_ctx) adds the buffers of the ranks holding the other parts (an
// all-reduce over them); the rank with `saves` writes the checkpoint.
typedef void (*PartsSum)(float *buf, size_t n, void *ctx);
void save_checkpoint_from_parts(const Config *cfg, const ParamLayout *part, const ParamLayout *whole,
                                const float *params, const float *m, const float *v, long step, TensorFilter take,
                                const void *take_ctx, PartsSum sum, void *sum_ctx, bool saves);

#endif
