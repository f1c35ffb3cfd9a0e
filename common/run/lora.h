// lora.h: LoRA fine-tuning (Hu et al., 2021), as Hugging Face PEFT does it, as a plug-in of the
// layer table (gpt.h's LayerOps).
//
// The base model is frozen: its parameters have no gradient buffer and no AdamW state. Each target
// linear W (out, in) of each block gets two small fp32 matrices, A (r, in) and B (out, r), and
// computes y = x W^T + (alpha / r) (x A^T) B^T, in training with lora_dropout on the adapter's x
// (lora_training below). A starts Kaiming-uniform (PEFT's bound, 1/sqrt(in)), B at zero, so the
// adapted model starts as the base. Only A and B train.
//
// The plug-in wraps the layers that run the base (serial_layer_ops(), or a stage's): a linear's
// forward runs the base's, then adds each of its adapters; its backward computes the base's input
// gradient only (no weight gradient) and adds the adapters' input gradient and their own
// gradients. A target that is part of a fused projection (Llama's q, k, v in the one qkv matrix;
// gate and up in the one fc matrix) adds into its rows of the fused output. LayerNorm weights get
// no gradient either; the embedding's backward is skipped.
//
// Files, as PEFT's save_pretrained writes them (huggingface/peft docs, "PEFT checkpoint format"):
// <dir>/adapter_model.safetensors with tensors base_model.model.<module>.lora_A.weight (r, in)
// and .lora_B.weight (out, r), <module> the linear's Hugging Face module name
// (model.layers.0.self_attn.q_proj), and <dir>/adapter_config.json (peft_type LORA, r, lora_alpha,
// lora_dropout, target_modules, ...). tools/lora_merge.c folds an adapter into its base.
#ifndef LORA_H
#define LORA_H

#include <stdbool.h>
#include <stddef.h>

#include "config/config.h"
#include "model/gpt.h"
#include "ops/ops.h"
#include "stage_run.h"
#include "trainable.h"

// One adapter: B (rows, r) @ A (r, in_dim), times scale, added to rows [row0, row0 + rows) of one
// base linear's output
typedef struct {
    LinearKind kind;
    int layer;
    int row0, rows, in_dim;
    size_t base_offset;   // where the base linear's (fused) weight starts in the base's flat buffer
    const float *base_w;  // that weight in the running model: how the layer ops recognise the linear
                          // (NULL where the stage says which block runs: trained.run_block)
    int a, b;             // its tensors A and B in Lora.trained.layout
    int part;             // which part of its fused linear it adapts (q 0, k 1, v 2; gate 0, up 1)
    int col0;             // its input's first column in the whole linear's (tensor parallelism's
                          // row-parallel slices): with layer, kind and part, where its dropout mask lies
    float *h;             // (N, r) on the device: x A^T, kept from forward for backward
} LoraSite;

typedef struct {
    LayerOps ops;          // first: the activations' ops point at the struct
    LayerOps *inner;       // the layers that run the base
    int rank;              // 0: no LoRA (full fine-tuning); the rest is then unset
    float alpha, scale;    // scale = alpha / rank
    float dropout;         // lora_dropout: the adapters' input dropped with this probability in training
    uint64_t seed;         // the run's, which the dropout masks are drawn from
    // in training (lora_training) the rows that run next, as lora_training describes them; the
    // step goes into each site's mask stream. Otherwise (evaluation, inference) no dropout.
    bool training;
    long step;
    int first_seq;         // lora_training's
    DropoutMask rows;
    const Arch *arch;
    char targets[256];     // the target module names, comma-separated, as resolved
    // what trains: the adapters' table (their tensors named as PEFT's without "base_model.model."),
    // on the device their values, gradients and AdamW's moments, and what the sites keep for
    // backward with the backward scratch; after lora_attach, the frozen base
    Trainable trained;
    LoraSite *sites;
    int n_sites;
    float *dy, *dh, *x32;  // scratch: an adapter's output (gradient), x A^T's gradient, a widened input
    float *xd, *dxd;       // with dropout: the dropped input, and its gradient (scratch)
    // a stage whose linears are split over ranks (05): completes x A^T (forward) or its gradient
    // dy B (backward), (N, r) partial sums over the slices of A's columns or B's rows this rank
    // holds, by summing them over the ranks that hold the others; NULL: nothing to complete
    void (*complete)(void *ctx, LinearKind k, bool backward, float *h, size_t n);
    void *complete_ctx;
    // a stage that passes every block's weights through one buffer (04's gathers) says which block
    // runs (trainable.h's run_block): the sites are then recognised by block and kind, not by weight
    bool by_block;
    int block;
    // a stage whose micro-batches run their forwards before earlier ones' backwards (07's
    // pipeline): backward recomputes x A^T from the input the block kept, as one site's h is shared
    bool recompute_h;
    Norm norm_grads;       // where the frozen norms' weight gradients go (never read)
} Lora;

// The adapters of `rank` on the linears of `base` that `targets` names (comma-separated Hugging
// Face module names, matched as PEFT does: the module's name or its last components; empty: PEFT's
// default for the architecture). A name that matches no linear is fatal, naming `where` (the
// config's source, or an adapter_config.json) and the linears there are. Fills the sites and the
// layout; allocates nothing on the device.
void lora_describe(Lora *lo, const ParamLayout *base, int rank, double alpha, const char *targets, const char *where);
// reads r, lora_alpha and target_modules from <dir>/adapter_config.json (anything in it we do not
// implement refused by name)
void lora_read_adapter_config(const char *dir, int *rank, double *alpha, char *targets, size_t targets_size);
// fills host[layout.num_params]: A Kaiming-uniform in [-1/sqrt(in), 1/sqrt(in)] (counter-based, so
// any layout of the model draws the same), B zero
void lora_init(const Lora *lo, float *host, uint64_t seed);
// reads <dir>/adapter_model.safetensors into host (every tensor of the layout, shapes checked)
void lora_read_adapter(const Lora *lo, const char *dir, float *host);
// writes <dir>/adapter_model.safetensors and <dir>/adapter_config.json (base_model: the base's path)
void lora_write_adapter(const Lora *lo, const char *dir, const float *host, const char *base_model);
// W += scale * B @ A for every site: host buffers, base laid out as lora_describe's base
void lora_merge(const Lora *lo, const float *adapters, float *base_params);

// Puts the described adapters (host values) on the device, with their gradients, AdamW's moments
// and what the layers keep, and plugs the LoRA layers in around acts->ops: the base whose
// linears they adapt is laid out in base_params (device), as lora_describe's base.
// base_params NULL: the stage says which block runs (trainable_run_block) before each runs.
// A pipeline's micro-batches run out of order: lora_training names the replica's first sequence,
// and the stage says where the one that runs next starts (trainable_run_micro).
void lora_plug(Lora *lo, const float *adapters, const float *base_params, Activations *acts);
// the same for the n_slots activation slots of a stage whose micro-batches are in flight together
// (07's pipeline): every slot runs the LoRA layers, and backward recomputes x A^T when n_slots > 1
void lora_plug_slots(Lora *lo, const float *adapters, const float *base_params, Activations *slots, int n_slots);
// LoRA dropout (lora_dropout > 0). In training, each adapter sees its input with every element
// zeroed with probability p and the rest scaled by 1 / (1 - p) (PEFT's nn.Dropout on lora_A's
// input); the base sees it whole. The mask is a pure function of (seed, step, layer, linear,
// part, sequence in the global batch, position, column), recomputed in backward, so every layout
// of the run draws one mask and backward (or a recomputation) the forward's.
// lora_training: the micro-batch that runs next (its forward and backward) is `T`-token sequences
// first_seq, first_seq + 1, ... of step `step`'s global batch (a slice's rows: slice * rows).
void lora_training(Lora *lo, long step, int first_seq, int T);
// context parallelism: the rows are two chunks of every sequence, chunk 0's first, each c tokens,
// starting at positions pos0 and pos1 (after lora_training, with T = c)
void lora_training_chunks(Lora *lo, int pos0, int pos1);
// training's micro-batches are done: what runs next (evaluation) sees no dropout
void lora_training_done(Lora *lo);
// the mask site s draws in training, for the rows lora_training last described
void lora_site_mask(const Lora *lo, const LoraSite *s, DropoutMask *mask);
// A stage's LoRA (lora_rank > 0; otherwise nothing happens): describes the adapters on `layout`'s
// linears (cfg's keys, checked against lora_adapter's config when that is set), starts them
// (lora_init, or lora_adapter's tensors), plugs the LoRA layers in around acts->ops and freezes the
// base (trainable_take_base): the stage then trains the adapters with the code it trains a model
// with, layout and mb naming them. lora_free frees the base; model_buffers_free and
// gpt_layout_free the adapters.
void lora_attach(Lora *lo, const Config *cfg, ParamLayout *layout, ModelBuffers *mb, Activations *acts);
// lora_attach for a stage that passes every block's weights through one buffer (04's gathers) and
// keeps the base itself: returns the adapters (NULL without LoRA), which the stage trains in the
// base's place; it says which block runs (trainable_run_block).
Trainable *lora_attach_blocks(Lora *lo, const Config *cfg, const ParamLayout *base, Activations *acts);
// lora_attach for a stage that holds a part of the model (07's pipeline stage: `layout`, in every
// one of its n_slots activation slots): the adapters start from the whole model's (`full`), each
// part taking its own by name, and full becomes the whole adapters' table, which checkpoints are
// saved in. Backward recomputes x A^T when several micro-batches are in flight. Returns the
// part's adapters (NULL without LoRA).
Trainable *lora_attach_part(Lora *lo, const Config *cfg, ParamLayout *layout, ParamLayout *full, ModelBuffers *mb,
                            Activations *slots, int n_slots);
// The pieces of lora_attach, for a stage that lays the adapters out its own way (05): describes
// them on `base`'s linears from cfg's keys, and their starting values on the host (lora_init, or
// lora_adapter's tensors, checked against the keys; the caller frees them)
void lora_describe_keys(Lora *lo, const Config *cfg, const ParamLayout *base);
float *lora_start(const Lora *lo, const Config *cfg, const ParamLayout *base);
// the one line a LoRA run prints once its adapters are plugged in (rank 0): r, alpha, targets and
// the trained parameters beside the frozen base's `base_params`
void lora_print_summary(const Lora *lo, size_t base_params);
// The adapters of a LoRA run (laid out as lora_attach's layout, host values) as PEFT's two files in
// out_dir; what save_checkpoint writes when lora_rank > 0
void lora_save(const Config *cfg, const ParamLayout *adapters, const float *host);
// frees what lo holds (after lora_attach: the base's parameters and table)
void lora_free(Lora *lo);

#endif
