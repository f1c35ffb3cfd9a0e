// http_head.c: a request's head, checked as its bytes come (check_head), then read (read_head).
// Every request on a connection passes both, its first or a later one (keep-alive, pipelined): a
// head that is not HTTP/1.x gets OpenAI's error object and ends its connection, as the framing
// of whatever follows it is unknown.
#include "http_head.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static bool is_token_char(unsigned char c) {  // RFC 9110's tchar
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

// a Content-Length's value: one or more digits (400), at most MAX_BODY (413); *bytes its number
static bool content_length_ok(const char *v, size_t n, size_t *bytes, ApiError *e) {
    unsigned long long b = 0;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9')
            return api_fail(e, 400, NULL, "invalid_content_length", "Content-Length is not a number of bytes "
                            "(a digit expected at its byte %zu)", i);
        if (b <= MAX_BODY) b = b * 10 + (unsigned long long)(v[i] - '0');
    }
    if (n == 0) return api_fail(e, 400, NULL, "invalid_content_length", "Content-Length is empty");
    if (b > MAX_BODY)
        return api_fail(e, 413, NULL, "body_too_large", "the body is %.*s bytes, over %d", n < 40 ? (int)n : 40, v,
                        MAX_BODY);
    *bytes = (size_t)b;
    return true;
}

// the request line, or as much of it as has come: METHOD SP target SP HTTP/d.d (RFC 9112 3); an
// HTTP major version other than 1 is 505
static bool request_line_ok(const char *l, size_t n, bool whole, ApiError *e) {
    static const char version[] = "HTTP/d.d";
    int part = 0;  // the method, the target, the version
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)l[i];
        if (c == ' ' && part < 2 && len > 0) {
            part++;
            len = 0;
            continue;
        }
        bool ok = part == 0 ? is_token_char(c) : part == 1 ? c > ' ' && c < 0x7F
                  : len < 8 && (version[len] == 'd' ? c >= '0' && c <= '9' : c == (unsigned char)version[len]);
        if (!ok)
            return api_fail(e, 400, NULL, "invalid_request_line", "the request line is malformed at its byte %zu: "
                            "expected METHOD /path HTTP/1.1", i);
        if (part == 2 && len == 5 && c != '1')
            return api_fail(e, 505, NULL, "http_version_not_supported", "HTTP/%c.x is not supported: this server "
                            "speaks HTTP/1.1 and 1.0", c);
        len++;
    }
    if (whole && (part < 2 || len < 8))
        return api_fail(e, 400, NULL, "invalid_request_line", "the request line is malformed: expected METHOD "
                        "/path HTTP/1.1");
    return true;
}

// whether header line l[0..n) is named `name` (case-insensitive); *value: where its value begins
static bool header_is(const char *l, size_t n, const char *name, size_t *value) {
    size_t k = strlen(name);
    if (n <= k || l[k] != ':' || strncasecmp(l, name, k) != 0) return false;
    for (k++; k < n && (l[k] == ' ' || l[k] == '\t'); k++) {}
    *value = k;
    return true;
}

// header line k, or as much of it as has come: Name: value, the name a token, the value without
// control characters but tab (a NUL would cut it short); a line that starts with whitespace
// continues the one before (obs-fold); a Content-Length of digits
static bool header_line_ok(const char *l, size_t n, bool whole, int k, ApiError *e) {
    size_t i = 0, value, bytes;
    bool folded = k > 1 && n > 0 && (l[0] == ' ' || l[0] == '\t');
    if (!folded) {
        while (i < n && is_token_char((unsigned char)l[i])) i++;
        if (i < n ? l[i] != ':' || i == 0 : whole)
            return api_fail(e, 400, NULL, "invalid_header", "header line %d is malformed: expected Name: value", k);
    }
    for (size_t j = i; j < n; j++)
        if (((unsigned char)l[j] < ' ' && l[j] != '\t') || l[j] == 0x7F)
            return api_fail(e, 400, NULL, "invalid_header", "header line %d has the control character 0x%02x", k,
                            (unsigned char)l[j]);
    if (!whole || folded || !header_is(l, n, "Content-Length", &value)) return true;
    return content_length_ok(l + value, n - value, &bytes, e);
}

// the next line of p[0..n) from *i: its length without CR LF (*len); false when no LF ends it
// yet (*len: what has come); *i then points past it
static bool next_line(const char *p, size_t n, size_t *i, size_t *len) {
    const char *eol = memchr(p + *i, '\n', n - *i);
    *len = (eol ? (size_t)(eol - p) : n) - *i;
    if (eol && *len > 0 && p[*i + *len - 1] == '\r') (*len)--;
    if (eol) *i = (size_t)(eol - p) + 1;
    return eol != NULL;
}

// the empty lines before a request line (RFC 9112 2.2 allows them)
static size_t skip_empty_lines(const char *p, size_t n) {
    size_t i = 0;
    while (i < n && (p[i] == '\r' || p[i] == '\n')) i++;
    return i;
}

HeadCheck check_head(const char *p, size_t n, size_t *head_len, ApiError *e) {
    size_t i = skip_empty_lines(p, n), len;
    int k = 0;
    for (;; k++) {
        size_t start = i;
        bool whole = next_line(p, n, &i, &len);
        if (whole && len == 0 && k > 0) {
            *head_len = i;
            return HEAD_OK;
        }
        if (!(k == 0 ? request_line_ok(p + start, len, whole, e) : header_line_ok(p + start, len, whole, k, e)))
            return HEAD_BAD;
        if (!whole) break;
    }
    if (n <= MAX_HEADER_BYTES) return HEAD_PARTIAL;
    if (k == 0) api_fail(e, 414, NULL, "uri_too_long", "the request line is over %d bytes", MAX_HEADER_BYTES);
    else api_fail(e, 431, NULL, "headers_too_large", "the request line and headers are over %d bytes", MAX_HEADER_BYTES);
    return HEAD_BAD;
}

static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

// the target t[0..n) as a path: up to its query ('?'), %XX decoded, cut to fit
static void read_path(const char *t, size_t n, char *path, size_t size) {
    size_t o = 0;
    for (size_t i = 0; i < n && t[i] != '?' && o + 1 < size; i++) {
        int hi = i + 2 < n ? hex_digit(t[i + 1]) : -1, lo = i + 2 < n ? hex_digit(t[i + 2]) : -1;
        if (t[i] == '%' && hi >= 0 && lo >= 0) {
            path[o++] = (char)(hi * 16 + lo);
            i += 2;
        } else {
            path[o++] = t[i];
        }
    }
    path[o] = '\0';
}

// whether the comma-separated list v[0..n) holds `token` (case-insensitive)
static bool list_has(const char *v, size_t n, const char *token) {
    size_t k = strlen(token);
    for (size_t i = 0; i < n;) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ',')) i++;
        size_t j = i;
        while (j < n && v[j] != ',') j++;
        size_t end = j;
        while (end > i && (v[end - 1] == ' ' || v[end - 1] == '\t')) end--;
        if (end - i == k && strncasecmp(v + i, token, k) == 0) return true;
        i = j;
    }
    return false;
}

// the request line: its method, path and version (check_head has found it right)
static void read_request_line(const char *l, size_t n, RequestHead *h) {
    const char *sp1 = memchr(l, ' ', n), *sp2 = memchr(sp1 + 1, ' ', n - (size_t)(sp1 + 1 - l));
    snprintf(h->method, sizeof h->method, "%.*s", (int)(sp1 - l), l);
    read_path(sp1 + 1, (size_t)(sp2 - sp1 - 1), h->path, sizeof h->path);
    h->http10 = l + n - sp2 - 1 == 8 && memcmp(sp2 + 1, "HTTP/1.0", 8) == 0;
}

bool read_head(const char *p, size_t head_len, RequestHead *h, ApiError *e) {
    *h = (RequestHead){0};
    size_t i = skip_empty_lines(p, head_len), len, value, bytes;
    size_t start = i;
    next_line(p, head_len, &i, &len);
    read_request_line(p + start, len, h);
    int hosts = 0, lengths = 0;
    bool lengths_differ = false;
    const char *coding = NULL;
    size_t coding_len = 0;
    for (start = i; next_line(p, head_len, &i, &len) && len > 0; start = i) {
        const char *l = p + start;
        if (header_is(l, len, "Host", &value)) hosts++;
        if (header_is(l, len, "Content-Length", &value)) {
            content_length_ok(l + value, len - value, &bytes, e);  // check_head has checked it
            lengths_differ |= lengths++ && bytes != h->body_len;
            h->body_len = bytes;
        }
        if (header_is(l, len, "Transfer-Encoding", &value)) coding = l + value, coding_len = len - value;
        if (header_is(l, len, "Connection", &value)) h->close |= list_has(l + value, len - value, "close");
        if (header_is(l, len, "Expect", &value)) h->expect_continue |= list_has(l + value, len - value, "100-continue");
    }
    if (!h->http10 && hosts != 1)
        return api_fail(e, 400, NULL, "invalid_host", "an HTTP/1.1 request must have one Host header, this one has %d",
                        hosts);
    if (lengths_differ) return api_fail(e, 400, NULL, "invalid_content_length", "two Content-Length headers disagree");
    if (coding && list_has(coding, coding_len, "chunked"))
        return api_fail(e, 411, NULL, "length_required", "a body in chunks is not taken: send its Content-Length");
    if (coding)
        return api_fail(e, 501, NULL, "unsupported_transfer_encoding", "Transfer-Encoding '%.*s' is not supported: "
                        "send the body as it is, with its Content-Length", coding_len < 64 ? (int)coding_len : 64, coding);
    return true;
}
