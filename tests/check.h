// check.h: the smallest test harness that can fail. Each CHECK prints a line only when it fails
// (with file:line and the values), every check is counted, and test_summary() prints
// "<name>: N passed, N failed" and returns the exit code. tests/run.sh adds the counts up.
#ifndef CHECK_H
#define CHECK_H

#include <math.h>
#include <stdio.h>

static int check_passed_ = 0, check_failed_ = 0;

#define CHECK(cond, ...)                                                         \
    do {                                                                         \
        if (cond) {                                                              \
            check_passed_++;                                                     \
        } else {                                                                 \
            check_failed_++;                                                     \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);      \
            fprintf(stderr, __VA_ARGS__);                                        \
            fputc('\n', stderr);                                                 \
        }                                                                        \
    } while (0)

// |got - want| <= rtol * |want| + atol
#define CHECK_CLOSE(got, want, rtol, atol, what)                                       \
    do {                                                                               \
        double g_ = (double)(got), w_ = (double)(want);                                \
        CHECK(fabs(g_ - w_) <= (rtol) * fabs(w_) + (atol), "%s: got %.9g, want %.9g", \
              (what), g_, w_);                                                         \
    } while (0)

static inline int test_summary(const char *name) {
    printf("%s: %d passed, %d failed\n", name, check_passed_, check_failed_);
    return check_failed_ ? 1 : 0;
}

#endif
