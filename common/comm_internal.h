// comm_internal.h: what comm.c (groups, accounting, host values; always MPI) shares with the
// backend that moves the payload (comm_mpi.c for host buffers, comm_nccl.c for GPU buffers).
#ifndef COMM_INTERNAL_H
#define COMM_INTERNAL_H

#include <mpi.h>

#include "comm.h"

struct Comm {
    MPI_Comm mpi;
    int rank, size;
    char name[32];
    CommStats stats;
    void *backend;  // the backend's own state for this group (an ncclComm_t for NCCL)
    Comm *next;     // every group, for the totals and the table
};

struct CommRequest {
    Comm *comm;
    CollKind kind;
    double bytes, start;
    int done;           // comm_test saw it finish
    // comm_mpi.c: a collective, send or receive uses mpi[0]; a send-recv its receive and its
    // send. Unused entries are MPI_REQUEST_NULL, which MPI counts as finished.
    MPI_Request mpi[2];
    void *event;        // comm_nccl.c: a cudaEvent_t recorded after the collective
    // the trace's marks (trace.h) of its launch and end, -1 when not recording; comm.c marks the
    // launch on the compute stream and the end when the wait returns, which is right for MPI and
    // for a group of one; NCCL marks both on its group's stream, around the collective itself
    int launch_mark, end_mark;
};

extern double g_comm_timeout;
extern const char *COMM_KIND_NAMES[COLL_KINDS];

// the backend's part
void comm_backend_init_group(Comm *c);  // after the MPI communicator exists
void comm_backend_free_group(Comm *c);
void comm_backend_wait(CommRequest *r); // bounded by g_comm_timeout
int comm_backend_test(CommRequest *r);  // 1 when finished
// the seconds comm_wait books for r: MPI's host time from start to wait; 0 on NCCL, which books
// the GPU's own time of the collective when it finishes
double comm_backend_seconds(const CommRequest *r);

// shared helpers
CommRequest *comm_new_request(Comm *c, CollKind kind, double bytes);
void comm_check_mpi(int err, const char *what);
void comm_check_peer(const Comm *c, int peer, const char *what);
double comm_total_count(const size_t *counts, int n);  // the size of an all-to-all-v, in floats
void comm_wait_mpi(MPI_Request *reqs, int n, const char *what, const char *group);
void comm_timeout_exceeded(const char *what, const char *group);

#endif
