// preemption.h: stopping at a step boundary, saving, and exiting to be resumed. Slurm warns a
// job before its time limit or a preemption with SIGUSR1 (--signal=B:USR1@N) and cancels it with
// SIGTERM. Neither kills the run: the handler only sets a flag, and the stage's step loop looks at
// it after a whole step, where the weights and optimizer agree.
#ifndef PREEMPTION_H
#define PREEMPTION_H

#include "config/config.h"

// sysexits.h's EX_TEMPFAIL, "try again later": the run saved its state and should be resumed
#define EXIT_TO_BE_RESUMED 75

// installs the SIGTERM and SIGUSR1 handlers; call once, before the step loop
void preemption_watch(void);
// Gives the calling thread's signal handlers (those installed with SA_ONSTACK) a stack of their
// own; once is enough, later calls do nothing. A signal lands in the middle of whatever the thread
// runs, oneDNN's JIT kernels included, and the handler's frame is otherwise built below that
// code's stack pointer. Seen in test-slurm's preemption jobs: a USR1 arriving during oneDNN's
// batched attention matmuls corrupted the heap ("corrupted size vs. prev_size") in 3 runs of 3,
// and in none of 4 once the handlers had this stack.
void signal_handlers_own_stack(void);
// hook(sig) runs in the handler too (async-signal-safe, then: the flight recorder's ring)
void preemption_on_signal(void (*hook)(int sig));
// 1 if this process has been signalled (a long, ready for comm_sum_long: the ranks agree when
// any one of them was signalled, since mpirun or srun may deliver it to only some)
long preemption_signalled(void);
// prints where the checkpoint of `step` is, for a run a signal stopped; the stage then exits with
// EXIT_TO_BE_RESUMED. MPI stages print before comm_finalize: once one rank has exited non-zero,
// the launcher may kill the others, so nothing may be left to do after it
void print_stopped_to_be_resumed(const Config *cfg, long step);

#endif
