// pipe_lora.c: see pipe_lora.h.
#include "pipe_lora.h"

#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "model/activations.h"

// host buffers: part's tensors from whole's of the same name
static void take_by_name(const ParamLayout *whole, const float *from, const ParamLayout *part, float *to) {
    for (int i = 0; i < part->num_tensors; i++) {
        const TensorInfo *t = &part->tensors[i], *w = layout_tensor(whole, t->name);
        if (!w) fatal("internal: the whole model has no adapter %s", t->name);
        memcpy(to + t->offset, from + w->offset, t->numel * sizeof(float));
    }
}

void pipe_lora_attach(Lora *lo, const Config *cfg, ParamLayout *layout, ParamLayout *full, ModelBuffers *mb,
                      Pipeline *p) {
    memset(lo, 0, sizeof *lo);
    if (!cfg->lora_rank) return;
    // zb-h1 defers the linears' weight gradients to a later pass through the slot's own layers;
    // the adapters' gradients would have to be deferred with them
    if (p->deferred)
        fatal("%s: key 'pp_schedule' is '%s', but LoRA (lora_rank %d) runs under gpipe, 1f1b and interleaved only",
              config_source("pp_schedule"), pipe_schedule_name(p->schedule), cfg->lora_rank);
    Lora whole;
    lora_describe_keys(&whole, cfg, full);
    float *all = lora_start(&whole, cfg, full);  // the values every stage starts from
    lora_describe_keys(lo, cfg, layout);
    float *mine = malloc_or_die(lo->layout.num_params * sizeof(float));
    take_by_name(&whole.layout, all, &lo->layout, mine);
    lora_plug(lo, mine, mb->params, &p->slots[0]);
    for (int i = 1; i < p->n_slots; i++) p->slots[i].ops = &lo->ops;  // the slots' layers are all alike
    lo->recompute_h = p->n_slots > 1;
    free(mine), free(all);
    lora_take_over(lo, layout, mb);
    gpt_layout_free(full);
    *full = whole.layout;  // the table the saved adapter is assembled in
    whole.layout = (ParamLayout){0};
    lora_free(&whole);
    p->lora = lo;
}
