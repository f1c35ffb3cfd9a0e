// buf.c: the server's growable byte buffer (scheduler.h's Buf), which the HTTP side, the
// scheduler and the chat templates append to
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "scheduler.h"

void buf_append(Buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        char *grown = realloc(b->p, b->cap);
        if (!grown) fatal("out of memory in the server");
        b->p = grown;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void buf_printf(Buf *b, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    buf_append(b, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}
