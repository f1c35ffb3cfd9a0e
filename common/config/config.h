// config.h: the run's settings. A flat JSON file (the SC24 tutorial's keys plus ours), then
// --key=value overrides from the command line, then validation. Every key, its type, default and
// meaning is in one table in config.c; `--help` prints it.
#ifndef CONFIG_H
#define CONFIG_H

#include <stdbool.h>

#include "ops/ops.h"  // HalfFormat

// The key precision as config_load reads it, once: every other site asks this, not the string
// (which the config keeps for what it writes: metrics, stats.json, a checkpoint's run_config).
typedef enum {
    PREC_FP32,        // "32", "32-true": everything in fp32
    PREC_BF16_MIXED,  // "bf16-mixed": the matmuls read bf16 copies of fp32 master weights
    PREC_BF16,        // "bf16": the weights themselves in bf16, no fp32 master
    PREC_FP16_MIXED,  // "16-mixed": fp16 copies of fp32 master weights, with loss scaling
    PREC_FP8_TENSORWISE,  // "fp8-tensorwise": bf16-mixed, the block's linears on FP8 (stage 02)
    PREC_FP8_ROWWISE,     // "fp8-rowwise": the same with a scale per row of each matmul operand
    PREC_MXFP8,           // "mxfp8": the same with a scale per block of 32 (OCP MX, e4m3 elements)
} Precision;

// The key pp_schedule as config_load reads it, once (the string stays for what the config writes)
typedef enum {
    SCHED_GPIPE,        // "gpipe": every forward, then every backward
    SCHED_1F1B,         // "1f1b": one forward, one backward once the pipe is full
    SCHED_INTERLEAVED,  // "interleaved": 1F1B over virtual_stages chunks of blocks per stage
    SCHED_ZB_H1,        // "zb-h1": the backward split into B and W, the W's filling the bubble
} PipeSchedule;

typedef struct {
    // the tutorial's keys
    char model_id[64];        // "gpt2", "gpt2-medium", ... picks n_layer/n_head/n_embd; "custom"
    char arch[16];            // "gpt2", "phi" or "llama" (empty: model_id's)
    char dataset_id[64];      // "synthetic", or "alpaca"/"tatsu-lab/alpaca": the file in data_path
    int seed;
    char precision[16];       // "32", "32-true", "bf16-mixed", "bf16", "16-mixed" (fp16)
    Precision prec;           // not a key: config_load's reading of precision
    char strategy[24];        // "single_device", "ddp", "fsdp", "axonn", "pipeline", "expert_parallel",
                              // "context_parallel": the stage's own
    int tp_dimensions[3];     // [x, y, z] for strategy axonn
    int global_batch_size;    // sequences per optimizer step, over all ranks
    int gradient_acc_steps;   // micro-batches per optimizer step
    int log_interval;
    int num_epochs;
    bool random_init;         // ignore init_from and start from random weights
    bool compile;             // inference: capture the decode step as a CUDA graph
    bool tf32;                // stage 01: f32 matmuls in TF32 on the tensor cores (ops_set_tf32)
    int stop_iteration;       // stop after this many optimizer steps (-1: run every epoch)
    int tokens_to_generate;
    // ours
    int n_layer, n_head, n_embd, max_seq_len;
    int n_kv_head;            // llama: key/value heads (0: n_head)
    int intermediate_size;    // llama: the SwiGLU MLP's width (0: 4 n_embd)
    int vocab_size;           // 0: the tokenizer's; larger adds unused rows (GPT-2's 50257)
    char data_path[512];      // alpaca JSON file; "" = the built-in synthetic instruction set
    char tokenizer_path[512]; // GPT-2 BPE or tokenizer.json directory; "" = the byte tokenizer
    char init_from[512];      // a checkpoint (directory or .safetensors) to start from
    char resume_mode[8];      // key 'resume': "auto", "true" (must resume) or "false" (start over)
    bool resume;              // not a key: resolve_resume's answer, this run continues the one in out_dir
    char out_dir[512];
    double lr, min_lr, beta1, beta2, eps, weight_decay, grad_clip, val_fraction;
    char optimizer[16];          // "adamw", or "muon" (common/run/muon.h)
    bool muon;                   // not a key: optimizer is muon
    double muon_lr;              // muon: the matrices' peak learning rate (lr's schedule scales it)
    double muon_momentum;        // muon: beta of its momentum
    bool muon_nesterov;          // muon: orthogonalize the Nesterov look-ahead (false: the momentum)
    int muon_ns_steps;           // muon: Newton-Schulz iterations
    bool muon_redundant;         // muon, fsdp: every rank orthogonalizes every matrix (false: one owner each)
    double loss_scale;           // 16-mixed: the initial loss scale
    int loss_scale_window;       // 16-mixed: good steps before the scale doubles (0: fixed scale)
    char fp8_scaling[8];         // fp8-tensorwise: "current" (this cast's amax), "delayed" (the history's), "none"
    int fp8_amax_history;        // fp8_scaling delayed: the casts of a tensor whose amaxes it keeps
    int warmup_steps, eval_interval, eval_batches, checkpoint_interval;
    bool always_input_template;  // the tutorial's quirk: the with-input prompt for every record
    bool activation_checkpointing;  // blocks recompute their activations in backward
    bool trace;       // <out_dir>/trace.json (trace.h)
    int trace_steps;  // the first N steps are traced
    bool overlap_communication;  // ddp: bucketed all-reduce during backward; axonn: prefetching
    char comm_backend[16];       // auto, nccl, mpi or mpi-staged (comm_select_backend)
    double bucket_size_mb;       // ddp: gradient bucket size for the overlapped all-reduce
    int zero_stage;              // fsdp: 1 shards AdamW's state, 2 the gradients too, 3 the parameters too
    int hsdp_replicas;           // fsdp: replica groups the ranks form, each sharding over its own ranks
    bool vocab_parallel_loss;    // axonn: loss on the vocabulary split over x (false: gather the logits)
    bool sequence_parallel;      // axonn [x, 1, 1]: LayerNorms and residual on 1/x of the tokens (Megatron's)
    // pipeline (stage 07)
    int pp_size;                 // pipeline stages; the ranks / pp_size replicas are data-parallel
    int num_microbatches;        // micro-batches a replica's rows are cut into (in place of gradient_acc_steps)
    char pp_schedule[16];        // "gpipe", "1f1b", "interleaved" or "zb-h1"
    PipeSchedule pp_sched;       // not a key: config_load's reading of pp_schedule
    int virtual_stages;          // interleaved: chunks of blocks per stage
    // mixture of experts (stage 08; stage 06 generates with such a model)
    int num_experts;             // experts of each MoE block (0: every block has its dense MLP)
    int experts_per_token;       // k: the experts each token goes to
    int moe_every;               // every moe_every-th block is a MoE block
    double capacity_factor;      // rows per expert per sequence: ceil(factor * T * k / E); 0: no limit
    double aux_loss_coef;        // weight of the load-balancing loss in the objective
    int ep_size;                 // ranks the experts are spread over; ranks / ep_size replicas
    // context parallelism (stage 09)
    int cp_size;                 // ranks each sequence is split over; ranks / cp_size replicas
    char cp_impl[16];            // "ring" (keys and values passed around) or "ulysses" (all-to-all)
    // LoRA: adapters on the frozen base's linears (common/run/lora.h)
    int lora_rank;               // r (0: full fine-tuning)
    double lora_alpha;           // the adapters' output is scaled by lora_alpha / lora_rank
    double lora_dropout;         // dropout on the adapters' input
    char lora_targets[256];      // Hugging Face module names, comma-separated ("": PEFT's default)
    char lora_adapter[512];      // a PEFT adapter directory to start from ("": A random, B zero)
    // inference (stage 06)
    char prompts_path[512];      // prompts, one per line ("-": stdin)
    int max_batch_size;          // prompts generated together
    double temperature, top_p;   // sampling (temperature 0: greedy)
    int top_k;
    bool kv_cache;               // false: recompute the whole sequence every step (the reference)
    bool eval_accuracy;          // generate for the held-out split and report exact-answer accuracy
    bool show_token_ids;         // print each prompt's and answer's token ids
    bool serve;                  // an OpenAI-compatible HTTP server instead of the prompts file
    char host[64];               // the IPv4 address it listens on
    int port;                    // its TCP port (0: any free one)
    int max_queue;               // requests waiting for a slot before it answers 429
    char served_model_name[128]; // the "model" it answers to ("": init_from's base name)
    int kv_block_size;           // positions per block of the paged KV cache
    double kv_cache_bytes;       // the server's block pool per rank (0: max_batch_size whole contexts)
    double kv_cache_memory_fraction;  // ... or this share of the device's free memory (not given: 0)
    int max_prefill_tokens;      // prompt tokens a server step takes (0: whole prompts)
    bool prefix_caching;         // requests whose text begins alike share cache blocks
    char draft_model[512];       // speculative decoding's draft checkpoint ("": none)
    int num_speculative_tokens;  // tokens it proposes a step
} Config;

// The program loading the config. Each stage implements one strategy and reads its own config
// when neither --config nor $CONFIG_FILE is given; a config whose strategy another stage
// implements is refused with the stage to run instead, and so is a key the stage does not take
// (stage 01 a bf16 precision, stage 07 overlap_communication, ...), with why. All of it is one
// table in config.c, STAGES, one row per stage.
typedef enum {
    STAGE_SINGLE_GPU = 1,       // single_device
    STAGE_MIXED_PRECISION,      // single_device
    STAGE_DDP,                  // ddp
    STAGE_FSDP,                 // fsdp
    STAGE_TENSOR_PARALLEL,      // axonn
    STAGE_INFERENCE,            // axonn over [x, y, 1] (single_device: the [1, 1, 1] grid only)
    STAGE_PIPELINE_PARALLEL,    // pipeline
    STAGE_MIXTURE_OF_EXPERTS,   // expert_parallel
    STAGE_CONTEXT_PARALLEL,     // context_parallel
    STAGE_COMPOSED,             // composed: data x tensor x pipeline parallelism on one mesh
} Stage;

// Reads the stage's config, applies --key=value overrides, validates, and fills in what empty
// keys mean (strategy: the stage's own; dataset_id: what data_path names). Whether a training
// run resumes is resolve_resume's (run_checkpoint.h), from what out_dir holds. Prints usage and
// exits 0 on --help; any error goes through fatal() naming where the value came from (the file,
// the command line or the defaults), the key, what was expected and what was found.
void config_load(Config *cfg, int argc, char **argv, Stage stage);
// where the value of `key` in the config config_load read last came from: "defaults", the
// config file's path or "command line", for messages about it
const char *config_source(const char *key);

// The config as one JSON line (for the log and for checkpoints); malloc'd.
char *config_to_json(const Config *cfg);

// precision helpers: matmul inputs in 16 bits (every precision but fp32), and in which format
// (HALF_FP16 for 16-mixed, else HALF_BF16)
static inline bool config_is_half(const Config *cfg) { return cfg->prec != PREC_FP32; }
// the FP8 precisions (stage 02's fp8.c): fp8-tensorwise, fp8-rowwise, mxfp8
static inline bool config_is_fp8(const Config *cfg) { return cfg->prec >= PREC_FP8_TENSORWISE; }
// pp_schedule's name of s ("gpipe", "1f1b", "interleaved", "zb-h1")
const char *pipe_schedule_name(PipeSchedule s);
static inline HalfFormat config_half_format(const Config *cfg) {
    return cfg->prec == PREC_FP16_MIXED ? HALF_FP16 : HALF_BF16;
}

#endif
