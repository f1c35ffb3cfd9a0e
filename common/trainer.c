// trainer.c: see trainer.h.
#define _POSIX_C_SOURCE 200809L
#include "trainer.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "log.h"
#include "ops.h"
#include "trace.h"

// ---- model shape ------------------------------------------------------------------------------

bool starts_from_checkpoint(const Config *cfg) {
    return cfg->init_from[0] && !cfg->random_init && !cfg->resume;
}

// phi-1_5's position encoding: rotary on half of each head's dims, base 10000
static void phi_rotary_defaults(GPTConfig *mc) {
    mc->arch = &ARCH_PHI;
    mc->rotary_dim = mc->n_embd / mc->n_head / 4 * 2;  // half the head, in pairs
    mc->rope_theta = 10000.0f;
}

// the experts' routing as the run trains it (capacity_factor and aux_loss_coef are the run's)
static void moe_training_settings(GPTConfig *mc, const Config *cfg) {
    mc->capacity_factor = (float)cfg->capacity_factor;
    mc->aux_loss_coef = (float)cfg->aux_loss_coef;
}

// a checkpoint's experts: num_experts 0 takes them, as n_layer 0 takes its blocks
static void check_checkpoint_experts(const GPTConfig *mc, const Config *cfg, const char *path) {
    if (cfg->num_experts && mc->n_experts != cfg->num_experts)
        fatal("%s: the checkpoint has %d experts per mixture-of-experts block but key 'num_experts' is %d; "
              "set num_experts to %d (or 0: the checkpoint's)", path, mc->n_experts, cfg->num_experts,
              mc->n_experts);
}

GPTConfig model_shape(const Config *cfg, const Tokenizer *tok) {
    GPTConfig mc = {0};
    int vocab = tokenizer_vocab_size(tok);
    if (starts_from_checkpoint(cfg) || cfg->resume) {
        const char *path = cfg->resume ? cfg->out_dir : cfg->init_from;
        checkpoint_read_config(path, &mc);
        // phi's checkpoint pads its vocabulary (51200 rows for 50295 tokens); GPT-2's does not
        if (mc.arch == &ARCH_PHI ? mc.vocab_size < vocab : mc.vocab_size != vocab)
            fatal("%s: the checkpoint's vocabulary has %d tokens but the tokenizer ('%s') has %d; "
                  "set tokenizer_path to the tokenizer it was trained with", path, mc.vocab_size,
                  cfg->tokenizer_path[0] ? cfg->tokenizer_path : "byte tokenizer", vocab);
        if (mc.max_seq_len < cfg->max_seq_len)
            fatal("%s: the checkpoint has %d positions but max_seq_len is %d", path, mc.max_seq_len,
                  cfg->max_seq_len);
        check_checkpoint_experts(&mc, cfg, path);
        moe_training_settings(&mc, cfg);
        return mc;
    }
    mc.max_seq_len = cfg->max_seq_len;
    if (cfg->vocab_size && cfg->vocab_size < vocab)
        fatal("key 'vocab_size': the tokenizer needs at least %d, found %d", vocab, cfg->vocab_size);
    mc.vocab_size = cfg->vocab_size ? cfg->vocab_size : vocab;
    mc.padded_vocab_size = gpt_padded_vocab(mc.vocab_size);
    mc.n_layer = cfg->n_layer;
    mc.n_head = cfg->n_head;
    mc.n_embd = cfg->n_embd;
    mc.n_experts = cfg->num_experts;
    mc.experts_per_token = cfg->experts_per_token;
    mc.moe_every = cfg->moe_every;
    moe_training_settings(&mc, cfg);
    if (strcmp(cfg->arch, "phi") == 0) phi_rotary_defaults(&mc);
    return mc;
}

// ---- data and the length of the run ----------------------------------------------------------

int micro_batches_per_step(const Config *cfg) { return cfg->gradient_acc_steps * cfg->num_microbatches; }

void print_batch_plan(const Config *cfg, const Dataset *data, int row_groups, const char *what, long total_steps) {
    int acc = micro_batches_per_step(cfg), rows = cfg->global_batch_size / acc / row_groups;
    char ranks[64] = "";
    if (row_groups > 1) snprintf(ranks, sizeof ranks, "%d %s x ", row_groups, what);
    printf("data: %d train / %d validation records | global batch %d = %s%d micro-batch%s of %d "
           "sequence%s | %ld steps\n", dataset_size(data, 0), dataset_size(data, 1), cfg->global_batch_size,
           ranks, acc, acc == 1 ? "" : "es", rows, rows == 1 ? "" : "s", total_steps);
}

int acts_flags(const Config *cfg) {
    return (config_is_half(cfg) ? ACTS_BF16 : 0) | (cfg->activation_checkpointing ? ACTS_RECOMPUTE : 0);
}

Dataset *load_dataset(const Config *cfg, const Tokenizer *tok) {
    DatasetOptions opt = {.data_path = cfg->data_path, .tok = tok, .max_seq_len = cfg->max_seq_len,
                          .always_input_template = cfg->always_input_template,
                          .val_fraction = cfg->val_fraction};
    return dataset_load(&opt);
}

void plan_steps(const Config *cfg, const Dataset *data, long *batches_per_epoch, long *schedule_steps,
                long *total_steps) {
    *batches_per_epoch = dataset_batches_per_epoch(data, 0, cfg->global_batch_size);
    if (*batches_per_epoch == 0)
        fatal("%s: %d training records make no global batch of %d",
              cfg->data_path[0] ? cfg->data_path : "synthetic data", dataset_size(data, 0),
              cfg->global_batch_size);
    *schedule_steps = *total_steps = *batches_per_epoch * cfg->num_epochs;
    if (cfg->stop_iteration >= 0 && cfg->stop_iteration < *total_steps) *total_steps = cfg->stop_iteration;
}

// ---- optimisation -----------------------------------------------------------------------------

double learning_rate(const Config *cfg, long step, long total_steps) {
    if (step < cfg->warmup_steps) return cfg->lr * (double)(step + 1) / cfg->warmup_steps;
    long decay_steps = total_steps - cfg->warmup_steps;
    if (decay_steps <= 1) return cfg->lr;
    double progress = (double)(step - cfg->warmup_steps) / (double)(decay_steps - 1);
    if (progress > 1) progress = 1;
    double cosine = 0.5 * (1.0 + cos(3.14159265358979323846 * progress));
    return cfg->min_lr + cosine * (cfg->lr - cfg->min_lr);
}

void adamw_step(const ParamLayout *layout, float *params, const float *grads, float *m, float *v,
                size_t first, size_t n, const Config *cfg, double lr, long t, float clip) {
    int m0 = trace_mark();
    // One call per tensor (or per part of one inside [first, first + n)), because the weight
    // decay differs between tensors; the pointers are to the range's first element.
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *ti = &layout->tensors[i];
        size_t lo = ti->offset > first ? ti->offset : first;
        size_t hi = ti->offset + ti->numel < first + n ? ti->offset + ti->numel : first + n;
        if (lo >= hi) continue;
        size_t at = lo - first;
        adamw_update(params + at, grads + at, clip, m + at, v + at, hi - lo, (float)lr, (float)cfg->beta1,
                     (float)cfg->beta2, (float)cfg->eps, ti->decay ? (float)cfg->weight_decay : 0.0f,
                     (int)t);
    }
    trace_span("optimizer", TRACK_COMPUTE, m0, trace_mark(), NULL);
}

float clip_factor(double norm, double max_norm) {
    return max_norm > 0 && norm > max_norm ? (float)(max_norm / (norm + 1e-6)) : 1.0f;
}

// ---- fp16 loss scaling -------------------------------------------------------------------------

static const LossScaler *g_saved_scaler;  // the scaler whose state save_checkpoint writes

void loss_scaler_init(LossScaler *s, const Config *cfg) {
    g_saved_scaler = s;
    *s = (LossScaler){.on = config_half_format(cfg) == HALF_FP16, .scale = 1, .inject_inf_at = -1};
    if (!s->on) return;
    s->scale = cfg->loss_scale;
    s->window = cfg->loss_scale_window;
    const char *hook = getenv("WORKBOOK_INJECT_INF_STEP");
    if (hook && *hook) s->inject_inf_at = atol(hook);
}

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
static void loss_scaler_save(const LossScaler *s, TrainState *state) {
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

void loss_scaler_resume(LossScaler *s, const Config *cfg) {
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

double flops_per_token(const GPTConfig *c, int T) {
    double L = c->n_layer, C = c->n_embd;
    double matmul_params = L * 12 * C * C + (double)c->padded_vocab_size * C;
    // a MoE block's token runs k experts' MLPs (8 C^2 each) instead of one, and the router (E C)
    double moe = gpt_moe_blocks(c, 0, c->n_layer);
    matmul_params += moe * ((c->experts_per_token - 1) * 8 * C * C + (double)c->n_experts * C);
    return 6 * matmul_params + 12 * L * C * T;
}

// ---- metrics ----------------------------------------------------------------------------------

static void make_dir(const char *dir) {
    char path[1024];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST) fatal("cannot create %s: %s", path, strerror(errno));
        *p = '/';
    }
    if (mkdir(path, 0755) != 0 && errno != EEXIST) fatal("cannot create %s: %s", path, strerror(errno));
}

// A run stopped after its last checkpoint (killed, or a save that failed) logged steps that the
// resumed run will log again: keep the first `steps` lines only, so every step appears once.
static void keep_first_steps(const char *path, long steps) {
    FILE *f = fopen(path, "rb");
    if (!f) return;  // nothing logged yet
    long lines = 0, offset = 0;
    for (int c; lines < steps && (c = getc(f)) != EOF; offset++)
        if (c == '\n') lines++;
    fclose(f);
    if (truncate(path, offset) != 0) fatal("cannot truncate %s: %s", path, strerror(errno));
}

void metrics_open(Metrics *m, const char *out_dir, bool resume, long start_step) {
    char path[1100];
    make_dir(out_dir);
    snprintf(path, sizeof path, "%s/metrics.jsonl", out_dir);
    if (resume) {
        keep_first_steps(path, start_step);
        printf("resuming the run saved in %s after step %ld\n", out_dir, start_step);
    }
    m->f = fopen_or_die(path, resume ? "a" : "w");
    m->start_time = wall_seconds();
    m->start_step = start_step;
}

static void format_duration(char *buf, size_t size, double seconds) {
    long s = (long)(seconds + 0.5);
    if (s >= 3600) snprintf(buf, size, "%ldh%02ldm", s / 3600, s / 60 % 60);
    else snprintf(buf, size, "%ldm%02lds", s / 60, s % 60);
}

// the load-balancing loss, the dropped pairs, and the rows each expert ran, summed over the blocks
static void print_expert_load(const MoEStepStats *moe) {
    printf(" | aux %.4f | dropped %ld | experts", moe->aux_loss, moe->dropped);
    for (int e = 0; e < moe->experts; e++) {
        long rows = 0;
        for (int b = 0; b < moe->blocks; b++) rows += moe->load[b * moe->experts + e];
        printf(" %ld", rows);
    }
}

static void write_expert_load(FILE *f, const MoEStepStats *moe) {
    fprintf(f, ", \"aux_loss\": %.17g, \"dropped\": %ld, \"expert_load\": [", moe->aux_loss, moe->dropped);
    for (int b = 0; b < moe->blocks; b++) {
        fprintf(f, "%s[", b ? ", " : "");
        for (int e = 0; e < moe->experts; e++) fprintf(f, "%s%ld", e ? ", " : "", moe->load[b * moe->experts + e]);
        fprintf(f, "]");
    }
    fprintf(f, "]");
}

static void print_progress(const Metrics *m, const StepStats *s) {
    double elapsed = wall_seconds() - m->start_time;
    long done = s->step - m->start_step;
    char eta[32];
    format_duration(eta, sizeof eta, done > 0 ? elapsed / done * (s->total_steps - s->step) : 0);
    printf("step %5ld/%ld | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s | mfu %.1f%% | mem %.0f MiB",
           s->step, s->total_steps, s->loss, s->lr, s->grad_norm, s->ms, s->tokens_per_sec,
           100 * s->mfu, s->mem_bytes / 1048576.0);
    if (s->has_comm) printf(" | comm %.2f MB %.1f ms", s->comm_bytes / 1e6, s->comm_ms);
    if (s->val_loss >= 0) printf(" | val %.4f", s->val_loss);
    if (s->scaler && s->scaler->on)
        printf(" | scale %.0f%s, %ld skipped", s->scaler->scale, s->scaler->skipped_now ? " (skipped: inf)" : "",
               s->scaler->skipped);
    if (s->moe) print_expert_load(s->moe);
    printf(" | eta %s\n", eta);
    fflush(stdout);
}

void metrics_log(Metrics *m, const StepStats *s, bool print_line) {
    if (print_line) print_progress(m, s);
    // a skipped fp16 step's norm is inf or NaN, which JSON cannot hold: null
    char norm[32] = "null";
    if (isfinite(s->grad_norm)) snprintf(norm, sizeof norm, "%.9g", s->grad_norm);
    fprintf(m->f, "{\"step\": %ld, \"loss\": %.17g, \"lr\": %.9g, \"grad_norm\": %s, \"ms\": %.3f, "
                  "\"tokens_per_sec\": %.1f, \"mfu\": %.5f, \"mem_bytes\": %zu",
            s->step, s->loss, s->lr, norm, s->ms, s->tokens_per_sec, s->mfu, s->mem_bytes);
    if (s->val_loss >= 0) fprintf(m->f, ", \"val_loss\": %.9g", s->val_loss);
    if (s->has_comm) fprintf(m->f, ", \"comm_bytes\": %.0f, \"comm_ms\": %.3f", s->comm_bytes, s->comm_ms);
    if (s->has_state) fprintf(m->f, ", \"state_bytes\": %.0f", s->state_bytes);
    if (s->scaler && s->scaler->on)
        fprintf(m->f, ", \"loss_scale\": %.17g, \"skipped\": %s, \"skipped_steps\": %ld, \"grad_underflow\": %.9g",
                s->scaler->scale, s->scaler->skipped_now ? "true" : "false", s->scaler->skipped,
                s->scaler->underflow);
    if (s->moe) write_expert_load(m->f, s->moe);
    fprintf(m->f, "}\n");
    fflush(m->f);
}

void metrics_close(Metrics *m) {
    if (m->f) fclose(m->f);
    m->f = NULL;
}

void print_memory_report(const char *title, const MemoryItem *items, int n) {
    size_t total = 0;
    printf("%s\n", title);
    for (int i = 0; i < n; i++) {
        printf("  %-28s %10.2f MiB\n", items[i].what, items[i].bytes / 1048576.0);
        total += items[i].bytes;
        run_stats_memory(items[i].what, items[i].bytes);
    }
    printf("  %-28s %10.2f MiB\n", "total", total / 1048576.0);
}

const char *parameters_label(const Config *cfg) {
    if (!config_is_half(cfg)) return "parameters (fp32)";
    return strcmp(cfg->precision, "bf16") == 0 ? "parameters (bf16, no master)" : "parameters (fp32 master)";
}

static bool is_fp16(const Config *cfg) { return config_half_format(cfg) == HALF_FP16; }

const char *copy_label(const Config *cfg) {
    return is_fp16(cfg) ? "parameters (fp16 copy)" : "parameters (bf16 copy)";
}

const char *activations_label(const Config *cfg) {
    if (!config_is_half(cfg)) return "activations (fp32)";
    return is_fp16(cfg) ? "activations (fp16 matmul inputs)" : "activations (bf16 matmul inputs)";
}

void print_bf16_activation_saving(const Activations *acts) {
    if (!acts->spec.bf16) return;
    // the matmul inputs are kept in bf16; what backward reads outside a matmul stays fp32: the
    // LayerNorm statistics, q/k/v and what attention keeps for its backward (the probabilities
    // on the CPU, log-sum-exps on a GPU), the pre-GELU values (GELU backward), the residual stream
    ActsSpec fp32 = acts->spec;
    fp32.bf16 = false;
    size_t fp32_bytes = acts_bytes(&fp32);
    printf("  (in fp32 the activations would take %.2f MiB: %s matmul inputs save %.0f%%; the "
           "statistics, attention, pre-GELU values and residual stream stay fp32)\n",
           fp32_bytes / 1048576.0, ops_half_format() == HALF_FP16 ? "fp16" : "bf16", 100.0 * (1.0 - (double)acts->bytes / fp32_bytes));
    run_stats_number("fp32_activations_bytes", (double)fp32_bytes);
}

// ---- stats.json -------------------------------------------------------------------------------

// What the run has recorded so far, until run_stats_write puts it into the file. One record per
// process, as comm.c keeps its counts: a report records what it prints without the stage passing
// a handle around, so that each stage's diff stays its technique.
static cJSON *g_recorded = NULL;

static cJSON *recorded(void) {
    if (!g_recorded) g_recorded = cJSON_CreateObject();
    if (!g_recorded) fatal("out of memory recording the run's figures");
    return g_recorded;
}

// sets obj[key] = value, replacing an earlier value (a figure recorded again is updated)
static void set_item(cJSON *obj, const char *key, cJSON *value) {
    if (!value) fatal("out of memory recording '%s' for stats.json", key);
    if (cJSON_GetObjectItemCaseSensitive(obj, key)) cJSON_ReplaceItemInObjectCaseSensitive(obj, key, value);
    else cJSON_AddItemToObject(obj, key, value);
}

void run_stats_memory(const char *what, size_t bytes) {
    cJSON *memory = cJSON_GetObjectItemCaseSensitive(recorded(), "memory");
    if (!memory) memory = cJSON_AddObjectToObject(recorded(), "memory");
    set_item(memory, what, cJSON_CreateNumber((double)bytes));
}

void run_stats_number(const char *key, double value) { set_item(recorded(), key, cJSON_CreateNumber(value)); }

static cJSON *layout_json(RunLayout layout) {
    cJSON *j = cJSON_CreateObject();
    if (layout.tp_dimensions[0])
        cJSON_AddItemToObject(j, "tp_dimensions", cJSON_CreateIntArray(layout.tp_dimensions, 3));
    if (layout.pp) cJSON_AddNumberToObject(j, "pp", layout.pp);
    if (layout.ep) cJSON_AddNumberToObject(j, "ep", layout.ep);
    cJSON_AddNumberToObject(j, "dp", layout.dp);
    if (layout.sharded) cJSON_AddTrueToObject(j, "sharded");
    return j;
}

void run_stats_write(const Config *cfg, int stage, int world_size, RunLayout layout, cJSON *communication) {
    // the fields that say what ran come first, for the person who opens the file
    cJSON *stats = cJSON_CreateObject();
    cJSON_AddNumberToObject(stats, "stage", stage);
    cJSON_AddNumberToObject(stats, "world_size", world_size);
    cJSON_AddItemToObject(stats, "layout", layout_json(layout));
    cJSON_AddStringToObject(stats, "precision", cfg->precision);
    cJSON *figures = recorded();
    while (figures->child) {
        cJSON *item = cJSON_DetachItemViaPointer(figures, figures->child);
        cJSON_AddItemToObject(stats, item->string, item);
    }
    cJSON_AddItemToObject(stats, "communication", communication ? communication : cJSON_CreateArray());
    char *text = cJSON_Print(stats);
    if (!text) fatal("out of memory writing %s/stats.json", cfg->out_dir);
    write_text_file(cfg->out_dir, "stats.json", text);
    free(text);
    cJSON_Delete(stats);
    cJSON_Delete(figures);
    g_recorded = NULL;
}

// ---- evaluation -------------------------------------------------------------------------------

static void whole_model_forward(void *weights, Activations *a, const int *inputs, int B, int T) {
    gpt_forward(a, weights, inputs, B, T);
}

void evaluate_sums(Activations *a, const Weights *w, const GPTConfig *mc, const Dataset *data,
                   const Config *cfg, int rank, int world, double sums[2]) {
    evaluate_sums_with(a, whole_model_forward, (void *)w, mc, data, cfg, rank, world, sums);
}

void evaluate_batches(BatchLossFn loss, void *ctx, const Dataset *data, const Config *cfg, int rank,
                      int world, double sums[2]) {
    long batches = dataset_batches_per_epoch(data, 1, cfg->global_batch_size);
    if (batches > cfg->eval_batches) batches = cfg->eval_batches;
    int acc = micro_batches_per_step(cfg);
    Batch batch = {0};
    sums[0] = sums[1] = 0;
    for (long b = 0; b < batches; b++)
        for (int micro = 0; micro < acc; micro++) {
            dataset_get_batch(data, 1, (uint64_t)cfg->seed, 0, b, cfg->global_batch_size,
                              rank * acc + micro, world * acc, &batch);
            sums[0] += loss(ctx, &batch);
            sums[1] += batch.n_targets_local;
        }
    batch_free(&batch);
}

typedef struct {
    Activations *a;
    ForwardFn forward;
    void *ctx;
    const GPTConfig *mc;
} ForwardThenLoss;

static double forward_then_loss(void *ctx, const Batch *batch) {
    ForwardThenLoss *f = ctx;
    f->forward(f->ctx, f->a, batch->inputs, batch->rows, batch->T);
    copy_to_device(f->a->targets, batch->targets, (size_t)batch->rows * batch->T * sizeof(int));
    return gpt_loss_forward(f->a, f->mc, batch->rows, batch->T);
}

void evaluate_sums_with(Activations *a, ForwardFn forward, void *ctx, const GPTConfig *mc,
                        const Dataset *data, const Config *cfg, int rank, int world, double sums[2]) {
    ForwardThenLoss f = {a, forward, ctx, mc};
    evaluate_batches(forward_then_loss, &f, data, cfg, rank, world, sums);
}

// ---- checkpoints ------------------------------------------------------------------------------

static float *to_host(const float *dev, size_t n) {
    float *host = malloc_or_die(n * sizeof(float));
    copy_to_host(host, dev, n * sizeof(float));
    return host;
}

void save_checkpoint(const Config *cfg, const ParamLayout *layout, const float *params,
                     const float *m, const float *v, long step) {
    int m0 = trace_mark();
    size_t n = layout->num_params;
    float *hp = to_host(params, n), *hm = to_host(m, n), *hv = to_host(v, n);
    char *json = config_to_json(cfg);
    TrainState state = {.step = step, .seed = (uint64_t)cfg->seed};
    loss_scaler_save(g_saved_scaler, &state);
    checkpoint_save(cfg->out_dir, layout, hp, hm, hv, &state, json);
    free(json);
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

// ---- preemption -------------------------------------------------------------------------------

static volatile sig_atomic_t signalled;

static void note_signal(int sig) {
    (void)sig;
    signalled = 1;  // all a handler may safely do; the step loop acts on it
}

void preemption_watch(void) {
    struct sigaction sa = {.sa_handler = note_signal};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // a read or an MPI wait that the signal interrupts carries on
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGUSR1, &sa, NULL) != 0)
        fatal("cannot install the SIGTERM/SIGUSR1 handlers: %s", strerror(errno));
}

long preemption_signalled(void) { return signalled; }

void print_stopped_to_be_resumed(const Config *cfg, long step) {
    printf("stopped by a signal after step %ld; checkpoint in %s; run again with the same config "
           "to resume (exit code %d)\n", step, cfg->out_dir, EXIT_TO_BE_RESUMED);
    fflush(stdout);
}
