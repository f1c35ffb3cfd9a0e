// mesh.h: the ranks arranged as a mesh of named dimensions, the one place that builds the groups
// of a run that composes techniques. Five dimensions: pp (pipeline stages), dp (data-parallel
// replicas), ep (expert ranks), cp (context ranks: a sequence's chunks), tp (tensor ranks).
// The product of their sizes is the rank count.
//
// The order, outermost first, is pp, dp, ep, cp, tp: rank = (((p * dp + d) * ep + e) * cp + c) * tp + t
// (Megatron-LM's, read innermost first: tp-cp-ep-dp-pp). The dimension that talks most and
// cannot hide it is innermost, so that its ranks are consecutive and share a host's fastest links:
//   tp  all-reduces (or all-gathers and reduce-scatters) the activations in every layer, forward
//       and backward, on the critical path;
//   cp  passes every layer's keys and values around its ring, hidden behind attention if fast enough;
//   ep  two all-to-alls of the routed rows per MoE block, each way;
//   dp  the gradients once per step, overlapped with backward;
//   pp  activations point to point at the stages' edges only: the least, so it may cross the
//       slowest links.
// A dimension of size 1 has a group of one rank: nothing to send.
#ifndef MESH_H
#define MESH_H

#include <stdbool.h>
#include <stddef.h>

#include "comm.h"

typedef enum { MESH_PP, MESH_DP, MESH_EP, MESH_CP, MESH_TP, MESH_DIMS } MeshDim;  // outermost first
#define MESH_ALONG(d) (1u << (d))  // a set of dimensions, for mesh_group

extern const char *const MESH_NAMES[MESH_DIMS];  // "pp", "dp", "ep", "cp", "tp"

typedef struct {
    int size[MESH_DIMS];
    int coord[MESH_DIMS];    // this rank's place along each dimension
    int stride[MESH_DIMS];   // the rank distance between neighbours along each dimension
    int rank, ranks;
    Comm *world;
    Comm *group[MESH_DIMS];  // the ranks that differ from this one along that dimension only,
                             // ranked by their coordinate on it
    bool one_host[MESH_DIMS];  // whether every group of that dimension lies within one host
} Mesh;

// Reads a description such as "tp=2,pp=2,dp=2" into size: a dimension it does not name is 1,
// except dp, which then takes the ranks the others leave (as every stage's data dimension does).
// False, with the reason in why (naming the dimension and the number), when a name is unknown or
// repeated, a size is not a whole number of at least 1, or the sizes do not fit `ranks`.
bool mesh_parse(const char *text, int ranks, int size[MESH_DIMS], char *why, size_t why_size);
// whether the sizes multiply to `ranks`; false, with the first dimension (innermost first) that
// does not divide the ranks the inner ones leave, or dp's size against the replicas left
bool mesh_fits(const int size[MESH_DIMS], int ranks, char *why, size_t why_size);
// Checks the sizes against the world (fatal() on every rank alike, `source` naming where they
// came from), places this rank and makes one group per dimension; every rank calls it.
void mesh_init(Mesh *m, Comm *world, const int size[MESH_DIMS], const char *source);
// A group over several dimensions (a set of MESH_ALONG(d)): the ranks that differ from this one
// along those only, ranked as in the world. Gradients of dense weights are summed over
// MESH_ALONG(MESH_DP) | MESH_ALONG(MESH_CP) | MESH_ALONG(MESH_EP), for instance. Every rank calls it.
Comm *mesh_group(const Mesh *m, unsigned along, const char *name);
// Rank 0 prints the sizes, the rank formula, why the order is what it is, and which dimensions'
// groups cross hosts.
void print_mesh_plan(const Mesh *m);

#endif
