// mesh_check <description>: run under mpirun with up to 16 ranks. Builds the mesh the description
// names (common/comm/mesh.h, e.g. "dp=3,pp=2,tp=2") and checks it against a layout written out here
// independently: the ranks numbered by nested loops, pp outermost and tp innermost. For every
// dimension's group and for groups over several dimensions: its size, this rank's place in it,
// its members in order (an all-gather of their world ranks), and an all-reduce of 2^rank, whose
// sum names exactly the ranks it added up. Also: tp's ranks are consecutive and on one host here.
// Rank 0 prints the mesh's plan, then "mesh_check <description>: N passed, N failed" with every
// rank's failures counted; tests/test_mesh.sh runs it.
#include <stdlib.h>
#include <string.h>

#include "../check.h"
#include "base/device.h"
#include "base/log.h"
#include "comm/comm.h"
#include "comm/mesh.h"

enum { MAX_RANKS = 16 };  // 2^rank summed exactly in a float

// coordinates of every rank, by counting through the nested loops
static void layout_by_loops(const int size[MESH_DIMS], int coords[][MESH_DIMS]) {
    int r = 0;
    for (int p = 0; p < size[MESH_PP]; p++)
        for (int d = 0; d < size[MESH_DP]; d++)
            for (int e = 0; e < size[MESH_EP]; e++)
                for (int c = 0; c < size[MESH_CP]; c++)
                    for (int t = 0; t < size[MESH_TP]; t++, r++) {
                        coords[r][MESH_PP] = p, coords[r][MESH_DP] = d, coords[r][MESH_EP] = e;
                        coords[r][MESH_CP] = c, coords[r][MESH_TP] = t;
                    }
}

// the ranks that agree with `me` outside the set `along`, in world order
static int members(int ranks, int coords[][MESH_DIMS], int me, unsigned along, int *out) {
    int n = 0;
    for (int r = 0; r < ranks; r++) {
        bool same = true;
        for (int d = 0; d < MESH_DIMS; d++)
            if (!(along & MESH_ALONG(d)) && coords[r][d] != coords[me][d]) same = false;
        if (same) out[n++] = r;
    }
    return n;
}

static void check_group(Comm *g, const char *what, int ranks, int coords[][MESH_DIMS], int me, unsigned along) {
    int want[MAX_RANKS], n = members(ranks, coords, me, along, want), place = -1;
    for (int i = 0; i < n; i++)
        if (want[i] == me) place = i;
    CHECK(comm_size(g) == n, "%s on rank %d: %d ranks, want %d", what, me, comm_size(g), n);
    CHECK(comm_rank(g) == place, "%s on rank %d: place %d, want %d", what, me, comm_rank(g), place);
    if (comm_size(g) != n) return;
    float *mine = dev_malloc(sizeof(float)), *all = dev_malloc((size_t)n * sizeof(float));
    mine[0] = (float)me;
    comm_all_gather(g, all, mine, 1);
    for (int i = 0; i < n; i++)
        CHECK(all[i] == (float)want[i], "%s on rank %d: member %d is rank %g, want %d", what, me, i, all[i], want[i]);
    mine[0] = (float)(1 << me);
    comm_all_reduce(g, mine, 1);
    float sum = 0;
    for (int i = 0; i < n; i++) sum += (float)(1 << want[i]);
    CHECK(mine[0] == sum, "%s on rank %d: the all-reduce of 2^rank summed the ranks of mask %#x, want %#x", what, me,
          (unsigned)mine[0], (unsigned)sum);
    dev_free(mine);
    dev_free(all);
}

int main(int argc, char **argv) {
    Comm *w = comm_init(&argc, &argv);
    comm_select_backend(w, "auto");
    ops_init();
    int me = comm_rank(w), ranks = comm_size(w);
    if (argc != 2 || ranks > MAX_RANKS) fatal("usage: mpirun -np P mesh_check <description>, with P at most %d", MAX_RANKS);
    int size[MESH_DIMS];
    char why[320];
    if (!mesh_parse(argv[1], ranks, size, why, sizeof why)) fatal("command line: mesh: %s", why);
    Mesh m;
    mesh_init(&m, w, size, "command line");
    print_mesh_plan(&m);

    int coords[MAX_RANKS][MESH_DIMS];
    layout_by_loops(size, coords);
    for (int d = 0; d < MESH_DIMS; d++) {
        CHECK(m.coord[d] == coords[me][d], "rank %d: %s coordinate %d, want %d", me, MESH_NAMES[d], m.coord[d],
              coords[me][d]);
        check_group(m.group[d], MESH_NAMES[d], ranks, coords, me, MESH_ALONG(d));
        CHECK(m.one_host[d], "rank %d: %s's groups cross hosts on one machine", me, MESH_NAMES[d]);
    }
    unsigned data = MESH_ALONG(MESH_DP) | MESH_ALONG(MESH_CP) | MESH_ALONG(MESH_EP);
    check_group(mesh_group(&m, data, "dp-cp-ep"), "dp x cp x ep", ranks, coords, me, data);
    unsigned model = MESH_ALONG(MESH_TP) | MESH_ALONG(MESH_PP);
    check_group(mesh_group(&m, model, "tp-pp"), "tp x pp", ranks, coords, me, model);
    check_group(mesh_group(&m, (1u << MESH_DIMS) - 1, "all"), "every dimension", ranks, coords, me, (1u << MESH_DIMS) - 1);
    // innermost: a tp group is a run of consecutive ranks
    CHECK(me - m.coord[MESH_TP] == me / size[MESH_TP] * size[MESH_TP], "rank %d: tp coordinate %d is not rank mod tp",
          me, m.coord[MESH_TP]);

    long passed = comm_sum_long(w, check_passed_), failed = comm_sum_long(w, check_failed_);
    comm_finalize(w);
    if (me == 0) printf("mesh_check %s: %ld passed, %ld failed\n", argv[1], passed, failed);
    return failed ? 1 : 0;
}
