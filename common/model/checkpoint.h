// checkpoint.h: checkpoints as safetensors files that Hugging Face tools open.
//
// A checkpoint directory holds
//   model.safetensors      the weights, F32, under Hugging Face names and layouts (GPT-2's or
//                          phi's: the architecture's description in layout.c names them); loading
//                          also reads shards listed in model.safetensors.index.json
//   config.json            the model shape, as transformers' GPT2LMHeadModel or PhiForCausalLM
//                          reads it
//   optimizer.safetensors  AdamW's m and v (our flat layout) + step and seed, for resume
// Every file is written to a temp file, flushed to disk, then renamed over the real name: a
// crash while saving leaves the previous checkpoint intact, never a half-written one.
//
// Underneath is a small safetensors reader. The format (github.com/huggingface/safetensors):
//   8 bytes   N, the header length, little-endian
//   N bytes   JSON {"name": {"dtype": "F32", "shape": [2, 6], "data_offsets": [begin, end]},
//                   ..., "__metadata__": {"key": "string value", ...}}
//   the rest  raw little-endian tensor data; offsets count from the end of the header
// A file is untrusted input: the reader checks every number in the header against the file
// before it reads a byte of data, and every problem is one message naming the file.
#ifndef CHECKPOINT_H
#define CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cjson/cJSON.h>

#include "gpt.h"

// ---- the model checkpoint (what train.c calls) -------------------------------------------------

// Reads the model shape from a checkpoint's config.json. `path` is a directory (with
// model.safetensors and config.json in it) or a .safetensors file (config.json beside it).
// Fills every field of cfg, padded_vocab_size included. model_type "phi" selects ARCH_PHI (its
// options that we do not implement, such as qk_layernorm, are refused by name).
void checkpoint_read_config(const char *path, GPTConfig *cfg);

// Loads every tensor of `layout` into params (host memory, layout->num_params floats).
// Accepts names with or without the "transformer." prefix; F32, F16 and BF16; one file or the
// shards of model.safetensors.index.json; for GPT-2 an optional lm_head.weight (it must equal wte:
// GPT-2's head is tied). Conv1D weights are transposed from
// Hugging Face's (in, out) into our (out, in); wte's V rows fill the first V of our Vp rows and
// the padding rows are zeroed. A missing tensor or a wrong shape is fatal.
void checkpoint_load_model(const char *path, const ParamLayout *layout, float *params);

// Writes <out_dir>/model.safetensors and <out_dir>/config.json (creating out_dir if missing).
// run_config_json (may be NULL) goes into the file's __metadata__ as "run_config".
void checkpoint_save_model(const char *out_dir, const ParamLayout *layout, const float *params,
                           const char *run_config_json);

// What, besides m and v, a resumed run needs: the data position follows from step.
typedef struct {
    long step;      // optimizer steps done
    uint64_t seed;
    // fp16's loss scaler (loss_scale.h), saved beside the step it belongs to so that one atomic
    // group holds both; has_loss_scale false: none saved (another precision, or an older file)
    bool has_loss_scale;
    double loss_scale;
    long loss_scale_good_steps, loss_scale_skipped_steps;
    // a plug-in's state kept with the step (run_checkpoint.h's checkpoint_keep_extra: stage 02's FP8
    // amax histories): one more F32 tensor, extra_name [extra_rows, extra_cols]; written when extra is
    // not NULL, read by checkpoint_load_optimizer_extra
    const char *extra_name;
    const float *extra;
    int64_t extra_rows, extra_cols;
} TrainState;

// <out_dir>/optimizer.safetensors: tensors "m" and "v", each [num_params] F32 in our flat layout,
// and the TrainState in __metadata__ (step, seed; loss_scale, loss_scale_good_steps and
// loss_scale_skipped_steps when it has a loss scale).
void checkpoint_save_optimizer(const char *out_dir, const ParamLayout *layout, const float *m,
                               const float *v, const TrainState *state);
void checkpoint_load_optimizer(const char *out_dir, const ParamLayout *layout, float *m, float *v,
                               TrainState *state);
// the TrainState alone (the header, not the moments): what every rank needs when only one loads
void checkpoint_load_train_state(const char *out_dir, TrainState *state);
// TrainState's extra tensor `name` of <out_dir>/optimizer.safetensors into out (rows x cols floats);
// false, reading nothing, when the file has none of that name (saved without it); a tensor of
// another shape is fatal
bool checkpoint_load_optimizer_extra(const char *out_dir, const char *name, int64_t rows, int64_t cols, float *out);

// What a directory holds of a checkpoint: how many of its three files (model.safetensors,
// config.json, optimizer.safetensors) are there, and the first one missing (NULL: none).
int checkpoint_files_in(const char *dir, const char **missing);
// The run_config a checkpoint's model.safetensors was saved with (malloc'd JSON text), or NULL
// when it has none (written by another tool).
char *checkpoint_run_config(const char *dir);

// The whole checkpoint: model.safetensors, config.json and optimizer.safetensors. Every temp
// file is written and synced before the first rename, so a failure while writing (a full disk)
// leaves the previous checkpoint whole; only a kill in the instant between the renames mixes two.
void checkpoint_save(const char *out_dir, const ParamLayout *layout, const float *params, const float *m,
                     const float *v, const TrainState *state, const char *run_config_json);

// Writes <dir>/<file>: the tensors of `layout` from params (host), F32, as laid out, each named
// prefix + its name: a file of tensors that are not a model (LoRA's adapters, common/run/lora.h)
void safetensors_save_layout(const char *dir, const char *file, const char *prefix, const ParamLayout *layout,
                             const float *params);

// ---- the safetensors reader underneath ---------------------------------------------------------

#define SAFETENSORS_MAX_DIMS 8
#define SAFETENSORS_MAX_HEADER (100u * 1000u * 1000u)  // the reference implementation's limit

typedef struct {
    const char *name;        // points into the parsed header
    const char *dtype;       // "F32", "BF16", ... (a known dtype: checked)
    int dtype_bytes;
    int ndim;
    int64_t shape[SAFETENSORS_MAX_DIMS];
    uint64_t numel;
    uint64_t begin, end;     // byte range in the data section; end - begin = numel * dtype_bytes
} SafeTensor;

typedef struct {
    char *path;              // for messages ("<buffer>" when parsed from memory)
    FILE *file;              // open while the reader is; NULL when parsed from memory
    uint64_t data_start;     // 8 + header length: the file offset that data_offsets count from
    uint64_t data_len;       // bytes after the header
    int num_tensors;
    SafeTensor *tensors;     // in header order
    cJSON *header;           // the parsed header, which the names point into
    const cJSON *metadata;   // the "__metadata__" object, or NULL
} SafeTensors;

// Opens and checks a file; any problem is fatal with the path in the message.
void safetensors_open(SafeTensors *st, const char *path);
void safetensors_close(SafeTensors *st);
const SafeTensor *safetensors_find(const SafeTensors *st, const char *name);  // NULL if absent
const char *safetensors_metadata(const SafeTensors *st, const char *key);     // NULL if absent
// Reads tensor t into out[t->numel] as floats (from F32, F16 or BF16); anything else is fatal.
void safetensors_read_floats(const SafeTensors *st, const SafeTensor *t, float *out);

// The checks themselves, without exiting, so that a fuzzer can drive them: each returns 0, or
// -1 with the reason in err (the caller adds the file name). On failure st holds nothing to free.
// parse_header checks a header of json_len bytes against a data section of data_len bytes;
// parse_bytes checks a whole file held in memory (length prefix + header).
int safetensors_parse_header(SafeTensors *st, const char *json, size_t json_len, uint64_t data_len,
                             char *err, size_t errlen);
int safetensors_parse_bytes(SafeTensors *st, const unsigned char *bytes, size_t size, char *err,
                            size_t errlen);
// Converts n elements of a float dtype to float; returns -1 (and writes nothing) for other dtypes.
int safetensors_to_float(float *out, const void *raw, const char *dtype, size_t n);
// "[2, 6]": writes a shape for messages into buf
const char *safetensors_shape_str(char *buf, size_t size, int ndim, const int64_t *shape);

#endif
