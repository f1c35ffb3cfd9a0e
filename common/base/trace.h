// trace.h: a timeline of a run in Chrome's trace-event format (Perfetto and chrome://tracing open
// it). With `trace: true` every rank records complete events ("ph": "X", microseconds) while the
// step it is in is among the first `trace_steps` it runs: the data load, each block's forward and
// backward, the embedding and head, every collective (its group, kind and bytes), the optimizer
// and checkpoint writes. One track per kind of work on each rank (pid = rank):
//   tid 0 "compute": what the rank's thread is doing, nested (a block's forward inside the step);
//   tid 1.. "comm": each collective from its launch to the end of its wait, a lane per collective
//   in flight at once (so the lanes nest too); a wait that blocks the thread also shows on tid 0.
// Every time is a mark on the device's clock (device.h: dev_mark), read as microseconds since the
// trace's epoch: on the CUDA backend an event on the stream, so a block's span is the GPU's time
// for it and a collective's is NCCL's own (from the events on its group's stream), not the host's
// launch times, which run ahead of the GPU; on the CPU a clock reading. Marks are read when the
// events are written (trace_events_text), after the device has passed them.
// The merge (comm_trace_write in comm.h for MPI stages, trace_write for one process) puts
// every rank's events in <out_dir>/trace.json.
#ifndef TRACE_H
#define TRACE_H

#include <stdbool.h>

enum { TRACK_COMPUTE = 0, TRACK_COMM = 1 };

// starts recording for this rank; epoch = the clock reading that becomes ts 0 (every rank's
// clock reading taken at the same moment, e.g. just after a barrier)
void trace_open(bool enabled, int trace_steps, int rank, double epoch);
// called as each step starts: events are kept in the first trace_steps steps this run makes
void trace_step(void);
// a mark (dev_mark) while recording, else -1: what spans begin and end with
int trace_mark(void);
// one complete event from mark m0 to mark m1; args: a JSON object's text or NULL. Nothing is
// kept when either mark is -1 (the span began or ended outside the recorded steps).
void trace_span(const char *name, int tid, int m0, int m1, const char *args);
// One op (ops.h) on the compute track, with what its bound is made of (tools/step_bound.py):
// bytes, what it must read and write at least (its inputs and outputs once), and FLOPs, its
// matmul-shaped work (0 for element-wise ops); shape: the matmul's "NxCxOC" (NULL for others).
// Only the outermost op is kept (a 16-bit matmul that widens its inputs runs casts and an f32
// matmul inside): trace_op_begin returns -1 inside another op, as outside the recorded steps.
int trace_op_begin(void);
void trace_op_end(const char *name, int m0, double bytes, double flops, const char *shape);
// a collective from launch to end on a comm lane not busy in that time, and on the compute
// track the wait from `wait` until it ended (empty when it had ended before)
void trace_collective(const char *kind, const char *group, double bytes, int launch, int wait, int end);
// this rank's events as the text of JSON objects separated by commas ("" if none); caller frees
char *trace_events_text(void);
// the merged file: <out_dir>/trace.json from the ranks' event texts (rank 0 or the only process)
void trace_write_file(const char *out_dir, char **rank_texts, int n_ranks);
// one process: writes its own events
void trace_write(const char *out_dir);

#endif
