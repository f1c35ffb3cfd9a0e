// loss_scale.c: see loss_scale.h.
#include "loss_scale.h"

#include <math.h>
#include <stdlib.h>

#include "base/log.h"
#include "ops/ops.h"

static const LossScaler *g_saved_scaler;  // the scaler whose state save_checkpoint writes


float loss_scaler_dloss(const LossScaler *s, long n_targets, long step) {
    if (!n_targets) return 0.0f;
    if (step + 1 == s->inject_inf_at) return INFINITY;  // the test hook: every gradient inf or NaN
    return (float)(s->scale / (double)n_targets);
}

bool loss_scaler_unscale(LossScaler *s, float *grads, size_t n, double *norm) {
    if (!s->on) return true;
    double nonzero, flushed;
    ops_half_underflow(&nonzero, &flushed);
    s->underflow = nonzero > 0 ? flushed / nonzero : 0;
    s->skipped_now = !isfinite(*norm);
    if (s->skipped_now) {
        s->skipped++;
        s->good = 0;
        if (s->window) s->scale /= 2;
        return false;
    }
    scale_inplace(grads, (float)(1.0 / s->scale), n);
    *norm /= s->scale;
    if (s->window && ++s->good == s->window) {
        s->scale *= 2;
        s->good = 0;
    }
    return true;
}

// the scaler's state goes into the optimizer file's metadata, in the checkpoint's atomic group
void loss_scaler_save(TrainState *state) {
    const LossScaler *s = g_saved_scaler;
    if (!s || !s->on) return;
    state->has_loss_scale = true;
    state->loss_scale = s->scale;
    state->loss_scale_good_steps = s->good;
    state->loss_scale_skipped_steps = s->skipped;
}

// Checkpoints saved before the scale moved into the optimizer file kept it in loss_scale.json.
static void loss_scaler_read_old_file(LossScaler *s, const Config *cfg) {
    char path[1100];
    snprintf(path, sizeof path, "%s/loss_scale.json", cfg->out_dir);
    char *text = read_file_or_die(path, NULL);
    cJSON *j = cJSON_Parse(text);
    const cJSON *scale = cJSON_GetObjectItem(j, "loss_scale"), *good = cJSON_GetObjectItem(j, "good_steps"),
                *skipped = cJSON_GetObjectItem(j, "skipped_steps");
    if (!cJSON_IsNumber(scale) || !cJSON_IsNumber(good) || !cJSON_IsNumber(skipped) || !(scale->valuedouble > 0))
        fatal("%s: expected loss_scale (> 0), good_steps and skipped_steps, as a 16-mixed checkpoint "
              "writes them", path);
    s->scale = scale->valuedouble;
    s->good = good->valueint;
    s->skipped = (long)skipped->valuedouble;
    cJSON_Delete(j);
    free(text);
}

// the state save_checkpoint saved, read back when resuming (on every rank); a checkpoint from before
// the state moved into the optimizer file has it in <out_dir>/loss_scale.json
static void loss_scaler_resume(LossScaler *s, const Config *cfg) {
    if (!s->on) return;
    TrainState state;
    checkpoint_load_train_state(cfg->out_dir, &state);
    if (!state.has_loss_scale) {
        loss_scaler_read_old_file(s, cfg);
        return;
    }
    s->scale = state.loss_scale;
    s->good = (int)state.loss_scale_good_steps;
    s->skipped = state.loss_scale_skipped_steps;
}

void loss_scaler_init(LossScaler *s, const Config *cfg) {
    g_saved_scaler = s;
    *s = (LossScaler){.on = config_half_format(cfg) == HALF_FP16, .scale = 1, .inject_inf_at = -1};
    if (!s->on) return;
    s->scale = cfg->loss_scale;
    s->window = cfg->loss_scale_window;
    const char *hook = getenv("WORKBOOK_INJECT_INF_STEP");
    if (hook && *hook) s->inject_inf_at = atol(hook);
    if (cfg->resume) loss_scaler_resume(s, cfg);
}
