// test_llama.c: the Llama architecture's own ops, and our side of tests/test_llama_oracle.sh.
//
// Without arguments: grouped-query attention's reduce is its expand's transpose (<E p, y> =
// <p, R y>) and the expand gives query head h the key/value head h / group; RMSNorm and SwiGLU
// against double-precision references, their backwards against central differences of those;
// Llama 3's rope_scaling frequencies against transformers' formula in double precision, in all
// three of its wavelength ranges.
//
// `test_llama --oracle DIR`: tests/oracle_step.h, for tests/oracle_llama.py.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/device.h"
#include "check.h"
#include "inputs.h"
#include "ops/kernels.h"
#include "ops/ops.h"
#include "oracle_step.h"

static float *random_floats(size_t n, double scale) {
    float *x = calloc_or_die(n, sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = (float)((uniform() * 2 - 1) * scale);
    return x;
}

static double dotf(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

static void test_gqa(void) {
    enum { N = 3, NH = 6, NKV = 2, HS = 4, CA = NH * HS, W = CA + 2 * NKV * HS };
    float *p = random_floats((size_t)N * W, 1), *y = random_floats((size_t)N * 3 * CA, 1);
    float *e = calloc_or_die((size_t)N * 3 * CA, sizeof(float)), *r = calloc_or_die((size_t)N * W, sizeof(float));
    gqa_expand(e, p, N, CA, NH, NKV);
    gqa_reduce(r, y, N, CA, NH, NKV);
    CHECK_CLOSE(dotf(e, y, (size_t)N * 3 * CA), dotf(p, r, (size_t)N * W), 1e-5, 1e-5, "<E p, y> = <p, R y>");
    int wrong = 0;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < HS; i++) {
                const float *pr = p + (size_t)n * W, *er = e + (size_t)n * 3 * CA;
                int kv = h / (NH / NKV);
                wrong += er[h * HS + i] != pr[h * HS + i];
                wrong += er[CA + h * HS + i] != pr[CA + kv * HS + i];
                wrong += er[2 * CA + h * HS + i] != pr[CA + NKV * HS + kv * HS + i];
            }
    CHECK(wrong == 0, "query head h reads key and value head h / group (%d elements wrong)", wrong);
    free(p), free(y), free(e), free(r);
}

// the reference RMSNorm of one row, and the loss sum(dout * out) whose gradient backward gives
static double ref_rmsnorm_loss(const float *x, const float *w, const float *dout, int C, double eps) {
    double ss = 0, loss = 0;
    for (int c = 0; c < C; c++) ss += (double)x[c] * x[c];
    double r = 1 / sqrt(ss / C + eps);
    for (int c = 0; c < C; c++) loss += dout[c] * x[c] * r * w[c];
    return loss;
}

static void test_rmsnorm(void) {
    enum { N = 4, C = 37 };
    const float eps = 1e-5f;
    float *x = random_floats(N * C, 2), *w = random_floats(C, 1), *dout = random_floats(N * C, 1);
    float out[N * C], rstd[N], dx[N * C] = {0}, dw[C] = {0};
    rmsnorm_forward(out, rstd, x, w, N, C, eps);
    rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C);
    double worst = 0, worst_dx = 0, worst_dw = 0, h = 1e-3;
    for (int n = 0; n < N; n++) {
        float *xr = x + n * C;
        double ss = 0;
        for (int c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
        for (int c = 0; c < C; c++) {
            double want = xr[c] / sqrt(ss / C + eps) * w[c];
            worst = fmax(worst, fabs(out[n * C + c] - want));
            float keep = xr[c];
            xr[c] = keep + (float)h;
            double up = ref_rmsnorm_loss(xr, w, dout + n * C, C, eps);
            xr[c] = keep - (float)h;
            double down = ref_rmsnorm_loss(xr, w, dout + n * C, C, eps);
            xr[c] = keep;
            double fd = (up - down) / (((double)(keep + (float)h)) - ((double)(keep - (float)h)));
            worst_dx = fmax(worst_dx, fabs(dx[n * C + c] - fd) / (fabs(fd) + 1e-2));
        }
    }
    for (int c = 0; c < C; c++) {
        double want = 0;
        for (int n = 0; n < N; n++) want += dout[n * C + c] * out[n * C + c] / w[c];
        worst_dw = fmax(worst_dw, fabs(dw[c] - want) / (fabs(want) + 1e-2));
    }
    CHECK(worst < 1e-5, "RMSNorm forward = x / sqrt(mean(x^2) + eps) * w (largest gap %g)", worst);
    CHECK(worst_dx < 1e-3, "RMSNorm dinp = central differences (largest relative gap %g)", worst_dx);
    CHECK(worst_dw < 1e-4, "RMSNorm dweight = sum of dout * x * rstd (largest relative gap %g)", worst_dw);
    free(x), free(w), free(dout);
}

static double ref_silu(double x) { return x / (1 + exp(-x)); }

static void test_swiglu(void) {
    enum { N = 3, F = 11 };
    float *gu = random_floats(N * 2 * F, 4), *dh = random_floats(N * F, 1);
    float h[N * F], dgu[N * 2 * F] = {0};
    swiglu_forward(h, gu, N, F);
    swiglu_backward(dgu, gu, dh, N, F);
    double worst = 0, worst_d = 0, e = 1e-3;
    for (int n = 0; n < N; n++)
        for (int f = 0; f < F; f++) {
            double g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f], d = dh[n * F + f];
            worst = fmax(worst, fabs(h[n * F + f] - ref_silu(g) * u));
            double dg = d * u * (ref_silu(g + e) - ref_silu(g - e)) / (2 * e), du = d * ref_silu(g);
            worst_d = fmax(worst_d, fabs(dgu[n * 2 * F + f] - dg) / (fabs(dg) + 1e-2));
            worst_d = fmax(worst_d, fabs(dgu[n * 2 * F + F + f] - du) / (fabs(du) + 1e-2));
        }
    CHECK(worst < 1e-5, "SwiGLU = silu(gate) * up (largest gap %g)", worst);
    CHECK(worst_d < 1e-4, "SwiGLU's gradient = the derivative of silu(gate) * up (largest relative gap %g)", worst_d);
    free(gu), free(dh);
}

// transformers' _compute_llama3_parameters for one frequency, in double precision
static double ref_llama3_inv_freq(int i, int dim, double theta, double factor, double low, double high, double orig) {
    double inv_freq = 1 / pow(theta, 2.0 * i / dim), wavelen = 2 * 3.14159265358979323846 / inv_freq;
    if (wavelen > orig / low) return inv_freq / factor;
    if (wavelen < orig / high) return inv_freq;
    double smooth = (orig / wavelen - low) / (high - low);
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq;
}

static void test_llama3_rope(void) {
    Rope rope = {.theta = 500000, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                 .original_max_positions = 8192};
    int ranges[3] = {0};  // frequencies kept, blended, divided by factor
    double worst = 0;
    for (int i = 0; i < 64; i++) {
        double want = ref_llama3_inv_freq(i, 128, 500000, 8, 1, 4, 8192);
        double plain = 1 / pow(500000, 2.0 * i / 128);
        ranges[want == plain ? 0 : fabs(want - plain / 8) < 1e-12 * plain ? 2 : 1]++;
        worst = fmax(worst, fabs(rope_inv_freq(i, 128, rope) - want) / want);
    }
    CHECK(ranges[0] && ranges[1] && ranges[2], "Llama 3.1's frequencies fall in all three ranges (%d kept, %d "
          "blended, %d divided)", ranges[0], ranges[1], ranges[2]);
    CHECK(worst < 1e-5, "Llama 3 rope_scaling's frequencies = transformers' formula (largest relative gap %g)", worst);
}

int main(int argc, char **argv) {
    ops_init();
    if (argc == 3 && strcmp(argv[1], "--oracle") == 0) return run_oracle(argv[2]);
    test_gqa();
    test_rmsnorm();
    test_swiglu();
    test_llama3_rope();
    return test_summary("test_llama");
}
