// lora_merge: folds a LoRA adapter into its base model and writes the merged model as a Hugging
// Face checkpoint, which any stage (and transformers) loads without knowing about LoRA.
//
//   build/lora_merge BASE ADAPTER OUT
//
// BASE: the base checkpoint (a directory with config.json and model.safetensors, or its shards);
// ADAPTER: a PEFT adapter directory (adapter_config.json, adapter_model.safetensors), ours or
// PEFT's; OUT: where model.safetensors and config.json go. Each adapted linear's weight becomes
// W + (lora_alpha / r) B A, PEFT's merge_and_unload; the adapted model and the merged one compute
// the same logits.
#include <stdio.h>
#include <stdlib.h>

#include "base/log.h"
#include "model/checkpoint.h"
#include "model/gpt.h"
#include "run/lora.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: build/lora_merge BASE ADAPTER OUT\n"
                        "  writes OUT/model.safetensors and OUT/config.json: BASE's model with ADAPTER's\n"
                        "  LoRA adapters (PEFT's files) folded into its weights\n");
        return 2;
    }
    const char *base_dir = argv[1], *adapter_dir = argv[2], *out_dir = argv[3];
    GPTConfig cfg;
    checkpoint_read_config(base_dir, &cfg);
    ParamLayout base;
    gpt_layout(&base, &cfg);
    float *params = malloc_or_die(base.num_params * sizeof(float));
    checkpoint_load_model(base_dir, &base, params);

    int rank;
    double alpha;
    char targets[256], where[1100];
    lora_read_adapter_config(adapter_dir, &rank, &alpha, targets, sizeof targets);
    snprintf(where, sizeof where, "%s/adapter_config.json", adapter_dir);
    Lora lo;
    lora_describe(&lo, &base, rank, alpha, targets, where);
    float *adapters = malloc_or_die(lo.trained.layout.num_params * sizeof(float));
    lora_read_adapter(&lo, adapter_dir, adapters);
    lora_merge(&lo, adapters, params);

    checkpoint_save_model(out_dir, &base, params, NULL);
    printf("merged %d adapters (r %d, alpha %g) of %s into %s/model.safetensors\n", lo.n_sites, rank, alpha,
           adapter_dir, out_dir);
    lora_free(&lo);
    free(adapters);
    free(params);
    gpt_layout_free(&base);
    return 0;
}
