// test_checkpoint.c: safetensors checkpoints. Round trips, the Hugging Face fixtures checked
// against an independent read of their bytes, F16/BF16, hostile files (each in a child process,
// since a bad file ends the program through fatal()), atomic saves under a simulated crash, and
// the fixtures' reference losses through the real model.
//
// Run from the repository root (the fixtures are ../shared/fixtures). TEST_VERBOSE=1 prints the
// message of every failure case, to read what a user would see.
// `test_checkpoint --oracle-save DIR` is a helper for tests/test_checkpoint_oracle.sh: it saves a
// model with known random weights to DIR, writes DIR/tokens.json and prints our loss and logits.
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/device.h"
#include "base/log.h"
#include "check.h"
#include "model/activations.h"
#include "model/checkpoint.h"
#include "model/gpt.h"
#include "ops/ops.h"

#define FIX "../shared/fixtures"

// ---- small helpers ------------------------------------------------------------------------------

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float uniform(float lo, float hi) {  // xorshift64*: any fixed sequence will do
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t r = rng_state * 0x2545f4914f6cdd1dull;
    return lo + (hi - lo) * (float)(r >> 40) / (float)(1ull << 24);
}

static GPTConfig make_cfg(int V, int maxT, int L, int NH, int C) {
    GPTConfig c = {.max_seq_len = maxT, .vocab_size = V, .padded_vocab_size = gpt_padded_vocab(V),
                   .n_layer = L, .n_head = NH, .n_embd = C};
    return c;
}

// Random weights everywhere (biases and LayerNorms too, so a misplaced one shows), zero in the
// vocab padding rows as a real model has. With `grid` set, every value is k/128 with |k| < 256:
// exact in F16 and BF16, so files in those dtypes must load bit-identically.
static void random_params(const ParamLayout *l, float *p, float scale, int grid) {
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *t = &l->tensors[i];
        size_t real = (size_t)t->hf_rows * (size_t)(t->ndim == 2 ? t->shape[1] : 1);
        int is_ln_weight = t->ndim == 1 && t->init_value == 1.0f;
        for (size_t j = 0; j < t->numel; j++) {
            float x = j < real ? uniform(-scale, scale) : 0.0f;
            if (is_ln_weight) x += 1.0f;
            if (grid) x = (float)(int)(x * 128.0f) / 128.0f;  // |x| < 2: k/128 with |k| < 256
            p[t->offset + j] = x;
        }
    }
}

// Temp directories, removed at the end by remove_temp_dirs()
static char temp_dirs[16][64];
static int temp_dirs_used = 0;

static char *make_temp_dir(void) {
    if (temp_dirs_used == 16) fatal("test_checkpoint: too many temp dirs");
    char *d = temp_dirs[temp_dirs_used++];
    snprintf(d, 64, "/tmp/test_checkpoint_XXXXXX");
    if (!mkdtemp(d)) fatal("mkdtemp: %s", strerror(errno));
    return d;
}

static void remove_tree(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return;
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char sub[1024];
            snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
            remove_tree(sub);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static void remove_temp_dirs(void) {
    for (int i = 0; i < temp_dirs_used; i++) remove_tree(temp_dirs[i]);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// The directory's file names, sorted, comma-separated: "config.json,model.safetensors"
static void list_dir(const char *dir, char *out, size_t size) {
    char *names[64];
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) && n < 64)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) names[n++] = strdup(e->d_name);
    if (d) closedir(d);
    qsort(names, (size_t)n, sizeof names[0], cmp_str);
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        snprintf(out + strlen(out), size - strlen(out), "%s%s", i ? "," : "", names[i]);
        free(names[i]);
    }
}

static int file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen_or_die(path, "wb");
    if (n && fwrite(data, 1, n, f) != n) fatal("cannot write %s", path);
    fclose(f);
}

// A safetensors file from a header string and data_len zero bytes (hostile files are made so).
static void write_raw(const char *path, const char *header, size_t data_len) {
    size_t n = strlen(header);
    unsigned char *b = calloc_or_die(8 + n + data_len, 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(b + 8, header, n);
    write_bytes(path, b, 8 + n + data_len);
    free(b);
}

// ---- an independent safetensors writer and reader, for crafting files and checking ours -------

typedef struct {
    char name[80];
    const char *dtype;  // "F32", "F16", "BF16" or anything else for hostile files
    int ndim;
    int64_t shape[2];
    unsigned char *data;
    size_t nbytes;
} TestTensor;

static void write_tensors(const char *path, const TestTensor *t, int n, const char *metadata) {
    size_t cap = 256 + (size_t)n * 256, len = 0, off = 0;
    char *h = malloc_or_die(cap);
    len += (size_t)snprintf(h, cap, "{\"__metadata__\":%s", metadata ? metadata : "{}");
    for (int i = 0; i < n; i++) {
        char shape[64] = "";
        for (int d = 0; d < t[i].ndim; d++)
            snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        len += (size_t)snprintf(h + len, cap - len, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[%zu,%zu]}",
                                t[i].name, t[i].dtype, shape, off, off + t[i].nbytes);
        off += t[i].nbytes;
    }
    snprintf(h + len, cap - len, "}");
    len++;
    FILE *f = fopen_or_die(path, "wb");
    unsigned char prefix[8];
    for (int i = 0; i < 8; i++) prefix[i] = (unsigned char)((uint64_t)len >> (8 * i));
    fwrite(prefix, 1, 8, f);
    fwrite(h, 1, len, f);
    for (int i = 0; i < n; i++) fwrite(t[i].data, 1, t[i].nbytes, f);
    fclose(f);
    free(h);
}

static uint16_t to_bf16(float x) {  // exact for the grid values of random_params
    uint32_t b;
    memcpy(&b, &x, 4);
    return (uint16_t)(b >> 16);
}

static uint16_t to_f16(float x) {  // exact for zero and normal grid values (|x| >= 2^-7)
    uint32_t b;
    memcpy(&b, &x, 4);
    uint32_t sign = b >> 31, e = (b >> 23) & 0xff, m = b & 0x7fffff;
    if (e == 0) return (uint16_t)(sign << 15);
    return (uint16_t)(sign << 15 | (e - 127 + 15) << 10 | m >> 13);
}

static void put_value(TestTensor *t, size_t i, float x) {
    if (!strcmp(t->dtype, "F32")) memcpy(t->data + 4 * i, &x, 4);
    else if (!strcmp(t->dtype, "BF16")) { uint16_t h = to_bf16(x); memcpy(t->data + 2 * i, &h, 2); }
    else { uint16_t h = to_f16(x); memcpy(t->data + 2 * i, &h, 2); }
}

// The model as a Hugging Face file holds it, written out by hand here: Conv1D weights (in, out),
// wte with V rows, in `dtype`, names with or without "transformer.".
static int hf_tensors(TestTensor *out, const ParamLayout *l, const float *p, const char *dtype, int prefix) {
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *ti = &l->tensors[i];
        TestTensor *t = &out[i];
        snprintf(t->name, sizeof t->name, "%s", prefix ? ti->name : ti->name + strlen("transformer."));
        t->dtype = dtype;
        t->ndim = ti->ndim;
        int rows = ti->hf_rows, cols = ti->ndim == 2 ? ti->shape[1] : 1;
        t->shape[0] = ti->hf_transposed ? cols : rows;
        t->shape[1] = ti->hf_transposed ? rows : cols;
        size_t n = (size_t)rows * (size_t)cols, esize = strcmp(dtype, "F32") ? 2 : 4;
        t->nbytes = n * esize;
        t->data = malloc_or_die(t->nbytes);
        const float *src = p + ti->offset;
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                size_t at = ti->hf_transposed ? (size_t)c * rows + r : (size_t)r * cols + c;
                put_value(t, at, src[(size_t)r * cols + c]);
            }
    }
    return l->num_tensors;
}

static void free_tensors(TestTensor *t, int n) {
    for (int i = 0; i < n; i++) free(t[i].data);
}

// Reads a file with nothing but cJSON and byte offsets: the check on our reader and writer.
typedef struct {
    char *bytes;
    size_t size;
    uint64_t header_len;
    cJSON *header;
} RawFile;

static void raw_open(RawFile *r, const char *path) {
    r->bytes = read_file_or_die(path, &r->size);
    r->header_len = 0;
    for (int i = 7; i >= 0; i--) r->header_len = r->header_len << 8 | (unsigned char)r->bytes[i];
    r->header = cJSON_ParseWithLength(r->bytes + 8, r->header_len);
}

static void raw_close(RawFile *r) {
    cJSON_Delete(r->header);
    free(r->bytes);
}

// A copy of an F32 tensor's values, and its shape; NULL if absent.
static float *raw_floats(const RawFile *r, const char *name, int64_t shape[2], int *ndim) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(r->header, name);
    if (!e) return NULL;
    const cJSON *offs = cJSON_GetObjectItem(e, "data_offsets"), *sh = cJSON_GetObjectItem(e, "shape");
    size_t begin = (size_t)cJSON_GetArrayItem(offs, 0)->valuedouble, end = (size_t)cJSON_GetArrayItem(offs, 1)->valuedouble;
    *ndim = cJSON_GetArraySize(sh);
    for (int d = 0; d < *ndim && d < 2; d++) shape[d] = (int64_t)cJSON_GetArrayItem(sh, d)->valuedouble;
    float *v = malloc_or_die(end - begin);
    memcpy(v, r->bytes + 8 + r->header_len + begin, end - begin);
    return v;
}

// How many of params' values differ (bitwise) from the file's bytes, mapping the layouts here
// independently of checkpoint.c: Conv1D transposed, wte's padding rows zero.
static long mismatches_vs_file(const ParamLayout *l, const float *p, const char *path, int prefix) {
    RawFile r;
    raw_open(&r, path);
    long bad = 0;
    for (int i = 0; i < l->num_tensors; i++) {
        const TensorInfo *ti = &l->tensors[i];
        int64_t shape[2];
        int ndim;
        float *v = raw_floats(&r, prefix ? ti->name : ti->name + strlen("transformer."), shape, &ndim);
        if (!v) {
            fprintf(stderr, "  %s: %s not in the file\n", path, ti->name);
            bad++;
            continue;
        }
        int rows = ti->shape[0], cols = ti->ndim == 2 ? ti->shape[1] : 1;
        for (int row = 0; row < rows; row++)
            for (int c = 0; c < cols; c++) {
                float want = 0.0f;  // padding rows beyond hf_rows
                if (ti->hf_transposed) want = v[(size_t)c * rows + row];
                else if (row < ti->hf_rows) want = v[(size_t)row * cols + c];
                bad += memcmp(&want, &p[ti->offset + (size_t)row * cols + c], 4) != 0;
            }
        free(v);
    }
    raw_close(&r);
    return bad;
}

// ---- running a case that must fail -------------------------------------------------------------

// Runs fn(arg) in a child process with stderr captured; returns its exit status (128 + signal
// when killed) and what it printed.
static int run_child(void (*fn)(const char *), const char *arg, char *msg, size_t msglen) {
    char errpath[] = "/tmp/test_checkpoint_stderr_XXXXXX";
    int fd = mkstemp(errpath);
    if (fd < 0) fatal("mkstemp: %s", strerror(errno));
    fflush(NULL);  // or the child's exit() would print our buffered output a second time
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 2);
        fn(arg);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    ssize_t n = pread(fd, msg, msglen - 1, 0);
    msg[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(errpath);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// fn(arg) must exit 1 with a message holding both needles (the file and the problem).
static void expect_fatal(const char *what, void (*fn)(const char *), const char *arg, const char *needle1,
                         const char *needle2) {
    char msg[2048];
    int status = run_child(fn, arg, msg, sizeof msg);
    if (getenv("TEST_VERBOSE")) printf("  %-40s -> %s", what, msg);  // to read the messages
    CHECK(status == 1, "%s: exit status %d, want 1; stderr: %s", what, status, msg);
    CHECK(strstr(msg, needle1) && strstr(msg, needle2), "%s: message lacks '%s' or '%s': %s", what, needle1,
          needle2, msg);
}

// What the children do (the model they load is g_layout, a small one)
static ParamLayout g_layout;
static float *g_params;

static void child_open(const char *path) {
    SafeTensors st;
    safetensors_open(&st, path);
    for (int i = 0; i < st.num_tensors; i++) {  // read everything, as a loader would
        float *v = malloc_or_die((size_t)st.tensors[i].numel * sizeof(float));
        safetensors_read_floats(&st, &st.tensors[i], v);
        free(v);
    }
    safetensors_close(&st);
}
static void child_load_model(const char *path) { checkpoint_load_model(path, &g_layout, g_params); }
static void child_read_config(const char *path) {
    GPTConfig c;
    checkpoint_read_config(path, &c);
}
static void child_load_optimizer(const char *dir) {
    float *m = malloc_or_die(g_layout.num_params * sizeof(float)), *v = malloc_or_die(g_layout.num_params * sizeof(float));
    TrainState s;
    checkpoint_load_optimizer(dir, &g_layout, m, v, &s);
}
static void child_load_extra_of_other_shape(const char *dir) {
    float out[8];
    checkpoint_load_optimizer_extra(dir, "fp8_amax_history", 2, 4, out);
}
static void child_save_model(const char *dir) { checkpoint_save_model(dir, &g_layout, g_params, NULL); }
// a crash halfway through a save: the file size limit kills us (SIGXFSZ) during the write
static void child_crash_during_save(const char *dir) {
    struct rlimit lim = {1000, 1000};
    setrlimit(RLIMIT_FSIZE, &lim);
    checkpoint_save_model(dir, &g_layout, g_params, NULL);
}
// a failing write (disk full, say): with SIGXFSZ ignored the write returns EFBIG instead
static void child_write_error_during_save(const char *dir) {
    signal(SIGXFSZ, SIG_IGN);
    child_crash_during_save(dir);
}

// ---- the tests ---------------------------------------------------------------------------------

static int configs_equal(const GPTConfig *a, const GPTConfig *b) {
    return a->vocab_size == b->vocab_size && a->padded_vocab_size == b->padded_vocab_size &&
           a->n_layer == b->n_layer && a->n_head == b->n_head && a->n_embd == b->n_embd &&
           a->max_seq_len == b->max_seq_len;
}

// What our model.safetensors and config.json must look like to Hugging Face tools.
static void check_saved_format(const char *dir, const GPTConfig *cfg) {
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    RawFile r;
    raw_open(&r, path);
    CHECK(r.header != NULL, "header parses");
    CHECK((8 + r.header_len) % 8 == 0, "data starts 8-byte aligned (header %llu)", (unsigned long long)r.header_len);
    CHECK(cJSON_GetObjectItem(r.header, "lm_head.weight") == NULL, "no lm_head (tied)");
    const cJSON *meta = cJSON_GetObjectItem(r.header, "__metadata__");
    const cJSON *fmt = cJSON_GetObjectItem(meta, "format"), *run = cJSON_GetObjectItem(meta, "run_config");
    CHECK(cJSON_IsString(fmt) && !strcmp(fmt->valuestring, "pt"), "metadata format pt");
    CHECK(cJSON_IsString(run) && strstr(run->valuestring, "\"seed\""), "metadata run_config kept");
    int64_t shape[2];
    int ndim;
    float *v = raw_floats(&r, "transformer.h.0.attn.c_attn.weight", shape, &ndim);
    CHECK(v && ndim == 2 && shape[0] == cfg->n_embd && shape[1] == 3 * cfg->n_embd, "c_attn stored (in, out)");
    free(v);
    v = raw_floats(&r, "transformer.wte.weight", shape, &ndim);
    CHECK(v && shape[0] == cfg->vocab_size, "wte stored with V rows, not Vp");
    free(v);
    int all_f32 = 1;
    const cJSON *e;
    cJSON_ArrayForEach(e, r.header) if (strcmp(e->string, "__metadata__")) all_f32 &= !strcmp(cJSON_GetObjectItem(e, "dtype")->valuestring, "F32");
    CHECK(all_f32, "every tensor F32");
    raw_close(&r);

    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = read_file_or_die(path, NULL);
    cJSON *c = cJSON_Parse(text);
    free(text);
    const cJSON *arch = cJSON_GetArrayItem(cJSON_GetObjectItem(c, "architectures"), 0);
    CHECK(arch && !strcmp(arch->valuestring, "GPT2LMHeadModel"), "architectures");
    CHECK(!strcmp(cJSON_GetObjectItem(c, "model_type")->valuestring, "gpt2"), "model_type");
    CHECK(cJSON_GetObjectItem(c, "n_ctx")->valueint == cfg->max_seq_len, "n_ctx");
    CHECK(cJSON_GetObjectItem(c, "eos_token_id")->valueint == cfg->vocab_size - 1, "eos id");
    CHECK(cJSON_IsTrue(cJSON_GetObjectItem(c, "tie_word_embeddings")), "tied");
    CHECK(fabs(cJSON_GetObjectItem(c, "layer_norm_epsilon")->valuedouble - 1e-5) < 1e-15, "eps");
    CHECK(!strcmp(cJSON_GetObjectItem(c, "activation_function")->valuestring, "gelu_new"), "gelu_new");
    cJSON_Delete(c);
}

static void test_round_trip(void) {
    GPTConfig cfg = make_cfg(300, 16, 2, 2, 8);  // V=300 -> Vp=384: the padding rows matter
    ParamLayout l;
    gpt_layout(&l, &cfg);
    float *p = malloc_or_die(l.num_params * sizeof(float)), *q = malloc_or_die(l.num_params * sizeof(float));
    random_params(&l, p, 0.5f, 0);
    char dir[256], listing[512], file[300];
    snprintf(dir, sizeof dir, "%s/new/sub", make_temp_dir());  // out_dir does not exist yet
    checkpoint_save_model(dir, &l, p, "{\"seed\": 7}");
    list_dir(dir, listing, sizeof listing);
    CHECK(!strcmp(listing, "config.json,model.safetensors"), "files after save: %s", listing);
    check_saved_format(dir, &cfg);

    GPTConfig back;
    checkpoint_read_config(dir, &back);
    CHECK(configs_equal(&back, &cfg), "config round trip (V %d Vp %d L %d)", back.vocab_size,
          back.padded_vocab_size, back.n_layer);
    memset(q, 0xff, l.num_params * sizeof(float));  // NaN everywhere: every value must be written
    checkpoint_load_model(dir, &l, q);
    CHECK(!memcmp(p, q, l.num_params * sizeof(float)), "model round trip bit-identical");
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    CHECK(mismatches_vs_file(&l, p, file, 1) == 0, "saved bytes match an independent read");
    memset(q, 0, l.num_params * sizeof(float));
    checkpoint_load_model(file, &l, q);  // named by its file this time
    CHECK(!memcmp(p, q, l.num_params * sizeof(float)), "load by file name");
    checkpoint_read_config(file, &back);
    CHECK(configs_equal(&back, &cfg), "config beside the file");

    // optimizer state
    float *m = malloc_or_die(l.num_params * sizeof(float)), *v = malloc_or_die(l.num_params * sizeof(float));
    float *m2 = malloc_or_die(l.num_params * sizeof(float)), *v2 = malloc_or_die(l.num_params * sizeof(float));
    for (size_t i = 0; i < l.num_params; i++) m[i] = uniform(-1, 1), v[i] = uniform(0, 1e-3f);
    TrainState s = {.step = 1234, .seed = 0xdeadbeefcafebabeull}, s2 = {.step = 0};
    checkpoint_save_optimizer(dir, &l, m, v, &s);
    checkpoint_load_optimizer(dir, &l, m2, v2, &s2);
    CHECK(!memcmp(m, m2, l.num_params * sizeof(float)) && !memcmp(v, v2, l.num_params * sizeof(float)),
          "optimizer m, v bit-identical");
    CHECK(s2.step == 1234 && s2.seed == 0xdeadbeefcafebabeull, "train state: step %ld seed %llx", s2.step,
          (unsigned long long)s2.seed);
    // fp16's loss scaler rides in the same metadata; without one, has_loss_scale reads false
    CHECK(!s2.has_loss_scale, "a state saved without a loss scale reads one back");
    TrainState scaled = {.step = 7, .seed = 1, .has_loss_scale = true, .loss_scale = 32768.5,
                         .loss_scale_good_steps = 3, .loss_scale_skipped_steps = 2}, back_state;
    checkpoint_save_optimizer(dir, &l, m, v, &scaled);
    checkpoint_load_train_state(dir, &back_state);
    CHECK(back_state.has_loss_scale && back_state.loss_scale == 32768.5 && back_state.loss_scale_good_steps == 3 &&
          back_state.loss_scale_skipped_steps == 2 && back_state.step == 7,
          "loss scale state: %g %ld %ld", back_state.loss_scale, back_state.loss_scale_good_steps,
          back_state.loss_scale_skipped_steps);
    // a plug-in's extra tensor (stage 02's amax histories): back bit for bit; absent from a file saved
    // without it, where nothing is read
    float extra[6] = {0.5f, 3e-7f, 448.0f, 0, 1, 57344.0f}, extra_back[6] = {0};
    TrainState with_extra = {.step = 7, .seed = 1, .extra_name = "fp8_amax_history", .extra = extra,
                             .extra_rows = 2, .extra_cols = 3};
    CHECK(!checkpoint_load_optimizer_extra(dir, "fp8_amax_history", 2, 3, extra_back) && extra_back[0] == 0,
          "an extra tensor read from a file saved without one");
    checkpoint_save_optimizer(dir, &l, m, v, &with_extra);
    CHECK(checkpoint_load_optimizer_extra(dir, "fp8_amax_history", 2, 3, extra_back) &&
              !memcmp(extra, extra_back, sizeof extra),
          "the extra tensor is not back bit for bit");
    checkpoint_load_optimizer(dir, &l, m2, v2, &s2);
    CHECK(s2.step == 7 && !memcmp(m, m2, l.num_params * sizeof(float)), "the moments beside an extra tensor");
    expect_fatal("extra tensor of another shape", child_load_extra_of_other_shape, dir,
                 "optimizer.safetensors: tensor fp8_amax_history has shape [2, 3], expected [2, 4]", dir);
    list_dir(dir, listing, sizeof listing);
    CHECK(!strcmp(listing, "config.json,model.safetensors,optimizer.safetensors"), "files: %s", listing);

    // saving over an existing checkpoint
    random_params(&l, q, 0.5f, 0);
    checkpoint_save_model(dir, &l, q, NULL);
    checkpoint_load_model(dir, &l, p);
    CHECK(!memcmp(p, q, l.num_params * sizeof(float)), "overwrite then load");
    free(m), free(v), free(m2), free(v2), free(p), free(q);
    gpt_layout_free(&l);
}

// A crash in the middle of a save leaves the previous checkpoint under the real name.
static void test_atomic_save(void) {
    GPTConfig cfg = make_cfg(300, 16, 2, 2, 8);
    gpt_layout(&g_layout, &cfg);
    size_t bytes = g_layout.num_params * sizeof(float);
    float *old = malloc_or_die(bytes), *now = malloc_or_die(bytes);
    g_params = malloc_or_die(bytes);
    random_params(&g_layout, old, 0.5f, 0);
    const char *dir = make_temp_dir();
    char model[300], tmp[300], msg[2048];
    snprintf(model, sizeof model, "%s/model.safetensors", dir);
    snprintf(tmp, sizeof tmp, "%s/model.safetensors.tmp", dir);
    checkpoint_save_model(dir, &g_layout, old, NULL);

    random_params(&g_layout, g_params, 0.5f, 0);  // the save that crashes writes new weights
    int status = run_child(child_crash_during_save, dir, msg, sizeof msg);
    CHECK(status == 128 + SIGXFSZ, "the save was killed mid-write (status %d)", status);
    struct stat sb;
    CHECK(stat(tmp, &sb) == 0 && sb.st_size > 0 && sb.st_size <= 1000, "a partial temp file exists");
    checkpoint_load_model(dir, &g_layout, now);
    CHECK(!memcmp(old, now, bytes), "after the crash the real name still holds the old checkpoint");

    status = run_child(child_write_error_during_save, dir, msg, sizeof msg);
    CHECK(status == 1 && strstr(msg, "cannot write") && strstr(msg, tmp), "write error reported: %d %s", status, msg);
    CHECK(!file_exists(tmp), "a failed write removes its temp file");
    checkpoint_load_model(dir, &g_layout, now);
    CHECK(!memcmp(old, now, bytes), "after the write error the old checkpoint is intact");

    checkpoint_save_model(dir, &g_layout, g_params, NULL);  // a good save after all that
    checkpoint_load_model(dir, &g_layout, now);
    CHECK(!memcmp(g_params, now, bytes) && !file_exists(tmp), "a later save succeeds, no temp left");

    char blocker[300];
    snprintf(blocker, sizeof blocker, "%s/model.safetensors", dir);  // a file where a dir must go
    expect_fatal("out_dir is a file", child_save_model, blocker, "cannot create directory", blocker);
    free(old), free(now), free(g_params);
    gpt_layout_free(&g_layout);
}

// F16 and BF16 files, with and without the prefix, an lm_head, a missing tensor.
static void test_dtypes_and_names(void) {
    const uint16_t f16[] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00, 0x8000, 0x3555};
    const float f16_want[] = {1.0f, -2.0f, 65504.0f, 5.9604644775390625e-8f, INFINITY, -0.0f, 0.333251953125f};
    const uint16_t bf16[] = {0x3f80, 0xc020, 0x7f80, 0x0001};
    const float bf16_want[] = {1.0f, -2.5f, INFINITY, 9.18354961579912e-41f};
    float out[7];
    CHECK(safetensors_to_float(out, f16, "F16", 7) == 0, "F16 converts");
    for (int i = 0; i < 7; i++) CHECK(!memcmp(&out[i], &f16_want[i], 4), "F16 %04x -> %g, want %g", f16[i], out[i], f16_want[i]);
    CHECK(safetensors_to_float(out, bf16, "BF16", 4) == 0, "BF16 converts");
    for (int i = 0; i < 4; i++) CHECK(!memcmp(&out[i], &bf16_want[i], 4), "BF16 %04x -> %g", bf16[i], out[i]);
    CHECK(safetensors_to_float(out, f16, "I16", 1) == -1, "I16 is not a float type");

    GPTConfig cfg = make_cfg(200, 8, 2, 2, 8);
    gpt_layout(&g_layout, &cfg);
    size_t bytes = g_layout.num_params * sizeof(float);
    float *p = malloc_or_die(bytes);
    g_params = malloc_or_die(bytes);
    random_params(&g_layout, p, 0.9f, 1);
    const char *dir = make_temp_dir();
    char file[300];
    TestTensor t[64];
    const char *dtypes[] = {"F32", "F16", "BF16"};
    for (int d = 0; d < 3; d++)
        for (int prefix = 0; prefix < 2; prefix++) {
            snprintf(file, sizeof file, "%s/%s_%d.safetensors", dir, dtypes[d], prefix);
            int n = hf_tensors(t, &g_layout, p, dtypes[d], prefix);
            write_tensors(file, t, n, NULL);
            free_tensors(t, n);
            memset(g_params, 0xff, bytes);
            checkpoint_load_model(file, &g_layout, g_params);
            CHECK(!memcmp(p, g_params, bytes), "%s file, prefix %d: loads bit-identically", dtypes[d], prefix);
        }

    // lm_head: a copy of wte loads; a different one or a wrong shape does not
    int n = hf_tensors(t, &g_layout, p, "F32", 1);
    t[n] = t[0];
    snprintf(t[n].name, sizeof t[n].name, "lm_head.weight");
    snprintf(file, sizeof file, "%s/lm_head_same.safetensors", dir);
    write_tensors(file, t, n + 1, NULL);
    checkpoint_load_model(file, &g_layout, g_params);
    CHECK(!memcmp(p, g_params, bytes), "an lm_head equal to wte is accepted");
    unsigned char *other = malloc_or_die(t[0].nbytes);
    memcpy(other, t[0].data, t[0].nbytes);
    other[5] ^= 0x40;
    t[n].data = other;
    snprintf(file, sizeof file, "%s/lm_head_different.safetensors", dir);
    write_tensors(file, t, n + 1, NULL);
    expect_fatal("untied lm_head", child_load_model, file, file, "lm_head.weight differs");
    t[n].shape[0] = 10;
    t[n].nbytes = 10 * 8 * 4;
    snprintf(file, sizeof file, "%s/lm_head_shape.safetensors", dir);
    write_tensors(file, t, n + 1, NULL);
    expect_fatal("lm_head shape", child_load_model, file, "lm_head.weight has shape [10, 8], expected [200, 8]", file);
    free(other);

    // a missing tensor, and one of a type that is not floating point
    snprintf(file, sizeof file, "%s/missing.safetensors", dir);
    write_tensors(file, t + 2, n - 2, NULL);  // everything but wte and wpe
    expect_fatal("missing tensor", child_load_model, file, "transformer.wte.weight (or wte.weight) is missing", file);
    t[3].dtype = "I32";  // ln_f.bias
    snprintf(file, sizeof file, "%s/int.safetensors", dir);
    write_tensors(file, t, n, NULL);
    expect_fatal("int tensor", child_load_model, file, "transformer.ln_f.bias has dtype I32", file);
    free_tensors(t, n);
    free(p), free(g_params);
    gpt_layout_free(&g_layout);
}

// A saved model must not load into a model of another shape.
static void test_wrong_model_shape(void) {
    GPTConfig cfg = make_cfg(200, 8, 2, 2, 8);
    ParamLayout l;
    gpt_layout(&l, &cfg);
    float *p = calloc_or_die(l.num_params, sizeof(float));
    const char *dir = make_temp_dir();
    checkpoint_save_model(dir, &l, p, NULL);
    TrainState s = {.step = 5, .seed = 1};
    checkpoint_save_optimizer(dir, &l, p, p, &s);

    struct { GPTConfig cfg; const char *what, *needle; } cases[] = {
        {make_cfg(200, 8, 2, 2, 16), "n_embd", "transformer.wte.weight has shape [200, 8], expected [200, 16]"},
        {make_cfg(201, 8, 2, 2, 8), "vocab", "transformer.wte.weight has shape [200, 8], expected [201, 8]"},
        {make_cfg(200, 9, 2, 2, 8), "positions", "transformer.wpe.weight has shape [8, 8], expected [9, 8]"},
        {make_cfg(200, 8, 3, 2, 8), "more layers", "transformer.h.2.ln_1.weight (or h.2.ln_1.weight) is missing"},
        {make_cfg(200, 8, 1, 2, 8), "fewer layers", "belongs to block 1, but the configured model has n_layer 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        gpt_layout(&g_layout, &cases[i].cfg);
        g_params = calloc_or_die(g_layout.num_params, sizeof(float));
        expect_fatal(cases[i].what, child_load_model, dir, cases[i].needle, "model.safetensors");
        free(g_params);
        gpt_layout_free(&g_layout);
    }
    gpt_layout(&g_layout, &cases[3].cfg);  // more parameters than the optimizer file has
    expect_fatal("optimizer shape", child_load_optimizer, dir, "tensor m has shape [", "optimizer.safetensors");
    gpt_layout_free(&g_layout);
    free(p);
    gpt_layout_free(&l);
}

// Files that lie about themselves: each must end in one message naming the file.
static void test_hostile_files(void) {
    GPTConfig cfg = make_cfg(200, 8, 1, 2, 8);
    gpt_layout(&g_layout, &cfg);
    g_params = calloc_or_die(g_layout.num_params, sizeof(float));
    const char *dir = make_temp_dir();
    char f[300];
    snprintf(f, sizeof f, "%s/bad.safetensors", dir);

    write_bytes(f, "\x10\0\0\0\0", 5);
    expect_fatal("5-byte file", child_open, f, f, "truncated file: 5 bytes");
    write_bytes(f, "", 0);
    expect_fatal("empty file", child_load_model, f, f, "truncated file: 0 bytes");
    write_bytes(f, "\xe8\x03\0\0\0\0\0\0{\"a\":1}   ", 18);  // says 1000 header bytes, has 10
    expect_fatal("header length beyond the file", child_open, f, f, "header length 1000 is beyond the end of the file");
    write_bytes(f, "\0\0\0\0\0\0\0\x80{}", 10);  // 2^63
    expect_fatal("huge header length", child_open, f, f, "is beyond the end of the file");

    struct { const char *what, *header; size_t data; const char *needle; } cases[] = {
        {"not JSON", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offs", 0, "header is not valid JSON"},
        {"binary junk", "\x01\x02\xff\xfe", 0, "header is not valid JSON"},
        {"not an object", "[1, 2, 3]", 0, "header is JSON but not an object"},
        {"junk after the JSON", "{}  xyz", 0, "header has bytes after its JSON object"},
        {"out of range", "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8,
         "tensor 'w': data_offsets [0, 16] are out of range: the data section has only 8 bytes"},
        {"overlap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                    "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 24,
         "tensors 'a' [0, 16] and 'b' [8, 24] overlap"},
        {"size mismatch", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 12,
         "tensor 'w': data_offsets [0, 12] hold 12 bytes, but shape [2, 2] of F32 needs 16"},
        {"unknown dtype", "{\"w\":{\"dtype\":\"F12\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
         "tensor 'w': unknown dtype 'F12'"},
        {"no dtype", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "\"dtype\" is missing"},
        {"negative dim", "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
         "shape entry 0 is not a non-negative integer"},
        {"fractional dim", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4,
         "shape entry 0 is not a non-negative integer"},
        {"9 dims", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
         "\"shape\" must be an array of at most 8 sizes"},
        {"huge shape", "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", 4,
         "shape is impossibly large"},
        {"end before begin", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4,
         "\"data_offsets\" must be [begin, end]"},
        {"offsets not numbers", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[\"0\",4]}}", 4,
         "\"data_offsets\" must be [begin, end]"},
        {"duplicate name", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                           "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8,
         "tensor 'w' appears twice"},
        {"entry not an object", "{\"w\": 3}", 0, "tensor 'w': expected an object"},
        {"metadata not strings", "{\"__metadata__\":{\"step\":3}}", 0, "\"__metadata__\" entry 'step' is not a string"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_raw(f, cases[i].header, cases[i].data);
        expect_fatal(cases[i].what, child_open, f, f, cases[i].needle);
    }
    write_raw(f, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8);
    expect_fatal("out of range, through the model loader", child_load_model, f, f, "out of range");

    // a real checkpoint cut in half: its last tensors now end beyond the file
    size_t len;
    char *whole = read_file_or_die(FIX "/lm-buddy-tiny_gpt2/model.safetensors", &len);
    write_bytes(f, whole, len / 2);
    free(whole);
    expect_fatal("truncated real file", child_load_model, f, f, "(truncated file?)");
    expect_fatal("no such file", child_load_model, "/nonexistent/model.safetensors", "cannot open /nonexistent/model.safetensors", "No such file");
    expect_fatal("a directory without model.safetensors", child_load_model, dir, dir, "model.safetensors");
    free(g_params);
    gpt_layout_free(&g_layout);
}

static void test_hostile_configs(void) {
    const char *dir = make_temp_dir();
    char f[300];
    snprintf(f, sizeof f, "%s/config.json", dir);
    struct { const char *what, *json, *needle; } cases[] = {
        {"not JSON", "{\"n_embd\": 8,", "not a JSON object"},
        {"missing n_head", "{\"n_embd\": 8, \"n_layer\": 2, \"vocab_size\": 50, \"n_positions\": 16}", "missing key \"n_head\""},
        {"missing positions", "{\"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2, \"vocab_size\": 50}", "missing key \"n_positions\" (or \"n_ctx\")"},
        {"string n_layer", "{\"n_embd\": 8, \"n_layer\": \"2\", \"n_head\": 2, \"vocab_size\": 50, \"n_ctx\": 16}", "\"n_layer\" must be a positive integer, found a JSON string"},
        {"zero n_embd", "{\"n_embd\": 0, \"n_layer\": 2, \"n_head\": 2, \"vocab_size\": 50, \"n_ctx\": 16}", "\"n_embd\" must be a positive integer, found 0"},
        {"heads", "{\"n_embd\": 10, \"n_layer\": 2, \"n_head\": 3, \"vocab_size\": 50, \"n_ctx\": 16}", "n_embd 10 is not a multiple of n_head 3"},
        {"relu", "{\"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2, \"vocab_size\": 50, \"n_ctx\": 16, \"activation_function\": \"relu\"}", "\"activation_function\" must be \"gelu_new\""},
        {"n_inner", "{\"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2, \"vocab_size\": 50, \"n_ctx\": 16, \"n_inner\": 16}", "\"n_inner\" must be null or 4 * n_embd = 32"},
        {"eps", "{\"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2, \"vocab_size\": 50, \"n_ctx\": 16, \"layer_norm_epsilon\": 1e-6}", "\"layer_norm_epsilon\" must be 1e-5"},
        {"model type", "{\"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2, \"vocab_size\": 50, \"n_ctx\": 16, \"model_type\": \"gpt_neox\"}", "\"model_type\" must be \"gpt2\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_bytes(f, cases[i].json, strlen(cases[i].json));
        expect_fatal(cases[i].what, child_read_config, dir, f, cases[i].needle);
    }
    const char *old = "{\"n_embd\": 8, \"n_layer\": 2, \"n_head\": 2, \"vocab_size\": 50, \"n_ctx\": 16, \"n_inner\": null}";
    write_bytes(f, old, strlen(old));
    GPTConfig c;
    checkpoint_read_config(dir, &c);
    CHECK(c.max_seq_len == 16 && c.vocab_size == 50 && c.padded_vocab_size == 128, "n_ctx read as max_seq_len");
    // the reference checkpoint has no config.json beside it
    expect_fatal("no config beside the file", child_read_config, FIX "/reference/tiny_gpt2_C8_L2_H2.safetensors",
                 FIX "/reference/config.json: no such file", "beside its .safetensors file");

    // optimizer files with bad metadata
    GPTConfig cfg = make_cfg(50, 4, 1, 1, 4);
    gpt_layout(&g_layout, &cfg);
    float *z = calloc_or_die(g_layout.num_params, sizeof(float));
    TestTensor t[2] = {{.name = "m", .dtype = "F32", .ndim = 1, .shape = {(int64_t)g_layout.num_params, 0},
                        .data = (unsigned char *)z, .nbytes = g_layout.num_params * 4},
                       {.name = "v", .dtype = "F32", .ndim = 1, .shape = {(int64_t)g_layout.num_params, 0},
                        .data = (unsigned char *)z, .nbytes = g_layout.num_params * 4}};
    snprintf(f, sizeof f, "%s/optimizer.safetensors", dir);
    write_tensors(f, t, 2, "{\"step\":\"-3\",\"seed\":\"1\"}");
    expect_fatal("negative step", child_load_optimizer, dir, f, "\"step\" must be a whole number");
    write_tensors(f, t, 2, "{\"step\":\"3\"}");
    expect_fatal("no seed", child_load_optimizer, dir, f, "__metadata__ has no \"seed\"");
    write_tensors(f, t, 2, "{\"step\":\"3\",\"seed\":\"18446744073709551616\"}");
    expect_fatal("seed overflow", child_load_optimizer, dir, f, "\"seed\" must be a whole number");
    write_tensors(f, t, 1, "{\"step\":\"3\",\"seed\":\"1\"}");
    expect_fatal("no v", child_load_optimizer, dir, f, "tensor v is missing");
    free(z);
    gpt_layout_free(&g_layout);
}

// The real Hugging Face fixtures load, every value where an independent read says it must be.
static void test_fixtures(void) {
    GPTConfig c;
    checkpoint_read_config(FIX "/lm-buddy-fake_gpt2", &c);
    GPTConfig want = make_cfg(50257, 1024, 1, 1, 2);
    CHECK(configs_equal(&c, &want) && c.padded_vocab_size == 50304, "fake_gpt2 config (V %d Vp %d maxT %d)",
          c.vocab_size, c.padded_vocab_size, c.max_seq_len);
    ParamLayout l;
    gpt_layout(&l, &c);
    float *p = malloc_or_die(l.num_params * sizeof(float));
    memset(p, 0xff, l.num_params * sizeof(float));
    checkpoint_load_model(FIX "/lm-buddy-fake_gpt2", &l, p);
    CHECK(mismatches_vs_file(&l, p, FIX "/lm-buddy-fake_gpt2/model.safetensors", 1) == 0, "fake_gpt2 values");
    free(p);
    gpt_layout_free(&l);

    checkpoint_read_config(FIX "/lm-buddy-tiny_gpt2", &c);
    want = make_cfg(21, 1024, 1, 1, 2);
    CHECK(configs_equal(&c, &want) && c.padded_vocab_size == 128, "tiny_gpt2 config");
    gpt_layout(&l, &c);
    p = malloc_or_die(l.num_params * sizeof(float));
    memset(p, 0xff, l.num_params * sizeof(float));
    checkpoint_load_model(FIX "/lm-buddy-tiny_gpt2/model.safetensors", &l, p);
    CHECK(mismatches_vs_file(&l, p, FIX "/lm-buddy-tiny_gpt2/model.safetensors", 0) == 0, "tiny_gpt2 values (no prefix)");
    // one value by hand: c_attn.weight is (in 2, out 6) in the file, so our (out, in) element
    // [o=4][i=1] is the file's [1][4], the 11th float of that tensor
    RawFile r;
    raw_open(&r, FIX "/lm-buddy-tiny_gpt2/model.safetensors");
    int64_t shape[2];
    int nd;
    float *raw = raw_floats(&r, "h.0.attn.c_attn.weight", shape, &nd);
    const TensorInfo *c_attn = layout_tensor(&l, "transformer.h.0.attn.c_attn.weight");
    CHECK(raw && c_attn && p[c_attn->offset + 4 * 2 + 1] == raw[1 * 6 + 4], "c_attn [4][1] transposed");
    free(raw);
    raw_close(&r);
    free(p);
    gpt_layout_free(&l);
}

// ---- through the model: needs ops (the forward pass) ------------------------------------------

// Mean loss over B*T targets of a model held in host memory; logits (B*T, Vp) copied out if asked.
static double model_loss(const ParamLayout *l, const float *params, const int *x, const int *y, int B, int T,
                         float *logits) {
    const GPTConfig *cfg = &l->cfg;
    float *dev = dev_malloc(l->num_params * sizeof(float));
    copy_to_device(dev, params, l->num_params * sizeof(float));
    Weights w;
    weights_point(&w, l, dev);
    Activations a;
    acts_alloc(&a, cfg, B, T, 0);
    gpt_forward(&a, &w, x, B, T);
    copy_to_device(a.targets, y, (size_t)B * T * sizeof(int));
    double loss = gpt_loss_forward(&a, cfg, B, T) / (B * T);
    if (logits) copy_to_host(logits, a.logits, (size_t)B * T * cfg->padded_vocab_size * sizeof(float));
    acts_free(&a);
    weights_free(&w);
    dev_free(dev);
    return loss;
}

static int json_ints(const cJSON *arr, int *out, int max) {
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) if (n < max) out[n++] = e->valueint;
    return n;
}

static void check_logits(const cJSON *want8, const float *row, const char *what) {
    for (int i = 0; i < 8; i++) CHECK_CLOSE(row[i], cJSON_GetArrayItem(want8, i)->valuedouble, 1e-4, 1e-6, what);
}

// fake_gpt2_forward.json: the Hugging Face checkpoint on alpaca record 0, computed by PyTorch.
static void test_fake_gpt2_loss(void) {
    char *text = read_file_or_die(FIX "/reference/fake_gpt2_forward.json", NULL);
    cJSON *ref = cJSON_Parse(text);
    free(text);
    int x[256], y[256];
    int T = json_ints(cJSON_GetObjectItem(ref, "input_ids"), x, 256);
    json_ints(cJSON_GetObjectItem(ref, "targets"), y, 256);
    GPTConfig c;
    checkpoint_read_config(FIX "/lm-buddy-fake_gpt2", &c);
    ParamLayout l;
    gpt_layout(&l, &c);
    float *p = malloc_or_die(l.num_params * sizeof(float));
    checkpoint_load_model(FIX "/lm-buddy-fake_gpt2", &l, p);
    float *logits = malloc_or_die((size_t)T * c.padded_vocab_size * sizeof(float));
    double loss = model_loss(&l, p, x, y, 1, T, logits);
    CHECK_CLOSE(loss, cJSON_GetObjectItem(ref, "mean_loss")->valuedouble, 1e-5, 0, "fake_gpt2 loss on alpaca record 0");
    check_logits(cJSON_GetObjectItem(ref, "logits_first_pos_first8"), logits, "fake_gpt2 logits, first position");
    const float *last = logits + (size_t)(T - 1) * c.padded_vocab_size;
    check_logits(cJSON_GetObjectItem(ref, "logits_last_pos_first8"), last, "fake_gpt2 logits, last position");
    int argmax = 0;
    for (int v = 1; v < c.vocab_size; v++) argmax = last[v] > last[argmax] ? v : argmax;
    CHECK(argmax == cJSON_GetObjectItem(ref, "argmax_last_pos")->valueint, "argmax %d", argmax);
    free(logits), free(p);
    gpt_layout_free(&l);
    cJSON_Delete(ref);
}

// tiny_gpt2_train_step.json: the reference file has no config.json, so its shape comes from there.
static void test_reference_tiny_loss(void) {
    char *text = read_file_or_die(FIX "/reference/tiny_gpt2_train_step.json", NULL);
    cJSON *ref = cJSON_Parse(text);
    free(text);
    const cJSON *rc = cJSON_GetObjectItem(ref, "config");
    GPTConfig c = make_cfg(cJSON_GetObjectItem(rc, "vocab_size")->valueint, cJSON_GetObjectItem(rc, "n_positions")->valueint,
                           cJSON_GetObjectItem(rc, "n_layer")->valueint, cJSON_GetObjectItem(rc, "n_head")->valueint,
                           cJSON_GetObjectItem(rc, "n_embd")->valueint);
    ParamLayout l;
    gpt_layout(&l, &c);
    float *p = malloc_or_die(l.num_params * sizeof(float));
    const char *file = FIX "/reference/tiny_gpt2_C8_L2_H2.safetensors";
    checkpoint_load_model(file, &l, p);
    CHECK(mismatches_vs_file(&l, p, file, 1) == 0, "reference tiny values");
    int x[32], y[32];
    const cJSON *xs = cJSON_GetObjectItem(ref, "x"), *ys = cJSON_GetObjectItem(ref, "y");
    int T = json_ints(cJSON_GetArrayItem(xs, 0), x, 16);
    json_ints(cJSON_GetArrayItem(xs, 1), x + T, 16);
    json_ints(cJSON_GetArrayItem(ys, 0), y, 16);
    json_ints(cJSON_GetArrayItem(ys, 1), y + T, 16);
    float *logits = malloc_or_die((size_t)2 * T * c.padded_vocab_size * sizeof(float));
    double loss = model_loss(&l, p, x, y, 2, T, logits);
    CHECK_CLOSE(loss, cJSON_GetObjectItem(ref, "loss_before")->valuedouble, 1e-5, 0, "reference tiny loss");
    check_logits(cJSON_GetObjectItem(ref, "logits_b0_t0_first8"), logits, "reference tiny logits b0 t0");
    free(logits), free(p);
    gpt_layout_free(&l);
    cJSON_Delete(ref);
}

// ---- the helper for tests/test_checkpoint_oracle.sh -------------------------------------------

static int oracle_save(const char *dir) {
    GPTConfig cfg = make_cfg(1000, 64, 2, 4, 32);  // Vp 1024: padding rows exist
    ParamLayout l;
    gpt_layout(&l, &cfg);
    float *p = malloc_or_die(l.num_params * sizeof(float));
    random_params(&l, p, 0.3f, 0);
    checkpoint_save_model(dir, &l, p, "{\"note\": \"test_checkpoint --oracle-save\"}");
    enum { B = 2, T = 48 };  // T < max_seq_len: only wpe's first rows are used
    int x[B * T], y[B * T];
    for (int i = 0; i < B * T; i++) x[i] = (i * 37 + 11) % cfg.vocab_size, y[i] = (i * 101 + 5) % cfg.vocab_size;
    char path[512];
    snprintf(path, sizeof path, "%s/tokens.json", dir);
    FILE *f = fopen_or_die(path, "w");
    const char *key[2] = {"inputs", "targets"};
    const int *arr[2] = {x, y};
    fprintf(f, "{\"B\": %d, \"T\": %d", B, T);
    for (int k = 0; k < 2; k++) {
        fprintf(f, ", \"%s\": [", key[k]);
        for (int i = 0; i < B * T; i++) fprintf(f, "%s%d", i ? ", " : "", arr[k][i]);
        fprintf(f, "]");
    }
    fprintf(f, "}\n");
    fclose(f);
    ops_init();
    float *logits = malloc_or_die((size_t)B * T * cfg.padded_vocab_size * sizeof(float));
    printf("loss %.9g\nlogits_b1_tlast_first4", model_loss(&l, p, x, y, B, T, logits));
    const float *row = logits + (size_t)(B * T - 1) * cfg.padded_vocab_size;
    for (int i = 0; i < 4; i++) printf(" %.9g", row[i]);
    printf("\n");
    free(logits), free(p);
    gpt_layout_free(&l);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--oracle-save")) return oracle_save(argv[2]);
    test_round_trip();
    test_atomic_save();
    test_dtypes_and_names();
    test_wrong_model_shape();
    test_hostile_files();
    test_hostile_configs();
    test_fixtures();
    ops_init();
    test_fake_gpt2_loss();
    test_reference_tiny_loss();
    remove_temp_dirs();
    return test_summary("test_checkpoint");
}
