// chat_template.c: a checkpoint's own chat template (tokenizer_config.json's "chat_template", a
// Jinja template), rendered as transformers' apply_chat_template renders it, for the subset of
// Jinja that the ChatML, Llama-3 and phi templates use:
//   {{ expr }}, {% if %}/{% elif %}/{% else %}/{% endif %}, {% for x in expr %}/{% endfor %} (with
//   loop.index0, index, first, last, length), {% set x = expr %}, {# comments #}, whitespace control
//   ({%- -%}, {{- -}}) and transformers' trim_blocks and lstrip_blocks;
//   expressions: 'strings' "strings", integers, true/false/none, names, x.y, x['y'], x[i], x[a:b],
//   + ~ == != < > <= >= in, not in, and, or, not, is (not) defined/none/string, filters trim, length,
//   upper, lower, and raise_exception(message).
// Values are cJSON items (a message list is the request's own JSON); an undefined name is NULL.
// Anything else is an error that names the template's byte where it is, never a wrong prompt.
#include "chat_template.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include "base/log.h"

typedef enum { NODE_TEXT, NODE_EXPR, NODE_STMT } NodeKind;
typedef struct {
    NodeKind kind;
    const char *p;  // the text, or the tag's inside (without its delimiters and '-')
    size_t n;
    size_t at;      // its byte in the template, for errors
} Node;

typedef struct {
    const char *src;
    Node *nodes;
    int n_nodes;
    cJSON *scope;   // the variables
    Buf *out;
    char *err;      // the first error; rendering stops there
    size_t err_size;
    bool failed;
} Render;

static void render_error(Render *r, size_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void render_error(Render *r, size_t at, const char *fmt, ...) {
    if (r->failed) return;
    r->failed = true;
    int k = snprintf(r->err, r->err_size, "chat template, byte %zu: ", at);
    va_list ap;
    va_start(ap, fmt);
    if (k >= 0 && (size_t)k < r->err_size) vsnprintf(r->err + k, r->err_size - (size_t)k, fmt, ap);
    va_end(ap);
}

// ---- the template as nodes: text, {{ expressions }}, {% statements %} ----------------------------

static void strip_right(Node *text) {
    while (text->n && isspace((unsigned char)text->p[text->n - 1])) text->n--;
}

// trim_blocks: the newline right after a block tag goes; lstrip_blocks: the spaces and tabs
// between a line's start and a block tag go
static bool split_nodes(Render *r) {
    const char *s = r->src;
    size_t len = strlen(s), i = 0, tags = 0;
    for (const char *c = s; (c = strchr(c, '{')); c++) tags++;
    r->nodes = malloc_or_die((2 * tags + 1) * sizeof(Node));  // a text and a tag each, and the last text
    bool strip_next = false, newline_next = false;
    while (i < len) {
        const char *open = strstr(s + i, "{");
        while (open && open[1] != '{' && open[1] != '%' && open[1] != '#') open = strstr(open + 1, "{");
        size_t text_end = open ? (size_t)(open - s) : len;
        Node text = {NODE_TEXT, s + i, text_end - i, i};
        if (strip_next) while (text.n && isspace((unsigned char)*text.p)) text.p++, text.n--;
        else if (newline_next && text.n && *text.p == '\n') text.p++, text.n--;
        strip_next = newline_next = false;
        if (!open) {
            r->nodes[r->n_nodes++] = text;
            break;
        }
        char kind = open[1];
        const char *close = strstr(open + 2, kind == '{' ? "}}" : kind == '%' ? "%}" : "#}");
        if (!close) return render_error(r, text_end, "a tag that does not end"), false;
        const char *in = open + 2, *in_end = close;
        bool strip_before = *in == '-', strip_after = in_end > in && in_end[-1] == '-';
        if (strip_before) in++;
        if (strip_after) in_end--;
        if (strip_before) strip_right(&text);
        else if (kind != '{') {  // lstrip_blocks
            size_t k = text.n;
            while (k && (text.p[k - 1] == ' ' || text.p[k - 1] == '\t')) k--;
            if (k == 0 ? text.p == s || text.p[-1] == '\n' : text.p[k - 1] == '\n') text.n = k;
        }
        r->nodes[r->n_nodes++] = text;
        if (kind != '#') r->nodes[r->n_nodes++] = (Node){kind == '{' ? NODE_EXPR : NODE_STMT, in, (size_t)(in_end - in), (size_t)(open - s)};
        strip_next = strip_after;
        newline_next = kind != '{';
        i = (size_t)(close - s) + 2;
    }
    return true;
}

// ---- expressions ------------------------------------------------------------------------------

typedef struct {
    Render *r;
    const char *p, *end;
    size_t at;  // the node's byte, for errors
} Expr;

static cJSON *expression(Expr *x);

static void skip_spaces(Expr *x) {
    while (x->p < x->end && isspace((unsigned char)*x->p)) x->p++;
}

// the word (keyword or name) at x->p, if it is `word`: taken
static bool take_word(Expr *x, const char *word) {
    skip_spaces(x);
    size_t n = strlen(word);
    if ((size_t)(x->end - x->p) < n || strncmp(x->p, word, n) != 0) return false;
    if (x->p + n < x->end && (isalnum((unsigned char)x->p[n]) || x->p[n] == '_')) return false;
    x->p += n;
    return true;
}

static bool take(Expr *x, const char *symbol) {
    skip_spaces(x);
    size_t n = strlen(symbol);
    if ((size_t)(x->end - x->p) < n || strncmp(x->p, symbol, n) != 0) return false;
    x->p += n;
    return true;
}

// the name at x->p (after spaces) into name (NAME_SIZE): taken; its length, 0 when there is none
enum { NAME_SIZE = 64 };
static size_t take_name(Expr *x, char *name) {
    skip_spaces(x);
    size_t n = 0;
    while (x->p + n < x->end && (isalnum((unsigned char)x->p[n]) || x->p[n] == '_')) n++;
    if (x->p < x->end && isdigit((unsigned char)*x->p)) n = 0;
    snprintf(name, NAME_SIZE, "%.*s", (int)n, x->p);
    x->p += n;
    return n;
}

static bool truthy(const cJSON *v) {
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v)) return false;
    if (cJSON_IsNumber(v)) return v->valuedouble != 0;
    if (cJSON_IsString(v)) return v->valuestring[0] != 0;
    if (cJSON_IsArray(v) || cJSON_IsObject(v)) return v->child != NULL;
    return true;
}

// a value as output text (Python's str: True, False, None, integers without a point)
static void append_value(Buf *out, const cJSON *v) {
    char number[32];
    if (!v) return;  // undefined: nothing
    if (cJSON_IsString(v)) buf_append(out, v->valuestring, strlen(v->valuestring));
    else if (cJSON_IsNumber(v)) {
        snprintf(number, sizeof number, "%.17g", v->valuedouble);
        buf_append(out, number, strlen(number));
    } else if (cJSON_IsBool(v)) buf_append(out, cJSON_IsTrue(v) ? "True" : "False", cJSON_IsTrue(v) ? 4 : 5);
    else if (cJSON_IsNull(v)) buf_append(out, "None", 4);
    else {
        char *json = cJSON_PrintUnformatted(v);
        buf_append(out, json, strlen(json));
        free(json);
    }
}

static cJSON *string_literal(Expr *x) {
    char quote = *x->p++;
    Buf s = {0};
    buf_append(&s, "", 0);
    while (x->p < x->end && *x->p != quote) {
        char c = *x->p++;
        if (c == '\\' && x->p < x->end) {
            c = *x->p++;
            c = c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c;
        }
        buf_append(&s, &c, 1);
    }
    if (x->p >= x->end) render_error(x->r, x->at, "a string that does not end");
    x->p++;
    cJSON *v = cJSON_CreateString(s.p);
    free(s.p);
    return v;
}

static cJSON *primary(Expr *x) {
    skip_spaces(x);
    if (x->p >= x->end) return render_error(x->r, x->at, "an expression that ends too soon"), NULL;
    if (*x->p == '\'' || *x->p == '"') return string_literal(x);
    if (isdigit((unsigned char)*x->p)) {
        char *end;
        double d = strtod(x->p, &end);
        x->p = end;
        return cJSON_CreateNumber(d);
    }
    if (take(x, "(")) {
        cJSON *v = expression(x);
        if (!take(x, ")")) render_error(x->r, x->at, "a '(' without its ')'");
        return v;
    }
    if (take(x, "[")) {
        cJSON *list = cJSON_CreateArray();
        while (!x->r->failed && !take(x, "]")) {
            cJSON *item = expression(x);
            cJSON_AddItemToArray(list, item ? item : cJSON_CreateNull());
            if (!take(x, ",") && !take(x, "]")) return render_error(x->r, x->at, "a list without its ']'"), list;
            if (x->p[-1] == ']') break;
        }
        return list;
    }
    if (take_word(x, "true") || take_word(x, "True")) return cJSON_CreateTrue();
    if (take_word(x, "false") || take_word(x, "False")) return cJSON_CreateFalse();
    if (take_word(x, "none") || take_word(x, "None")) return cJSON_CreateNull();
    char name[NAME_SIZE];
    if (!take_name(x, name)) return render_error(x->r, x->at, "unexpected '%.20s'", x->p), NULL;
    if (strcmp(name, "raise_exception") == 0 && take(x, "(")) {
        cJSON *message = expression(x);
        render_error(x->r, x->at, "the template raises: %s", cJSON_IsString(message) ? message->valuestring : "?");
        cJSON_Delete(message);
        return NULL;
    }
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(x->r->scope, name);
    return v ? cJSON_Duplicate(v, true) : NULL;
}

// v[key] (NULL: undefined); v is freed
static cJSON *member(cJSON *v, const cJSON *key) {
    const cJSON *found = NULL;
    if (cJSON_IsObject(v) && cJSON_IsString(key)) found = cJSON_GetObjectItemCaseSensitive(v, key->valuestring);
    else if (cJSON_IsArray(v) && cJSON_IsNumber(key)) {
        int i = (int)key->valuedouble, n = cJSON_GetArraySize(v);
        found = cJSON_GetArrayItem(v, i < 0 ? i + n : i);
    } else if (cJSON_IsString(v) && cJSON_IsNumber(key)) {
        int i = (int)key->valuedouble, n = (int)strlen(v->valuestring);
        i = i < 0 ? i + n : i;
        if (i >= 0 && i < n) {
            char c[2] = {v->valuestring[i], 0};
            cJSON_Delete(v);
            return cJSON_CreateString(c);
        }
    }
    cJSON *copy = found ? cJSON_Duplicate(found, true) : NULL;
    cJSON_Delete(v);
    return copy;
}

// v[from:to] of a list or a string
static cJSON *slice(cJSON *v, const cJSON *from, const cJSON *to) {
    int n = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : cJSON_IsString(v) ? (int)strlen(v->valuestring) : 0;
    int a = cJSON_IsNumber(from) ? (int)from->valuedouble : 0, b = cJSON_IsNumber(to) ? (int)to->valuedouble : n;
    a = a < 0 ? a + n : a, b = b < 0 ? b + n : b;
    a = a < 0 ? 0 : a > n ? n : a, b = b < a ? a : b > n ? n : b;
    cJSON *out;
    if (cJSON_IsString(v)) {
        char *s = copy_string_or_die(v->valuestring + a);
        s[b - a] = 0;
        out = cJSON_CreateString(s);
        free(s);
    } else {
        out = cJSON_CreateArray();
        for (int i = a; i < b; i++) cJSON_AddItemToArray(out, cJSON_Duplicate(cJSON_GetArrayItem(v, i), true));
    }
    cJSON_Delete(v);
    return out;
}

static cJSON *postfix(Expr *x) {
    cJSON *v = primary(x);
    for (;;) {
        if (take(x, ".")) {
            char name[NAME_SIZE];
            take_name(x, name);
            cJSON *key = cJSON_CreateString(name);
            v = member(v, key);
            cJSON_Delete(key);
        } else if (take(x, "[")) {
            cJSON *key = take(x, ":") ? NULL : expression(x), *to = NULL;
            bool sliced = x->p[-1] == ':' || take(x, ":");
            if (sliced && !take(x, "]")) to = expression(x);
            if (sliced && to && !take(x, "]")) render_error(x->r, x->at, "a slice without its ']'");
            if (!sliced && !take(x, "]")) render_error(x->r, x->at, "a '[' without its ']'");
            v = sliced ? slice(v, key, to) : member(v, key);
            cJSON_Delete(key);
            cJSON_Delete(to);
        } else {
            return v;
        }
    }
}

static char *trimmed(const char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *t = copy_string_or_die(s);
    size_t n = strlen(t);
    while (n && isspace((unsigned char)t[n - 1])) t[--n] = 0;
    return t;
}

static cJSON *apply_filter(Expr *x, cJSON *v, const char *name) {
    cJSON *out = NULL;
    if (strcmp(name, "trim") == 0 && cJSON_IsString(v)) {
        char *t = trimmed(v->valuestring);
        out = cJSON_CreateString(t);
        free(t);
    } else if ((strcmp(name, "upper") == 0 || strcmp(name, "lower") == 0) && cJSON_IsString(v)) {
        char *t = copy_string_or_die(v->valuestring);
        for (char *c = t; *c; c++) *c = (char)(name[0] == 'u' ? toupper((unsigned char)*c) : tolower((unsigned char)*c));
        out = cJSON_CreateString(t);
        free(t);
    } else if (strcmp(name, "length") == 0 && v) {
        out = cJSON_CreateNumber(cJSON_IsString(v) ? (double)strlen(v->valuestring) : cJSON_GetArraySize(v));
    } else {
        render_error(x->r, x->at, "the filter '%s' is not in this server's subset of Jinja", name);
    }
    cJSON_Delete(v);
    return out;
}

static cJSON *filtered(Expr *x) {
    cJSON *v = postfix(x);
    while (!x->r->failed && !(x->p + 1 < x->end && x->p[0] == '|' && x->p[1] == '|') && take(x, "|")) {
        char name[NAME_SIZE];
        take_name(x, name);
        v = apply_filter(x, v, name);
    }
    return v;
}

static cJSON *additive(Expr *x) {
    cJSON *v = filtered(x);
    for (;;) {
        bool concat = take(x, "~"), plus = !concat && take(x, "+");
        if (!concat && !plus) return v;
        cJSON *w = filtered(x), *sum;
        if (plus && cJSON_IsNumber(v) && cJSON_IsNumber(w)) sum = cJSON_CreateNumber(v->valuedouble + w->valuedouble);
        else if (plus && cJSON_IsArray(v) && cJSON_IsArray(w)) {
            sum = cJSON_Duplicate(v, true);
            for (cJSON *item = w->child; item; item = item->next) cJSON_AddItemToArray(sum, cJSON_Duplicate(item, true));
        } else if (concat || (cJSON_IsString(v) && cJSON_IsString(w))) {
            Buf s = {0};
            buf_append(&s, "", 0);
            append_value(&s, v);
            append_value(&s, w);
            sum = cJSON_CreateString(s.p);
            free(s.p);
        } else {
            render_error(x->r, x->at, "'+' of values that are not both strings, numbers or lists");
            sum = NULL;
        }
        cJSON_Delete(v);
        cJSON_Delete(w);
        v = sum;
    }
}

// v in w: a substring, a list's item, a dict's key
static bool contains(const cJSON *w, const cJSON *v) {
    if (cJSON_IsString(w) && cJSON_IsString(v)) return strstr(w->valuestring, v->valuestring) != NULL;
    if (cJSON_IsObject(w) && cJSON_IsString(v)) return cJSON_GetObjectItemCaseSensitive(w, v->valuestring) != NULL;
    if (cJSON_IsArray(w))
        for (const cJSON *item = w->child; item; item = item->next)
            if (cJSON_Compare(item, v, true)) return true;
    return false;
}

static cJSON *comparison(Expr *x) {
    cJSON *v = additive(x);
    if (take_word(x, "is")) {
        bool negated = take_word(x, "not"), result;
        if (take_word(x, "defined")) result = v != NULL;
        else if (take_word(x, "none")) result = cJSON_IsNull(v);
        else if (take_word(x, "string")) result = cJSON_IsString(v);
        else return render_error(x->r, x->at, "a test that is not in this server's subset of Jinja"), cJSON_Delete(v), NULL;
        cJSON_Delete(v);
        return cJSON_CreateBool(result != negated);
    }
    static const char *const ops[] = {"==", "!=", "<=", ">=", "<", ">"};
    int op = -1;
    for (int i = 0; i < 6 && op < 0; i++)
        if (take(x, ops[i])) op = i;
    bool negated_in = op < 0 && take_word(x, "not");
    bool in = op < 0 && take_word(x, "in");
    if (negated_in && !in) return render_error(x->r, x->at, "'not' where 'not in' was expected"), cJSON_Delete(v), NULL;
    if (op < 0 && !in) return v;
    cJSON *w = additive(x);
    bool result;
    if (in) result = contains(w, v) != negated_in;
    else if (op <= 1) result = (v && w ? cJSON_Compare(v, w, true) : v == w) == (op == 0);
    else {
        double d = cJSON_IsNumber(v) && cJSON_IsNumber(w) ? v->valuedouble - w->valuedouble
                   : cJSON_IsString(v) && cJSON_IsString(w) ? strcmp(v->valuestring, w->valuestring) : 0;
        result = op == 2 ? d <= 0 : op == 3 ? d >= 0 : op == 4 ? d < 0 : d > 0;
    }
    cJSON_Delete(v);
    cJSON_Delete(w);
    return cJSON_CreateBool(result);
}

static cJSON *negation(Expr *x) {
    if (!take_word(x, "not")) return comparison(x);
    cJSON *v = negation(x);
    bool result = !truthy(v);
    cJSON_Delete(v);
    return cJSON_CreateBool(result);
}

// a and b, a or b: Python's, the deciding operand
static cJSON *conjunction(Expr *x) {
    cJSON *v = negation(x);
    while (take_word(x, "and")) {
        cJSON *w = negation(x);
        if (truthy(v)) cJSON_Delete(v), v = w;
        else cJSON_Delete(w);
    }
    return v;
}

static cJSON *expression(Expr *x) {
    cJSON *v = conjunction(x);
    while (take_word(x, "or")) {
        cJSON *w = conjunction(x);
        if (!truthy(v)) cJSON_Delete(v), v = w;
        else cJSON_Delete(w);
    }
    return v;
}

// the whole of p[0..n) as one expression
static cJSON *evaluate(Render *r, const char *p, size_t n, size_t at) {
    Expr x = {r, p, p + n, at};
    cJSON *v = expression(&x);
    skip_spaces(&x);
    if (x.p < x.end && !r->failed) render_error(r, at, "unexpected '%.20s'", x.p);
    return v;
}

// ---- statements -------------------------------------------------------------------------------

// the statement node i's keyword is `word`; *rest: what follows it
static bool is_statement(const Render *r, int i, const char *word, const char **rest) {
    if (i >= r->n_nodes || r->nodes[i].kind != NODE_STMT) return false;
    const char *p = r->nodes[i].p, *end = p + r->nodes[i].n;
    while (p < end && isspace((unsigned char)*p)) p++;
    size_t n = strlen(word);
    if ((size_t)(end - p) < n || strncmp(p, word, n) != 0 || (p + n < end && (isalnum((unsigned char)p[n]) || p[n] == '_')))
        return false;
    if (rest) *rest = p + n;
    return true;
}

// runs nodes from i (emitting output when `emit`) up to the statement that ends the block
// (elif, else, endif, endfor) or the template's end; returns that node's index
static int run(Render *r, int i, bool emit) {
    for (; i < r->n_nodes && !r->failed; i++) {
        const Node *node = &r->nodes[i];
        const char *rest;
        if (node->kind == NODE_TEXT) {
            if (emit) buf_append(r->out, node->p, node->n);
        } else if (node->kind == NODE_EXPR) {
            if (!emit) continue;
            cJSON *v = evaluate(r, node->p, node->n, node->at);
            append_value(r->out, v);
            cJSON_Delete(v);
        } else if (is_statement(r, i, "elif", NULL) || is_statement(r, i, "else", NULL) ||
                   is_statement(r, i, "endif", NULL) || is_statement(r, i, "endfor", NULL)) {
            return i;
        } else if (is_statement(r, i, "if", &rest)) {
            bool taken = false;
            for (;;) {  // the first branch whose condition holds runs; every branch is walked to find the end
                cJSON *cond = emit && !taken ? evaluate(r, rest, (size_t)(node->p + node->n - rest), node->at) : NULL;
                bool now = emit && !taken && truthy(cond);
                cJSON_Delete(cond);
                i = run(r, i + 1, now);
                taken |= now;
                if (r->failed || i >= r->n_nodes) return render_error(r, node->at, "an 'if' without its 'endif'"), i;
                node = &r->nodes[i];
                if (is_statement(r, i, "elif", &rest)) continue;
                if (is_statement(r, i, "else", NULL)) {
                    i = run(r, i + 1, emit && !taken);
                    if (!is_statement(r, i, "endif", NULL)) return render_error(r, node->at, "an 'else' without 'endif'"), i;
                }
                if (!is_statement(r, i, "endif", NULL)) return render_error(r, node->at, "an 'if' without its 'endif'"), i;
                break;
            }
        } else if (is_statement(r, i, "for", &rest)) {
            Expr x = {r, rest, node->p + node->n, node->at};
            char name[NAME_SIZE];
            if (!take_name(&x, name) || !take_word(&x, "in")) return render_error(r, node->at, "expected 'for name in list'"), i;
            cJSON *list = emit ? evaluate(r, x.p, (size_t)(x.end - x.p), node->at) : NULL;
            int count = cJSON_IsArray(list) ? cJSON_GetArraySize(list) : 0, end = -1, k = 0;
            for (cJSON *item = list ? list->child : NULL; k < count && !r->failed; item = item->next, k++) {
                cJSON *loop = cJSON_CreateObject();
                cJSON_AddNumberToObject(loop, "index0", k);
                cJSON_AddNumberToObject(loop, "index", k + 1);
                cJSON_AddBoolToObject(loop, "first", k == 0);
                cJSON_AddBoolToObject(loop, "last", k == count - 1);
                cJSON_AddNumberToObject(loop, "length", count);
                cJSON_DeleteItemFromObjectCaseSensitive(r->scope, "loop");
                cJSON_AddItemToObject(r->scope, "loop", loop);
                cJSON_DeleteItemFromObjectCaseSensitive(r->scope, name);
                cJSON_AddItemToObject(r->scope, name, cJSON_Duplicate(item, true));
                end = run(r, i + 1, true);
            }
            cJSON_Delete(list);
            if (end < 0) end = run(r, i + 1, false);  // no items: walked to find the end
            if (!is_statement(r, end, "endfor", NULL)) return render_error(r, node->at, "a 'for' without its 'endfor'"), end;
            i = end;
        } else if (is_statement(r, i, "set", &rest)) {
            if (!emit) continue;
            Expr x = {r, rest, node->p + node->n, node->at};
            char name[NAME_SIZE];
            if (!take_name(&x, name) || !take(&x, "=")) return render_error(r, node->at, "expected 'set name = value'"), i;
            cJSON *v = evaluate(r, x.p, (size_t)(x.end - x.p), node->at);
            cJSON_DeleteItemFromObjectCaseSensitive(r->scope, name);
            cJSON_AddItemToObject(r->scope, name, v ? v : cJSON_CreateNull());
        } else {
            render_error(r, node->at, "the statement '%.*s' is not in this server's subset of Jinja", (int)node->n, node->p);
        }
    }
    return i;
}

char *chat_template_render(const char *tmpl, const cJSON *messages, bool add_generation_prompt, const char *bos_token,
                           const char *eos_token, char *err, size_t err_size) {
    Buf out = {0};
    buf_append(&out, "", 0);
    Render r = {.src = tmpl, .scope = cJSON_CreateObject(), .out = &out, .err = err, .err_size = err_size};
    cJSON_AddItemToObject(r.scope, "messages", cJSON_Duplicate(messages, true));
    cJSON_AddBoolToObject(r.scope, "add_generation_prompt", add_generation_prompt);
    cJSON_AddStringToObject(r.scope, "bos_token", bos_token ? bos_token : "");
    cJSON_AddStringToObject(r.scope, "eos_token", eos_token ? eos_token : "");
    if (split_nodes(&r)) {
        int end = run(&r, 0, true);
        if (end < r.n_nodes && !r.failed) render_error(&r, r.nodes[end].at, "a block's end without its start");
    }
    free(r.nodes);
    cJSON_Delete(r.scope);
    if (r.failed) {
        free(out.p);
        return NULL;
    }
    return out.p;
}

// a special token as tokenizer_config.json gives it: a string, or {"content": string, ...}
static char *special_token(const cJSON *config, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(config, key);
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    return copy_string_or_die(cJSON_IsString(v) ? v->valuestring : "");
}

ChatTemplate *chat_template_load(const char *dir) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (!dir[0] || access(path, R_OK) != 0) return NULL;
    size_t len;
    char *text = read_file_or_die(path, &len);
    cJSON *config = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(config)) fatal("%s: expected a JSON object", path);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(config, "chat_template"), *named;
    if (cJSON_IsArray(t)) {  // [{"name": ..., "template": ...}, ...]: the one named "default"
        const cJSON *found = NULL;
        cJSON_ArrayForEach(named, t) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(named, "name");
            if (cJSON_IsString(name) && strcmp(name->valuestring, "default") == 0)
                found = cJSON_GetObjectItemCaseSensitive(named, "template");
        }
        if (!found) fatal("%s: key 'chat_template': expected a template named \"default\" in the list", path);
        t = found;
    }
    if (!t || cJSON_IsNull(t)) {
        cJSON_Delete(config);
        return NULL;
    }
    if (!cJSON_IsString(t)) fatal("%s: key 'chat_template': expected a string, found another JSON type", path);
    ChatTemplate *c = malloc_or_die(sizeof *c);
    *c = (ChatTemplate){.text = copy_string_or_die(t->valuestring), .bos = special_token(config, "bos_token"),
                        .eos = special_token(config, "eos_token")};
    snprintf(c->path, sizeof c->path, "%s", path);
    cJSON_Delete(config);
    // rendered once now: a template outside the subset stops the server here, not at a request
    char err[512];
    cJSON *hello = cJSON_Parse("[{\"role\": \"user\", \"content\": \"Hello\"}]");
    char *prompt = chat_template_render(c->text, hello, true, c->bos, c->eos, err, sizeof err);
    cJSON_Delete(hello);
    if (!prompt) fatal("%s: key 'chat_template': %s", path, err);
    free(prompt);
    return c;
}

void chat_template_free(ChatTemplate *c) {
    if (!c) return;
    free(c->text);
    free(c->bos);
    free(c->eos);
    free(c);
}
