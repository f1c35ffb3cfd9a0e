// http_head.h: a request's head (http_head.c): checked as its bytes come, then read into the
// fields the server acts on. Every request on a connection passes both (http.c).
#ifndef HTTP_HEAD_H
#define HTTP_HEAD_H

#include <stdbool.h>
#include <stddef.h>

#include "openai.h"

// the limits of a request (README.md, "Limits"): its request line and headers, its body
enum { MAX_HEADER_BYTES = 16 << 10, MAX_BODY = 1 << 20 };

typedef enum { HEAD_PARTIAL, HEAD_OK, HEAD_BAD } HeadCheck;

// The head at the start of p[0..n) (n at most MAX_HEADER_BYTES + 1 of the bytes come): HEAD_OK
// and its length (*head_len: up to its empty line, included) once it is whole and right;
// HEAD_PARTIAL while what has come is right so far; HEAD_BAD and the error (400, 413, 414, 431, 505).
HeadCheck check_head(const char *p, size_t n, size_t *head_len, ApiError *e);

typedef struct {
    char method[32];
    char path[1024];      // the target without its query, percent-decoded (cut short: no route has one so long)
    bool http10;          // HTTP/1.0: its connection ends with the answer
    bool close;           // Connection: close
    bool expect_continue; // Expect: 100-continue: the client waits for a 100 before it sends the body
    size_t body_len;      // Content-Length (0: none)
} RequestHead;

// the fields of a head check_head found right (p[0..head_len)), or false and the error that HTTP
// (RFC 9112) gives the rest: an HTTP/1.1 request without one Host, Content-Lengths that disagree
// (400), a body in chunks (411), another transfer coding (501)
bool read_head(const char *p, size_t head_len, RequestHead *h, ApiError *e);

#endif
