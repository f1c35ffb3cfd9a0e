// tp_lora.h: LoRA (common/run/lora.h) on the [x, y, z] grid: each adapter split as its linear.
//
// A linear's block holds W's rows of this rank's out-features and columns of its in-features
// (tp_linear.h); its adapters are cut the same way: A (r, in) keeps the block's columns, B (out, r)
// its rows, the rank r whole. Over x alone that is: the column-parallel layers (qkv, gate|up)
// keep A whole and B's rows, the row-parallel ones (the attention and MLP projections) A's
// columns and B whole. The linear's in-features being split, x A^T is a partial sum, completed by
// an all-reduce over the layer's in group (N x r floats, beside the output's N x out over the same
// group); in backward the gradient dy B is completed over the out group, as dX is. The adapters
// are small, so they are not depth-sharded: every z rank holds a copy, whose gradients are summed
// over z (as the norms') and over the data replicas.
#ifndef TP_LORA_H
#define TP_LORA_H

#include "run/lora.h"
#include "tp_model.h"

// A stage-05 run's LoRA (lora_rank > 0; otherwise nothing happens): lora_attach's work on the
// grid. The adapters are described on the full model, started there (as every stage starts them),
// and this rank's slices of them plugged in around acts' layers; layout and mb become the slices'
// (mb.w still names the base's share), and m->trained hands the model's gradient norm (each
// element of the slices counted on one rank of the replica) and checkpoint (the whole adapters,
// put together from every rank's slices and saved as PEFT's files) to this file.
void tp_lora_attach(Lora *lo, const Config *cfg, TPModel *m, ParamLayout *layout, ModelBuffers *mb, TPActs *acts);
// the same where m holds a part of `model` (stage 10: a pipeline stage's blocks), run in n_slots
// activation slots (lora_plug_slots): the whole adapters are described and started on `model`,
// this rank keeps its slices of the adapters of m's linears, and the checkpoint's group puts
// together every part's (its sum spans every rank that holds slices)
void tp_lora_attach_part(Lora *lo, const Config *cfg, TPModel *m, const ParamLayout *model, ParamLayout *layout,
                         ModelBuffers *mb, Activations *slots, int n_slots);
// tp_memory_items' rows with LoRA: the base's share without gradients or moments (nor their
// depth blocks), the slices' own, and what they keep for backward
void tp_lora_memory(const Lora *lo, MemoryItem items[TP_MEMORY_ITEMS]);

#endif
