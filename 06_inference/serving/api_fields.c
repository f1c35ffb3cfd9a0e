// api_fields.c: every field a request to the server may carry, honoured or refused, never
// ignored (README.md, "The API, field by field"). A client asking for something this server does
// not do (log-probabilities, several choices, tools, a JSON schema) gets a 400 naming the field,
// not an answer that is silently something else. A refused field is still accepted with the value
// that asks for nothing (null, false, 0, 1, an empty list): clients send those by default.
#include "api_fields.h"

#include <string.h>

typedef bool (*AsksNothing)(const cJSON *v);

static bool is_false(const cJSON *v) { return cJSON_IsFalse(v); }
static bool is_one(const cJSON *v) { return cJSON_IsNumber(v) && v->valuedouble == 1; }
static bool is_empty(const cJSON *v) { return (cJSON_IsArray(v) || cJSON_IsObject(v)) && !v->child; }
static bool is_bool(const cJSON *v) { return cJSON_IsBool(v); }
static bool is_none(const cJSON *v) { return cJSON_IsString(v) && strcmp(v->valuestring, "none") == 0; }
static bool only_null(const cJSON *v) { return (void)v, false; }
static bool is_text_format(const cJSON *v) {
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(v, "type");
    return cJSON_IsObject(v) && cJSON_GetArraySize(v) == 1 && cJSON_IsString(type) && strcmp(type->valuestring, "text") == 0;
}

typedef struct {
    const char *name;
    unsigned endpoints;       // API_COMPLETIONS | API_CHAT
    AsksNothing asks_nothing; // NULL: honoured; else refused unless null or this holds
    const char *why;          // a refused field: what the server does not do
} Field;

enum { BOTH = API_COMPLETIONS | API_CHAT };

// The honoured fields are read by openai.c (read_prompt, read_sampling, read_max_tokens, ...);
// `user` is OpenAI's end-user id for its abuse monitoring, which changes no answer there either.
static const Field FIELDS[] = {
    {"model", BOTH, NULL, NULL},
    {"prompt", API_COMPLETIONS, NULL, NULL},
    {"messages", API_CHAT, NULL, NULL},
    {"max_tokens", BOTH, NULL, NULL},
    {"max_completion_tokens", API_CHAT, NULL, NULL},
    {"temperature", BOTH, NULL, NULL},
    {"top_p", BOTH, NULL, NULL},
    {"top_k", BOTH, NULL, NULL},
    {"min_p", BOTH, NULL, NULL},
    {"seed", BOTH, NULL, NULL},
    {"stop", BOTH, NULL, NULL},
    {"stop_token_ids", BOTH, NULL, NULL},
    {"ignore_eos", BOTH, NULL, NULL},
    {"logit_bias", BOTH, NULL, NULL},
    {"presence_penalty", BOTH, NULL, NULL},
    {"frequency_penalty", BOTH, NULL, NULL},
    {"repetition_penalty", BOTH, NULL, NULL},
    {"stream", BOTH, NULL, NULL},
    {"stream_options", BOTH, NULL, NULL},
    {"user", BOTH, NULL, NULL},
    {"logprobs", BOTH, NULL, NULL},
    {"top_logprobs", API_CHAT, NULL, NULL},
    {"echo", API_COMPLETIONS, NULL, NULL},
    {"n", BOTH, NULL, NULL},
    {"best_of", API_COMPLETIONS, is_one, "best_of is not implemented"},
    {"suffix", API_COMPLETIONS, only_null, "inserting text (a suffix) is not implemented"},
    {"response_format", API_CHAT, is_text_format, "only plain text answers ({\"type\": \"text\"}): "
                                                  "structured output is not implemented"},
    {"tools", API_CHAT, is_empty, "tool calls are not implemented"},
    {"tool_choice", API_CHAT, is_none, "tool calls are not implemented"},
    {"parallel_tool_calls", API_CHAT, is_bool, "tool calls are not implemented"},
    {"functions", API_CHAT, is_empty, "function calls are not implemented"},
    {"function_call", API_CHAT, is_none, "function calls are not implemented"},
    {"store", API_CHAT, is_false, "this server stores no answers"},
    {"metadata", API_CHAT, is_empty, "this server stores no answers, so it keeps no metadata"},
    {"service_tier", BOTH, only_null, "this server has one tier"},
    {"modalities", API_CHAT, only_null, "this model answers in text only"},
    {"audio", API_CHAT, only_null, "this model answers in text only"},
    {"prediction", API_CHAT, only_null, "predicted outputs are not implemented"},
    {"reasoning_effort", API_CHAT, only_null, "this model does not reason apart from its answer"},
    {"web_search_options", API_CHAT, only_null, "this server does not search the web"},
};

const char *api_refused_field(const cJSON *req, unsigned endpoint, const char **why) {
    const cJSON *v;
    cJSON_ArrayForEach(v, req) {
        const Field *f = NULL;
        for (size_t i = 0; i < sizeof FIELDS / sizeof FIELDS[0] && !f; i++)
            if ((FIELDS[i].endpoints & endpoint) && strcmp(FIELDS[i].name, v->string) == 0) f = &FIELDS[i];
        if (!f) {
            *why = "this server does not know the field";
            return v->string;
        }
        if (f->asks_nothing && !cJSON_IsNull(v) && !f->asks_nothing(v)) {
            *why = f->why;
            return v->string;
        }
    }
    return NULL;
}
