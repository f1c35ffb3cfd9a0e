// stage_run.c: what every stage's main shares besides its technique (stage_run.h).
#include "stage_run.h"

#include <stdio.h>

#include "base/log.h"
#include "base/device.h"
#include "ops/ops.h"

void model_buffers_alloc(ModelBuffers *mb, const ParamLayout *layout, bool with_16bit_copy) {
    mb->n = layout->num_params;
    mb->bytes = mb->n * sizeof(float);
    mb->params = dev_malloc(mb->bytes);
    mb->grads = dev_malloc(mb->bytes);
    mb->adam_m = dev_malloc(mb->bytes);
    mb->adam_v = dev_malloc(mb->bytes);
    weights_point(&mb->w, layout, mb->params);
    weights_point(&mb->g, layout, mb->grads);
    mb->params16 = NULL;
    if (with_16bit_copy) {
        mb->params16 = dev_malloc(mb->n * sizeof(half16));
        weights_point_16(&mb->w, layout, mb->params16);
    }
}

void model_buffers_free(ModelBuffers *mb) {
    weights_free(&mb->w);
    weights_free(&mb->g);
    dev_free(mb->params16);
    dev_free(mb->params);
    dev_free(mb->grads);
    dev_free(mb->adam_m);
    dev_free(mb->adam_v);
}

void model_memory_items(MemoryItem items[MODEL_MEMORY_ITEMS], const Config *cfg, size_t n, size_t activation_bytes) {
    size_t bytes = n * sizeof(float);
    items[0] = (MemoryItem){parameters_label(cfg), bytes};
    items[1] = (MemoryItem){copy_label(cfg), config_is_half(cfg) ? n * sizeof(half16) : 0};
    items[2] = (MemoryItem){"gradients (fp32)", bytes};
    items[3] = (MemoryItem){"AdamW m and v (fp32)", 2 * bytes};
    items[4] = (MemoryItem){activations_label(cfg), activation_bytes};
}

void print_stage_banner(int stage, int ranks, const Config *cfg, const GPTConfig *mc, double num_params) {
    bool half = config_is_half(cfg);
    printf("stage %02d | ", stage);
    if (stage >= 3) printf("%d ranks | ", ranks);
    printf("%s backend (%s) | ", ops_backend_name(), half ? ops_matmul_engine_16() : ops_matmul_engine());
    if (stage >= 2) printf("precision %s | ", cfg->precision);
    printf("%s L=%d H=%d C=%d V=%d | %.2fM parameters\n", gpt_arch(mc)->name, mc->n_layer, mc->n_head, mc->n_embd,
           mc->vocab_size, num_params / 1e6);
    printf("MFU peak: %s\n", ops_peak_flops_source(half));
}

void step_stats_measure(StepStats *s, const Config *cfg, double t0, long tokens, double flops_per_token, int ranks) {
    double seconds = wall_seconds() - t0;
    s->ms = 1e3 * seconds;
    s->tokens_per_sec = tokens / seconds;
    s->mem_bytes = dev_bytes_in_use();
    s->mfu = flops_per_token * s->tokens_per_sec / (ranks * ops_peak_flops(config_is_half(cfg)));
}

bool evaluation_due(const Config *cfg, long step, bool last) {
    return (cfg->eval_interval && step % cfg->eval_interval == 0) || last;
}

bool checkpoint_due(const Config *cfg, long step, bool last) {
    return cfg->checkpoint_interval && step % cfg->checkpoint_interval == 0 && !last;
}

void check_batch_splits(const Config *cfg, int ranks) {
    if (cfg->global_batch_size % (ranks * cfg->gradient_acc_steps) != 0)
        fatal("key 'global_batch_size': %d sequences do not split into %d ranks x %d micro-batches",
              cfg->global_batch_size, ranks, cfg->gradient_acc_steps);
}
