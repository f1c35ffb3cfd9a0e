// run_setup.c: see run_setup.h.
#include "run_setup.h"

#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "data/synthetic.h"
#include "model/activations.h"
#include "model/checkpoint.h"
#include "model/moe_mlp.h"

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

// a Llama trained from scratch: rotary over each whole head (base 10000), RMSNorm's epsilon 1e-5,
// grouped-query attention with n_kv_head heads, an lm_head of its own
static void llama_defaults(GPTConfig *mc, const Config *cfg) {
    mc->arch = &ARCH_LLAMA;
    mc->rotary_dim = mc->n_embd / mc->n_head;
    mc->rope_theta = 10000.0f;
    mc->norm_eps = 1e-5f;
    mc->n_kv_head = cfg->n_kv_head ? cfg->n_kv_head : cfg->n_head;
    mc->ffn_dim = cfg->intermediate_size ? cfg->intermediate_size : 4 * cfg->n_embd;
}

// the experts' routing as the run trains it (capacity_factor and aux_loss_coef are the run's)
static void moe_training_settings(GPTConfig *mc, const Config *cfg) {
    if (!mc->moe) return;
    mc->moe->capacity_factor = (float)cfg->capacity_factor;
    mc->moe->aux_loss_coef = (float)cfg->aux_loss_coef;
}

// a checkpoint's experts: num_experts 0 takes them, as n_layer 0 takes its blocks
static void check_checkpoint_experts(const GPTConfig *mc, const Config *cfg, const char *path) {
    if (cfg->num_experts && gpt_experts(mc) != cfg->num_experts)
        fatal("%s: the checkpoint has %d experts per mixture-of-experts block but key 'num_experts' is %d; "
              "set num_experts to %d (or 0: the checkpoint's)", path, gpt_experts(mc), cfg->num_experts,
              gpt_experts(mc));
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
    mc.moe = moe_config_new(cfg->num_experts, cfg->experts_per_token, cfg->moe_every);
    moe_training_settings(&mc, cfg);
    if (strcmp(cfg->arch, "phi") == 0) phi_rotary_defaults(&mc);
    if (strcmp(cfg->arch, "llama") == 0) llama_defaults(&mc, cfg);
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
    return (config_is_half(cfg) ? ACTS_16BIT : 0) | (cfg->activation_checkpointing ? ACTS_RECOMPUTE : 0);
}

Dataset *load_dataset(const Config *cfg, const Tokenizer *tok) {
    DatasetOptions opt = {.data_path = cfg->data_path, .tok = tok, .max_seq_len = cfg->max_seq_len,
                          .always_input_template = cfg->always_input_template,
                          .val_fraction = cfg->val_fraction, .builtin = synthetic_generate};
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

double flops_per_token(const GPTConfig *c, int T) {
    double L = c->n_layer, C = c->n_embd;
    double matmul_params = L * 12 * C * C + (double)c->padded_vocab_size * C;
    // a MoE block's token runs k experts' MLPs (8 C^2 each) instead of one, and the router (E C)
    double moe = gpt_moe_blocks(c, 0, c->n_layer);
    if (moe) matmul_params += moe * ((c->moe->experts_per_token - 1) * 8 * C * C + (double)c->moe->n_experts * C);
    return 6 * matmul_params + 12 * L * C * T;
}
