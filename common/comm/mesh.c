// mesh.c: see mesh.h.
#define _POSIX_C_SOURCE 200809L  // gethostname
#include "mesh.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"

const char *const MESH_NAMES[MESH_DIMS] = {[MESH_PP] = "pp", [MESH_DP] = "dp", [MESH_EP] = "ep", [MESH_CP] = "cp",
                                           [MESH_TP] = "tp"};

// ---- the description --------------------------------------------------------------------------

static int dimension_named(const char *name, size_t len) {
    for (int d = 0; d < MESH_DIMS; d++)
        if (strlen(MESH_NAMES[d]) == len && strncmp(name, MESH_NAMES[d], len) == 0) return d;
    return -1;
}

// "ep 1 x cp 1 x tp 4": the dimensions inside d but dp, whose size is what the others leave
static void describe_inside(int d, const int size[MESH_DIMS], char *out, size_t n) {
    size_t used = 0;
    out[0] = '\0';
    for (int e = d + 1; e < MESH_DIMS && used < n; e++)
        if (e != MESH_DP)
            used += (size_t)snprintf(out + used, n - used, "%s%s %d", used ? " x " : "", MESH_NAMES[e], size[e]);
}

bool mesh_fits(const int size[MESH_DIMS], int ranks, char *why, size_t why_size) {
    for (int d = 0; d < MESH_DIMS; d++)
        if (size[d] < 1) {
            snprintf(why, why_size, "dimension '%s': expected a size of at least 1, found %d", MESH_NAMES[d], size[d]);
            return false;
        }
    // innermost first: each dimension must divide what the ones inside it leave of the ranks
    int left = ranks;
    for (int d = MESH_DIMS - 1; d >= 0; d--) {
        if (d == MESH_DP) continue;
        if (left % size[d] != 0) {
            if (left == ranks)
                snprintf(why, why_size, "dimension '%s' is %d, which does not divide the %d ranks", MESH_NAMES[d],
                         size[d], ranks);
            else {
                char inside[96];
                describe_inside(d, size, inside, sizeof inside);
                snprintf(why, why_size, "dimension '%s' is %d, which does not divide %d: the %d ranks over the "
                         "dimensions inside it (%s)", MESH_NAMES[d], size[d], left, ranks, inside);
            }
            return false;
        }
        left /= size[d];
    }
    if (size[MESH_DP] != left) {
        snprintf(why, why_size, "dimension 'dp' is %d, expected %d: the %d ranks over pp %d x ep %d x cp %d x tp %d "
                 "leave %d replicas", size[MESH_DP], left, ranks, size[MESH_PP], size[MESH_EP], size[MESH_CP],
                 size[MESH_TP], left);
        return false;
    }
    return true;
}

bool mesh_parse(const char *text, int ranks, int size[MESH_DIMS], char *why, size_t why_size) {
    bool named[MESH_DIMS] = {false};
    for (int d = 0; d < MESH_DIMS; d++) size[d] = 1;
    for (const char *p = text; *p;) {
        int len = (int)strcspn(p, ",");
        const char *eq = memchr(p, '=', (size_t)len);
        int d = eq ? dimension_named(p, (size_t)(eq - p)) : -1;
        if (d < 0) {
            snprintf(why, why_size, "'%.*s': expected <dimension>=<size>, the dimension pp, dp, ep, cp or tp", len, p);
            return false;
        }
        if (named[d]) {
            snprintf(why, why_size, "dimension '%s' is given twice", MESH_NAMES[d]);
            return false;
        }
        char *end;
        long v = strtol(eq + 1, &end, 10);
        if (end == eq + 1 || end != p + len || v < 1 || v > INT_MAX) {
            snprintf(why, why_size, "dimension '%s': expected a whole number of at least 1, found '%.*s'",
                     MESH_NAMES[d], (int)(p + len - eq - 1), eq + 1);
            return false;
        }
        size[d] = (int)v;
        named[d] = true;
        p += len + (p[len] == ',');
    }
    if (!named[MESH_DP]) {  // the replicas the others leave, when they leave a whole number
        long others = (long)size[MESH_PP] * size[MESH_EP] * size[MESH_CP] * size[MESH_TP];
        if (ranks % others == 0) size[MESH_DP] = (int)(ranks / others);
    }
    return mesh_fits(size, ranks, why, why_size);
}

// ---- the groups -------------------------------------------------------------------------------

Comm *mesh_group(const Mesh *m, unsigned along, const char *name) {
    // the colour: the group's first rank, this one with its coordinates along the set at 0
    int color = m->rank;
    for (int d = 0; d < MESH_DIMS; d++)
        if (along & MESH_ALONG(d)) color -= m->coord[d] * m->stride[d];
    return comm_split(m->world, color, m->rank, name);
}

// Whether each dimension's groups stay on one host: every rank's host name hashed to a number a
// double holds exactly, its least and greatest over the group compared (a hash collision could
// only hide a crossing, never invent one).
static void find_hosts(Mesh *m) {
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    double id = (double)(hash_bytes(host, strlen(host)) >> 12);
    for (int d = 0; d < MESH_DIMS; d++) {
        bool within = comm_max_double(m->group[d], id) == -comm_max_double(m->group[d], -id);
        m->one_host[d] = comm_max_double(m->world, within ? 0 : 1) == 0;
    }
}

void mesh_init(Mesh *m, Comm *world, const int size[MESH_DIMS], const char *source) {
    char why[320];
    if (!mesh_fits(size, comm_size(world), why, sizeof why)) fatal("%s: mesh: %s", source, why);
    *m = (Mesh){.rank = comm_rank(world), .ranks = comm_size(world), .world = world};
    int stride = 1;
    for (int d = MESH_DIMS - 1; d >= 0; d--) {  // innermost first
        m->size[d] = size[d];
        m->stride[d] = stride;
        m->coord[d] = m->rank / stride % size[d];
        stride *= size[d];
    }
    for (int d = 0; d < MESH_DIMS; d++) m->group[d] = mesh_group(m, MESH_ALONG(d), MESH_NAMES[d]);
    find_hosts(m);
}

void print_mesh_plan(const Mesh *m) {
    if (m->rank != 0) return;
    const int *s = m->size;
    printf("mesh: pp %d x dp %d x ep %d x cp %d x tp %d = %d ranks; rank = (((p x %d + d) x %d + e) x %d + c) x %d + t "
           "for coordinates p, d, e, c, t\n", s[MESH_PP], s[MESH_DP], s[MESH_EP], s[MESH_CP], s[MESH_TP], m->ranks,
           s[MESH_DP], s[MESH_EP], s[MESH_CP], s[MESH_TP]);
    printf("mesh order, outermost first: pp, dp, ep, cp, tp. Tensor parallelism is innermost, its ranks consecutive "
           "on one host, because it moves activations in every layer, forward and backward, on the critical path; "
           "then cp (keys and values around a ring every layer), ep (two all-to-alls per MoE block), dp (the "
           "gradients once a step, overlapped with backward); pp is outermost: activations point to point at the "
           "stages' edges only\n");
    printf("mesh hosts:");
    for (int d = MESH_DIMS - 1; d >= 0; d--)
        if (s[d] > 1) printf(" %s %s;", MESH_NAMES[d], m->one_host[d] ? "within one host" : "across hosts");
    printf("%s\n", m->one_host[MESH_TP] ? "" : " tp groups cross hosts, so every layer's collectives go over the "
                                               "network: a tp no larger than a host's ranks keeps them inside");
}
