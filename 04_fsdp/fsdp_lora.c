// fsdp_lora.c: see fsdp_lora.h.
#include "fsdp_lora.h"

#include <stdlib.h>
#include <string.h>

void fsdp_lora_attach(Lora *lo, const Config *cfg, Fsdp *f, Activations *acts) {
    memset(lo, 0, sizeof *lo);
    if (!cfg->lora_rank) return;
    lora_describe_keys(lo, cfg, f->layout);
    float *host = lora_start(lo, cfg, f->layout);  // the same on every rank: the replicas start alike
    lora_plug(lo, host, NULL, acts);               // no base address: the blocks are known by index
    free(host);
    fsdp_freeze_base(f, lo);
    lora_print_summary(lo, f->layout->num_params);
}

void fsdp_lora_memory_items(const Lora *lo, MemoryItem fsdp[], MemoryItem ddp[]) {
    for (MemoryItem *items = fsdp; items; items = items == fsdp ? ddp : NULL) {
        items[0].bytes += lo->bytes;      // beside the base's parameters (FSDP: its shard)
        items[1].bytes = lo->bytes;       // the adapters' gradients only
        items[2].bytes = 2 * lo->bytes;   // and their AdamW moments
        items[5].bytes += lo->acts_bytes;
    }
}
