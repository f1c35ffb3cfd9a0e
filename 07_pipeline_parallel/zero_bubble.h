// zero_bubble.h: the backward split into B (input gradients) and W (weight gradients) for the
// zero-bubble schedule zb-h1 (zero_bubble.c).
#ifndef ZERO_BUBBLE_H
#define ZERO_BUBBLE_H

#include <stddef.h>

#include "model/activations.h"
#include "model/gpt.h"

typedef struct DeferredWeights DeferredWeights;

// the output gradients one row of a block's linear layers keeps for W: their output widths added up
size_t deferred_floats_per_row(const ModelShape *s);
// the floats a slot of activations for spec keeps for W: its blocks' output gradients of B x T rows
// (the one formula of the buffer, pipeline.c's memory report and the planner)
size_t deferred_weights_floats(const ActsSpec *spec);
// Wraps a's layer ops so that its backwards can defer their weight gradients, with room for the
// output gradients of its blocks at its capacity (deferred_weights_floats of a->spec).
DeferredWeights *deferred_weights_new(Activations *a);
// the device bytes it keeps for the deferred weight gradients
size_t deferred_weights_bytes(const DeferredWeights *d);
void deferred_weights_free(DeferredWeights *d);
// B: a backward through a's layers between these two computes the input gradients (a->dres at
// the end, as gpt_backward) and the LayerNorms' and embedding's gradients, and notes the linear
// layers' for W
void deferred_begin(DeferredWeights *d);
void deferred_end(DeferredWeights *d);
// W: the weight gradients noted in the last B (d: a DeferredWeights), added into the gradients
// given there; a void * so that a stage's layers can run it inside their own weight pass
void deferred_weight_pass(void *d);

#endif
