// device.h: the device runtime under ops.h: the device's selection, its memory, the copies to
// and from the host, the stream the ops run on, and the marks that time it. The backends that
// implement ops.h implement it too (ops_cpu.c, where the device is the host; ops_cuda.cu). The
// comm layer and the trace need only this half; the model's math is ops.h.
#ifndef DEVICE_H
#define DEVICE_H

#include <stddef.h>

// selects this process's device and starts the backend (ops.h's libraries too); exits with a
// clear message if there is none. Call it once, before any other function of this header or ops.h.
void ops_init(void);

void *dev_malloc(size_t bytes);     // zero-filled; exits with a message on failure
void dev_free(void *ptr);
void dev_zero(void *ptr, size_t bytes);
void dev_copy(void *dst, const void *src, size_t bytes);      // device -> device
void copy_to_device(void *dst, const void *src, size_t bytes);  // host -> device
void copy_to_host(void *dst, const void *src, size_t bytes);    // device -> host
void dev_synchronize(void);
// the CUDA stream the ops run on (a cudaStream_t), so that communication can order itself after
// them; NULL on the CPU backend
void *dev_stream(void);
// While the host waits for the device (a copy to the host, a sum, dev_synchronize), the backend
// calls check every few microseconds: the NCCL comm layer checks there that no collective the ops
// wait for has failed or passed its deadline, so a dead peer ends the job instead of hanging it.
// The CPU backend never waits (its ops run to completion), so it never calls check.
void dev_on_wait(void (*check)(void));
// Marks: the trace's clock (trace.h). dev_mark() notes where the ops stream has got to, and
// dev_mark_seconds() says when the device passed that point, in wall_seconds() terms (waiting
// until it has). On the CUDA backend a mark is an event on the stream, so the span between two
// marks is the GPU's own time, not the host's launch time, which runs ahead of it; on the CPU
// the device is the host and a mark is the clock reading. dev_mark_stream marks another stream
// of the device (an NCCL group's, a cudaStream_t); the CPU has one. dev_marks_clear forgets them.
int dev_mark(void);
int dev_mark_stream(void *stream);
double dev_mark_seconds(int mark);
void dev_marks_clear(void);
// A clock that runs while the device computes for this process, to time one op (between two
// dev_synchronize): CUDA's is wall_seconds(), the GPU being this process's alone; the CPU's is the
// host thread's CPU time, which stops while the OS runs another process on the core, so that an
// op's time on a shared machine is its own work and not its neighbours'.
double dev_busy_seconds(void);
size_t dev_bytes_in_use(void);      // what dev_malloc currently holds
size_t dev_bytes_peak(void);
// The device's free memory now, for sizing a buffer as a share of it (the server's KV cache pool):
// CUDA's cudaMemGetInfo, after the stream drains and the allocator hands back what dev_free gave
// it; on the CPU backend the host's MemAvailable (/proc/meminfo), what can be allocated without
// swapping. Exits with a message when it cannot be read.
size_t dev_free_bytes(void);

#endif
