// zero_bubble.h: the backward split into B (input gradients) and W (weight gradients) for the
// zero-bubble schedule zb-h1 (zero_bubble.c).
#ifndef ZERO_BUBBLE_H
#define ZERO_BUBBLE_H

#include <stddef.h>

#include "model/activations.h"
#include "model/gpt.h"
#include "pipeline.h"

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
// B: the backward of `layers` through a, computing the input gradients (a->dres at the end, as
// gpt_backward) and the LayerNorms' and embedding's gradients, noting the linear layers' for W
void deferred_backward(DeferredWeights *d, PipeLayers *layers, Activations *a, const Weights *w, Weights *g, int B,
                       int T);
// W: the weight gradients noted in the last B, added into the gradients given there, through
// `layers`' weight pass (pipeline.h) when they have one
void deferred_weight_pass(DeferredWeights *d, PipeLayers *layers, Activations *a, const Weights *w);

#endif
