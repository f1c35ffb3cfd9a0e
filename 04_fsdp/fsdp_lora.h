// fsdp_lora.h: LoRA (common/run/lora.h) under FSDP: the frozen base sharded, the adapters replicated.
//
// The base's shards, gathers and frees are FSDP's as ever, but the base is frozen: it has no
// gradient to reduce-scatter and no AdamW moments to shard, so a LoRA run on FSDP holds 1/P of
// the base's parameters and nothing else of it. The adapters are small (well under 1% of the
// base): every rank holds them whole, as DDP's replicas hold a model, and their gradients are
// all-reduced once a step (fsdp_reduce_gradients). Sharding them would save little and cost a
// gather per block. The gathered blocks all pass through the same slots, so the LoRA layers know
// a block's adapters by its index (lora_run_block), not by its weights' address.
#ifndef FSDP_LORA_H
#define FSDP_LORA_H

#include "fsdp.h"

// A stage-04 run's LoRA (lora_rank > 0; otherwise nothing happens): describes the adapters on the
// whole model's linears, starts them as every stage does (lora_init, or lora_adapter's tensors),
// plugs the LoRA layers in around acts' layers and freezes f's base (fsdp_freeze_base).
void fsdp_lora_attach(Lora *lo, const Config *cfg, Fsdp *f, Activations *acts);
// fsdp_memory_items' rows with LoRA, FSDP's and DDP's: the adapters' parameters beside the base's,
// their gradients and moments only, and what they keep for backward
void fsdp_lora_memory_items(const Lora *lo, MemoryItem fsdp[], MemoryItem ddp[]);

#endif
