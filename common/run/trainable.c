// trainable.c: see trainable.h.
#include "trainable.h"

#include <string.h>

#include "base/device.h"
#include "base/log.h"
#include "ops/ops.h"

// weights naming nothing: the frozen base's gradients (every pointer NULL)
static void point_nowhere(Weights *g, int n_layer) {
    memset(g, 0, sizeof *g);
    g->n_layer = n_layer;
    g->h = calloc_or_die((size_t)n_layer, sizeof(BlockWeights));
}

void trainable_take_base(Trainable *t, ParamLayout *layout, ModelBuffers *mb) {
    t->base_layout = *layout;
    t->base_params = mb->params;
    t->base_bytes = mb->bytes;
    dev_free(mb->grads), dev_free(mb->adam_m), dev_free(mb->adam_v);
    weights_free(&mb->g);
    point_nowhere(&mb->g, layout->cfg.n_layer);
    if (mb->params16) {
        cast_to_16(mb->params16, mb->params, mb->n);
        t->base_params16 = mb->params16;
        mb->params16 = dev_malloc(t->layout.num_params * sizeof(half16));
    }
    *layout = t->layout;
    mb->n = t->layout.num_params;
    mb->bytes = t->bytes;
    mb->params = t->params, mb->grads = t->grads, mb->adam_m = t->m, mb->adam_v = t->v;
}

void trainable_free_base(Trainable *t) {
    dev_free(t->base_params);
    dev_free(t->base_params16);
    gpt_layout_free(&t->base_layout);
    t->base_params = NULL, t->base_params16 = NULL;
}

void trainable_run_block(Trainable *t, int block) {
    if (t && t->run_block) t->run_block(t, block);
}

void trainable_run_micro(Trainable *t, int after) {
    if (t && t->run_micro) t->run_micro(t, after);
}

void trainable_add_memory(const Trainable *t, MemoryItem items[MODEL_MEMORY_ITEMS]) {
    items[0].bytes += t->base_bytes;
    if (t->base_params16) items[1].bytes += t->base_bytes / sizeof(float) * sizeof(half16);
    items[4].bytes += t->acts_bytes;
}
