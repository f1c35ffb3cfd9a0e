// composed_lora.c: see composed_lora.h.
#include "composed_lora.h"

#include "base/log.h"

Trainable *composed_lora_attach(Lora *lo, const Config *cfg, TPModel *m, const ParamLayout *full, ParamLayout *layout,
                                ModelBuffers *mb, Pipeline *pipe) {
    if (cfg->lora_rank && cfg->cp_size > 1)  // the copies over cp would each be saved, and dropout's chunks unplaced
        fatal("%s: key 'cp_size' is %d but lora_rank is %d: stage 10 trains LoRA adapters on dp x tp x pp "
              "(stage 09 trains them with context parallelism); set one of them otherwise",
              config_source("cp_size"), cfg->cp_size, cfg->lora_rank);
    // zb-h1 defers the linears' weight gradients to a later pass; the adapters' would have to be deferred too
    if (cfg->lora_rank && pipe->deferred)
        fatal("%s: key 'pp_schedule' is '%s', but LoRA (lora_rank %d) runs under gpipe and 1f1b only",
              config_source("pp_schedule"), pipe_schedule_name(pipe->schedule), cfg->lora_rank);
    tp_lora_attach_part(lo, cfg, m, full, layout, mb, pipe->slots, pipe->n_slots);
    return lo->rank ? &lo->trained : NULL;
}
