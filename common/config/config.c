// config.c: a table of keys drives parsing, overriding, defaults and --help, so adding a key is
// one line. Unknown keys are errors naming the closest known key: the tutorial's args.py
// silently ignored them, and a typo ("global_bach_size") then trained with the default.
#include "config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "model/moe_mlp.h"  // MAX_EXPERTS

typedef enum { T_INT, T_FLOAT, T_BOOL, T_STRING, T_INT3 } KeyType;

typedef struct {
    const char *name;
    KeyType type;
    size_t offset;    // where the value lives in Config
    size_t size;      // for strings: the buffer size
    const char *dflt; // the default, written as it would be on the command line
    const char *help;
} Key;

#define K(name, type, dflt, help) {#name, type, offsetof(Config, name), sizeof(((Config *)0)->name), dflt, help}

static const Key KEYS[] = {
    K(model_id, T_STRING, "gpt2", "model shape: gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl, microsoft/phi-1_5, "
                                  "meta-llama/Llama-2-7b-hf, meta-llama/Llama-3.1-8B, custom"),
    K(arch, T_STRING, "", "architecture: gpt2, phi or llama (empty: model_id's; custom is gpt2)"),
    K(dataset_id, T_STRING, "",
      "tatsu-lab/alpaca or alpaca (the alpaca JSON file in data_path), synthetic (the built-in "
      "set); empty: data_path decides"),
    K(seed, T_INT, "123456", "seeds initialisation and the sample order"),
    K(precision, T_STRING, "32",
      "32, 32-true, bf16-mixed, bf16, 16-mixed (fp16 with loss scaling), or stage 02's FP8 linears in the "
      "block: fp8-tensorwise, fp8-rowwise (a scale per row) or mxfp8 (a scale per block of 32)"),
    K(strategy, T_STRING, "",
      "single_device, ddp, fsdp, axonn, pipeline, expert_parallel, context_parallel or composed; empty: the "
      "stage's own (above)"),
    K(tp_dimensions, T_INT3, "1,1,1", "tensor-parallel grid [x, y, z] (strategy axonn; composed: [x, 1, 1])"),
    K(global_batch_size, T_INT, "32", "sequences per optimizer step, over all ranks"),
    K(gradient_acc_steps, T_INT, "1", "micro-batches per optimizer step"),
    K(log_interval, T_INT, "1", "print a progress line every N steps"),
    K(num_epochs, T_INT, "1", "passes over the training split"),
    K(random_init, T_BOOL, "false", "start from random weights even if init_from is set"),
    K(compile, T_BOOL, "false", "inference: capture the decode step as a CUDA graph"),
    K(tf32, T_BOOL, "false", "stage 01 on a GPU: f32 matmuls on the tensor cores in TF32 (10-bit mantissa), a lesson"),
    K(stop_iteration, T_INT, "-1", "stop after N optimizer steps (-1: run all epochs)"),
    K(tokens_to_generate, T_INT, "256", "inference: maximum new tokens per prompt"),
    K(n_layer, T_INT, "0", "transformer blocks (0: from model_id)"),
    K(n_head, T_INT, "0", "attention heads (0: from model_id)"),
    K(n_embd, T_INT, "0", "hidden size (0: from model_id)"),
    K(n_kv_head, T_INT, "0", "llama: key/value heads, grouped-query attention (0: from model_id, or n_head)"),
    K(intermediate_size, T_INT, "0", "llama: the SwiGLU MLP's width (0: from model_id, or 4 n_embd)"),
    K(vocab_size, T_INT, "0", "embedding rows (0: the tokenizer's; 50257 gives GPT-2's shape)"),
    K(max_seq_len, T_INT, "256", "longest sequence; longer records are cut"),
    K(data_path, T_STRING, "", "alpaca JSON file (empty: the built-in synthetic instruction set)"),
    K(tokenizer_path, T_STRING, "", "tokenizer directory: GPT-2's vocab.json + merges.txt, or a tokenizer.json (Llama-2, Llama-3) (empty: byte tokenizer)"),
    K(init_from, T_STRING, "", "checkpoint directory or .safetensors file to start from"),
    {"resume", T_STRING, offsetof(Config, resume_mode), sizeof(((Config *)0)->resume_mode), "auto",
     "auto: continue the run saved in out_dir if it holds one of this config (another config's is "
     "refused); true: must continue one; false: start over, replacing what out_dir holds"},
    K(out_dir, T_STRING, "out", "where metrics.jsonl and checkpoints go"),
    K(lr, T_FLOAT, "3e-4", "peak learning rate"),
    K(min_lr, T_FLOAT, "3e-5", "learning rate at the end of the cosine decay"),
    K(warmup_steps, T_INT, "10", "steps of linear warm-up"),
    K(beta1, T_FLOAT, "0.9", "AdamW beta1"),
    K(beta2, T_FLOAT, "0.95", "AdamW beta2"),
    K(eps, T_FLOAT, "1e-8", "AdamW epsilon"),
    K(weight_decay, T_FLOAT, "0.0", "AdamW decoupled weight decay (not on biases and norms)"),
    K(grad_clip, T_FLOAT, "1.0", "clip the global gradient norm to this (0: off)"),
    K(optimizer, T_STRING, "adamw",
      "adamw, or muon: the blocks' matrices take Newton-Schulz orthogonalized momentum, the embeddings, "
      "head, norms and biases AdamW (stages 01, 02, 04 and 05)"),
    K(muon_lr, T_FLOAT, "0.02", "muon: peak learning rate of the matrices (lr's warm-up and decay scale it alike)"),
    K(muon_momentum, T_FLOAT, "0.95", "muon: momentum of the matrices' gradients"),
    K(muon_nesterov, T_BOOL, "true", "muon: orthogonalize the Nesterov look-ahead (false: the momentum itself)"),
    K(muon_ns_steps, T_INT, "5", "muon: Newton-Schulz iterations of the orthogonalization"),
    K(muon_redundant, T_BOOL, "false",
      "muon, fsdp: every rank orthogonalizes every gathered matrix (false: each matrix by one owner rank, "
      "its result reduce-scattered)"),
    K(loss_scale, T_FLOAT, "65536", "16-mixed: the initial loss scale (the loss, and so every gradient, times it)"),
    K(loss_scale_window, T_INT, "1000",
      "16-mixed: good steps before the loss scale doubles; a step with an inf or NaN gradient is "
      "skipped and halves it (0: a fixed scale, never changed)"),
    K(fp8_scaling, T_STRING, "current",
      "fp8-tensorwise: current (a tensor's scale from its amax now), delayed (from the largest amax of its "
      "last fp8_amax_history casts, Transformer Engine's recipe) or none (scale 1: the lesson of what scaling "
      "protects against)"),
    K(fp8_amax_history, T_INT, "16", "fp8_scaling delayed: how many casts of a tensor its amax history holds"),
    K(eval_interval, T_INT, "0", "validation loss every N steps (0: only at the end)"),
    K(eval_batches, T_INT, "4", "validation batches per evaluation"),
    K(checkpoint_interval, T_INT, "0", "save a checkpoint every N steps (0: only at the end)"),
    K(val_fraction, T_FLOAT, "0.05", "share of the records held out for validation"),
    K(overlap_communication, T_BOOL, "false",
      "overlap communication with computation (ddp: bucketed all-reduce during backward; "
      "fsdp: prefetch the next block's all-gather)"),
    K(comm_backend, T_STRING, "auto",
      "what moves the bytes between ranks: auto (NCCL when every rank has a GPU of its own, else MPI), "
      "nccl, mpi (GPU buffers staged through pinned host memory, or CUDA-aware MPI), mpi-staged "
      "(staged even so; on the CPU, the shared-GPU path with memcpy)"),
    K(trace, T_BOOL, "false", "write <out_dir>/trace.json, a Chrome trace-event timeline of every rank"),
    K(trace_steps, T_INT, "3", "the first N steps of the run go into the trace"),
    K(activation_checkpointing, T_BOOL, "false",
      "activation recomputation: each block keeps only its input and recomputes the rest in backward"),
    K(bucket_size_mb, T_FLOAT, "25", "ddp: megabytes of gradients per all-reduce bucket when overlapping"),
    K(zero_stage, T_INT, "3",
      "fsdp: what is sharded: 1 AdamW's m and v, 2 the gradients too, 3 the parameters too (ZeRO's stages)"),
    K(hsdp_replicas, T_INT, "1",
      "fsdp: hybrid sharding: the ranks form this many groups, each sharding over its own ranks, the "
      "gradients summed across them (must divide the ranks)"),
    K(vocab_parallel_loss, T_BOOL, "true",
      "axonn: cross-entropy on the vocabulary split over x (false: all-gather the logits first)"),
    K(sequence_parallel, T_BOOL, "false",
      "axonn with tp_dimensions [x, 1, 1]: Megatron's sequence parallelism, the LayerNorms and the residual "
      "stream on 1/x of the tokens, all-gathered before and reduce-scattered after each tensor-parallel region"),
    K(pp_size, T_INT, "1", "pipeline: stages the blocks are split over (ranks / pp_size data-parallel replicas)"),
    K(num_microbatches, T_INT, "1",
      "pipeline: micro-batches each replica's rows are cut into (takes the place of gradient_acc_steps)"),
    K(pp_schedule, T_STRING, "1f1b", "pipeline: gpipe (all forwards, then all backwards) or 1f1b"),
    K(virtual_stages, T_INT, "1",
      "pipeline: chunks of blocks each stage holds, non-adjacent (pp_schedule interleaved; 1 otherwise)"),
    K(num_experts, T_INT, "0", "experts of each mixture-of-experts block (0: dense MLPs; stage 08)"),
    K(experts_per_token, T_INT, "2", "experts each token is sent to (top-k of the router's softmax)"),
    K(moe_every, T_INT, "1", "every N-th block is a mixture-of-experts block"),
    K(capacity_factor, T_FLOAT, "1.25",
      "rows an expert takes per sequence: ceil(factor x tokens x experts_per_token / num_experts); "
      "pairs over it are dropped (0: no limit)"),
    K(aux_loss_coef, T_FLOAT, "0.01", "weight of the load-balancing loss (Switch/Mixtral) in the objective"),
    K(ep_size, T_INT, "1", "expert_parallel: ranks the experts are spread over (ranks / ep_size replicas)"),
    K(cp_size, T_INT, "1", "context_parallel: ranks each sequence is split over (ranks / cp_size replicas)"),
    K(cp_impl, T_STRING, "ring",
      "context_parallel: ring (keys and values passed around the ranks) or ulysses (all-to-all to heads)"),
    K(lora_rank, T_INT, "0", "LoRA: rank r of the adapters trained on the frozen base's linears (0: full fine-tuning)"),
    K(lora_alpha, T_FLOAT, "16", "LoRA: the adapters' output is scaled by lora_alpha / lora_rank"),
    K(lora_dropout, T_FLOAT, "0", "LoRA: dropout on the adapters' input (0: none)"),
    K(lora_targets, T_STRING, "",
      "LoRA: the linears that get adapters, Hugging Face module names (llama: q_proj,k_proj,v_proj,o_proj,"
      "gate_proj,up_proj,down_proj; phi: q_proj,k_proj,v_proj,dense,fc1,fc2; gpt2: c_attn,c_proj,c_fc); "
      "empty: PEFT's default for the architecture"),
    K(lora_adapter, T_STRING, "", "LoRA: a PEFT adapter directory to start the adapters from (empty: A random, B zero)"),
    K(always_input_template, T_BOOL, "false",
      "the tutorial's quirk: use the with-input prompt template for every record"),
    K(prompts_path, T_STRING, "data/inference/prompts.txt", "inference: prompts, one per line ('-': stdin)"),
    K(max_batch_size, T_INT, "8", "inference: prompts generated together in one batch"),
    K(temperature, T_FLOAT, "0", "inference: sampling temperature (0: greedy)"),
    K(top_k, T_INT, "0", "inference: sample from the k most likely tokens only (0: all)"),
    K(top_p, T_FLOAT, "1", "inference: sample from the smallest set with this much probability"),
    K(kv_cache, T_BOOL, "true", "inference: keep keys and values (false: recompute every step)"),
    K(eval_accuracy, T_BOOL, "false", "inference: answer the held-out split, report exact-answer accuracy"),
    K(show_token_ids, T_BOOL, "false", "inference: print the token ids of every prompt and answer"),
    K(serve, T_BOOL, "false", "inference: serve an OpenAI-compatible HTTP API instead of reading prompts"),
    K(host, T_STRING, "127.0.0.1", "inference: the server's IPv4 address to listen on (0.0.0.0: every interface)"),
    K(port, T_INT, "8000", "inference: the server's TCP port (0: any free one, printed at start)"),
    K(max_queue, T_INT, "64", "inference: requests waiting for a batch slot before the server answers 429"),
    K(served_model_name, T_STRING, "", "inference: the model name the server answers to (empty: init_from's base name)"),
    K(kv_block_size, T_INT, "16", "inference: positions per block of the paged KV cache"),
    K(kv_cache_bytes, T_FLOAT, "0",
      "inference server: bytes of the KV cache's block pool per rank (0: max_batch_size whole contexts)"),
    K(kv_cache_memory_fraction, T_FLOAT, "0",
      "inference server: the KV cache's block pool as a share (0, 1] of the device's free memory once the "
      "weights are loaded, instead of kv_cache_bytes (not given: kv_cache_bytes decides)"),
    K(prefix_caching, T_BOOL, "true",
      "inference server: requests whose text begins alike share the KV cache's blocks of it"),
    K(draft_model, T_STRING, "",
      "inference server: a small checkpoint with the same tokenizer that proposes tokens (speculative decoding)"),
    K(num_speculative_tokens, T_INT, "4", "inference server: tokens the draft_model proposes a step"),
    K(max_prefill_tokens, T_INT, "0",
      "inference server: prompt tokens a step takes (chunked prefill; 0: whole prompts)"),
};
#define NKEYS (sizeof(KEYS) / sizeof(KEYS[0]))

static const char *TYPE_NAMES[] = {"an integer", "a number", "true or false", "a string",
                                   "a list of 3 integers"};

// ---- finding keys ------------------------------------------------------------------------------

static const Key *find_key(const char *name) {
    for (size_t i = 0; i < NKEYS; i++)
        if (strcmp(KEYS[i].name, name) == 0) return &KEYS[i];
    return NULL;
}

static int edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    int row[128];
    if (lb >= 128) return 1000;
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (row[j] + 1 < best) best = row[j] + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

static const Key *find_key_or_die(const char *name, const char *where) {
    const Key *k = find_key(name);
    if (k) return k;
    const Key *closest = &KEYS[0];
    for (size_t i = 1; i < NKEYS; i++)
        if (edit_distance(name, KEYS[i].name) < edit_distance(name, closest->name)) closest = &KEYS[i];
    fatal("%s: unknown key '%s' (did you mean '%s'? --help lists every key)", where, name,
          closest->name);
}

// ---- setting values ----------------------------------------------------------------------------

static void *slot(Config *cfg, const Key *k) { return (char *)cfg + k->offset; }

static void set_string(Config *cfg, const Key *k, const char *value, const char *where) {
    if (strlen(value) >= k->size)
        fatal("%s: key '%s': expected a string of at most %zu characters, found %zu", where,
              k->name, k->size - 1, strlen(value));
    strcpy(slot(cfg, k), value);
}

static void set_int(Config *cfg, const Key *k, double value, const char *found, const char *where) {
    if (!isfinite(value) || value != floor(value) || fabs(value) > 2e9)
        fatal("%s: key '%s': expected an integer, found %s", where, k->name, found);
    *(int *)slot(cfg, k) = (int)value;
}

// Parses a command-line or default text value of key k.
static void set_from_text(Config *cfg, const Key *k, const char *text, const char *where) {
    char *end;
    switch (k->type) {
    case T_STRING: set_string(cfg, k, text, where); return;
    case T_BOOL:
        if (strcmp(text, "true") == 0 || strcmp(text, "1") == 0) *(bool *)slot(cfg, k) = true;
        else if (strcmp(text, "false") == 0 || strcmp(text, "0") == 0) *(bool *)slot(cfg, k) = false;
        else fatal("%s: key '%s': expected true or false, found '%s'", where, k->name, text);
        return;
    case T_INT3: {
        int *v = slot(cfg, k);
        const char *p = text;
        for (int i = 0; i < 3; i++) {
            while (*p == '[' || *p == ' ') p++;
            errno = 0;
            long x = strtol(p, &end, 10);
            if (end == p || errno) fatal("%s: key '%s': expected 3 integers like 2,2,1, found '%s'", where, k->name, text);
            v[i] = (int)x;
            p = end;
            while (*p == ' ' || *p == ']') p++;
            if (i < 2 && *p++ != ',') fatal("%s: key '%s': expected 3 integers like 2,2,1, found '%s'", where, k->name, text);
        }
        if (*p) fatal("%s: key '%s': expected 3 integers like 2,2,1, found '%s'", where, k->name, text);
        return;
    }
    case T_INT:
    case T_FLOAT: {
        errno = 0;
        double x = strtod(text, &end);
        if (end == text || *end || errno)
            fatal("%s: key '%s': expected %s, found '%s'", where, k->name, TYPE_NAMES[k->type], text);
        if (k->type == T_FLOAT) *(double *)slot(cfg, k) = x;
        else set_int(cfg, k, x, text, where);
        return;
    }
    }
}

static const char *json_type_name(const cJSON *v) {
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsArray(v)) return "a list";
    if (cJSON_IsObject(v)) return "an object";
    return "null";
}

static void set_from_json(Config *cfg, const Key *k, const cJSON *v, const char *where) {
    char found[64];
    snprintf(found, sizeof found, "%s", json_type_name(v));
    switch (k->type) {
    case T_STRING:
        // The tutorial writes "precision": "32"; accept the bare number 32 too.
        if (cJSON_IsNumber(v) && strcmp(k->name, "precision") == 0) {
            char text[32];
            snprintf(text, sizeof text, "%g", v->valuedouble);
            set_string(cfg, k, text, where);
            return;
        }
        // resume was true or false before auto: a file may still say so
        if (cJSON_IsBool(v) && strcmp(k->name, "resume") == 0) {
            set_string(cfg, k, cJSON_IsTrue(v) ? "true" : "false", where);
            return;
        }
        if (!cJSON_IsString(v)) break;
        set_string(cfg, k, v->valuestring, where);
        return;
    case T_BOOL:
        if (!cJSON_IsBool(v)) break;
        *(bool *)slot(cfg, k) = cJSON_IsTrue(v);
        return;
    case T_INT:
        if (!cJSON_IsNumber(v)) break;
        snprintf(found, sizeof found, "%g", v->valuedouble);
        set_int(cfg, k, v->valuedouble, found, where);
        return;
    case T_FLOAT:
        if (!cJSON_IsNumber(v)) break;
        *(double *)slot(cfg, k) = v->valuedouble;
        return;
    case T_INT3: {
        if (!cJSON_IsArray(v)) break;
        int n = cJSON_GetArraySize(v);
        if (n != 3) {
            snprintf(found, sizeof found, "a list of %d", n);
            break;
        }
        for (int i = 0; i < 3; i++) {
            const cJSON *e = cJSON_GetArrayItem(v, i);
            if (!cJSON_IsNumber(e) || e->valuedouble != (int)e->valuedouble) {
                snprintf(found, sizeof found, "element %d is %s", i, json_type_name(e));
                goto bad;
            }
            ((int *)slot(cfg, k))[i] = (int)e->valuedouble;
        }
        return;
    }
    }
bad:
    fatal("%s: key '%s': expected %s, found %s", where, k->name, TYPE_NAMES[k->type], found);
}

// ---- the stages -------------------------------------------------------------------------------

// What each stage implements, what it reads by default, and what it does with the keys not every
// stage takes: each refusal is the reason printed. A learner runs one config through several
// stages, so a strategy or a key a stage cannot honour is refused with why and where to go rather
// than ignored (the tutorial's strategy key picked the code path; here the program does). A
// strategy's own keys go with it: a tp_dimensions grid other than [1, 1, 1] needs axonn, pp_size
// and num_microbatches other than 1 need pipeline (which cuts the batch with them, in place of
// gradient_acc_steps). The rules below read this table; every other key, every stage takes.
typedef struct {
    const char *strategy;      // the one it implements (and what an empty strategy means)
    const char *also;          // another it accepts, or NULL (stage 06: one device is the 1x1 grid)
    const char *default_file;  // read when neither --config nor $CONFIG_FILE names one
    bool experts;              // takes num_experts > 0 (the others' blocks are dense MLPs)
    bool expert_ranks;         // takes ep_size > 1 (spreads the experts over ranks)
    bool generates;            // reads the inference keys and needs weights to generate with
    // why it refuses (NULL: it takes)
    const char *no_half;          // precision bf16-mixed, bf16 or 16-mixed
    const char *no_half_experts;  // the same, with num_experts > 0
    const char *no_overlap;       // overlap_communication true
    bool tf32;                    // takes tf32 true (stage 01's lesson; elsewhere the CPU-equivalence tests' f32)
    const char *no_grid_depth;    // tp_dimensions with z > 1
    bool zero_ladder;             // takes zero_stage other than 3 and hsdp_replicas other than 1
    bool lora;                    // trains LoRA adapters (lora_rank > 0)
    bool muon;                    // takes optimizer muon
    bool sequence_parallel;       // takes sequence_parallel true (it splits what lies between TP regions)
} StageInfo;

static const StageInfo STAGES[] = {
    [STAGE_SINGLE_GPU] = {"single_device", NULL, "configs/single_gpu.json",
                          .no_half = "stage 01 trains in fp32 (32 or 32-true); bf16 and fp16 are stage 02 "
                                     "(build/stage-2)",
                          .tf32 = true,
                          .lora = true, .muon = true},
    [STAGE_MIXED_PRECISION] = {"single_device", NULL, "configs/mixed_precision.json", .lora = true, .muon = true},
    [STAGE_DDP] = {"ddp", NULL, "configs/ddp.json", .lora = true, .muon = true},
    [STAGE_FSDP] = {"fsdp", NULL, "configs/fsdp.json", .zero_ladder = true, .lora = true, .muon = true},
    [STAGE_TENSOR_PARALLEL] = {"axonn", NULL, "configs/axonn.json", .lora = true, .muon = true,
                               .sequence_parallel = true},
    [STAGE_INFERENCE] = {"axonn", "single_device", "configs/inference.json", .experts = true, .generates = true,
                         // z shards the weights to gather them again before each use: a saving for
                         // training's memory, only traffic for a decode step, whose cost is reading
                         // the weights; and generation has no rows to split over z
                         .no_grid_depth = "inference does not support z tensor parallelism (the tutorial's "
                                          "infer.py neither): z must be 1"},
    [STAGE_PIPELINE_PARALLEL] = {"pipeline", NULL, "configs/pipeline.json",
                                 .no_overlap = "stage 07 has no overlapped variant (stage 03 and 04 do); set "
                                               "it to false",
                                 .lora = true},
    [STAGE_MIXTURE_OF_EXPERTS] = {"expert_parallel", NULL, "configs/moe.json", .experts = true, .expert_ranks = true,
                                  .no_half_experts = "stage 08's experts train in fp32 (32 or 32-true)",
                                  .no_overlap = "stage 08 all-reduces its gradients after backward (its MoE "
                                                "blocks already talk during backward)"},
    [STAGE_CONTEXT_PARALLEL] = {"context_parallel", NULL, "configs/context_parallel.json", .lora = true},
    // 05's layers inside 07's stages: 1-D tensor parallelism [x, 1, 1] (10_composed/README.md)
    [STAGE_COMPOSED] = {"composed", NULL, "configs/composed.json",
                        .no_overlap = "stage 10 overlaps nothing yet (stage 07, whose schedule it runs, neither); set "
                                      "it to false",
                        .no_grid_depth = "stage 10 splits layers 1-D, over x (Megatron's column and row split): z "
                                         "must be 1",
                        .lora = true, .sequence_parallel = true, .experts = true, .expert_ranks = true,
                        .no_half_experts = "stage 10's experts train in fp32 (32 or 32-true), as stage 08's",
                        .zero_ladder = true},  // zero_stage 1 only (10_composed/composed_zero.h says why)
};
#define LAST_STAGE STAGE_COMPOSED

static bool stage_runs(const StageInfo *s, const char *strategy) {
    return strcmp(s->strategy, strategy) == 0 || (s->also && strcmp(s->also, strategy) == 0);
}

// The first stage that trains with `strategy`: where the refusal sends the learner.
static int stage_training_with(const char *strategy) {
    for (int n = STAGE_SINGLE_GPU; n <= LAST_STAGE; n++)
        if (strcmp(STAGES[n].strategy, strategy) == 0) return n;
    return 0;  // not reached: every strategy validate() accepts has a stage
}

// ---- where values came from -------------------------------------------------------------------

// Where each key's value was set last: "defaults", the config file's path or "command line".
// Validation blames that place, so a bad --lr=... points at the command line, not at the file.
typedef struct { const char *of[NKEYS]; } Sources;

static void note_source(Sources *src, const Key *k, const char *where) { src->of[k - KEYS] = where; }

static const char *source_of(const Sources *src, const char *key) { return src->of[find_key(key) - KEYS]; }

// For a rule over two keys: the place the user wrote them, or each key's place when they differ
// (a default is nobody's writing, so it names no place when the other key has one).
static const char *sources_of_pair(const Sources *src, const char *a, const char *b, char *buf, size_t size) {
    const char *wa = source_of(src, a), *wb = source_of(src, b);
    if (strcmp(wa, wb) == 0 || strcmp(wb, "defaults") == 0) return wa;
    if (strcmp(wa, "defaults") == 0) return wb;
    snprintf(buf, size, "%s (%s), %s (%s)", wa, a, wb, b);
    return buf;
}

// ---- reading the file and the command line ----------------------------------------------------

static bool is_blank(const char *text) { return text[strspn(text, " \t\r\n")] == '\0'; }

static void apply_json_file(Config *cfg, Sources *src, const char *path) {
    char *text = read_file_or_die(path, NULL);
    // cJSON calls an empty file invalid JSON near line 1, which hides that the file is empty
    if (is_blank(text)) fatal("%s: the file is empty: expected a JSON object of key: value ({} keeps every default)", path);
    cJSON *root = cJSON_Parse(text);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        int line = 1;
        for (const char *p = text; at && p < at; p++) line += (*p == '\n');
        fatal("%s: not valid JSON (near line %d)", path, line);
    }
    if (!cJSON_IsObject(root)) fatal("%s: expected a JSON object of key: value, found %s", path, json_type_name(root));
    for (const cJSON *item = root->child; item; item = item->next) {
        const Key *k = find_key_or_die(item->string, path);
        set_from_json(cfg, k, item, path);
        note_source(src, k, path);
    }
    cJSON_Delete(root);
    free(text);
}

// "ddp"; or "axonn" or "single_device" for the stage that accepts two
static const char *strategies_of(const StageInfo *s, char *buf, size_t size) {
    if (s->also) snprintf(buf, size, "\"%s\" or \"%s\"", s->strategy, s->also);
    else snprintf(buf, size, "\"%s\"", s->strategy);
    return buf;
}

static void print_help(Stage stage) {
    char runs[64];
    printf("usage: [mpirun -np P] build/stage-%d [--config FILE] [--key=value ...]\n\n"
           "Stage %02d runs strategy %s. FILE defaults to $CONFIG_FILE, then to %s.\n"
           "Keys (default in brackets):\n", (int)stage, (int)stage,
           strategies_of(&STAGES[stage], runs, sizeof runs), STAGES[stage].default_file);
    for (size_t i = 0; i < NKEYS; i++)
        printf("  --%-22s %s [%s]\n", KEYS[i].name, KEYS[i].help, KEYS[i].dflt);
}

// --config FILE or --config=FILE, at most once: a second file would silently replace the first.
// Without one, $CONFIG_FILE, then the stage's own.
static const char *config_file_from_args(int argc, char **argv, const char *stage_default) {
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *given;
        if (strcmp(argv[i], "--config") == 0) given = i + 1 < argc ? argv[++i] : "";
        else if (strncmp(argv[i], "--config=", 9) == 0) given = argv[i] + 9;
        else continue;
        if (!*given) fatal("command line: --config needs a file name");
        if (path)
            fatal("command line: --config given twice ('%s' and '%s'): give one file and change "
                  "its keys with --key=value", path, given);
        path = given;
    }
    if (path) return path;
    const char *env = getenv("CONFIG_FILE");
    return (env && *env) ? env : stage_default;
}

static void apply_overrides(Config *cfg, Sources *src, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--config") == 0) { i++; continue; }
        if (strncmp(arg, "--config=", 9) == 0) continue;
        if (strncmp(arg, "--", 2) != 0 || !strchr(arg, '='))
            fatal("command line: expected --key=value, found '%s'", arg);
        char name[64];
        size_t len = (size_t)(strchr(arg, '=') - arg - 2);
        if (len >= sizeof name) len = sizeof name - 1;
        memcpy(name, arg + 2, len);
        name[len] = '\0';
        const Key *k = find_key_or_die(name, "command line");
        set_from_text(cfg, k, strchr(arg, '=') + 1, "command line");
        note_source(src, k, "command line");
    }
}

// ---- model presets and validation -------------------------------------------------------------

typedef struct {
    const char *id;
    int n_layer, n_head, n_embd;
    const char *arch;
    int vocab_size, n_kv_head, intermediate_size;
} Preset;
static const Preset PRESETS[] = {
    {"gpt2", 12, 12, 768, "gpt2", 0, 0, 0}, {"gpt2-medium", 24, 16, 1024, "gpt2", 0, 0, 0},
    {"gpt2-large", 36, 20, 1280, "gpt2", 0, 0, 0}, {"gpt2-xl", 48, 25, 1600, "gpt2", 0, 0, 0},
    {"microsoft/phi-1_5", 24, 32, 2048, "phi", 51200, 0, 0},  // its vocabulary as its checkpoint pads it
    {"meta-llama/Llama-2-7b-hf", 32, 32, 4096, "llama", 32000, 32, 11008},
    {"meta-llama/Llama-3.1-8B", 32, 32, 4096, "llama", 128256, 8, 14336},
    {"custom", 0, 0, 0, "gpt2", 0, 0, 0},
};

static void apply_model_preset(Config *cfg, const Sources *src) {
    for (size_t i = 0; i < sizeof PRESETS / sizeof PRESETS[0]; i++) {
        const Preset *p = &PRESETS[i];
        if (strcmp(cfg->model_id, p->id) != 0) continue;
        if (!cfg->n_layer) cfg->n_layer = p->n_layer;
        if (!cfg->n_head) cfg->n_head = p->n_head;
        if (!cfg->n_embd) cfg->n_embd = p->n_embd;
        if (!cfg->vocab_size) cfg->vocab_size = p->vocab_size;
        if (!cfg->n_kv_head) cfg->n_kv_head = p->n_kv_head;
        if (!cfg->intermediate_size) cfg->intermediate_size = p->intermediate_size;
        if (!cfg->arch[0]) snprintf(cfg->arch, sizeof cfg->arch, "%s", p->arch);
        if (strcmp(cfg->arch, "gpt2") && strcmp(cfg->arch, "phi") && strcmp(cfg->arch, "llama"))
            fatal("%s: key 'arch': expected gpt2, phi or llama, found '%s'", source_of(src, "arch"), cfg->arch);
        return;
    }
    fatal("%s: key 'model_id': expected gpt2, gpt2-medium, gpt2-large, gpt2-xl, microsoft/phi-1_5, "
          "meta-llama/Llama-2-7b-hf, meta-llama/Llama-3.1-8B or custom, "
          "found '%s'",
          source_of(src, "model_id"), cfg->model_id);
}

static void require_positive(const Sources *src, const char *key, double value) {
    if (!(value > 0)) fatal("%s: key '%s': expected a positive value, found %g", source_of(src, key), key, value);
}

static void require_not_negative(const Sources *src, const char *key, double value) {
    if (value < 0) fatal("%s: key '%s': expected 0 or more, found %g", source_of(src, key), key, value);
}

static void require_one_of(const Sources *src, const char *key, const char *value, const char *const *allowed,
                           int n, const char *expected) {
    for (int i = 0; i < n; i++)
        if (strcmp(value, allowed[i]) == 0) return;
    fatal("%s: key '%s': expected %s, found '%s'", source_of(src, key), key, expected, value);
}

// precision's names and what each means (config.h)
static const struct { const char *name; Precision prec; } PRECISIONS[] = {
    {"32", PREC_FP32}, {"32-true", PREC_FP32}, {"bf16-mixed", PREC_BF16_MIXED}, {"bf16", PREC_BF16},
    {"16-mixed", PREC_FP16_MIXED}, {"fp8-tensorwise", PREC_FP8_TENSORWISE}, {"fp8-rowwise", PREC_FP8_ROWWISE},
    {"mxfp8", PREC_MXFP8},
};

static void resolve_precision(Config *cfg, const Sources *src) {
    for (size_t i = 0; i < sizeof PRECISIONS / sizeof PRECISIONS[0]; i++)
        if (strcmp(cfg->precision, PRECISIONS[i].name) == 0) {
            cfg->prec = PRECISIONS[i].prec;
            return;
        }
    fatal("%s: key 'precision': expected 32, 32-true, bf16-mixed, bf16, 16-mixed, fp8-tensorwise, fp8-rowwise or "
          "mxfp8, found '%s'",
          source_of(src, "precision"), cfg->precision);
}

// pp_schedule's names, in PipeSchedule's order (config.h)
static const char *const PIPE_SCHEDULES[] = {"gpipe", "1f1b", "interleaved", "zb-h1"};

static void resolve_pp_schedule(Config *cfg, const Sources *src) {
    for (size_t i = 0; i < sizeof PIPE_SCHEDULES / sizeof PIPE_SCHEDULES[0]; i++)
        if (strcmp(cfg->pp_schedule, PIPE_SCHEDULES[i]) == 0) {
            cfg->pp_sched = (PipeSchedule)i;
            return;
        }
    fatal("%s: key 'pp_schedule': expected gpipe, 1f1b, interleaved or zb-h1, found '%s'",
          source_of(src, "pp_schedule"), cfg->pp_schedule);
}

const char *pipe_schedule_name(PipeSchedule s) { return PIPE_SCHEDULES[s]; }

// FP8's linears are stage 02's plug-in (02_mixed_precision/fp8.c); elsewhere a run would quietly
// be bf16-mixed
static void require_fp8_fits_stage(const Config *cfg, const Sources *src, Stage stage) {
    if (!config_is_fp8(cfg)) return;
    if (stage != STAGE_MIXED_PRECISION)
        fatal("%s: key 'precision' is %s but stage %02d has no FP8 linears: FP8 training is stage 02's "
              "(build/stage-2)", source_of(src, "precision"), cfg->precision, (int)stage);
    if (cfg->lora_rank)
        fatal("%s: key 'precision' is %s but lora_rank is %d: LoRA's adapters train in bf16-mixed",
              source_of(src, "precision"), cfg->precision, cfg->lora_rank);
}

// ---- the stage rules (the STAGES table) -------------------------------------------------------

// An empty strategy is the stage's own; another stage's strategy is refused with where to go.
static void resolve_strategy(Config *cfg, const Sources *src, Stage stage) {
    static const char *const strategies[] = {"single_device", "ddp", "fsdp", "axonn", "pipeline", "expert_parallel",
                                             "context_parallel", "composed"};
    const StageInfo *s = &STAGES[stage];
    if (!cfg->strategy[0]) {
        strcpy(cfg->strategy, s->strategy);
        return;
    }
    require_one_of(src, "strategy", cfg->strategy, strategies, 8,
                   "single_device, ddp, fsdp, axonn, pipeline, expert_parallel, context_parallel or composed");
    if (stage_runs(s, cfg->strategy)) return;
    char runs[64];
    fatal("%s: key 'strategy' is \"%s\" but stage %02d runs %s; run build/stage-%d for %s",
          source_of(src, "strategy"), cfg->strategy, (int)stage, strategies_of(s, runs, sizeof runs),
          stage_training_with(cfg->strategy), cfg->strategy);
}

// The table's refusals of keys no other rule checks: a 16-bit precision, overlap_communication.
static void require_stage_takes_switches(const Config *cfg, const Sources *src, Stage stage) {
    const StageInfo *s = &STAGES[stage];
    if (s->no_half && config_is_half(cfg))
        fatal("%s: key 'precision' is '%s' but %s", source_of(src, "precision"), cfg->precision, s->no_half);
    if (s->no_overlap && cfg->overlap_communication)
        fatal("%s: key 'overlap_communication' is true but %s", source_of(src, "overlap_communication"),
              s->no_overlap);
    if (!s->sequence_parallel && cfg->sequence_parallel)
        fatal("%s: key 'sequence_parallel' is true but stage %02d has no tensor-parallel regions to split the "
              "sequence between: it is stage 05's and 10's (tp_dimensions [x, 1, 1])",
              source_of(src, "sequence_parallel"), (int)stage);
    if (cfg->sequence_parallel && cfg->lora_rank > 0)
        fatal("%s: key 'sequence_parallel' is true but lora_rank is %d: LoRA's tensor-parallel adapters "
              "all-reduce their own partial sums over x; set one of them otherwise",
              source_of(src, "sequence_parallel"), cfg->lora_rank);
    if (!s->tf32 && cfg->tf32)
        fatal("%s: key 'tf32' is true but stage %02d keeps its f32 matmuls in f32: TF32 is stage 01's lesson "
              "(build/cuda/stage-1 --tf32=true)", source_of(src, "tf32"), (int)stage);
}

// The sharding ladder is stage 04's: elsewhere zero_stage and hsdp_replicas would be ignored.
// Whether hsdp_replicas divides the ranks is known once they are started (fsdp_init).
static void require_ladder_keys_fit_stage(const Config *cfg, const Sources *src, Stage stage) {
    if (cfg->zero_stage < 1 || cfg->zero_stage > 3)
        fatal("%s: key 'zero_stage': expected 1, 2 or 3, found %d", source_of(src, "zero_stage"), cfg->zero_stage);
    require_positive(src, "hsdp_replicas", cfg->hsdp_replicas);
    if (STAGES[stage].zero_ladder || (cfg->zero_stage == 3 && cfg->hsdp_replicas == 1)) return;
    fatal("%s: keys 'zero_stage' and 'hsdp_replicas' are %d and %d but stage %02d shards nothing: the sharding "
          "ladder is strategy fsdp (build/stage-4)", source_of(src, cfg->zero_stage != 3 ? "zero_stage" : "hsdp_replicas"),
          cfg->zero_stage, cfg->hsdp_replicas, (int)stage);
}

// virtual_stages chunks each stage's blocks, which only the interleaved schedule runs; zb-h1 computes
// a weight gradient long after its block's backward, from activations that recomputation does not
// keep (each block's are recomputed into one buffer that the next block's recomputation overwrites)
static void require_schedule_keys(const Config *cfg, const Sources *src) {
    require_positive(src, "virtual_stages", cfg->virtual_stages);
    if (cfg->virtual_stages != 1 && cfg->pp_sched != SCHED_INTERLEAVED)
        fatal("%s: key 'virtual_stages' is %d but pp_schedule is '%s': only pp_schedule interleaved "
              "gives a stage more than one chunk of blocks", source_of(src, "virtual_stages"), cfg->virtual_stages,
              cfg->pp_schedule);
    if (cfg->pp_sched == SCHED_ZB_H1 && cfg->activation_checkpointing)
        fatal("%s: key 'activation_checkpointing' is true but pp_schedule zb-h1 computes each weight gradient "
              "after the block's backward, from activations recomputation does not keep: set one of them "
              "otherwise", source_of(src, "activation_checkpointing"));
}

// pp_size > 1 splits the blocks over ranks, which only strategy pipeline does; elsewhere it would
// be ignored. Stage 07 cuts the batch with num_microbatches: a gradient_acc_steps beside it would
// be a second, conflicting answer to the same question.
static void require_pipeline_keys_fit_strategy(const Config *cfg, const Sources *src) {
    require_positive(src, "pp_size", cfg->pp_size);
    require_positive(src, "num_microbatches", cfg->num_microbatches);
    require_schedule_keys(cfg, src);
    bool pipeline = strcmp(cfg->strategy, "pipeline") == 0 || strcmp(cfg->strategy, "composed") == 0;
    if (!pipeline && (cfg->pp_size != 1 || cfg->num_microbatches != 1))
        fatal("%s: keys 'pp_size' and 'num_microbatches' are %d and %d but strategy \"%s\" runs no "
              "pipeline: pipeline parallelism is strategy pipeline (build/stage-7)",
              source_of(src, cfg->pp_size != 1 ? "pp_size" : "num_microbatches"), cfg->pp_size,
              cfg->num_microbatches, cfg->strategy);
    if (pipeline && cfg->gradient_acc_steps != 1)
        fatal("%s: key 'gradient_acc_steps' is %d but strategy pipeline cuts the batch with "
              "num_microbatches: set num_microbatches instead", source_of(src, "gradient_acc_steps"),
              cfg->gradient_acc_steps);
}

// cp_size > 1 splits each sequence over ranks, which only strategies context_parallel and composed
// (stage 10's cp dimension) do; elsewhere it would be ignored
static void require_context_keys_fit_strategy(const Config *cfg, const Sources *src) {
    static const char *const impls[] = {"ring", "ulysses"};
    require_positive(src, "cp_size", cfg->cp_size);
    require_one_of(src, "cp_impl", cfg->cp_impl, impls, 2, "ring or ulysses");
    if (cfg->cp_size != 1 && strcmp(cfg->strategy, "context_parallel") != 0 && strcmp(cfg->strategy, "composed") != 0)
        fatal("%s: key 'cp_size' is %d but strategy \"%s\" does not split sequences: context parallelism "
              "is strategy context_parallel (build/stage-9) or composed (build/stage-10)", source_of(src, "cp_size"),
              cfg->cp_size, cfg->strategy);
}

// Experts are stage 08's (and stage 06 generates with them): elsewhere num_experts would be ignored
// or need each stage's own version of the experts. They keep every activation, are described for
// GPT-2 only and route on the host (their grid: require_grid_fits_stage).
static void require_moe_keys_fit_stage(const Config *cfg, const Sources *src, Stage stage) {
    const StageInfo *s = &STAGES[stage];
    char where[1200];
    require_not_negative(src, "num_experts", cfg->num_experts);
    require_positive(src, "moe_every", cfg->moe_every);
    require_positive(src, "ep_size", cfg->ep_size);
    require_not_negative(src, "capacity_factor", cfg->capacity_factor);
    require_not_negative(src, "aux_loss_coef", cfg->aux_loss_coef);
    if (cfg->ep_size != 1 && !s->expert_ranks)
        fatal("%s: key 'ep_size' is %d but stage %02d spreads no experts: expert parallelism is "
              "strategy expert_parallel (build/stage-8)", source_of(src, "ep_size"), cfg->ep_size, (int)stage);
    if (!cfg->num_experts) return;
    if (!s->experts)
        fatal("%s: key 'num_experts' is %d but stage %02d trains dense MLPs: a mixture of experts "
              "is strategy expert_parallel (build/stage-8)", source_of(src, "num_experts"), cfg->num_experts,
              (int)stage);
    if (cfg->num_experts > MAX_EXPERTS)
        fatal("%s: key 'num_experts': expected at most %d, found %d", source_of(src, "num_experts"), MAX_EXPERTS,
              cfg->num_experts);
    if (cfg->experts_per_token < 1 || cfg->experts_per_token > cfg->num_experts)
        fatal("%s: keys 'experts_per_token' and 'num_experts': expected 1 to %d experts per token, found %d",
              sources_of_pair(src, "experts_per_token", "num_experts", where, sizeof where), cfg->num_experts,
              cfg->experts_per_token);
    if (cfg->num_experts % cfg->ep_size != 0)
        fatal("%s: keys 'num_experts' and 'ep_size': the experts must split evenly over the ranks, found "
              "%d experts and ep_size %d", sources_of_pair(src, "num_experts", "ep_size", where, sizeof where),
              cfg->num_experts, cfg->ep_size);
    if (s->no_half_experts && config_is_half(cfg))
        fatal("%s: key 'precision' is '%s' but %s", source_of(src, "precision"), cfg->precision, s->no_half_experts);
    if (cfg->activation_checkpointing)
        fatal("%s: key 'activation_checkpointing' is true but mixture-of-experts blocks keep their "
              "activations (recomputing would route the tokens again)", source_of(src, "activation_checkpointing"));
    if (strcmp(cfg->arch, "phi") == 0)
        fatal("%s: key 'arch' is phi but the experts are GPT-2 MLPs: use arch gpt2", source_of(src, "arch"));
    if (cfg->compile)
        fatal("%s: key 'compile' is true but a mixture of experts routes its tokens on the host at every "
              "step, which a CUDA graph cannot record", source_of(src, "compile"));
}

// The one check of tp_dimensions' values (how many ranks a grid needs is the stage's, once they
// are started). A grid other than [1, 1, 1] splits every layer over ranks, which only strategy
// axonn does; on another strategy it would be ignored. Called after the experts' keys: a mixture
// of experts generates on one grid cell (stage 10 trains one over x: its experts whole on each).
static void require_grid_fits_stage(const Config *cfg, const Sources *src, Stage stage) {
    const int *tp = cfg->tp_dimensions;
    for (int i = 0; i < 3; i++) require_positive(src, "tp_dimensions", tp[i]);
    if (tp[0] * tp[1] * tp[2] == 1) return;
    const char *where = source_of(src, "tp_dimensions");
    if (strcmp(cfg->strategy, "axonn") != 0 && strcmp(cfg->strategy, "composed") != 0)
        fatal("%s: key 'tp_dimensions' is [%d, %d, %d] but strategy \"%s\" does not split layers: a "
              "tensor-parallel grid is strategy axonn (build/stage-5; build/stage-6 for inference)",
              where, tp[0], tp[1], tp[2], cfg->strategy);
    if (tp[2] != 1 && STAGES[stage].no_grid_depth)
        fatal("%s: key 'tp_dimensions' is [%d, %d, %d] but %s", where, tp[0], tp[1], tp[2],
              STAGES[stage].no_grid_depth);
    if (cfg->num_experts && STAGES[stage].generates)
        fatal("%s: key 'tp_dimensions' is [%d, %d, %d] but a mixture of experts generates on one grid "
              "cell ([1, 1, 1]): its experts are not split", where, tp[0], tp[1], tp[2]);
}

// The server's pool is sized by kv_cache_bytes or by kv_cache_memory_fraction: one of them, and a
// fraction that is a share of something.
static void require_one_pool_size(const Config *cfg, const Sources *src) {
    const char *fraction_from = source_of(src, "kv_cache_memory_fraction");
    char where[1200];
    if (strcmp(fraction_from, "defaults") == 0) return;
    if (strcmp(source_of(src, "kv_cache_bytes"), "defaults") != 0)
        fatal("%s: keys 'kv_cache_bytes' and 'kv_cache_memory_fraction' both size the KV cache's pool: expected "
              "one of them, found %g and %g",
              sources_of_pair(src, "kv_cache_bytes", "kv_cache_memory_fraction", where, sizeof where),
              cfg->kv_cache_bytes, cfg->kv_cache_memory_fraction);
    if (!(cfg->kv_cache_memory_fraction > 0 && cfg->kv_cache_memory_fraction <= 1))
        fatal("%s: key 'kv_cache_memory_fraction': expected a share of the free memory in (0, 1], found %g",
              fraction_from, cfg->kv_cache_memory_fraction);
}

// The keys of a stage that generates (stage 06).
static void require_generation_keys(const Config *cfg, const Sources *src) {
    char where[1200];
    require_positive(src, "tokens_to_generate", cfg->tokens_to_generate);
    require_positive(src, "max_batch_size", cfg->max_batch_size);
    if (cfg->temperature < 0)
        fatal("%s: key 'temperature': expected 0 (greedy) or more, found %g", source_of(src, "temperature"),
              cfg->temperature);
    if (cfg->top_k < 0)
        fatal("%s: key 'top_k': expected 0 (no limit) or more, found %d", source_of(src, "top_k"), cfg->top_k);
    if (!(cfg->top_p > 0 && cfg->top_p <= 1))
        fatal("%s: key 'top_p': expected a value in (0, 1], found %g", source_of(src, "top_p"), cfg->top_p);
    require_positive(src, "kv_block_size", cfg->kv_block_size);
    require_not_negative(src, "kv_cache_bytes", cfg->kv_cache_bytes);
    require_one_pool_size(cfg, src);
    require_not_negative(src, "max_prefill_tokens", cfg->max_prefill_tokens);
    require_positive(src, "num_speculative_tokens", cfg->num_speculative_tokens);
    if (cfg->serve && !cfg->kv_cache)
        fatal("%s: key 'kv_cache' is false but the server (serve: true) needs the KV cache",
              sources_of_pair(src, "kv_cache", "serve", where, sizeof where));
    if (cfg->serve && cfg->eval_accuracy)
        fatal("%s: keys 'serve' and 'eval_accuracy': a run either serves or evaluates, found both true",
              sources_of_pair(src, "serve", "eval_accuracy", where, sizeof where));
    if (!cfg->init_from[0] && !cfg->random_init)
        fatal("%s: key 'init_from' is empty but stage 06 needs a checkpoint to generate with (a directory "
              "or a .safetensors file, e.g. --init_from=out/demo-stage-1), or random_init: true",
              sources_of_pair(src, "init_from", "random_init", where, sizeof where));
}

// dataset_id names the data and data_path holds the file: both must say the same. An empty
// dataset_id takes what data_path says (the file, else the built-in synthetic set).
static void resolve_dataset(Config *cfg, const Sources *src) {
    const char *id = cfg->dataset_id;
    bool has_file = cfg->data_path[0] != '\0';
    char where[1200];
    if (!*id) {
        strcpy(cfg->dataset_id, has_file ? "alpaca" : "synthetic");
    } else if (strcmp(id, "alpaca") == 0 || strcmp(id, "tatsu-lab/alpaca") == 0) {
        if (!has_file)
            fatal("%s: key 'dataset_id' is \"%s\", an alpaca JSON file, but data_path is empty: set "
                  "data_path to the file (the tutorial's is alpaca_data.json from "
                  "github.com/tatsu-lab/stanford_alpaca), or dataset_id to synthetic for the built-in set",
                  sources_of_pair(src, "dataset_id", "data_path", where, sizeof where), id);
    } else if (strcmp(id, "synthetic") == 0) {
        if (has_file)
            fatal("%s: key 'dataset_id' is \"synthetic\" (the built-in set) but data_path is '%s': "
                  "set dataset_id to alpaca to train on the file, or leave data_path empty",
                  sources_of_pair(src, "dataset_id", "data_path", where, sizeof where), cfg->data_path);
    } else {
        fatal("%s: key 'dataset_id': expected tatsu-lab/alpaca or alpaca (the alpaca JSON file in "
              "data_path), or synthetic (the built-in set), found '%s'", source_of(src, "dataset_id"), id);
    }
}

// n_kv_head and intermediate_size shape a Llama only; its heads split into groups of n_kv_head
static void require_llama_keys_fit_arch(const Config *cfg, const Sources *src) {
    require_not_negative(src, "n_kv_head", cfg->n_kv_head);
    require_not_negative(src, "intermediate_size", cfg->intermediate_size);
    bool llama = strcmp(cfg->arch, "llama") == 0;
    if (!llama && (cfg->n_kv_head || cfg->intermediate_size))
        fatal("%s: key '%s' shapes a Llama but key 'arch' is %s", source_of(src, cfg->n_kv_head ? "n_kv_head" : "intermediate_size"),
              cfg->n_kv_head ? "n_kv_head" : "intermediate_size", cfg->arch);
    char where[1200];
    if (cfg->n_kv_head && cfg->n_head % cfg->n_kv_head)
        fatal("%s: keys 'n_head' and 'n_kv_head': n_head must be divisible by n_kv_head, found %d and %d",
              sources_of_pair(src, "n_head", "n_kv_head", where, sizeof where), cfg->n_head, cfg->n_kv_head);
}

// LoRA: which stages train adapters, and the keys' ranges (lora_targets is checked against the
// model's linears by common/run/lora.c, which knows them)
static void require_lora_keys_fit_stage(const Config *cfg, const Sources *src, Stage stage) {
    require_not_negative(src, "lora_rank", cfg->lora_rank);
    if (!cfg->lora_rank) return;
    require_positive(src, "lora_alpha", cfg->lora_alpha);
    if (cfg->lora_dropout < 0 || cfg->lora_dropout >= 1)
        fatal("%s: key 'lora_dropout': expected a value in [0, 1), found %g", source_of(src, "lora_dropout"),
              cfg->lora_dropout);
    char stages[64] = "";
    for (int n = STAGE_SINGLE_GPU; n <= LAST_STAGE; n++)
        if (STAGES[n].lora) snprintf(stages + strlen(stages), sizeof stages - strlen(stages), " %02d", n);
    if (!STAGES[stage].lora)
        fatal("%s: key 'lora_rank' is %d but stage %02d does not train LoRA adapters (stages that do:%s)",
              source_of(src, "lora_rank"), cfg->lora_rank, (int)stage, stages);
    if (cfg->num_experts)
        fatal("%s: key 'lora_rank' is %d but num_experts is %d: LoRA adapts dense linears only",
              source_of(src, "lora_rank"), cfg->lora_rank, cfg->num_experts);
    // stage 10 cuts its ZeRO shards from the dense share before the adapters replace the layout
    if (stage == STAGE_COMPOSED && strcmp(source_of(src, "zero_stage"), "defaults") != 0)
        fatal("%s: key 'zero_stage' is %d but lora_rank is %d: stage 10 shards the whole model's replicas only "
              "(expected no zero_stage)", source_of(src, "zero_stage"), cfg->zero_stage, cfg->lora_rank);
    if (cfg->prec == PREC_BF16)
        fatal("%s: key 'precision' is bf16 but LoRA's adapters train in fp32 over the base's 16-bit copy: "
              "use bf16-mixed", source_of(src, "precision"));
    if (strcmp(cfg->resume_mode, "true") == 0)
        fatal("%s: key 'resume' is true but a LoRA run (lora_rank %d) saves its adapters only and does not "
              "resume; start from them with lora_adapter", source_of(src, "resume"), cfg->lora_rank);
}

// whether key `name` holds its default value (a saved run's config writes every key: one that
// holds its default there was set by nobody)
static bool holds_default(const Config *cfg, const char *name) {
    const Key *k = find_key(name);
    Config dflt = *cfg;
    set_from_text(&dflt, k, k->dflt, "defaults");
    return memcmp(slot(&dflt, k), slot((Config *)cfg, k), k->size) == 0;
}

// The optimizer: Muon's keys choose nothing under AdamW, so setting one there is refused; Muon
// itself runs where a stage wires it (it needs whole matrices: common/run/muon.h) and trains every
// parameter of a dense model, not LoRA's adapters.
static void require_optimizer_keys_fit_stage(Config *cfg, const Sources *src, Stage stage) {
    static const char *const optimizers[] = {"adamw", "muon"};
    require_one_of(src, "optimizer", cfg->optimizer, optimizers, 2, "adamw or muon");
    cfg->muon = strcmp(cfg->optimizer, "muon") == 0;
    static const char *const muon_keys[] = {"muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps",
                                            "muon_redundant"};
    if (!cfg->muon) {
        for (int i = 0; i < 5; i++)
            if (!holds_default(cfg, muon_keys[i]))
                fatal("%s: key '%s' is set but key 'optimizer' is %s: Muon's keys need optimizer muon",
                      source_of(src, muon_keys[i]), muon_keys[i], cfg->optimizer);
        return;
    }
    char stages[64] = "";
    for (int n = STAGE_SINGLE_GPU; n <= LAST_STAGE; n++)
        if (STAGES[n].muon) snprintf(stages + strlen(stages), sizeof stages - strlen(stages), " %02d", n);
    if (!STAGES[stage].muon)
        fatal("%s: key 'optimizer' is muon but stage %02d has no Muon (stages that do:%s)",
              source_of(src, "optimizer"), (int)stage, stages);
    if (cfg->lora_rank)
        fatal("%s: key 'optimizer' is muon but lora_rank is %d: LoRA's adapters train with adamw",
              source_of(src, "optimizer"), cfg->lora_rank);
    if (cfg->num_experts)
        fatal("%s: key 'optimizer' is muon but num_experts is %d: Muon updates dense blocks' matrices only",
              source_of(src, "optimizer"), cfg->num_experts);
    if (cfg->muon_redundant && !STAGES[stage].zero_ladder)
        fatal("%s: key 'muon_redundant' is true but stage %02d holds every matrix whole: only a sharded "
              "optimizer (strategy fsdp, build/stage-4) chooses who orthogonalizes", source_of(src, "muon_redundant"),
              (int)stage);
    require_positive(src, "muon_lr", cfg->muon_lr);
    require_positive(src, "muon_ns_steps", cfg->muon_ns_steps);
    if (cfg->muon_momentum < 0 || cfg->muon_momentum >= 1)
        fatal("%s: key 'muon_momentum': expected a value in [0, 1), found %g", source_of(src, "muon_momentum"),
              cfg->muon_momentum);
}

// Delayed scaling is the tensorwise recipe's (one scale a tensor, known before its cast); rowwise
// and MX scales are the amaxes of this cast's rows and blocks, which no history could know
static void require_fp8_scaling_fits_precision(const Config *cfg, const Sources *src) {
    static const char *const scalings[] = {"current", "delayed", "none"};
    require_one_of(src, "fp8_scaling", cfg->fp8_scaling, scalings, 3, "current, delayed or none");
    require_positive(src, "fp8_amax_history", cfg->fp8_amax_history);
    bool delayed = strcmp(cfg->fp8_scaling, "delayed") == 0;
    if (strcmp(cfg->fp8_scaling, "current") != 0 && cfg->prec != PREC_FP8_TENSORWISE)
        fatal("%s: key 'fp8_scaling' is %s but precision is %s: fp8_scaling is fp8-tensorwise's (a scale per "
              "row or per block comes from that row's or block's amax now)",
              source_of(src, "fp8_scaling"), cfg->fp8_scaling, cfg->precision);
    if (!delayed && !holds_default(cfg, "fp8_amax_history"))
        fatal("%s: key 'fp8_amax_history' is set but fp8_scaling is %s: the history is delayed scaling's",
              source_of(src, "fp8_amax_history"), cfg->fp8_scaling);
}

static void validate(Config *cfg, const Sources *src, Stage stage) {
    resolve_precision(cfg, src);
    resolve_pp_schedule(cfg, src);
    require_fp8_fits_stage(cfg, src, stage);
    require_fp8_scaling_fits_precision(cfg, src);
    static const char *const comm_backends[] = {"auto", "nccl", "mpi", "mpi-staged"};
    require_one_of(src, "comm_backend", cfg->comm_backend, comm_backends, 4, "auto, nccl, mpi or mpi-staged");
    resolve_strategy(cfg, src, stage);
    require_pipeline_keys_fit_strategy(cfg, src);
    require_context_keys_fit_strategy(cfg, src);
    require_stage_takes_switches(cfg, src, stage);
    require_moe_keys_fit_stage(cfg, src, stage);
    require_grid_fits_stage(cfg, src, stage);
    require_ladder_keys_fit_stage(cfg, src, stage);
    require_lora_keys_fit_stage(cfg, src, stage);
    require_optimizer_keys_fit_stage(cfg, src, stage);
    resolve_dataset(cfg, src);
    apply_model_preset(cfg, src);
    require_positive(src, "n_layer", cfg->n_layer);
    require_positive(src, "n_head", cfg->n_head);
    require_positive(src, "n_embd", cfg->n_embd);
    require_positive(src, "max_seq_len", cfg->max_seq_len);
    require_positive(src, "global_batch_size", cfg->global_batch_size);
    require_positive(src, "gradient_acc_steps", cfg->gradient_acc_steps);
    require_positive(src, "log_interval", cfg->log_interval);
    require_positive(src, "num_epochs", cfg->num_epochs);
    require_positive(src, "lr", cfg->lr);
    require_positive(src, "trace_steps", cfg->trace_steps);
    require_not_negative(src, "vocab_size", cfg->vocab_size);
    require_not_negative(src, "warmup_steps", cfg->warmup_steps);
    require_not_negative(src, "eval_interval", cfg->eval_interval);
    require_not_negative(src, "checkpoint_interval", cfg->checkpoint_interval);
    require_not_negative(src, "grad_clip", cfg->grad_clip);
    require_positive(src, "loss_scale", cfg->loss_scale);
    require_not_negative(src, "loss_scale_window", cfg->loss_scale_window);
    char where[1200];
    if (cfg->n_embd % cfg->n_head != 0)
        fatal("%s: keys 'n_embd' and 'n_head': n_embd must be divisible by n_head, found %d and %d",
              sources_of_pair(src, "n_embd", "n_head", where, sizeof where), cfg->n_embd, cfg->n_head);
    require_llama_keys_fit_arch(cfg, src);
    if (cfg->global_batch_size % cfg->gradient_acc_steps != 0)
        fatal("%s: keys 'global_batch_size' and 'gradient_acc_steps': the batch must split into "
              "equal micro-batches, found %d and %d",
              sources_of_pair(src, "global_batch_size", "gradient_acc_steps", where, sizeof where),
              cfg->global_batch_size, cfg->gradient_acc_steps);
    if (cfg->min_lr < 0 || cfg->min_lr > cfg->lr)
        fatal("%s: key 'min_lr': expected a value between 0 and lr (%g), found %g",
              sources_of_pair(src, "min_lr", "lr", where, sizeof where), cfg->lr, cfg->min_lr);
    if (cfg->val_fraction < 0 || cfg->val_fraction >= 1)
        fatal("%s: key 'val_fraction': expected a value in [0, 1), found %g", source_of(src, "val_fraction"),
              cfg->val_fraction);
    if (STAGES[stage].generates) require_generation_keys(cfg, src);
}

static void require_resume_mode(const Config *cfg, const Sources *src) {
    static const char *const modes[] = {"auto", "true", "false"};
    require_one_of(src, "resume", cfg->resume_mode, modes, 3, "auto, true or false");
}

// where each key of the config config_load read last came from (config_source)
static Sources g_sources;

const char *config_source(const char *key) { return source_of(&g_sources, key); }

void config_load(Config *cfg, int argc, char **argv, Stage stage) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            print_help(stage);
            exit(0);
        }
    memset(cfg, 0, sizeof *cfg);
    Sources src;
    for (size_t i = 0; i < NKEYS; i++) {
        set_from_text(cfg, &KEYS[i], KEYS[i].dflt, "defaults");
        note_source(&src, &KEYS[i], "defaults");
    }
    apply_json_file(cfg, &src, config_file_from_args(argc, argv, STAGES[stage].default_file));
    apply_overrides(cfg, &src, argc, argv);
    validate(cfg, &src, stage);
    require_resume_mode(cfg, &src);
    g_sources = src;
}

char *config_to_json(const Config *cfg) {
    cJSON *root = cJSON_CreateObject();
    for (size_t i = 0; i < NKEYS; i++) {
        const Key *k = &KEYS[i];
        const void *v = (const char *)cfg + k->offset;
        switch (k->type) {
        case T_INT: cJSON_AddNumberToObject(root, k->name, *(const int *)v); break;
        case T_FLOAT: cJSON_AddNumberToObject(root, k->name, *(const double *)v); break;
        case T_BOOL: cJSON_AddBoolToObject(root, k->name, *(const bool *)v); break;
        case T_STRING: cJSON_AddStringToObject(root, k->name, (const char *)v); break;
        case T_INT3: cJSON_AddItemToObject(root, k->name, cJSON_CreateIntArray((const int *)v, 3)); break;
        }
    }
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}
