// openai.c: OpenAI's API as JSON: a request's body in, checked field by field, as the jobs of its
// choices (parse_request); a job's tokens out, as a whole answer or as server-sent events; an
// error as OpenAI's error object. No HTTP here: http.c carries these bytes.
#include "openai.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api_fields.h"
#include "base/log.h"
#include "chat_template.h"
#include "data/alpaca.h"

static const char *FINISH_NAMES[] = {"", "stop", "length"};
enum { MAX_STOP_IDS = 64, MAX_LOGIT_BIAS = 300 };  // a request's stop_token_ids, logit_bias (OpenAI's limit)
enum { MAX_TOP_LOGPROBS = 20 };                    // the alternatives a request's logprobs may ask for (OpenAI's)

static bool all_continuation_bytes(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) return false;
    return true;
}

// Appends the valid UTF-8 of s[0..n) to out, a bad byte as U+FFFD; an incomplete character at the
// end is held back (its other bytes come with the next token) unless `final`. Returns the bytes
// of s it used. A BPE or byte token can end in the middle of a character, and JSON wants text.
// the bytes the lead byte c says its character has (0: no lead byte)
static size_t utf8_length(unsigned char c) {
    return c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
}

// whether s[0..n) begins with a whole, valid character of len bytes
static bool utf8_char_at(const char *s, size_t n, size_t len) {
    return len > 0 && len <= n && utf8_is_valid(s, len, NULL);
}

static size_t append_utf8(Buf *out, const char *s, size_t n, bool final) {
    size_t i = 0;
    while (i < n) {
        size_t len = utf8_length((unsigned char)s[i]);
        if (len > 1 && i + len > n && !final && all_continuation_bytes(s + i + 1, n - i - 1)) break;
        if (utf8_char_at(s + i, n - i, len)) {
            buf_append(out, s + i, len);
            i += len;
        } else {
            buf_append(out, "\xEF\xBF\xBD", 3);
            i++;
        }
    }
    return i;
}

// ---- a request's life ------------------------------------------------------------------------

void job_free(Job *j) {
    free(j->ids);
    for (int i = 0; i < j->n_stops; i++) free(j->stops[i]);
    free(j->text.p);
    free(j->ends);
    free(j->out_ids);
    free(j->bias_ids);
    free(j->bias);
    free(j->stop_ids);
    free(j->token_lp);
    free(j->top_lp);
    free(j->top_ids);
    free(j);
}

void job_release(Server *s, Job *j) {
    if (--j->refs > 0) return;
    job_free(j);
    s->live_jobs--;
}

// ---- requests: OpenAI's JSON in, a Job out -----------------------------------------------------

bool api_fail(ApiError *e, int status, const char *param, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    e->code = code;
    return false;
}

char *api_error_json(const ApiError *e) {
    cJSON *root = cJSON_CreateObject(), *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", e->message);
    cJSON_AddStringToObject(err, "type", e->status == 429 ? "rate_limit_error"
                                         : e->status == 503 ? "server_error" : "invalid_request_error");
    if (e->param[0]) cJSON_AddStringToObject(err, "param", e->param);
    else cJSON_AddNullToObject(err, "param");
    if (e->code) cJSON_AddStringToObject(err, "code", e->code);
    else cJSON_AddNullToObject(err, "code");
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return text;
}

// Reads an optional number field into *x; false (and the error) if it is there but not a number
// in [lo, hi].
static bool optional_number(const cJSON *req, const char *key, double lo, double hi, double *x, ApiError *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(req, key);
    if (!v || cJSON_IsNull(v)) return true;
    if (!cJSON_IsNumber(v)) return api_fail(e, 400, key, "invalid_type", "'%s' must be a number", key);
    if (!(v->valuedouble >= lo && v->valuedouble <= hi))
        return api_fail(e, 400, key, "invalid_value", "'%s' is %g, expected a value in [%g, %g]", key,
                    v->valuedouble, lo, hi);
    *x = v->valuedouble;
    return true;
}

static bool optional_integer(const cJSON *req, const char *key, double lo, double hi, long *x, ApiError *e) {
    double d = (double)*x;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(req, key);
    if (v && cJSON_IsNumber(v) && v->valuedouble != floor(v->valuedouble))
        return api_fail(e, 400, key, "invalid_type", "'%s' must be an integer, found %g", key, v->valuedouble);
    if (!optional_number(req, key, lo, hi, &d, e)) return false;
    *x = (long)d;
    return true;
}

static const char *string_field(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

// A message's content may be a list of parts, as OpenAI's API allows: text parts are joined with
// newlines (as vLLM does) into the string the template takes; this model reads nothing else.
static bool join_text_parts(cJSON *messages, ApiError *e) {
    cJSON *msg;
    int i = 0;
    cJSON_ArrayForEach(msg, messages) {
        cJSON *parts = cJSON_GetObjectItemCaseSensitive(msg, "content"), *part;
        if (!cJSON_IsArray(parts)) {
            i++;
            continue;
        }
        Buf text = {0};
        buf_append(&text, "", 0);
        int k = 0;
        cJSON_ArrayForEach(part, parts) {
            const char *type = string_field(part, "type"), *piece = string_field(part, "text");
            if (!type || strcmp(type, "text") != 0 || !piece) {
                free(text.p);
                return api_fail(e, 400, "messages", "invalid_value", "messages[%d].content[%d]: this model "
                            "reads text parts only ({\"type\": \"text\", \"text\": ...})", i, k);
            }
            if (k++) buf_append(&text, "\n", 1);
            buf_append(&text, piece, strlen(piece));
        }
        cJSON_ReplaceItemInObjectCaseSensitive(msg, "content", cJSON_CreateString(text.p));
        free(text.p);
        i++;
    }
    return true;
}

// The chat as one Alpaca prompt: each user message is an instruction (a system message before it
// becomes that instruction's input, the template's "further context"), each assistant message
// the response to the one before; the last message is the user's, whose response is wanted.
// One user message gives exactly the prompt stage 06 makes from a line of the prompts file.
static char *chat_prompt(const cJSON *messages, bool always_input, ApiError *e) {
    if (!cJSON_IsArray(messages) || cJSON_GetArraySize(messages) == 0)
        return api_fail(e, 400, "messages", "invalid_type", "'messages' must be a non-empty array"), NULL;
    Buf prompt = {0};
    buf_append(&prompt, "", 0);
    const char *system = "", *last_role = "";
    int i = 0;
    const cJSON *msg;
    cJSON_ArrayForEach(msg, messages) {
        const char *role = string_field(msg, "role"), *content = string_field(msg, "content");
        if (!cJSON_IsObject(msg) || !role || !content) {
            free(prompt.p);
            return api_fail(e, 400, "messages", "invalid_type", "messages[%d] must be an object with "
                        "string 'role' and 'content'", i), NULL;
        }
        if (strcmp(role, "system") == 0 || strcmp(role, "developer") == 0) {
            system = content;
        } else if (strcmp(role, "user") == 0) {
            AlpacaRecord rec = {.instruction = (char *)content, .input = (char *)system, .output = ""};
            char *turn = alpaca_format_prompt(&rec, always_input);
            buf_append(&prompt, turn, strlen(turn));
            free(turn);
            system = "";
        } else if (strcmp(role, "assistant") == 0) {
            buf_append(&prompt, content, strlen(content));
            buf_append(&prompt, "\n\n", 2);
        } else {
            free(prompt.p);
            return api_fail(e, 400, "messages", "invalid_value", "messages[%d]: unknown role '%s' "
                        "(expected system, user or assistant)", i, role), NULL;
        }
        last_role = role;
        i++;
    }
    if (strcmp(last_role, "user") != 0) {
        free(prompt.p);
        return api_fail(e, 400, "messages", "invalid_value", "the last message must be the user's"), NULL;
    }
    return prompt.p;
}

// The chat through the checkpoint's own template (tokenizer_config.json's chat_template), with the
// assistant's turn begun (add_generation_prompt); a template that raises on it (roles that do not
// alternate, say) refuses it with its words.
static char *templated_prompt(const ChatTemplate *t, const cJSON *messages, ApiError *e) {
    const cJSON *msg;
    int i = 0;
    if (!cJSON_IsArray(messages) || cJSON_GetArraySize(messages) == 0)
        return api_fail(e, 400, "messages", "invalid_type", "'messages' must be a non-empty array"), NULL;
    cJSON_ArrayForEach(msg, messages) {
        if (!cJSON_IsObject(msg) || !string_field(msg, "role") || !string_field(msg, "content"))
            return api_fail(e, 400, "messages", "invalid_type", "messages[%d] must be an object with string 'role' and "
                        "'content'", i), NULL;
        i++;
    }
    char err[400];
    char *text = chat_template_render(t->text, messages, true, t->bos, t->eos, err, sizeof err);
    if (!text) api_fail(e, 400, "messages", "invalid_value", "%s (%s)", err, t->path);
    return text;
}

static bool read_stops(const cJSON *req, Job *j, ApiError *e) {
    const cJSON *stop = cJSON_GetObjectItemCaseSensitive(req, "stop"), *item;
    if (!stop || cJSON_IsNull(stop)) return true;
    if (cJSON_IsString(stop)) {
        if (!stop->valuestring[0]) return api_fail(e, 400, "stop", "invalid_value", "'stop' must not be empty");
        j->stops[j->n_stops++] = copy_string_or_die(stop->valuestring);
        return true;
    }
    if (!cJSON_IsArray(stop) || cJSON_GetArraySize(stop) > MAX_STOPS)
        return api_fail(e, 400, "stop", "invalid_type", "'stop' must be a string or up to %d strings", MAX_STOPS);
    cJSON_ArrayForEach(item, stop) {
        if (!cJSON_IsString(item) || !item->valuestring[0])
            return api_fail(e, 400, "stop", "invalid_type", "'stop' must hold non-empty strings");
        j->stops[j->n_stops++] = copy_string_or_die(item->valuestring);
    }
    return true;
}

static bool read_sampling(const cJSON *req, const Config *cfg, Job *j, ApiError *e) {
    double temperature = cfg->temperature, top_p = cfg->top_p, min_p = 0;
    long top_k = cfg->top_k, seed = -1;
    if (!optional_number(req, "temperature", 0, 2, &temperature, e) ||
        !optional_number(req, "top_p", 1e-9, 1, &top_p, e) ||
        !optional_number(req, "min_p", 0, 1, &min_p, e) ||
        !optional_integer(req, "top_k", 0, 1e9, &top_k, e) ||
        !optional_integer(req, "seed", 0, 9007199254740991.0, &seed, e))
        return false;
    const cJSON *stream = cJSON_GetObjectItemCaseSensitive(req, "stream");
    if (stream && !cJSON_IsNull(stream) && !cJSON_IsBool(stream))
        return api_fail(e, 400, "stream", "invalid_type", "'stream' must be true or false");
    j->stream = cJSON_IsTrue(stream);
    j->temperature = (float)temperature;
    j->top_p = (float)top_p;
    j->min_p = (float)min_p;
    j->top_k = (int)top_k;
    // a request's own seed makes its sample a function of the seed alone; otherwise the server's
    // seed and the request's number pick it
    j->seed = seed >= 0 ? (uint64_t)seed : (uint64_t)cfg->seed;
    j->key = seed >= 0 ? 0 : j->id;
    return read_stops(req, j, e);
}

// an optional true or false
static bool optional_bool(const cJSON *req, const char *key, bool *x, ApiError *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(req, key);
    if (!v || cJSON_IsNull(v)) return true;
    if (!cJSON_IsBool(v)) return api_fail(e, 400, key, "invalid_type", "'%s' must be true or false", key);
    *x = cJSON_IsTrue(v);
    return true;
}

// a token id as a request gives it: an integer in [0, V)
static bool token_id_ok(double id, int V) { return id >= 0 && id < V && id == floor(id); }

// stop_token_ids: a list of token ids, each of which ends the answer (kept in it, as vLLM does)
static bool read_stop_token_ids(const cJSON *req, int V, Job *j, ApiError *e) {
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(req, "stop_token_ids"), *id;
    if (!ids || cJSON_IsNull(ids)) return true;
    if (!cJSON_IsArray(ids) || cJSON_GetArraySize(ids) > MAX_STOP_IDS)
        return api_fail(e, 400, "stop_token_ids", "invalid_type", "'stop_token_ids' must be a list of up to %d token ids",
                    MAX_STOP_IDS);
    j->stop_ids = malloc_or_die((size_t)MAX_STOP_IDS * sizeof(int));
    cJSON_ArrayForEach(id, ids) {
        if (!cJSON_IsNumber(id) || !token_id_ok(id->valuedouble, V))
            return api_fail(e, 400, "stop_token_ids", "invalid_value", "'stop_token_ids' must hold token ids in [0, %d)", V);
        j->stop_ids[j->n_stop_ids++] = (int)id->valuedouble;
    }
    return true;
}

// logit_bias: {"token id": a bias in [-100, 100], ...}, OpenAI's (up to MAX_LOGIT_BIAS tokens)
static bool read_logit_bias(const cJSON *req, int V, Job *j, ApiError *e) {
    const cJSON *bias = cJSON_GetObjectItemCaseSensitive(req, "logit_bias"), *b;
    if (!bias || cJSON_IsNull(bias)) return true;
    if (!cJSON_IsObject(bias) || cJSON_GetArraySize(bias) > MAX_LOGIT_BIAS)
        return api_fail(e, 400, "logit_bias", "invalid_type", "'logit_bias' must be an object of up to %d token ids "
                    "and their biases", MAX_LOGIT_BIAS);
    j->bias_ids = malloc_or_die((size_t)MAX_LOGIT_BIAS * sizeof(int));
    j->bias = malloc_or_die((size_t)MAX_LOGIT_BIAS * sizeof(float));
    cJSON_ArrayForEach(b, bias) {
        char *end;
        double id = strtod(b->string, &end);
        if (!b->string[0] || *end || !token_id_ok(id, V))
            return api_fail(e, 400, "logit_bias", "invalid_value", "'logit_bias': '%.40s' is not a token id in [0, %d)",
                        b->string, V);
        if (!cJSON_IsNumber(b) || !(b->valuedouble >= -100 && b->valuedouble <= 100))
            return api_fail(e, 400, "logit_bias", "invalid_value", "'logit_bias': token %s's bias must be a number in "
                        "[-100, 100]", b->string);
        j->bias_ids[j->n_bias] = (int)id;
        j->bias[j->n_bias++] = (float)b->valuedouble;
    }
    return true;
}

// logprobs: completions' is the number of alternatives wanted with each token's (0 to
// MAX_TOP_LOGPROBS); chat's is true or false, and its top_logprobs that number
static bool read_logprobs(const cJSON *req, bool chat, Job *j, ApiError *e) {
    long n = -1;
    j->logprobs = -1;
    if (!chat) {
        if (!optional_integer(req, "logprobs", 0, MAX_TOP_LOGPROBS, &n, e)) return false;
        j->logprobs = (int)n;
        return true;
    }
    bool wanted = false;
    if (!optional_bool(req, "logprobs", &wanted, e) || !optional_integer(req, "top_logprobs", 0, MAX_TOP_LOGPROBS, &n, e))
        return false;
    if (n > 0 && !wanted) return api_fail(e, 400, "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
    if (wanted) j->logprobs = n > 0 ? (int)n : 0;
    return true;
}

// echo (completions): the answer begins with the prompt; its log-probabilities are not computed
static bool read_echo(const cJSON *req, Job *j, ApiError *e) {
    if (j->chat) return true;  // chat has none (api_fields.c refuses it)
    if (!optional_bool(req, "echo", &j->echo, e)) return false;
    if (j->echo && j->logprobs >= 0)
        return api_fail(e, 400, "echo", "unsupported_parameter", "'echo' with 'logprobs' is refused: the prompt's "
                    "log-probabilities are not computed");
    return true;
}

// the request's own changes to the logits (request_logits.c) and to when its answer ends
static bool read_logit_rules(const cJSON *req, const Server *s, Job *j, ApiError *e) {
    double presence = 0, frequency = 0, repetition = 1;
    int V = tokenizer_vocab_size(s->tok);
    if (!optional_number(req, "presence_penalty", -2, 2, &presence, e) ||
        !optional_number(req, "frequency_penalty", -2, 2, &frequency, e) ||
        !optional_number(req, "repetition_penalty", 0.01, 100, &repetition, e) ||
        !optional_bool(req, "ignore_eos", &j->ignore_eos, e) || !read_stop_token_ids(req, V, j, e) ||
        !read_logit_bias(req, V, j, e))
        return false;
    j->presence_penalty = (float)presence;
    j->frequency_penalty = (float)frequency;
    j->repetition_penalty = (float)repetition;
    return true;
}

// a prompt as its tokens: ids in [0, V)
static bool read_token_prompt(const cJSON *p, int V, Job *j, ApiError *e) {
    const cJSON *id;
    j->ids = malloc_or_die((size_t)cJSON_GetArraySize(p) * sizeof(int));
    cJSON_ArrayForEach(id, p) {
        if (!cJSON_IsNumber(id) || !token_id_ok(id->valuedouble, V))
            return api_fail(e, 400, "prompt", "invalid_value", "'prompt': token %d is not a token id in [0, %d)", j->n_ids, V);
        j->ids[j->n_ids++] = (int)id->valuedouble;
    }
    return true;
}

// a list of prompts, each a string or a list of token ids (a list of numbers is one prompt's tokens)
static bool is_prompt_list(const cJSON *p) {
    return cJSON_IsArray(p) && p->child && !cJSON_IsNumber(p->child);
}

// the prompts a request gives: a completions' list of them, else one
static int prompt_count(const cJSON *req, bool chat) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(req, "prompt");
    return !chat && is_prompt_list(p) ? cJSON_GetArraySize(p) : 1;
}

// prompt k of the request (completions: of its list of prompts, if it gives one) as j's tokens
static bool read_prompt(cJSON *req, const Server *s, int k, Job *j, ApiError *e) {
    char *text;
    if (j->chat) {
        cJSON *messages = cJSON_GetObjectItemCaseSensitive(req, "messages");
        if (cJSON_IsArray(messages) && !join_text_parts(messages, e)) return false;
        text = s->chat_template ? templated_prompt(s->chat_template, messages, e)
                                : chat_prompt(messages, s->cfg->always_input_template, e);
        if (!text) return false;
    } else {  // completions: the text as it is, or its tokens (either alone, or in a list of prompts)
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(req, "prompt");
        if (is_prompt_list(p)) p = cJSON_GetArrayItem(p, k);
        if (cJSON_IsArray(p) && p->child && cJSON_IsNumber(p->child)) text = NULL;
        else if (!cJSON_IsString(p) || !p->valuestring[0])
            return api_fail(e, 400, "prompt", "invalid_type", "'prompt' (prompt %d) must be a non-empty string, a list "
                            "of token ids, or a list of them", k);
        else text = copy_string_or_die(p->valuestring);
        if (!text && !read_token_prompt(p, tokenizer_vocab_size(s->tok), j, e)) return false;
    }
    if (text) j->n_ids = tokenizer_encode(s->tok, text, strlen(text), &j->ids);
    free(text);
    int maxT = s->cfg->max_seq_len;
    if (j->n_ids >= maxT)
        return api_fail(e, 400, j->chat ? "messages" : "prompt", "context_length_exceeded",
                    "the prompt is %d tokens, but this model's context is %d tokens and the answer "
                    "needs at least one", j->n_ids, maxT);
    return true;
}

// The answer may fill the context: max_tokens in [1, context - prompt]; omitted, the server's
// tokens_to_generate as far as the context allows.
static bool read_max_tokens(const cJSON *req, const Config *cfg, Job *j, ApiError *e) {
    long room = cfg->max_seq_len - j->n_ids;
    long max_tokens = cfg->tokens_to_generate < room ? cfg->tokens_to_generate : room;
    const char *key = j->chat && cJSON_GetObjectItemCaseSensitive(req, "max_completion_tokens")
                          ? "max_completion_tokens" : "max_tokens";
    if (!optional_integer(req, key, -1e18, 1e18, &max_tokens, e)) return false;
    if (max_tokens < 1 || max_tokens > room)
        return api_fail(e, 400, key, "invalid_value", "'%s' is %ld, expected 1 to %ld (the context of "
                    "%d tokens less the prompt's %d)", key, max_tokens, room, cfg->max_seq_len, j->n_ids);
    j->max_tokens = (int)max_tokens;
    return true;
}

// stream_options {"include_usage": true}: a streamed answer's last event before [DONE] carries
// the usage, with no choices (OpenAI's shape); only a streamed request may ask for it
static bool read_stream_options(const cJSON *req, bool stream, bool *include_usage, ApiError *e) {
    const cJSON *options = cJSON_GetObjectItemCaseSensitive(req, "stream_options");
    *include_usage = false;
    if (!options || cJSON_IsNull(options)) return true;
    if (!stream) return api_fail(e, 400, "stream_options", "invalid_value", "'stream_options' needs 'stream': true");
    const cJSON *usage = cJSON_GetObjectItemCaseSensitive(options, "include_usage");
    if (!cJSON_IsObject(options) || (usage && !cJSON_IsNull(usage) && !cJSON_IsBool(usage)))
        return api_fail(e, 400, "stream_options", "invalid_type", "'stream_options' must be an object whose "
                    "'include_usage' is true or false");
    *include_usage = cJSON_IsTrue(usage);
    return true;
}

// JSON escapes "\u0000" into a NUL, which would end the C string there: refused, like a raw NUL.
// A backslash outside a string is no JSON at all, so every one seen here starts an escape.
static bool has_escaped_nul(const char *body, size_t len) {
    for (size_t i = 0; i + 1 < len; i++)
        if (body[i] == '\\') {
            if (i + 5 < len && memcmp(body + i + 1, "u0000", 5) == 0) return true;
            i++;  // the escaped character: \\u0000 is a backslash, then text
        }
    return false;
}

// The body as a JSON object: valid UTF-8 with no NUL (escaped or not), and nothing after the
// object but white space. NULL and the error otherwise.
static cJSON *parse_body(const char *body, size_t len, ApiError *e) {
    size_t bad;
    if (!utf8_is_valid(body, len, &bad))
        return api_fail(e, 400, NULL, "invalid_encoding", "the body is not valid UTF-8 (byte %zu)", bad), NULL;
    if (memchr(body, '\0', len) || has_escaped_nul(body, len))
        return api_fail(e, 400, NULL, "invalid_value", "the body holds a NUL character, which no prompt may"), NULL;
    const char *end = NULL;
    cJSON *req = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!cJSON_IsObject(req)) {
        cJSON_Delete(req);
        return api_fail(e, 400, NULL, NULL, "the body is not a JSON object"), NULL;
    }
    while (end < body + len && *end && strchr(" \t\r\n", *end)) end++;
    if (end < body + len) {
        cJSON_Delete(req);
        return api_fail(e, 400, NULL, NULL, "the body goes on after its JSON object (byte %zu)", (size_t)(end - body)), NULL;
    }
    return req;
}

// every field of the request is one this server honours (api_fields.c), or the first that is not
static bool fields_honoured(const cJSON *req, bool chat, ApiError *e) {
    const char *why, *field = api_refused_field(req, chat ? API_CHAT : API_COMPLETIONS, &why);
    return !field || api_fail(e, 400, field, "unsupported_parameter", "'%s' is refused: %s (README.md, \"The API, "
                          "field by field\")", field, why);
}

// Prompt k of the request as a job (of its choice 0; *choices: the choices it asks for, n;
// *prompts: the prompts it gives), or NULL and the error.
static Job *parse_job(Server *s, const char *body, size_t len, bool chat, int k, int *prompts, int *choices,
                      bool *include_usage, ApiError *e) {
    cJSON *req = parse_body(body, len, e);
    if (!req) return NULL;
    Job *j = calloc_or_die(1, sizeof *j);
    j->chat = chat;
    pthread_mutex_lock(&s->lock);
    j->id = ++s->next_id;
    pthread_mutex_unlock(&s->lock);
    const char *model = string_field(req, "model");
    bool ok = model ? strcmp(model, s->model) == 0 ||
                          api_fail(e, 404, "model", "model_not_found", "the model '%s' does not exist "
                               "(this server has '%s')", model, s->model)
                    : api_fail(e, 400, "model", "invalid_type", "'model' must be a string (this server has '%s')", s->model);
    long n = 1;
    *prompts = prompt_count(req, chat);
    ok = ok && fields_honoured(req, chat, e) && optional_integer(req, "n", 1, s->cfg->max_queue, &n, e) &&
         (n * *prompts <= s->cfg->max_queue ||
          api_fail(e, 400, "prompt", "invalid_value", "%d prompts of %ld choices each are %ld answers, over the "
                   "%d the queue holds (max_queue)", *prompts, n, n * *prompts, s->cfg->max_queue)) &&
         read_prompt(req, s, k, j, e) && read_max_tokens(req, s->cfg, j, e) && read_sampling(req, s->cfg, j, e) &&
         read_logit_rules(req, s, j, e) && read_logprobs(req, chat, j, e) && read_echo(req, j, e) &&
         read_stream_options(req, j->stream, include_usage, e);
    cJSON_Delete(req);
    if (!ok) {
        job_free(j);
        return NULL;
    }
    j->ends = malloc_or_die((size_t)j->max_tokens * sizeof(size_t));
    j->out_ids = malloc_or_die((size_t)j->max_tokens * sizeof(int));
    if (j->logprobs >= 0) {
        size_t top = (size_t)j->max_tokens * (size_t)(j->logprobs ? j->logprobs : 1);
        j->token_lp = malloc_or_die((size_t)j->max_tokens * sizeof(float));
        j->top_lp = malloc_or_die(top * sizeof(float));
        j->top_ids = malloc_or_die(top * sizeof(int));
    }
    *choices = (int)n;
    j->request_id = j->id;
    j->created = time(NULL);
    j->t_arrival = wall_seconds();
    j->refs = 2;
    return j;
}

Job **parse_request(Server *s, const char *body, size_t len, bool chat, int *n_jobs, bool *include_usage, ApiError *e) {
    int prompts, choices;
    Job *j = parse_job(s, body, len, chat, 0, &prompts, &choices, include_usage, e);
    if (!j) return NULL;
    *n_jobs = prompts * choices;
    Job **jobs = calloc_or_die((size_t)*n_jobs, sizeof(Job *));
    jobs[0] = j;
    // answer i: prompt i / n's choice i % n, the request parsed again (a later prompt may be refused)
    for (int i = 1; i < *n_jobs; i++) {
        int choice = i % choices;
        jobs[i] = parse_job(s, body, len, chat, i / choices, &prompts, &choices, include_usage, e);
        if (!jobs[i]) {
            for (int k = 0; k < i; k++) job_free(jobs[k]);
            free(jobs);
            return NULL;
        }
        jobs[i]->choice = i, jobs[i]->request_id = j->id;
        jobs[i]->first = choice ? jobs[i - choice] : NULL;  // its prompt's choice 0
        if (!jobs[i]->key) jobs[i]->key = choice;  // a seeded request's choice c draws the seed's c-th numbers
    }
    return jobs;
}

// ---- responses: a Job's tokens as OpenAI's JSON --------------------------------------------------

static cJSON *response_head(const Server *s, const Job *j, const char *object) {
    cJSON *root = cJSON_CreateObject();
    char id[48];
    snprintf(id, sizeof id, "%s-%ld", j->chat ? "chatcmpl" : "cmpl", j->request_id);
    cJSON_AddStringToObject(root, "id", id);
    cJSON_AddStringToObject(root, "object", object);
    cJSON_AddNumberToObject(root, "created", (double)j->created);
    cJSON_AddStringToObject(root, "model", s->model);
    return root;
}

// ---- log-probabilities: the scheduler's record of each token (request_logits.c) as OpenAI's JSON

// a token as logprobs name it: its bytes when they are whole UTF-8 characters, else OpenAI's
// "bytes:\xNN..." (a byte or BPE token may hold part of a character)
static char *token_text(const Tokenizer *tok, int id) {
    int len;
    const char *bytes = tokenizer_token_bytes(tok, id, &len);
    Buf t = {0};
    buf_append(&t, "", 0);
    if (utf8_is_valid(bytes, (size_t)len, NULL) && !memchr(bytes, 0, (size_t)len)) buf_append(&t, bytes, (size_t)len);
    else {
        buf_append(&t, "bytes:", 6);
        for (int i = 0; i < len; i++) buf_printf(&t, "\\x%02x", (unsigned char)bytes[i]);
    }
    return t.p;
}

// chat's {"token", "logprob", "bytes"} of token id
static cJSON *chat_token_logprob(const Tokenizer *tok, int id, float logprob) {
    cJSON *o = cJSON_CreateObject();
    char *text = token_text(tok, id);
    int len;
    const char *bytes = tokenizer_token_bytes(tok, id, &len);
    cJSON_AddStringToObject(o, "token", text);
    cJSON_AddNumberToObject(o, "logprob", logprob);
    cJSON *b = cJSON_AddArrayToObject(o, "bytes");
    for (int i = 0; i < len; i++) cJSON_AddItemToArray(b, cJSON_CreateNumber((unsigned char)bytes[i]));
    free(text);
    return o;
}

// text_offset: the characters of text[0..len) as the answer writes them (append_utf8: a byte that
// is no character's is a U+FFFD) that lie wholly before byte `at` (a token that begins inside a
// character is at that character)
static int characters_before(const char *text, size_t len, size_t at) {
    int count = 0;
    for (size_t i = 0, n; i < len; i += n, count++) {
        n = utf8_char_at(text + i, len - i, utf8_length((unsigned char)text[i])) ? utf8_length((unsigned char)text[i]) : 1;
        if (i + n > at) break;
    }
    return count;
}

// The logprobs of j's tokens from..to-1: chat's {"content": [...]}, completions' {"tokens",
// "token_logprobs", "top_logprobs", "text_offset"}; each with its j->logprobs likeliest alternatives.
static cJSON *logprobs_json(const Server *s, const Job *j, int from, int to) {
    cJSON *root = cJSON_CreateObject(), *content = NULL, *tokens = NULL, *lps = NULL, *tops = NULL, *offsets = NULL;
    if (j->chat) content = cJSON_AddArrayToObject(root, "content");
    else {
        tokens = cJSON_AddArrayToObject(root, "tokens");
        lps = cJSON_AddArrayToObject(root, "token_logprobs");
        tops = cJSON_AddArrayToObject(root, "top_logprobs");
        offsets = cJSON_AddArrayToObject(root, "text_offset");
    }
    for (int i = from; i < to; i++) {
        const int *ids = j->top_ids + (size_t)i * j->logprobs;
        const float *top = j->top_lp + (size_t)i * j->logprobs;
        if (j->chat) {
            cJSON *item = chat_token_logprob(s->tok, j->out_ids[i], j->token_lp[i]);
            cJSON *alternatives = cJSON_AddArrayToObject(item, "top_logprobs");
            for (int k = 0; k < j->logprobs && ids[k] >= 0; k++)
                cJSON_AddItemToArray(alternatives, chat_token_logprob(s->tok, ids[k], top[k]));
            cJSON_AddItemToArray(content, item);
            continue;
        }
        char *text = token_text(s->tok, j->out_ids[i]);
        cJSON_AddItemToArray(tokens, cJSON_CreateString(text));
        free(text);
        cJSON_AddItemToArray(lps, cJSON_CreateNumber(j->token_lp[i]));
        cJSON *alternatives = cJSON_CreateObject();
        for (int k = 0; k < j->logprobs && ids[k] >= 0; k++) {
            text = token_text(s->tok, ids[k]);
            cJSON_AddNumberToObject(alternatives, text, top[k]);
            free(text);
        }
        cJSON_AddItemToArray(tops, alternatives);
        cJSON_AddItemToArray(offsets, cJSON_CreateNumber(characters_before(j->text.p, j->text.len, i ? j->ends[i - 1] : 0)));
    }
    return root;
}

// the tokens a whole answer shows: those that begin before its visible end (a stop string cuts it)
static int visible_tokens(const Job *j) {
    int n = 0;
    while (n < j->n_out && (n ? j->ends[n - 1] : 0) < j->visible) n++;
    return n;
}

// One choice: the text (NULL: none), the finish reason (NULL: not yet), and the logprobs of the
// tokens from..to-1 when the request asked for them; chat puts the text in a message, or in a
// delta when streaming.
static void add_choice(cJSON *root, const Server *s, const Job *j, const char *text, const char *finish, bool role,
                       int from, int to) {
    cJSON *choice = cJSON_CreateObject();
    cJSON_AddNumberToObject(choice, "index", j->choice);
    if (j->chat) {
        cJSON *msg = cJSON_AddObjectToObject(choice, j->stream ? "delta" : "message");
        if (role) cJSON_AddStringToObject(msg, "role", "assistant");
        if (text) cJSON_AddStringToObject(msg, "content", text);
    } else {
        cJSON_AddStringToObject(choice, "text", text ? text : "");
    }
    if (j->logprobs >= 0 && from < to) cJSON_AddItemToObject(choice, "logprobs", logprobs_json(s, j, from, to));
    else cJSON_AddNullToObject(choice, "logprobs");
    if (finish) cJSON_AddStringToObject(choice, "finish_reason", finish);
    else cJSON_AddNullToObject(choice, "finish_reason");
    cJSON *choices = cJSON_GetObjectItemCaseSensitive(root, "choices");
    cJSON_AddItemToArray(choices ? choices : cJSON_AddArrayToObject(root, "choices"), choice);
}

static void append_json(Buf *b, cJSON *root, bool event) {
    char *text = cJSON_PrintUnformatted(root);
    if (event) buf_append(b, "data: ", 6);
    buf_append(b, text, strlen(text));
    buf_append(b, event ? "\n\n" : "\n", event ? 2 : 1);
    free(text);
    cJSON_Delete(root);
}

// the usage of a request's jobs (each prompt's n choices): each prompt once (its choice 0, which
// has no `first`), the answers' tokens together
static void append_usage(cJSON *root, Job *const *jobs, int n) {
    int completion = 0, prompt = 0, cached = 0;
    for (int i = 0; i < n; i++) {
        completion += jobs[i]->n_out;
        prompt += jobs[i]->first ? 0 : jobs[i]->n_ids;
        // the prompt's positions found in the prefix cache (prefix_caching), not computed again
        cached += jobs[i]->first ? 0 : jobs[i]->cached_tokens;
    }
    cJSON *usage = cJSON_AddObjectToObject(root, "usage");
    cJSON_AddNumberToObject(usage, "prompt_tokens", prompt);
    cJSON_AddNumberToObject(usage, "completion_tokens", completion);
    cJSON_AddNumberToObject(usage, "total_tokens", prompt + completion);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(usage, "prompt_tokens_details"), "cached_tokens", cached);
}

// the prompt's text, for echo: the bytes of its tokens
static void append_prompt(const Server *s, const Job *j, Buf *bytes) {
    for (int i = 0; i < j->n_ids; i++) {
        int len;
        const char *b = tokenizer_token_bytes(s->tok, j->ids[i], &len);
        buf_append(bytes, b, (size_t)len);
    }
}

// a request's whole answer: every choice (its jobs, all finished) and the usage
void append_whole_answer(const Server *s, Job *const *jobs, int n, Buf *out) {
    cJSON *root = response_head(s, jobs[0], jobs[0]->chat ? "chat.completion" : "text_completion");
    for (int i = 0; i < n; i++) {
        Job *j = jobs[i];
        Buf text = {0}, bytes = {0};
        buf_append(&text, "", 0);
        buf_append(&bytes, "", 0);
        if (j->echo) append_prompt(s, j, &bytes);
        buf_append(&bytes, j->text.p ? j->text.p : "", j->visible);
        append_utf8(&text, bytes.p, bytes.len, true);
        free(bytes.p);
        add_choice(root, s, j, text.p, FINISH_NAMES[j->finish], true, 0, visible_tokens(j));
        free(text.p);
        j->done_written = true;
    }
    append_usage(root, jobs, n);
    append_json(out, root, false);
}

// the events of one choice's tokens that came since the last call: one per token, then the finish
void append_events(const Server *s, Job *j, Buf *out) {
    const char *object = j->chat ? "chat.completion.chunk" : "text_completion";
    if (j->chat && j->n_written == 0 && !j->done_written) {
        cJSON *root = response_head(s, j, object);  // OpenAI's first chunk: the role
        add_choice(root, s, j, "", NULL, true, 0, 0);
        append_json(out, root, true);
    }
    if (j->echo && !j->echo_written) {  // the first chunk: the prompt
        Buf bytes = {0}, text = {0};
        buf_append(&bytes, "", 0);
        buf_append(&text, "", 0);
        append_prompt(s, j, &bytes);
        append_utf8(&text, bytes.p, bytes.len, true);
        cJSON *root = response_head(s, j, object);
        add_choice(root, s, j, text.p, NULL, false, 0, 0);
        append_json(out, root, true);
        free(bytes.p);
        free(text.p);
        j->echo_written = true;
    }
    for (; j->n_written < j->n_out; j->n_written++) {
        size_t end = j->ends[j->n_written] < j->visible ? j->ends[j->n_written] : j->visible;
        Buf piece = {0};
        buf_append(&piece, "", 0);
        if (end > j->used) j->used += append_utf8(&piece, j->text.p + j->used, end - j->used, false);
        cJSON *root = response_head(s, j, object);
        add_choice(root, s, j, piece.p, NULL, false, j->n_written, j->n_written + 1);
        append_json(out, root, true);
        free(piece.p);
    }
    if (j->finish == FINISH_NONE || j->done_written) return;
    Buf rest = {0};  // what an incomplete last character held back
    buf_append(&rest, "", 0);
    if (j->visible > j->used) j->used += append_utf8(&rest, j->text.p + j->used, j->visible - j->used, true);
    cJSON *root = response_head(s, j, object);
    add_choice(root, s, j, j->chat && !rest.len ? NULL : rest.p, FINISH_NAMES[j->finish], false, 0, 0);
    append_json(out, root, true);
    free(rest.p);
    j->done_written = true;
}

// a stream's end, once every choice has finished: the usage if the request asked for it
// (stream_options.include_usage), and [DONE]
void append_stream_end(const Server *s, Job *const *jobs, int n, bool include_usage, Buf *out) {
    if (include_usage) {
        cJSON *root = response_head(s, jobs[0], jobs[0]->chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddArrayToObject(root, "choices");
        append_usage(root, jobs, n);
        append_json(out, root, true);
    }
    buf_append(out, "data: [DONE]\n\n", 14);
}

cJSON *model_object(const Server *s) {
    cJSON *model = cJSON_CreateObject();
    cJSON_AddStringToObject(model, "id", s->model);
    cJSON_AddStringToObject(model, "object", "model");
    cJSON_AddNumberToObject(model, "created", 0);
    cJSON_AddStringToObject(model, "owned_by", "workbook");
    return model;
}
