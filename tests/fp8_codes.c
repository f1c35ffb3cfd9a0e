// fp8_codes: tests/test_fp8.sh's program. Runs common/base/numbers.h's FP8 functions on raw binary
// from standard input to standard output, so that the test can hold them to ml_dtypes:
//   fp8_codes encode e4m3|e5m2 [saturate]   float32 values -> one byte each
//   fp8_codes decode e4m3|e5m2              bytes -> float32 values
//   fp8_codes scale e4m3|e5m2               amax (float32) -> fp8_scale (float32)
//   fp8_codes mx_scale e4m3|e5m2            amax (float32) -> mx_scale_e8m0 (one byte)
#include <stdio.h>
#include <string.h>

#include "base/numbers.h"

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[2], "e4m3") != 0 && strcmp(argv[2], "e5m2") != 0)) {
        fprintf(stderr, "usage: fp8_codes encode|decode|scale|mx_scale e4m3|e5m2 [saturate] <in >out\n");
        return 2;
    }
    Fp8Format f = strcmp(argv[2], "e5m2") == 0 ? FP8_E5M2 : FP8_E4M3;
    const char *mode = argv[1];
    int saturate = argc > 3 && strcmp(argv[3], "saturate") == 0;
    if (strcmp(mode, "decode") == 0) {
        int b;
        while ((b = getchar()) != EOF) {
            float x = fp8_to_float((uint8_t)b, f);
            fwrite(&x, sizeof x, 1, stdout);
        }
        return 0;
    }
    float x;
    while (fread(&x, sizeof x, 1, stdin) == 1) {
        if (strcmp(mode, "scale") == 0) {
            float s = fp8_scale(x, f);
            fwrite(&s, sizeof s, 1, stdout);
        } else {
            putchar(strcmp(mode, "mx_scale") == 0 ? mx_scale_e8m0(x, f) : fp8_from_float(x, f, saturate));
        }
    }
    return 0;
}
