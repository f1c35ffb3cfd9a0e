// buf.c: the server's growable byte buffer (scheduler.h's Buf), which the HTTP side, the
// scheduler and the chat templates append to
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
