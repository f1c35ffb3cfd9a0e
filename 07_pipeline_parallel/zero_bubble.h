// zero_bubble.h: the backward split into B (input gradients) and W (weight gradients) for the
// zero-bubble schedule zb-h1 (zero_bubble.c).
#ifndef ZERO_BUBBLE_H
#define ZERO_BUBBLE_H

#include <stddef.h>

#include "model/gpt.h"

typedef struct DeferredWeights DeferredWeights;

// Wraps a's layer ops so that its backwards can defer their weight gradients, with room for the
// output gradients of max_blocks blocks of max_rows rows.
DeferredWeights *deferred_weights_new(Activations *a, int max_blocks, int max_rows);
// the device bytes it keeps for the deferred weight gradients
size_t deferred_weights_bytes(const DeferredWeights *d);
void deferred_weights_free(DeferredWeights *d);
// B: the backward through a's layers, computing the input gradients (a->dres at the end, as
// gpt_backward) and the LayerNorms' and embedding's gradients, noting the linear layers' for W
void deferred_backward(DeferredWeights *d, Activations *a, const Weights *w, Weights *g, int B, int T);
// W: the weight gradients noted in the last B, added into the gradients given there
void deferred_weight_pass(DeferredWeights *d);

#endif
