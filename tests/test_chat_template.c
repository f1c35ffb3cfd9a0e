// test_chat_template.c: stage 06's chat templates (06_inference/serving/chat_template.c), a subset of Jinja.
//   test_chat_template                 a ChatML template by hand, and templates that must be refused
//   test_chat_template CASES.json      each case {"template", "messages", "add_generation_prompt",
//                                      "bos_token", "eos_token", "expected"}: tests/test_chat_template.sh
//                                      writes them with transformers' own rendering
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "chat_template.h"
#include "check.h"

static char *render(const char *tmpl, const char *messages_json, bool generation, char *err, size_t n) {
    cJSON *messages = cJSON_Parse(messages_json);
    char *text = chat_template_render(tmpl, messages, generation, "<s>", "</s>", err, n);
    cJSON_Delete(messages);
    return text;
}

static void by_hand(void) {
    const char *chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                         "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    const char *chat = "[{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"Hi\"}]";
    char err[256];
    char *text = render(chatml, chat, true, err, sizeof err);
    const char *want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    CHECK(text && strcmp(text, want) == 0, "ChatML: got %s", text ? text : err);
    free(text);
    // whitespace control, trim_blocks and lstrip_blocks, loop, set, elif, filters, slices, tests
    const char *t = "{%- set n = messages | length %}\n  {% for m in messages[1:] %}\n"
                    "{{- loop.index0 ~ ':' ~ m.role | upper }}{% if loop.last %}.{% elif m.content is defined %},{% endif %}\n"
                    "{% endfor %}{{ n }} {{ 'x' in 'axb' and not none }}";
    text = render(t, "[{\"role\": \"a\", \"content\": \"\"}, {\"role\": \"b\", \"content\": \"\"}, {\"role\": \"c\"}]", false,
                  err, sizeof err);
    CHECK(text && strcmp(text, "0:B,1:C.3 True") == 0, "the subset: got '%s'", text ? text : err);
    free(text);
    static const char *const refused[][2] = {
        {"{% if true %}x", "without its 'endif'"},
        {"{{ messages | tojson }}", "the filter 'tojson'"},
        {"{% macro m() %}{% endmacro %}", "the statement"},
        {"{{ raise_exception('roles must alternate') }}", "roles must alternate"},
        {"{{ 'a' + 1 }}", "'+' of values"},
        {"{{ 'a' ", "does not end"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        text = render(refused[i][0], chat, true, err, sizeof err);
        CHECK(!text && strstr(err, refused[i][1]), "'%s': want an error saying '%s', got %s", refused[i][0], refused[i][1],
              text ? text : err);
        free(text);
    }
}

static void cases(const char *path) {
    size_t len;
    char *json = read_file_or_die(path, &len);
    cJSON *all = cJSON_ParseWithLength(json, len), *c;
    free(json);
    CHECK(cJSON_GetArraySize(all) > 0, "%s: no cases", path);
    int k = 0;
    cJSON_ArrayForEach(c, all) {
        char err[512];
        const char *name = cJSON_GetObjectItem(c, "name")->valuestring;
        char *text = chat_template_render(cJSON_GetObjectItem(c, "template")->valuestring, cJSON_GetObjectItem(c, "messages"),
                                          cJSON_IsTrue(cJSON_GetObjectItem(c, "add_generation_prompt")),
                                          cJSON_GetObjectItem(c, "bos_token")->valuestring,
                                          cJSON_GetObjectItem(c, "eos_token")->valuestring, err, sizeof err);
        const char *want = cJSON_GetObjectItem(c, "expected")->valuestring;
        CHECK(text && strcmp(text, want) == 0, "case %d (%s): want\n%s\ngot\n%s", k, name, want, text ? text : err);
        free(text);
        k++;
    }
    cJSON_Delete(all);
}

int main(int argc, char **argv) {
    by_hand();
    if (argc > 1) cases(argv[1]);
    return test_summary("test_chat_template");
}
