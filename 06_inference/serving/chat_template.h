// chat_template.h: a checkpoint's own chat template (tokenizer_config.json), rendered for the
// server's chat requests in a subset of Jinja (chat_template.c) as transformers renders it
#ifndef CHAT_TEMPLATE_H
#define CHAT_TEMPLATE_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>

#include "scheduler.h"  // Buf

typedef struct ChatTemplate {
    char *text;       // the Jinja template
    char *bos, *eos;  // bos_token, eos_token as the template sees them
    char path[1024];  // the file it came from
} ChatTemplate;

// dir/tokenizer_config.json's chat_template (a string, or the list entry named "default"), or NULL
// when there is none; one outside the subset, or a malformed file, ends the process with an error
// naming the file and the key
ChatTemplate *chat_template_load(const char *dir);
void chat_template_free(ChatTemplate *c);
// The template rendered over messages (a JSON list of {"role", "content"}); NULL and the error in
// err when it raises or goes outside the subset.
char *chat_template_render(const char *tmpl, const cJSON *messages, bool add_generation_prompt, const char *bos_token,
                           const char *eos_token, char *err, size_t err_size);

#endif
