// trainable.h: which tensors train when the base model is frozen: a trained set beside the base.
//
// A model transform (LoRA, lora.h, is the one there is) freezes the base model and adds small
// tensors of its own that train. The code that trains a model (a stage's loop, ZeRO and FSDP,
// tensor and pipeline parallelism) sees only this: the trained tensors' table and buffers, what the
// frozen base holds, and two hooks for a loop that runs the blocks its own way. It never names the
// transform: the transform's layers (a LayerOps plug-in) do the rest.
#ifndef TRAINABLE_H
#define TRAINABLE_H

#include <stddef.h>

#include "model/gpt.h"
#include "stage_run.h"

typedef struct Trainable Trainable;
struct Trainable {
    ParamLayout layout;             // the trained tensors' table
    float *params, *grads, *m, *v;  // on the device in layout's order: values, gradients, AdamW's moments
    size_t bytes;                   // of one of those buffers
    size_t acts_bytes;              // what the trained tensors keep for backward, and their scratch
    // after trainable_take_base: the frozen base's table, parameters and 16-bit copy (or NULL)
    ParamLayout base_layout;
    float *base_params;
    half16 *base_params16;
    size_t base_bytes;
    // A loop that passes every block's weights through one buffer (04's gathers) says which block
    // runs next; a loop whose micro-batches run out of order (07's pipeline) says that the one that
    // runs next starts `after` sequences after the step's first. Either may be NULL.
    void (*run_block)(Trainable *t, int block);
    void (*run_micro)(Trainable *t, int after);
};

// The base is frozen and t trains instead (a transform's attach calls it): the base's gradients and
// AdamW's moments are freed, its table and parameters kept in t (trainable_free_base frees them),
// and from here on layout and mb name t's tensors (mb.w still names the base, which forward reads;
// mb.g names nothing). Stage 02: the base's 16-bit copy is made once, and mb.params16 becomes a
// copy of t's, which the stage's cast fills and nothing reads (t's matmuls run in fp32).
void trainable_take_base(Trainable *t, ParamLayout *layout, ModelBuffers *mb);
void trainable_free_base(Trainable *t);
// the hooks, for a t that may be NULL (the base trains) or lack them
void trainable_run_block(Trainable *t, int block);
void trainable_run_micro(Trainable *t, int after);
// adds to model_memory_items' rows (which, after trainable_take_base, count t's tensors) the frozen
// base's parameters and 16-bit copy, and to the activations what t keeps for backward
void trainable_add_memory(const Trainable *t, MemoryItem items[MODEL_MEMORY_ITEMS]);

#endif
