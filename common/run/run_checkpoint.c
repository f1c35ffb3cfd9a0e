// run_checkpoint.c: see run_checkpoint.h.
#include "run_checkpoint.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "model/checkpoint.h"
#include "base/device.h"
#include "base/log.h"
#include "loss_scale.h"
#include "lora.h"
#include "base/trace.h"

// ---- resume: what out_dir holds ---------------------------------------------------------------

// The keys that make a run's numbers, whatever the layout: a checkpoint resumes only under the
// same values. The model's shape, the data and its split, the seed, the global batch, the
// schedule (num_epochs spans it), the optimizer, the precision and its loss scaling, and where
// the weights started. Left out: how the run is laid out (strategy, ranks, grids, micro-batches,
// overlap: the same numbers up to rounding), when it stops (stop_iteration: a longer run
// continues a shorter one), and what it only reports (log, eval, checkpoint intervals, trace).
static const char *const RUN_KEYS[] = {
    "arch", "n_layer", "n_head", "n_embd", "vocab_size", "max_seq_len", "dataset_id", "data_path",
    "tokenizer_path", "val_fraction", "always_input_template", "seed", "global_batch_size",
    "num_epochs", "lr", "min_lr", "warmup_steps", "beta1", "beta2", "eps", "weight_decay",
    "grad_clip", "precision", "loss_scale", "loss_scale_window", "fp8_scaling", "fp8_amax_history", "init_from",
    "random_init",
    "num_experts", "experts_per_token", "moe_every", "capacity_factor", "aux_loss_coef",
    "lora_rank",
};

static const char *const START_OVER = "set resume=false to start over in it (its files are replaced), or choose "
                                      "another out_dir";

// Refuses a checkpoint saved under other values of the RUN_KEYS. A key the saved config lacks
// (a checkpoint older than the key) is not compared.
static void require_same_run(const Config *cfg, const char *saved_json) {
    cJSON *saved = cJSON_Parse(saved_json);
    if (!cJSON_IsObject(saved))
        fatal("%s/model.safetensors: its run_config is not a JSON object; it is neither resumed nor "
              "overwritten: %s", cfg->out_dir, START_OVER);
    char *now_json = config_to_json(cfg);
    cJSON *now = cJSON_Parse(now_json);
    for (size_t i = 0; i < sizeof RUN_KEYS / sizeof RUN_KEYS[0]; i++) {
        const cJSON *was = cJSON_GetObjectItemCaseSensitive(saved, RUN_KEYS[i]),
                    *is = cJSON_GetObjectItemCaseSensitive(now, RUN_KEYS[i]);
        if (!is) fatal("run_checkpoint.c: RUN_KEYS names '%s', which is not a key", RUN_KEYS[i]);
        if (!was || cJSON_Compare(was, is, true)) continue;
        char *was_text = cJSON_PrintUnformatted(was), *is_text = cJSON_PrintUnformatted(is);
        fatal("%s holds the checkpoint of another run: key '%s' was %s there but is %s now (%s); it is "
              "neither resumed nor overwritten: run with the config it was saved with to resume it, %s",
              cfg->out_dir, RUN_KEYS[i], was_text, is_text, config_source(RUN_KEYS[i]), START_OVER);
    }
    cJSON_Delete(now);
    free(now_json);
    cJSON_Delete(saved);
}

void resolve_resume(Config *cfg) {
    bool must = strcmp(cfg->resume_mode, "true") == 0;
    cfg->resume = false;
    if (strcmp(cfg->resume_mode, "false") == 0) return;
    const char *missing;
    int present = checkpoint_files_in(cfg->out_dir, &missing);
    if (present == 0 && !must) return;  // a new run
    if (present == 0)
        fatal("%s: key 'resume' is true but %s holds no checkpoint (model.safetensors, config.json, "
              "optimizer.safetensors) to resume; with resume=auto a run starts there",
              config_source("resume"), cfg->out_dir);
    if (missing)
        fatal("%s holds an incomplete checkpoint: %s is missing; it is neither resumed nor overwritten: %s",
              cfg->out_dir, missing, START_OVER);
    char *saved = checkpoint_run_config(cfg->out_dir);
    if (saved) require_same_run(cfg, saved);
    else if (!must)
        fatal("%s holds a checkpoint saved without its run's config (not by these stages), so "
              "whether it is this run's is unknown; it is neither resumed nor overwritten: set "
              "resume=true to resume it anyway, %s", cfg->out_dir, START_OVER);
    free(saved);
    cfg->resume = true;
}

// ---- saving and loading -----------------------------------------------------------------------

static float *to_host(const float *dev, size_t n) {
    float *host = malloc_or_die(n * sizeof(float));
    copy_to_host(host, dev, n * sizeof(float));
    return host;
}

static struct {
    const char *name;
    int64_t rows, cols;
    ExtraStateWriter write;
    const void *ctx;
} g_extra;  // the plug-in's state every checkpoint keeps (checkpoint_keep_extra)

void checkpoint_keep_extra(const char *name, int64_t rows, int64_t cols, ExtraStateWriter write, const void *ctx) {
    g_extra.name = name, g_extra.rows = rows, g_extra.cols = cols, g_extra.write = write, g_extra.ctx = ctx;
}

// the model and the optimizer state (host copies), and the plug-in's state
static void save_model_checkpoint(const Config *cfg, const ParamLayout *layout, const float *hp, const float *hm,
                                  const float *hv, long step) {
    char *json = config_to_json(cfg);
    TrainState state = {.step = step, .seed = (uint64_t)cfg->seed};
    loss_scaler_save(&state);
    float *extra = NULL;
    if (g_extra.name) {
        extra = malloc_or_die((size_t)(g_extra.rows * g_extra.cols) * sizeof(float));
        g_extra.write(g_extra.ctx, extra);
        state.extra_name = g_extra.name, state.extra = extra;
        state.extra_rows = g_extra.rows, state.extra_cols = g_extra.cols;
    }
    checkpoint_save(cfg->out_dir, layout, hp, hm, hv, &state, json);
    free(extra);
    free(json);
}

void save_checkpoint(const Config *cfg, const ParamLayout *layout, const float *params,
                     const float *m, const float *v, long step) {
    int m0 = trace_mark();
    size_t n = layout->num_params;
    float *hp = to_host(params, n), *hm = to_host(m, n), *hv = to_host(v, n);
    if (cfg->lora_rank) lora_save(cfg, layout, hp);  // layout: the adapters (lora_attach)
    else save_model_checkpoint(cfg, layout, hp, hm, hv, step);
    free(hp);
    free(hm);
    free(hv);
    trace_span("checkpoint write", TRACK_COMPUTE, m0, trace_mark(), NULL);
}

long resume_checkpoint(const Config *cfg, const ParamLayout *layout, float *params, float *m, float *v) {
    size_t n = layout->num_params, bytes = n * sizeof(float);
    float *hp = malloc_or_die(bytes), *hm = malloc_or_die(bytes), *hv = malloc_or_die(bytes);
    TrainState state;
    checkpoint_load_model(cfg->out_dir, layout, hp);
    checkpoint_load_optimizer(cfg->out_dir, layout, hm, hv, &state);
    if (state.seed != (uint64_t)cfg->seed)
        fatal("%s: the saved run used seed %llu but the config says %d; resume needs the same seed",
              cfg->out_dir, (unsigned long long)state.seed, cfg->seed);
    copy_to_device(params, hp, bytes);
    copy_to_device(m, hm, bytes);
    copy_to_device(v, hv, bytes);
    free(hp);
    free(hm);
    free(hv);
    return state.step;
}

void load_initial_weights(const Config *cfg, const ParamLayout *layout, float *params) {
    size_t bytes = layout->num_params * sizeof(float);
    float *host = malloc_or_die(bytes);
    checkpoint_load_model(cfg->init_from, layout, host);
    copy_to_device(params, host, bytes);
    free(host);
}

long load_checkpoint_part(const Config *cfg, const ParamLayout *part, const ParamLayout *whole, float *params,
                          float *m, float *v) {
    size_t bytes = whole->num_params * sizeof(float);
    float *wp = dev_malloc(bytes), *wm = dev_malloc(bytes), *wv = dev_malloc(bytes);
    long step = 0;
    if (cfg->resume) step = resume_checkpoint(cfg, whole, wp, wm, wv);
    else load_initial_weights(cfg, whole, wp);
    layout_copy_tensors(part, params, whole, wp, false, NULL, NULL);
    if (cfg->resume) {
        layout_copy_tensors(part, m, whole, wm, false, NULL, NULL);
        layout_copy_tensors(part, v, whole, wv, false, NULL, NULL);
    }
    dev_free(wp), dev_free(wm), dev_free(wv);
    return step;
}

void save_checkpoint_from_parts(const Config *cfg, const ParamLayout *part, const ParamLayout *whole,
                                const float *params, const float *m, const float *v, long step, TensorFilter take,
                                const void *take_ctx, PartsSum sum, void *sum_ctx, bool saves) {
    size_t n = whole->num_params;
    const float *parts[3] = {params, m, v};
    float *bufs[3];
    for (int i = 0; i < 3; i++) {
        bufs[i] = dev_malloc(n * sizeof(float));  // zero-filled: the other parts' elements stay 0
        layout_copy_tensors(part, (float *)parts[i], whole, bufs[i], true, take, take_ctx);
        sum(bufs[i], n, sum_ctx);  // each element is non-zero on exactly one rank
    }
    if (saves) save_checkpoint(cfg, whole, bufs[0], bufs[1], bufs[2], step);
    for (int i = 0; i < 3; i++) dev_free(bufs[i]);
}
