// comm_internal.h: what comm.c (groups, accounting, host values; always MPI) shares with the
// backend that moves the payload (comm_cpu.c for host buffers, comm_nccl.c for GPU buffers) and
// with the MPI path both backends use (comm_mpi.c).
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
    // the flight recorder's (flight.h): the group's id there, its collectives so far, and the
    // messages sent to and received from each rank of it
    int flight_group;
    long collectives, *sent, *received;
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
    void *staging;      // comm_mpi.c: the host block a staged operation copies back from
    // the trace's marks (trace.h) of its launch and end, -1 when not recording; comm.c marks the
    // launch on the compute stream and the end when the wait returns, which is right for MPI and
    // for a group of one; NCCL marks both on its group's stream, around the collective itself
    int launch_mark, end_mark;
    long flight;  // its ticket in the flight recorder (-1 once NCCL has taken it over: comm_nccl.c)
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

// the MPI path (comm_mpi.c): comm.h's payload operations over MPI, on host buffers or on device
// buffers staged through host blocks (mpi_path_set_staged; comm_wait and comm_test finish them
// through the backend's hooks, which call mpi_path_wait and mpi_path_test)
void mpi_path_set_staged(bool staged);
void mpi_path_free_staging(void);  // at the end, the host blocks kept for reuse
CommRequest *mpi_path_all_reduce_start(Comm *c, float *buf, size_t count);
CommRequest *mpi_path_all_gather_start(Comm *c, float *out, const float *in, size_t count);
CommRequest *mpi_path_all_gather16_start(Comm *c, uint16_t *out, const uint16_t *in, size_t count);
CommRequest *mpi_path_reduce_scatter_start(Comm *c, float *out, const float *in, size_t count);
void mpi_path_broadcast(Comm *c, float *buf, size_t count, int root);
void mpi_path_all_to_all(Comm *c, float *out, const float *in, size_t count);
void mpi_path_all_to_all_v(Comm *c, float *out, const size_t *recv_counts, const size_t *recv_offsets,
                           const float *in, const size_t *send_counts, const size_t *send_offsets);
CommRequest *mpi_path_send_start(Comm *c, const float *buf, size_t count, int peer);
CommRequest *mpi_path_recv_start(Comm *c, float *buf, size_t count, int peer);
CommRequest *mpi_path_send_recv_start(Comm *c, const float *send, size_t send_count, int dst, float *recv,
                                      size_t recv_count, int src);
void mpi_path_wait(CommRequest *r);
int mpi_path_test(CommRequest *r);
double mpi_path_seconds(const CommRequest *r);
// the backend's host memory for staging: pinned on CUDA (cudaMallocHost), malloc on the CPU
void *comm_host_alloc(size_t bytes);
void comm_host_free(void *ptr);

// shared helpers
// A new request, recorded by the flight recorder: every operation starts here. A point-to-point
// one names its peers (dst: the rank sent to, src: received from; -1 for none).
CommRequest *comm_new_request(Comm *c, CollKind kind, double bytes);
CommRequest *comm_new_p2p_request(Comm *c, CollKind kind, double bytes, int dst, int src);
void comm_check_mpi(int err, const char *what);
void comm_check_peer(const Comm *c, int peer, const char *what);
double comm_total_count(const size_t *counts, int n);  // the size of an all-to-all-v, in floats
void comm_wait_mpi(MPI_Request *reqs, int n, const char *what, const char *group);
void comm_timeout_exceeded(const char *what, const char *group);

#endif
