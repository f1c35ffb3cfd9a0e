// checkpoint.c: safetensors read and write, Hugging Face GPT-2 names, atomic saves.
// The file has four parts: the safetensors checks (parse and validate a header), reading
// tensors, the GPT-2 model and optimizer checkpoints on top, and writing them (files.h).
#define _POSIX_C_SOURCE 200809L
#include "checkpoint.h"
#include "moe_mlp.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/files.h"
#include "base/log.h"
#include "base/numbers.h"

// safetensors data is little-endian and we copy it to and from memory as is
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoint.c assumes a little-endian host"
#endif

// ================================================================================================
// 1. Checking a header. Nothing here exits: each check returns -1 with the reason in err, so
//    that the fuzzer (tests/fuzz/fuzz_safetensors.c) can run millions of hostile headers.
// ================================================================================================

__attribute__((format(printf, 3, 4)))
static int fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

// Every dtype the format defines, with its size: a file may hold tensors we never read (an int64
// step counter, say), and we still check their offsets.
static const struct {
    const char *name;
    int bytes;
} DTYPES[] = {
    {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F64", 8}, {"I64", 8}, {"I32", 4},
    {"I16", 2}, {"I8", 1},  {"U64", 8},  {"U32", 4}, {"U16", 2}, {"U8", 1},
    {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
};

// The table's own copy of the name (it outlives the header), or NULL for an unknown dtype.
static const char *known_dtype(const char *name, int *bytes) {
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (strcmp(name, DTYPES[i].name) == 0) {
            *bytes = DTYPES[i].bytes;
            return DTYPES[i].name;
        }
    return NULL;
}

const char *safetensors_shape_str(char *buf, size_t size, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

// JSON numbers are doubles: a whole number in [0, 2^53] is one a double holds exactly.
static int json_count(const cJSON *item, uint64_t *out) {
    if (!cJSON_IsNumber(item)) return 0;
    double d = item->valuedouble;
    if (!(d >= 0 && d <= 9007199254740992.0) || d != floor(d)) return 0;  // also refuses NaN
    *out = (uint64_t)d;
    return 1;
}

static int parse_shape(SafeTensor *t, const cJSON *shape, char *err, size_t errlen) {
    int n = cJSON_IsArray(shape) ? cJSON_GetArraySize(shape) : -1;
    if (n < 0 || n > SAFETENSORS_MAX_DIMS)
        return fail(err, errlen, "tensor '%.200s': \"shape\" must be an array of at most %d sizes",
                    t->name, SAFETENSORS_MAX_DIMS);
    t->ndim = n;
    t->numel = 1;
    const cJSON *dim;
    int i = 0;
    cJSON_ArrayForEach(dim, shape) {
        uint64_t d;
        if (!json_count(dim, &d))
            return fail(err, errlen, "tensor '%.200s': shape entry %d is not a non-negative integer", t->name, i);
        // refuse an element count that would overflow once multiplied by the dtype size
        if (d != 0 && t->numel > (UINT64_MAX / 8) / d)
            return fail(err, errlen, "tensor '%.200s': shape is impossibly large", t->name);
        t->shape[i++] = (int64_t)d;
        t->numel *= d;
    }
    return 0;
}

static int parse_offsets(SafeTensor *t, const cJSON *offsets, uint64_t data_len, char *err, size_t errlen) {
    uint64_t begin, end;
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2 ||
        !json_count(cJSON_GetArrayItem(offsets, 0), &begin) ||
        !json_count(cJSON_GetArrayItem(offsets, 1), &end) || begin > end)
        return fail(err, errlen, "tensor '%.200s': \"data_offsets\" must be [begin, end] with 0 <= begin <= end",
                    t->name);
    t->begin = begin;
    t->end = end;
    uint64_t need = t->numel * (uint64_t)t->dtype_bytes;  // no overflow: parse_shape bounded numel
    if (end - begin != need) {
        char s[128];
        return fail(err, errlen,
                    "tensor '%.200s': data_offsets [%llu, %llu] hold %llu bytes, but shape %s of %s needs %llu",
                    t->name, (unsigned long long)begin, (unsigned long long)end,
                    (unsigned long long)(end - begin), safetensors_shape_str(s, sizeof s, t->ndim, t->shape),
                    t->dtype, (unsigned long long)need);
    }
    if (end > data_len)
        return fail(err, errlen,
                    "tensor '%.200s': data_offsets [%llu, %llu] are out of range: the data section has only "
                    "%llu bytes (truncated file?)",
                    t->name, (unsigned long long)begin, (unsigned long long)end, (unsigned long long)data_len);
    return 0;
}

// One header entry: {"dtype": ..., "shape": [...], "data_offsets": [begin, end]}.
static int parse_tensor(SafeTensor *t, const cJSON *item, uint64_t data_len, char *err, size_t errlen) {
    t->name = item->string;
    if (!cJSON_IsObject(item))
        return fail(err, errlen, "tensor '%.200s': expected an object with dtype, shape and data_offsets", t->name);
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    if (!cJSON_IsString(dtype))
        return fail(err, errlen, "tensor '%.200s': \"dtype\" is missing or not a string", t->name);
    t->dtype = known_dtype(dtype->valuestring, &t->dtype_bytes);
    if (!t->dtype)
        return fail(err, errlen, "tensor '%.200s': unknown dtype '%.40s' (expected F32, F16, BF16, F64, I64, "
                    "I32, I16, I8, U64, U32, U16, U8, BOOL, F8_E4M3 or F8_E5M2)", t->name, dtype->valuestring);
    if (parse_shape(t, cJSON_GetObjectItemCaseSensitive(item, "shape"), err, errlen)) return -1;
    return parse_offsets(t, cJSON_GetObjectItemCaseSensitive(item, "data_offsets"), data_len, err, errlen);
}

// "__metadata__" is a flat object of strings.
static int parse_metadata(const cJSON *item, char *err, size_t errlen) {
    if (!cJSON_IsObject(item)) return fail(err, errlen, "\"__metadata__\" must be an object of strings");
    const cJSON *kv;
    cJSON_ArrayForEach(kv, item) {
        if (!cJSON_IsString(kv))
            return fail(err, errlen, "\"__metadata__\" entry '%.200s' is not a string", kv->string);
    }
    return 0;
}

static int by_begin(const void *a, const void *b) {
    const SafeTensor *x = *(const SafeTensor *const *)a, *y = *(const SafeTensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int by_name(const void *a, const void *b) {
    return strcmp((*(const SafeTensor *const *)a)->name, (*(const SafeTensor *const *)b)->name);
}

// Two tensors may not share bytes, nor a name: sort, then compare neighbours.
static int check_overlaps_and_names(const SafeTensors *st, char *err, size_t errlen) {
    int n = st->num_tensors, rc = 0;
    if (n < 2) return 0;
    const SafeTensor **p = malloc_or_die((size_t)n * sizeof *p);
    for (int i = 0; i < n; i++) p[i] = &st->tensors[i];
    qsort(p, (size_t)n, sizeof *p, by_begin);
    for (int i = 1; i < n && !rc; i++)
        if (p[i]->begin < p[i - 1]->end)
            rc = fail(err, errlen, "tensors '%.200s' [%llu, %llu] and '%.200s' [%llu, %llu] overlap", p[i - 1]->name,
                      (unsigned long long)p[i - 1]->begin, (unsigned long long)p[i - 1]->end, p[i]->name,
                      (unsigned long long)p[i]->begin, (unsigned long long)p[i]->end);
    qsort(p, (size_t)n, sizeof *p, by_name);
    for (int i = 1; i < n && !rc; i++)
        if (strcmp(p[i]->name, p[i - 1]->name) == 0)
            rc = fail(err, errlen, "tensor '%.200s' appears twice in the header", p[i]->name);
    free(p);
    return rc;
}

static int parse_entries(SafeTensors *st, uint64_t data_len, char *err, size_t errlen) {
    int n = cJSON_GetArraySize(st->header);
    st->tensors = calloc_or_die((size_t)n, sizeof(SafeTensor));
    const cJSON *item;
    cJSON_ArrayForEach(item, st->header) {
        if (strcmp(item->string, "__metadata__") == 0) {
            if (st->metadata) return fail(err, errlen, "\"__metadata__\" appears twice in the header");
            if (parse_metadata(item, err, errlen)) return -1;
            st->metadata = item;
        } else if (parse_tensor(&st->tensors[st->num_tensors++], item, data_len, err, errlen)) {
            return -1;
        }
    }
    return check_overlaps_and_names(st, err, errlen);
}

int safetensors_parse_header(SafeTensors *st, const char *json, size_t json_len, uint64_t data_len,
                             char *err, size_t errlen) {
    memset(st, 0, sizeof *st);
    st->data_len = data_len;
    const char *end = json;
    st->header = cJSON_ParseWithLengthOpts(json, json_len, &end, 0);
    if (!st->header)
        return fail(err, errlen, "header is not valid JSON (parse error at byte %td of %zu)", end - json, json_len);
    // writers pad the header with spaces to align the data; anything else after the JSON is junk
    for (const char *c = end; c < json + json_len; c++)
        if (*c != ' ' && *c != '\t' && *c != '\n' && *c != '\r') {
            safetensors_close(st);
            return fail(err, errlen, "header has bytes after its JSON object (at byte %td of %zu)", c - json, json_len);
        }
    int rc = cJSON_IsObject(st->header) ? parse_entries(st, data_len, err, errlen)
                                        : fail(err, errlen, "header is JSON but not an object");
    if (rc) safetensors_close(st);
    return rc;
}

static uint64_t read_le64(const unsigned char *b) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b[i];
    return n;
}

// The 8-byte length prefix against the file size.
static int check_header_length(uint64_t file_size, uint64_t header_len, char *err, size_t errlen) {
    if (header_len > file_size - 8)
        return fail(err, errlen, "header length %llu is beyond the end of the file (%llu bytes follow the "
                    "8-byte length)", (unsigned long long)header_len, (unsigned long long)(file_size - 8));
    if (header_len > SAFETENSORS_MAX_HEADER)
        return fail(err, errlen, "header length %llu exceeds the format's limit of %u bytes",
                    (unsigned long long)header_len, SAFETENSORS_MAX_HEADER);
    return 0;
}

static int check_file_size(uint64_t size, char *err, size_t errlen) {
    if (size < 8)
        return fail(err, errlen, "truncated file: %llu bytes, too short for the 8-byte header length that "
                    "starts a safetensors file", (unsigned long long)size);
    return 0;
}

int safetensors_parse_bytes(SafeTensors *st, const unsigned char *bytes, size_t size, char *err, size_t errlen) {
    memset(st, 0, sizeof *st);
    if (check_file_size(size, err, errlen)) return -1;
    uint64_t n = read_le64(bytes);
    if (check_header_length(size, n, err, errlen)) return -1;
    if (safetensors_parse_header(st, (const char *)bytes + 8, (size_t)n, size - 8 - n, err, errlen)) return -1;
    st->data_start = 8 + n;
    return 0;
}

// ================================================================================================
// 2. Opening a file and reading tensors
// ================================================================================================

void safetensors_open(SafeTensors *st, const char *path) {
    FILE *f = fopen_or_die(path, "rb");
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) fatal("%s: not a regular file", path);
    uint64_t size = (uint64_t)sb.st_size;
    char err[512];
    unsigned char prefix[8];
    if (check_file_size(size, err, sizeof err)) fatal("%s: %s", path, err);
    if (fread(prefix, 1, 8, f) != 8) fatal("%s: cannot read the header length", path);
    uint64_t n = read_le64(prefix);
    if (check_header_length(size, n, err, sizeof err)) fatal("%s: %s", path, err);
    char *json = malloc_or_die((size_t)n);
    if (fread(json, 1, (size_t)n, f) != n) fatal("%s: cannot read the %llu-byte header", path, (unsigned long long)n);
    int rc = safetensors_parse_header(st, json, (size_t)n, size - 8 - n, err, sizeof err);
    free(json);  // cJSON made its own copies of every string
    if (rc) fatal("%s: %s", path, err);
    st->data_start = 8 + n;
    st->path = strdup(path);
    st->file = f;
}

void safetensors_close(SafeTensors *st) {
    if (st->file) fclose(st->file);
    cJSON_Delete(st->header);
    free(st->tensors);
    free(st->path);
    memset(st, 0, sizeof *st);
}

const SafeTensor *safetensors_find(const SafeTensors *st, const char *name) {
    for (int i = 0; i < st->num_tensors; i++)
        if (strcmp(st->tensors[i].name, name) == 0) return &st->tensors[i];
    return NULL;
}

const char *safetensors_metadata(const SafeTensors *st, const char *key) {
    const cJSON *v = st->metadata ? cJSON_GetObjectItemCaseSensitive(st->metadata, key) : NULL;
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

int safetensors_to_float(float *out, const void *raw, const char *dtype, size_t n) {
    const unsigned char *b = raw;
    int is_f16 = strcmp(dtype, "F16") == 0, is_bf16 = strcmp(dtype, "BF16") == 0;
    if (strcmp(dtype, "F32") == 0) {
        memcpy(out, raw, n * sizeof(float));
        return 0;
    }
    if (!is_f16 && !is_bf16) return -1;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, b + 2 * i, 2);  // memcpy: the data need not be 2-byte aligned
        out[i] = is_f16 ? fp16_to_float(h) : bf16_to_float(h);
    }
    return 0;
}

void safetensors_read_floats(const SafeTensors *st, const SafeTensor *t, float *out) {
    if (strcmp(t->dtype, "F32") && strcmp(t->dtype, "F16") && strcmp(t->dtype, "BF16"))
        fatal("%s: tensor %s has dtype %s; expected F32, F16 or BF16", st->path, t->name, t->dtype);
    if (!st->file) fatal("internal: safetensors_read_floats on a header parsed from memory");
    uint64_t nbytes = t->end - t->begin;
    // F32 goes straight into out; the 2-byte types go through a buffer and get widened
    void *raw = strcmp(t->dtype, "F32") == 0 ? (void *)out : malloc_or_die((size_t)nbytes);
    if (fseeko(st->file, (off_t)(st->data_start + t->begin), SEEK_SET) != 0 ||
        fread(raw, 1, (size_t)nbytes, st->file) != nbytes)
        fatal("%s: tensor %s: cannot read %llu bytes at data offset %llu (file changed while reading?)",
              st->path, t->name, (unsigned long long)nbytes, (unsigned long long)t->begin);
    if (raw != out) {
        safetensors_to_float(out, raw, t->dtype, (size_t)t->numel);
        free(raw);
    }
}

// ================================================================================================
// 3. GPT-2 checkpoints
// ================================================================================================

// A checkpoint is named by its directory or by its .safetensors file: find both files.
static void checkpoint_files(const char *path, char *model_file, char *config_file) {
    if (is_directory(path)) {
        join_path(model_file, path, "model.safetensors");
        join_path(config_file, path, "config.json");
        return;
    }
    if (snprintf(model_file, FILE_PATH_LEN, "%s", path) >= FILE_PATH_LEN) fatal("path too long: %s", path);
    const char *slash = strrchr(path, '/');
    if (!slash) {
        snprintf(config_file, FILE_PATH_LEN, "config.json");
        return;
    }
    char dir[FILE_PATH_LEN];
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    join_path(config_file, slash == path ? "" : dir, "config.json");
}

// ---- config.json --------------------------------------------------------------------------------

// An integer key of config.json: its value, or -1 when the key is absent. Must be positive.
static int config_int(const cJSON *root, const char *key, const char *file) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!v) return -1;
    uint64_t n;
    if (!json_count(v, &n) || n == 0 || n > 1u << 30) {
        char found[64];
        if (cJSON_IsNumber(v)) snprintf(found, sizeof found, "%g", v->valuedouble);
        else snprintf(found, sizeof found, "a JSON %s", cJSON_IsString(v) ? "string" : "value of another type");
        fatal("%s: \"%s\" must be a positive integer, found %s", file, key, found);
    }
    return (int)n;
}

static int config_required(const cJSON *root, const char *key, const char *file) {
    int n = config_int(root, key, file);
    if (n < 0) fatal("%s: missing key \"%s\"", file, key);
    return n;
}

// Hugging Face's GPT2Config has switches for variants of the architecture; we implement the
// original GPT-2 only, so a checkpoint that sets one of them otherwise would load "fine" and
// compute something else. Refuse it instead.
static void check_variant(const cJSON *root, const char *file, int n_embd) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (v && (!cJSON_IsString(v) || strcmp(v->valuestring, "gpt2")))
        fatal("%s: \"model_type\" must be \"gpt2\", \"phi\", \"llama\" or \"mistral\"", file);
    v = cJSON_GetObjectItemCaseSensitive(root, "activation_function");
    if (v && (!cJSON_IsString(v) || (strcmp(v->valuestring, "gelu_new") && strcmp(v->valuestring, "gelu_pytorch_tanh"))))
        fatal("%s: \"activation_function\" must be \"gelu_new\" (GELU, tanh approximation), found %s", file,
              cJSON_IsString(v) ? v->valuestring : "a non-string");
    v = cJSON_GetObjectItemCaseSensitive(root, "n_inner");
    if (v && !cJSON_IsNull(v) && (!cJSON_IsNumber(v) || v->valuedouble != 4.0 * n_embd))
        fatal("%s: \"n_inner\" must be null or 4 * n_embd = %d", file, 4 * n_embd);
    v = cJSON_GetObjectItemCaseSensitive(root, "layer_norm_epsilon");
    if (v && (!cJSON_IsNumber(v) || fabs(v->valuedouble - 1e-5) > 1e-12))
        fatal("%s: \"layer_norm_epsilon\" must be 1e-5 (what our LayerNorm uses)", file);
    v = cJSON_GetObjectItemCaseSensitive(root, "scale_attn_weights");
    if (v && !cJSON_IsTrue(v)) fatal("%s: \"scale_attn_weights\" must be true", file);
    v = cJSON_GetObjectItemCaseSensitive(root, "scale_attn_by_inverse_layer_idx");
    if (v && !cJSON_IsFalse(v)) fatal("%s: \"scale_attn_by_inverse_layer_idx\" must be false", file);
}

// A number of config.json, or `otherwise` when the key is absent or null.
static double config_number(const cJSON *root, const char *key, const char *file, double otherwise) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!v || cJSON_IsNull(v)) return otherwise;
    if (!cJSON_IsNumber(v)) fatal("%s: \"%s\" must be a number", file, key);
    return v->valuedouble;
}

// the switches of transformers' PhiConfig that change the computation: refused by name unless
// they are what phi-1_5 uses (and what we implement)
static void check_phi_variant(const cJSON *root, const char *file, const GPTConfig *cfg) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (v && (!cJSON_IsString(v) || strcmp(v->valuestring, "gelu_new")))
        fatal("%s: \"hidden_act\" must be \"gelu_new\" (GELU, tanh approximation), found %s", file,
              cJSON_IsString(v) ? v->valuestring : "a non-string");
    v = cJSON_GetObjectItemCaseSensitive(root, "qk_layernorm");
    if (v && !cJSON_IsFalse(v)) fatal("%s: \"qk_layernorm\" is not implemented; it must be false", file);
    v = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (v && !cJSON_IsNull(v)) fatal("%s: \"rope_scaling\" is not implemented; it must be null", file);
    v = cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings");
    if (v && !cJSON_IsFalse(v)) fatal("%s: \"tie_word_embeddings\" must be false (phi's lm_head is its own)", file);
    if (config_number(root, "intermediate_size", file, 4.0 * cfg->n_embd) != 4.0 * cfg->n_embd)
        fatal("%s: \"intermediate_size\" must be 4 * hidden_size = %d", file, 4 * cfg->n_embd);
    if (config_number(root, "num_key_value_heads", file, cfg->n_head) != cfg->n_head)
        fatal("%s: \"num_key_value_heads\" must be null or num_attention_heads = %d (grouped-query attention "
              "is not implemented)", file, cfg->n_head);
    if (fabs(config_number(root, "layer_norm_eps", file, 1e-5) - 1e-5) > 1e-12)
        fatal("%s: \"layer_norm_eps\" must be 1e-5 (what our LayerNorm uses)", file);
}

// transformers' PhiConfig: the keys, and the defaults, of PhiForCausalLM's config.json
static void read_phi_config(const cJSON *root, const char *file, GPTConfig *cfg) {
    cfg->arch = &ARCH_PHI;
    cfg->n_embd = config_required(root, "hidden_size", file);
    cfg->n_layer = config_required(root, "num_hidden_layers", file);
    cfg->n_head = config_required(root, "num_attention_heads", file);
    cfg->vocab_size = config_required(root, "vocab_size", file);
    cfg->max_seq_len = config_int(root, "max_position_embeddings", file);
    if (cfg->max_seq_len < 0) cfg->max_seq_len = 2048;
    if (cfg->n_embd % cfg->n_head)
        fatal("%s: hidden_size %d is not a multiple of num_attention_heads %d", file, cfg->n_embd, cfg->n_head);
    check_phi_variant(root, file, cfg);
    int head_size = cfg->n_embd / cfg->n_head;
    double factor = config_number(root, "partial_rotary_factor", file, 0.5);
    cfg->rotary_dim = (int)(head_size * factor);  // as transformers rounds it
    if (factor <= 0 || factor > 1 || cfg->rotary_dim % 2)
        fatal("%s: \"partial_rotary_factor\" %g gives %d rotary dims of a %d-dim head; expected an even number "
              "in (0, %d]", file, factor, cfg->rotary_dim, head_size, head_size);
    cfg->rope_theta = (float)config_number(root, "rope_theta", file, 10000.0);
}

// a switch of LlamaConfig that must be false (we implement no biases)
static void require_false(const cJSON *root, const char *key, const char *file, const char *why) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (v && !cJSON_IsNull(v) && !cJSON_IsFalse(v)) fatal("%s: \"%s\" is not implemented (%s); it must be false", file, key, why);
}

// Llama's rope_scaling: null, or Llama 3's form {"rope_type": "llama3", "factor", "low_freq_factor",
// "high_freq_factor", "original_max_position_embeddings"}; any other form is refused by name
static void read_llama_rope_scaling(const cJSON *root, const char *file, GPTConfig *cfg) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (!v || cJSON_IsNull(v)) return;
    if (!cJSON_IsObject(v)) fatal("%s: \"rope_scaling\" must be null or an object", file);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(v, "rope_type");
    if (!type) type = cJSON_GetObjectItemCaseSensitive(v, "type");  // older configs' name for it
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "llama3"))
        fatal("%s: \"rope_scaling\" of type %s is not implemented; expected null or rope_type \"llama3\"", file,
              cJSON_IsString(type) ? type->valuestring : "(none)");
    const char *keys[] = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
    double values[4];
    for (int i = 0; i < 4; i++) {
        values[i] = config_number(v, keys[i], file, -1.0);
        if (!(values[i] > 0)) fatal("%s: \"rope_scaling\" of type llama3 needs a positive \"%s\"", file, keys[i]);
    }
    if (values[2] <= values[1])
        fatal("%s: \"rope_scaling\": \"high_freq_factor\" %g must exceed \"low_freq_factor\" %g", file, values[2],
              values[1]);
    cfg->rope_factor = (float)values[0];
    cfg->rope_low_freq_factor = (float)values[1];
    cfg->rope_high_freq_factor = (float)values[2];
    cfg->rope_original_max_positions = (int)values[3];
}

// transformers' LlamaConfig (and MistralConfig, the same model with other values): the keys, and
// the defaults, of LlamaForCausalLM's config.json. The switches we do not implement are refused.
static void read_llama_config(const cJSON *root, const char *file, GPTConfig *cfg) {
    cfg->n_embd = config_required(root, "hidden_size", file);
    cfg->n_layer = config_required(root, "num_hidden_layers", file);
    cfg->n_head = config_required(root, "num_attention_heads", file);
    cfg->vocab_size = config_required(root, "vocab_size", file);
    cfg->ffn_dim = config_required(root, "intermediate_size", file);
    cfg->max_seq_len = config_int(root, "max_position_embeddings", file);
    if (cfg->max_seq_len < 0) cfg->max_seq_len = 2048;
    cfg->n_kv_head = config_int(root, "num_key_value_heads", file);
    if (cfg->n_kv_head < 0) cfg->n_kv_head = cfg->n_head;
    if (cfg->n_embd % cfg->n_head)
        fatal("%s: hidden_size %d is not a multiple of num_attention_heads %d", file, cfg->n_embd, cfg->n_head);
    if (cfg->n_head % cfg->n_kv_head)
        fatal("%s: num_attention_heads %d is not a multiple of num_key_value_heads %d", file, cfg->n_head,
              cfg->n_kv_head);
    int head_size = cfg->n_embd / cfg->n_head;
    if (config_number(root, "head_dim", file, head_size) != head_size)
        fatal("%s: \"head_dim\" must be hidden_size / num_attention_heads = %d (another head size is not "
              "implemented)", file, head_size);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (v && (!cJSON_IsString(v) || strcmp(v->valuestring, "silu")))
        fatal("%s: \"hidden_act\" must be \"silu\" (SwiGLU), found %s", file, cJSON_IsString(v) ? v->valuestring : "a non-string");
    require_false(root, "attention_bias", file, "biases on q, k, v and o");
    require_false(root, "mlp_bias", file, "biases on gate, up and down");
    v = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
    if (v && !cJSON_IsNull(v))
        fatal("%s: \"sliding_window\" is not implemented (attention sees the whole sequence); it must be null", file);
    v = cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings");
    if (v && !cJSON_IsBool(v)) fatal("%s: \"tie_word_embeddings\" must be true or false", file);
    cfg->arch = v && cJSON_IsTrue(v) ? &ARCH_LLAMA_TIED : &ARCH_LLAMA;
    cfg->rotary_dim = head_size;
    cfg->rope_theta = (float)config_number(root, "rope_theta", file, 10000.0);
    cfg->norm_eps = (float)config_number(root, "rms_norm_eps", file, 1e-6);
    read_llama_rope_scaling(root, file, cfg);
}

// A mixture-of-experts GPT-2 (stage 08) names its experts the way Mixtral's config does. The
// capacity and the load-balancing loss's weight are how it is trained, not what it is: the run's.
static void read_moe_config(const cJSON *root, const char *file, GPTConfig *cfg) {
    int experts = config_int(root, "num_local_experts", file);
    if (experts < 0) return;
    if (experts > MAX_EXPERTS) fatal("%s: \"num_local_experts\" is %d; at most %d are supported", file, experts, MAX_EXPERTS);
    int per_token = config_required(root, "num_experts_per_tok", file);
    if (per_token > experts)
        fatal("%s: \"num_experts_per_tok\" is %d but there are %d experts", file, per_token, experts);
    cfg->moe = moe_config_new(experts, per_token, config_required(root, "moe_every", file));
}

void checkpoint_read_config(const char *path, GPTConfig *cfg) {
    char model_file[FILE_PATH_LEN], file[FILE_PATH_LEN];
    checkpoint_files(path, model_file, file);
    if (access(file, F_OK) != 0)
        fatal("%s: no such file; a checkpoint needs the Hugging Face config.json (n_embd, n_layer, n_head, "
              "vocab_size, n_positions) %s", file, is_directory(path) ? "in its directory" : "beside its .safetensors file");
    size_t len;
    char *text = read_file_or_die(file, &len);
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(root)) fatal("%s: not a JSON object", file);
    memset(cfg, 0, sizeof *cfg);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    bool llama = cJSON_IsString(type) && (!strcmp(type->valuestring, "llama") || !strcmp(type->valuestring, "mistral"));
    if (llama || (cJSON_IsString(type) && strcmp(type->valuestring, "phi") == 0)) {
        if (llama) read_llama_config(root, file, cfg);
        else read_phi_config(root, file, cfg);
        cfg->padded_vocab_size = gpt_padded_vocab(cfg->vocab_size);
        cJSON_Delete(root);
        return;
    }
    cfg->n_embd = config_required(root, "n_embd", file);
    cfg->n_layer = config_required(root, "n_layer", file);
    cfg->n_head = config_required(root, "n_head", file);
    cfg->vocab_size = config_required(root, "vocab_size", file);
    cfg->max_seq_len = config_int(root, "n_positions", file);
    if (cfg->max_seq_len < 0) cfg->max_seq_len = config_int(root, "n_ctx", file);  // older configs
    if (cfg->max_seq_len < 0) fatal("%s: missing key \"n_positions\" (or \"n_ctx\")", file);
    if (cfg->n_embd % cfg->n_head)
        fatal("%s: n_embd %d is not a multiple of n_head %d", file, cfg->n_embd, cfg->n_head);
    check_variant(root, file, cfg->n_embd);
    read_moe_config(root, file, cfg);
    cfg->padded_vocab_size = gpt_padded_vocab(cfg->vocab_size);
    cJSON_Delete(root);
}

// ---- loading the weights ------------------------------------------------------------------------

// The shape a tensor has in a Hugging Face file: Conv1D weights are (in, out), the transpose of
// ours, and wte has V rows where we have Vp.
static int hf_shape(const TensorInfo *t, int64_t shape[2]) {
    if (t->ndim == 1) {
        shape[0] = t->hf_rows;  // phi's lm_head.bias: V of our Vp
        return 1;
    }
    shape[0] = t->hf_transposed ? t->shape[1] : t->hf_rows;
    shape[1] = t->hf_transposed ? t->shape[0] : t->shape[1];
    return 2;
}

// "transformer.h.0.ln_1.weight" (GPT2LMHeadModel) or "h.0.ln_1.weight" (GPT2Model)
static const char *strip_prefix(const char *name) {
    const char *prefix = "transformer.";
    return strncmp(name, prefix, strlen(prefix)) == 0 ? name + strlen(prefix) : name;
}

// The model's weights: model.safetensors, or the shards a model.safetensors.index.json lists (how
// transformers saves a large model such as phi-1_5).
typedef struct {
    SafeTensors *files;
    int n;
} ModelFiles;

static void open_shards(ModelFiles *mf, const char *index_file) {
    size_t len;
    char *text = read_file_or_die(index_file, &len);
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(map)) fatal("%s: expected a JSON object with a \"weight_map\" object", index_file);
    char dir[FILE_PATH_LEN], shard[FILE_PATH_LEN];
    const char *slash = strrchr(index_file, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - index_file) : 1, slash ? index_file : ".");
    const cJSON *e;
    cJSON_ArrayForEach(e, map) {
        if (!cJSON_IsString(e)) fatal("%s: weight_map[\"%s\"] must be a file name", index_file, e->string);
        join_path(shard, dir, e->valuestring);
        bool seen = false;
        for (int i = 0; i < mf->n && !seen; i++) seen = strcmp(mf->files[i].path, shard) == 0;
        if (seen) continue;
        mf->files = realloc(mf->files, (size_t)(mf->n + 1) * sizeof(SafeTensors));
        if (!mf->files) fatal("out of host memory");
        safetensors_open(&mf->files[mf->n++], shard);
    }
    cJSON_Delete(root);
    if (!mf->n) fatal("%s: its weight_map lists no files", index_file);
}

static void model_files_open(ModelFiles *mf, const char *model_file) {
    memset(mf, 0, sizeof *mf);
    char index_file[FILE_PATH_LEN];
    if (snprintf(index_file, sizeof index_file, "%s.index.json", model_file) >= FILE_PATH_LEN)
        fatal("path too long: %s.index.json", model_file);
    if (access(model_file, F_OK) != 0 && access(index_file, F_OK) == 0) {
        open_shards(mf, index_file);
        return;
    }
    mf->files = malloc_or_die(sizeof(SafeTensors));
    mf->n = 1;
    safetensors_open(&mf->files[0], model_file);
}

static void model_files_close(ModelFiles *mf) {
    for (int i = 0; i < mf->n; i++) safetensors_close(&mf->files[i]);
    free(mf->files);
}

// the tensor of that name (with or without "transformer."), and the file holding it; NULL if none
static const SafeTensor *find_hf_tensor(const ModelFiles *mf, const char *name, const SafeTensors **in) {
    *in = &mf->files[0];
    for (int i = 0; i < mf->n; i++) {
        const SafeTensor *t = safetensors_find(&mf->files[i], name);
        if (!t) t = safetensors_find(&mf->files[i], strip_prefix(name));
        *in = &mf->files[i];
        if (t) return t;
    }
    return NULL;
}

static void check_shape(const SafeTensors *st, const SafeTensor *t, const char *name, int ndim,
                        const int64_t *shape, const GPTConfig *cfg) {
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (same) return;
    char want[64], found[128];
    fatal("%s: tensor %s has shape %s, expected %s for the configured model (vocab_size %d, n_positions %d, "
          "n_embd %d, n_layer %d)", st->path, name, safetensors_shape_str(found, sizeof found, t->ndim, t->shape),
          safetensors_shape_str(want, sizeof want, ndim, shape), cfg->vocab_size, cfg->max_seq_len,
          cfg->n_embd, cfg->n_layer);
}

// Reads one tensor into its place in the flat buffer.
static void load_tensor(const ModelFiles *mf, const TensorInfo *info, const GPTConfig *cfg, float *params) {
    const SafeTensors *st;
    const SafeTensor *t = find_hf_tensor(mf, info->name, &st);
    if (!t)
        fatal("%s%s: tensor %s (or %s) is missing; the file has %d tensors%s%s", st->path,
              mf->n > 1 ? " (and the other shards)" : "", info->name, strip_prefix(info->name), st->num_tensors,
              st->num_tensors ? ", the first is " : "", st->num_tensors ? st->tensors[0].name : "");
    int64_t shape[2];
    int ndim = hf_shape(info, shape);
    check_shape(st, t, info->name, ndim, shape, cfg);
    float *dst = params + info->offset;
    float *src = malloc_or_die((size_t)t->numel * sizeof(float));
    safetensors_read_floats(st, t, src);
    if (info->hf_transposed) {
        size_t in = (size_t)shape[0], out = (size_t)shape[1];  // file (in, out) -> ours (out, in)
        for (size_t i = 0; i < in; i++)
            for (size_t o = 0; o < out; o++) dst[o * in + i] = src[i * out + o];
    } else {
        // wte: V rows from the file, then Vp - V rows of zeros that no token ever uses
        memcpy(dst, src, (size_t)t->numel * sizeof(float));
        memset(dst + t->numel, 0, (info->numel - (size_t)t->numel) * sizeof(float));
    }
    free(src);
}

// A separate lm_head.weight is allowed only as a copy of wte: our head is tied to it.
static void check_lm_head(const SafeTensors *st, const TensorInfo *wte, const GPTConfig *cfg, const float *params) {
    const SafeTensor *t = safetensors_find(st, "lm_head.weight");
    if (!t) return;
    int64_t shape[2];
    check_shape(st, t, "lm_head.weight", hf_shape(wte, shape), shape, cfg);
    float *head = malloc_or_die((size_t)t->numel * sizeof(float));
    safetensors_read_floats(st, t, head);
    if (memcmp(head, params + wte->offset, (size_t)t->numel * sizeof(float)) != 0)
        fatal("%s: lm_head.weight differs from wte.weight; this GPT-2 ties its head to wte and cannot load "
              "an untied one", st->path);
    free(head);
}

// A file with more blocks than the configured model would otherwise load its first n_layer
// blocks and silently drop the rest.
static void check_no_extra_blocks(const SafeTensors *st, const GPTConfig *cfg) {
    for (int i = 0; i < st->num_tensors; i++) {
        const char *name = strip_prefix(st->tensors[i].name), *blocks = "h.";
        if (strncmp(name, "model.layers.", 13) == 0) blocks = "model.layers.";  // phi
        if (strncmp(name, blocks, strlen(blocks)) != 0) continue;
        long block = strtol(name + strlen(blocks), NULL, 10);
        if (block >= cfg->n_layer)
            fatal("%s: tensor %s belongs to block %ld, but the configured model has n_layer %d", st->path,
                  st->tensors[i].name, block, cfg->n_layer);
        const char *expert = strstr(name, ".mlp.experts.");
        long e = expert ? strtol(expert + strlen(".mlp.experts."), NULL, 10) : -1;
        if (e >= gpt_experts(cfg))
            fatal("%s: tensor %s belongs to expert %ld, but the configured model has %d experts per block",
                  st->path, st->tensors[i].name, e, gpt_experts(cfg));
    }
}

void checkpoint_load_model(const char *path, const ParamLayout *layout, float *params) {
    char model_file[FILE_PATH_LEN], config_file[FILE_PATH_LEN];
    checkpoint_files(path, model_file, config_file);
    ModelFiles mf;
    model_files_open(&mf, model_file);
    for (int i = 0; i < mf.n; i++) check_no_extra_blocks(&mf.files[i], &layout->cfg);
    for (int i = 0; i < layout->num_tensors; i++) load_tensor(&mf, &layout->tensors[i], &layout->cfg, params);
    if (layout->arch->tied_head) check_lm_head(&mf.files[0], &layout->tensors[0], &layout->cfg, params);
    model_files_close(&mf);
}

// ================================================================================================
// 4. Writing, atomically (files.h): temp file, flush, fsync, rename; a checkpoint's files are
//    renamed together, at the end.
// ================================================================================================

// One tensor as it goes into a file. The file stores `shape`; src is in our memory, where a
// Conv1D weight is the transpose (shape[1], shape[0]).
typedef struct {
    const char *name;
    int ndim;
    int64_t shape[2];
    const float *src;
    int transpose;
} OutTensor;

static uint64_t out_numel(const OutTensor *t) {
    return t->ndim == 1 ? (uint64_t)t->shape[0] : (uint64_t)t->shape[0] * (uint64_t)t->shape[1];
}

// The header: every tensor F32, laid out back to back in the order given.
static char *build_header(const OutTensor *t, int n, cJSON *metadata) {
    cJSON *h = cJSON_CreateObject();
    cJSON_AddItemToObject(h, "__metadata__", metadata);
    uint64_t offset = 0;
    for (int i = 0; i < n; i++) {
        cJSON *e = cJSON_AddObjectToObject(h, t[i].name);
        cJSON_AddStringToObject(e, "dtype", "F32");
        cJSON *shape = cJSON_AddArrayToObject(e, "shape");
        for (int d = 0; d < t[i].ndim; d++) cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t[i].shape[d]));
        uint64_t bytes = out_numel(&t[i]) * sizeof(float);
        cJSON *offsets = cJSON_AddArrayToObject(e, "data_offsets");
        cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)offset));
        cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)(offset + bytes)));
        offset += bytes;
    }
    char *json = cJSON_PrintUnformatted(h);
    cJSON_Delete(h);
    if (!json) fatal("out of memory building a safetensors header");
    return json;
}

static void write_tensor_data(AtomicFile *a, const OutTensor *t) {
    size_t n = (size_t)out_numel(t);
    if (!t->transpose) {
        atomic_write(a, t->src, n * sizeof(float));
        return;
    }
    size_t rows = (size_t)t->shape[0], cols = (size_t)t->shape[1];  // the file's (in, out)
    float *buf = malloc_or_die(n * sizeof(float));
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) buf[r * cols + c] = t->src[c * rows + r];
    atomic_write(a, buf, n * sizeof(float));
    free(buf);
}

// Writes <dir>/<name> as a safetensors file; takes ownership of metadata.
static void write_safetensors(const char *dir, const char *name, const OutTensor *t, int n, cJSON *metadata) {
    char *json = build_header(t, n, metadata);
    size_t len = strlen(json);
    size_t padded = (len + 7) / 8 * 8;  // spaces up to a multiple of 8: the data starts aligned
    unsigned char prefix[8];
    for (int i = 0; i < 8; i++) prefix[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    uint64_t size = 8 + padded;
    for (int i = 0; i < n; i++) size += out_numel(&t[i]) * sizeof(float);
    AtomicFile a;
    atomic_open(&a, dir, name, size);
    atomic_write(&a, prefix, 8);
    atomic_write(&a, json, len);
    atomic_write(&a, "        ", padded - len);
    for (int i = 0; i < n; i++) write_tensor_data(&a, &t[i]);
    atomic_commit(&a);
    free(json);
}

// a config.json's object, with the keys transformers picks the model class by
static cJSON *new_config(const char *model_type, const char *architecture) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "model_type", model_type);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(c, "architectures"), cJSON_CreateString(architecture));
    return c;
}

// key: a float32 as the shortest decimal that reads back as the same float32 (rms_norm_eps 1e-06,
// not the double nearest the float, 9.99999997475243e-07), whole ones with ".0" so that Python
// reads a float: transformers warns when Llama 3's rope_scaling factors are ints
static void add_float(cJSON *obj, const char *key, float v) {
    char text[32];
    if (v == truncf(v) && fabsf(v) < 1e7f) {  // whole, and every digit significant
        snprintf(text, sizeof text, "%.1f", (double)v);
    } else {
        for (int digits = 1; digits <= 9; digits++) {  // 9 significant digits always read back
            snprintf(text, sizeof text, "%.*g", digits, (double)v);
            if (strtof(text, NULL) == v) break;
        }
    }
    cJSON_AddRawToObject(obj, key, text);
}

// the text of a config.json (c is freed)
static char *config_text(cJSON *c) {
    char *text = cJSON_Print(c);
    cJSON_Delete(c);
    if (!text) fatal("out of memory building config.json");
    return text;
}

// What transformers' GPT2Config needs to rebuild this model (dropout off: these are weights to
// run or fine-tune, and our training has none).
static char *hf_config_json(const GPTConfig *cfg) {
    cJSON *c = new_config("gpt2", "GPT2LMHeadModel");
    cJSON_AddNumberToObject(c, "vocab_size", cfg->vocab_size);
    cJSON_AddNumberToObject(c, "n_positions", cfg->max_seq_len);
    cJSON_AddNumberToObject(c, "n_ctx", cfg->max_seq_len);
    cJSON_AddNumberToObject(c, "n_embd", cfg->n_embd);
    cJSON_AddNumberToObject(c, "n_layer", cfg->n_layer);
    cJSON_AddNumberToObject(c, "n_head", cfg->n_head);
    cJSON_AddNullToObject(c, "n_inner");
    cJSON_AddStringToObject(c, "activation_function", "gelu_new");
    cJSON_AddNumberToObject(c, "layer_norm_epsilon", 1e-5);
    cJSON_AddNumberToObject(c, "initializer_range", 0.02);
    cJSON_AddNumberToObject(c, "resid_pdrop", 0);
    cJSON_AddNumberToObject(c, "embd_pdrop", 0);
    cJSON_AddNumberToObject(c, "attn_pdrop", 0);
    cJSON_AddBoolToObject(c, "scale_attn_weights", 1);
    cJSON_AddBoolToObject(c, "tie_word_embeddings", 1);
    cJSON_AddBoolToObject(c, "use_cache", 1);
    cJSON_AddNumberToObject(c, "bos_token_id", cfg->vocab_size - 1);
    cJSON_AddNumberToObject(c, "eos_token_id", cfg->vocab_size - 1);
    cJSON_AddStringToObject(c, "torch_dtype", "float32");
    if (cfg->moe) {  // stage 08's experts, named as Mixtral's config names them
        cJSON_AddNumberToObject(c, "num_local_experts", cfg->moe->n_experts);
        cJSON_AddNumberToObject(c, "num_experts_per_tok", cfg->moe->experts_per_token);
        cJSON_AddNumberToObject(c, "moe_every", cfg->moe->moe_every);
        add_float(c, "router_aux_loss_coef", cfg->moe->aux_loss_coef);
    }
    return config_text(c);
}

// What transformers' PhiConfig needs to rebuild this model as PhiForCausalLM (dropout off).
static char *phi_config_json(const GPTConfig *cfg) {
    cJSON *c = new_config("phi", "PhiForCausalLM");
    cJSON_AddNumberToObject(c, "vocab_size", cfg->vocab_size);
    cJSON_AddNumberToObject(c, "hidden_size", cfg->n_embd);
    cJSON_AddNumberToObject(c, "intermediate_size", 4 * cfg->n_embd);
    cJSON_AddNumberToObject(c, "num_hidden_layers", cfg->n_layer);
    cJSON_AddNumberToObject(c, "num_attention_heads", cfg->n_head);
    cJSON_AddNumberToObject(c, "num_key_value_heads", cfg->n_head);
    cJSON_AddNumberToObject(c, "max_position_embeddings", cfg->max_seq_len);
    add_float(c, "partial_rotary_factor", (float)cfg->rotary_dim / (float)(cfg->n_embd / cfg->n_head));
    add_float(c, "rope_theta", cfg->rope_theta);
    cJSON_AddNullToObject(c, "rope_scaling");
    cJSON_AddStringToObject(c, "hidden_act", "gelu_new");
    cJSON_AddNumberToObject(c, "layer_norm_eps", 1e-5);
    cJSON_AddNumberToObject(c, "initializer_range", 0.02);
    cJSON_AddNumberToObject(c, "resid_pdrop", 0);
    cJSON_AddNumberToObject(c, "embd_pdrop", 0);
    cJSON_AddNumberToObject(c, "attention_dropout", 0);
    cJSON_AddBoolToObject(c, "qk_layernorm", 0);
    cJSON_AddBoolToObject(c, "tie_word_embeddings", 0);
    cJSON_AddStringToObject(c, "torch_dtype", "float32");
    return config_text(c);
}

// What transformers' LlamaConfig needs to rebuild this model as LlamaForCausalLM.
static char *llama_config_json(const GPTConfig *cfg) {
    cJSON *c = new_config("llama", "LlamaForCausalLM");
    cJSON_AddNumberToObject(c, "vocab_size", cfg->vocab_size);
    cJSON_AddNumberToObject(c, "hidden_size", cfg->n_embd);
    cJSON_AddNumberToObject(c, "intermediate_size", cfg->ffn_dim);
    cJSON_AddNumberToObject(c, "num_hidden_layers", cfg->n_layer);
    cJSON_AddNumberToObject(c, "num_attention_heads", cfg->n_head);
    cJSON_AddNumberToObject(c, "num_key_value_heads", cfg->n_kv_head ? cfg->n_kv_head : cfg->n_head);
    cJSON_AddNumberToObject(c, "max_position_embeddings", cfg->max_seq_len);
    add_float(c, "rope_theta", cfg->rope_theta);
    if (cfg->rope_factor) {
        cJSON *r = cJSON_AddObjectToObject(c, "rope_scaling");
        cJSON_AddStringToObject(r, "rope_type", "llama3");
        add_float(r, "factor", cfg->rope_factor);
        add_float(r, "low_freq_factor", cfg->rope_low_freq_factor);
        add_float(r, "high_freq_factor", cfg->rope_high_freq_factor);
        cJSON_AddNumberToObject(r, "original_max_position_embeddings", cfg->rope_original_max_positions);
    } else {
        cJSON_AddNullToObject(c, "rope_scaling");
    }
    add_float(c, "rms_norm_eps", cfg->norm_eps);
    cJSON_AddStringToObject(c, "hidden_act", "silu");
    cJSON_AddBoolToObject(c, "attention_bias", 0);
    cJSON_AddBoolToObject(c, "mlp_bias", 0);
    cJSON_AddNumberToObject(c, "attention_dropout", 0);
    cJSON_AddNumberToObject(c, "initializer_range", 0.02);
    cJSON_AddBoolToObject(c, "tie_word_embeddings", cfg->arch == &ARCH_LLAMA_TIED);
    cJSON_AddStringToObject(c, "torch_dtype", "float32");
    return config_text(c);
}

void checkpoint_save_model(const char *out_dir, const ParamLayout *layout, const float *params,
                           const char *run_config_json) {
    OutTensor *t = calloc_or_die((size_t)layout->num_tensors, sizeof(OutTensor));
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *info = &layout->tensors[i];
        t[i].name = info->name;
        t[i].ndim = hf_shape(info, t[i].shape);
        t[i].src = params + info->offset;  // wte: its first V rows are the file's V rows
        t[i].transpose = info->hf_transposed;
    }
    // transformers refuses a safetensors file whose metadata lacks format "pt"
    cJSON *meta = cJSON_CreateObject();
    cJSON_AddStringToObject(meta, "format", "pt");
    if (run_config_json) cJSON_AddStringToObject(meta, "run_config", run_config_json);
    write_safetensors(out_dir, "model.safetensors", t, layout->num_tensors, meta);
    free(t);
    char *config = layout->arch == &ARCH_PHI ? phi_config_json(&layout->cfg)
                   : layout->arch->rms_norm ? llama_config_json(&layout->cfg)
                                            : hf_config_json(&layout->cfg);
    write_text_file(out_dir, "config.json", config);
    free(config);
}

void safetensors_save_layout(const char *dir, const char *file, const char *prefix, const ParamLayout *layout,
                             const float *params) {
    OutTensor *t = calloc_or_die((size_t)layout->num_tensors, sizeof(OutTensor));
    char (*names)[160] = calloc_or_die((size_t)layout->num_tensors, sizeof *names);
    for (int i = 0; i < layout->num_tensors; i++) {
        const TensorInfo *info = &layout->tensors[i];
        snprintf(names[i], sizeof names[i], "%s%s", prefix, info->name);
        t[i] = (OutTensor){.name = names[i], .ndim = info->ndim, .shape = {info->shape[0], info->shape[1]},
                           .src = params + info->offset};
    }
    cJSON *meta = cJSON_CreateObject();
    cJSON_AddStringToObject(meta, "format", "pt");
    write_safetensors(dir, file, t, layout->num_tensors, meta);
    free(names);
    free(t);
}

// ---- optimizer state ----------------------------------------------------------------------------

// __metadata__ values are strings: a number goes in as its text
__attribute__((format(printf, 3, 4)))
static void add_metadata(cJSON *meta, const char *key, const char *fmt, ...) {
    char text[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    cJSON_AddStringToObject(meta, key, text);
}

void checkpoint_save_optimizer(const char *out_dir, const ParamLayout *layout, const float *m,
                               const float *v, const TrainState *state) {
    int64_t n = (int64_t)layout->num_params;
    OutTensor t[3] = {{"m", 1, {n, 0}, m, 0},
                      {"v", 1, {n, 0}, v, 0},
                      {state->extra_name, 2, {state->extra_rows, state->extra_cols}, state->extra, 0}};
    cJSON *meta = cJSON_CreateObject();
    cJSON_AddStringToObject(meta, "format", "adamw");
    add_metadata(meta, "step", "%ld", state->step);
    add_metadata(meta, "seed", "%llu", (unsigned long long)state->seed);
    if (state->has_loss_scale) {
        add_metadata(meta, "loss_scale", "%.17g", state->loss_scale);
        add_metadata(meta, "loss_scale_good_steps", "%ld", state->loss_scale_good_steps);
        add_metadata(meta, "loss_scale_skipped_steps", "%ld", state->loss_scale_skipped_steps);
    }
    write_safetensors(out_dir, "optimizer.safetensors", t, state->extra ? 3 : 2, meta);
}

// A metadata value that must be a whole decimal number (strtoull alone would accept "-1").
static unsigned long long metadata_number(const SafeTensors *st, const char *key, unsigned long long max) {
    const char *s = safetensors_metadata(st, key);
    if (!s) fatal("%s: __metadata__ has no \"%s\"", st->path, key);
    char *end;
    errno = 0;
    unsigned long long n = strtoull(s, &end, 10);
    if (s[0] < '0' || s[0] > '9' || *end != '\0' || errno == ERANGE || n > max)
        fatal("%s: __metadata__ \"%s\" must be a whole number up to %llu, found \"%s\"", st->path, key, max, s);
    return n;
}

static void load_moment(const SafeTensors *st, const char *name, const ParamLayout *layout, float *out) {
    const SafeTensor *t = safetensors_find(st, name);
    if (!t) fatal("%s: tensor %s is missing", st->path, name);
    int64_t shape[1] = {(int64_t)layout->num_params};
    check_shape(st, t, name, 1, shape, &layout->cfg);
    safetensors_read_floats(st, t, out);
}

// A positive finite loss scale (strtod alone would accept "inf", "-1" and "0x10")
static double metadata_scale(const SafeTensors *st, const char *key) {
    const char *s = safetensors_metadata(st, key);
    char *end;
    double x = strtod(s, &end);
    if (s[0] < '0' || s[0] > '9' || *end != '\0' || !isfinite(x) || !(x > 0))
        fatal("%s: __metadata__ \"%s\" must be a positive number, found \"%s\"", st->path, key, s);
    return x;
}

static void read_train_state(const SafeTensors *st, TrainState *state) {
    *state = (TrainState){0};
    state->step = (long)metadata_number(st, "step", (unsigned long long)LONG_MAX);
    state->seed = (uint64_t)metadata_number(st, "seed", UINT64_MAX);
    state->has_loss_scale = safetensors_metadata(st, "loss_scale") != NULL;
    if (!state->has_loss_scale) return;
    state->loss_scale = metadata_scale(st, "loss_scale");
    state->loss_scale_good_steps = (long)metadata_number(st, "loss_scale_good_steps", INT_MAX);
    state->loss_scale_skipped_steps = (long)metadata_number(st, "loss_scale_skipped_steps", LONG_MAX);
}

void checkpoint_load_optimizer(const char *out_dir, const ParamLayout *layout, float *m, float *v,
                               TrainState *state) {
    char file[FILE_PATH_LEN];
    join_path(file, out_dir, "optimizer.safetensors");
    SafeTensors st;
    safetensors_open(&st, file);
    load_moment(&st, "m", layout, m);
    load_moment(&st, "v", layout, v);
    read_train_state(&st, state);
    safetensors_close(&st);
}

void checkpoint_load_train_state(const char *out_dir, TrainState *state) {
    char file[FILE_PATH_LEN];
    join_path(file, out_dir, "optimizer.safetensors");
    SafeTensors st;
    safetensors_open(&st, file);
    read_train_state(&st, state);
    safetensors_close(&st);
}

bool checkpoint_load_optimizer_extra(const char *out_dir, const char *name, int64_t rows, int64_t cols, float *out) {
    char file[FILE_PATH_LEN];
    join_path(file, out_dir, "optimizer.safetensors");
    SafeTensors st;
    safetensors_open(&st, file);
    const SafeTensor *t = safetensors_find(&st, name);
    int64_t shape[2] = {rows, cols};
    if (t && !(t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols)) {
        char want[64], found[128];
        fatal("%s: tensor %s has shape %s, expected %s for this run", file, name,
              safetensors_shape_str(found, sizeof found, t->ndim, t->shape),
              safetensors_shape_str(want, sizeof want, 2, shape));
    }
    if (t) safetensors_read_floats(&st, t, out);
    safetensors_close(&st);
    return t != NULL;
}

// ---- what a directory holds ---------------------------------------------------------------------

int checkpoint_files_in(const char *dir, const char **missing) {
    static const char *const files[] = {"model.safetensors", "config.json", "optimizer.safetensors"};
    int present = 0;
    *missing = NULL;
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[FILE_PATH_LEN];
        join_path(path, dir, files[i]);
        if (access(path, F_OK) == 0) present++;
        else if (!*missing) *missing = files[i];
    }
    return present;
}

char *checkpoint_run_config(const char *dir) {
    char file[FILE_PATH_LEN];
    join_path(file, dir, "model.safetensors");
    SafeTensors st;
    safetensors_open(&st, file);
    const char *json = safetensors_metadata(&st, "run_config");
    char *copy = json ? copy_string_or_die(json) : NULL;
    safetensors_close(&st);
    return copy;
}

void checkpoint_save(const char *out_dir, const ParamLayout *layout, const float *params, const float *m,
                     const float *v, const TrainState *state, const char *run_config_json) {
    atomic_group_begin();
    checkpoint_save_model(out_dir, layout, params, run_config_json);
    checkpoint_save_optimizer(out_dir, layout, m, v, state);
    atomic_group_commit();
}
