// test_optimizer.c: the optimizer step's scalar arithmetic (common/run/optimizer.c) against its
// definition written out here in double: the learning-rate schedule (linear warm-up, then cosine
// decay to min_lr at the last step) and the gradient-clipping factor. (AdamW's per-element update
// is test_ops's.)
#include <math.h>
#include <stdio.h>

#include "check.h"
#include "run/optimizer.h"

static double schedule(double lr, double min_lr, long warmup, long step, long total) {
    if (step < warmup) return lr * (double)(step + 1) / (double)warmup;
    if (total - warmup <= 1) return lr;
    double progress = fmin(1.0, (double)(step - warmup) / (double)(total - warmup - 1));
    return min_lr + 0.5 * (1.0 + cos(acos(-1.0) * progress)) * (lr - min_lr);
}

static void test_learning_rate(void) {
    Config cfg = {0};
    cfg.lr = 3e-3, cfg.min_lr = 3e-4, cfg.warmup_steps = 7;
    const long total = 40;
    char what[64];
    for (long step = 0; step < total; step++) {
        snprintf(what, sizeof what, "learning rate at step %ld of %ld", step, total);
        CHECK_CLOSE(learning_rate(&cfg, step, total), schedule(cfg.lr, cfg.min_lr, 7, step, total), 1e-12, 0, what);
    }
    CHECK_CLOSE(learning_rate(&cfg, 6, total), cfg.lr, 1e-12, 0, "the warm-up ends at lr");
    CHECK_CLOSE(learning_rate(&cfg, total - 1, total), cfg.min_lr, 1e-12, 0, "the last step is at min_lr");
    cfg.warmup_steps = 0;
    CHECK_CLOSE(learning_rate(&cfg, 0, total), cfg.lr, 1e-12, 0, "without warm-up, step 0 is at lr");
}

static void test_clip_factor(void) {
    CHECK_CLOSE(clip_factor(0.5, 1.0), 1.0, 0, 0, "a norm within max_norm is not clipped");
    CHECK_CLOSE(clip_factor(1.0, 1.0), 1.0, 0, 0, "a norm equal to max_norm is not clipped");
    CHECK_CLOSE(clip_factor(100.0, 0.0), 1.0, 0, 0, "max_norm 0 means no clipping");
    CHECK_CLOSE(clip_factor(4.0, 1.0), 0.25, 1e-6, 0, "norm 4 clipped to 1");
    CHECK_CLOSE(clip_factor(3.0, 0.5) * 3.0, 0.5, 1e-6, 0, "the clipped norm is max_norm");
    CHECK_CLOSE(clip_factor(1e30, 1.0), 1e-30, 1e-6, 0, "a huge norm");
}

int main(void) {
    test_learning_rate();
    test_clip_factor();
    return test_summary("test_optimizer");
}
