// flight.h: the flight recorder. Every rank keeps its last FLIGHT_OPS communication operations
// in a fixed ring: which group, the sequence number within it, the kind, the peer, the bytes,
// and when the operation was issued, when this rank started waiting for it and when it
// completed. Recording is a few stores per operation, so it stays on (FLIGHT_RECORDER=0 turns it
// off, for measuring what it costs).
//
// The ring is written, one JSON file per rank (<dir>/flight-rank<R>.json), when the job fails
// (fatal(), a communication timeout) or is sent a signal: SIGUSR2 writes it and the run goes on;
// SIGTERM and SIGINT write it and then do what they did before (preemption.h's handling, or the
// default). tools/hangcheck merges the files and names the cause of a hang.
//
// Sequence numbers are what let rings from different ranks be lined up: every rank of a group
// calls its collectives in the same order, so collective #n is the same call on each of them;
// the n-th send from rank a to rank b (per group) is matched by b's n-th receive from a.
#ifndef FLIGHT_H
#define FLIGHT_H

enum { FLIGHT_OPS = 256 };

// Reads FLIGHT_RECORDER and FLIGHT_DIR (the directory for the rings; else the run's out_dir,
// flight_set_dir; until one is known nothing is written) and installs the SIGUSR2, SIGTERM and SIGINT handlers. pids[r] is world rank
// r's process id, same_host[r] whether it runs on this host: a rank that times out signals the
// ranks on its host so that they write their rings too.
void flight_init(int world_rank, int world_size, const int *pids, const char *same_host);
// where the rings go unless FLIGHT_DIR says; removes this rank's ring of an earlier run there
void flight_set_dir(const char *dir);
// A group's id in the ring: its name, this rank's rank in it, and its members' world ranks.
int flight_add_group(const char *name, int rank, int size, const int *world_ranks);

// An operation was issued: its ticket for flight_started/flight_completed (-1 when off). peer:
// the rank sent to, or received from; a send-recv also receives recv_seq from recv_peer (-1: none).
long flight_issued(const char *kind, int group, long seq, int peer, long recv_seq, int recv_peer,
                   double bytes);
void flight_started(long ticket);    // this rank waits for it
void flight_completed(long ticket);

// Writes this rank's ring now, with why (creating the directory). Async-signal-safe: a signal
// handler calls it. A fatal() error writes it too, into the directory only if it exists.
void flight_write(const char *reason);
// After a communication timeout, before the job ends: writes the ring, signals the ranks on this
// host to write theirs, waits briefly for the others' rings and, on the first rank to get there,
// runs tools/hangcheck on them so that the job's log says what each rank was doing.
void flight_on_timeout(const char *reason);
// the handler's work for a signal another module catches (preemption.h): writes the ring, creating
// the directory only for SIGUSR2 (the launcher's SIGTERM after a refused config leaves none)
void flight_on_signal(int sig);

#endif
