// preemption.c: see preemption.h.
#define _POSIX_C_SOURCE 200809L
#include "preemption.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "log.h"

static volatile sig_atomic_t signalled;
static void (*g_also)(int sig);

void preemption_on_signal(void (*hook)(int sig)) { g_also = hook; }

static void note_signal(int sig) {
    signalled = 1;  // the step loop acts on it
    if (g_also) g_also(sig);
}

void preemption_watch(void) {
    struct sigaction sa = {.sa_handler = note_signal};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // a read or an MPI wait that the signal interrupts carries on
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGUSR1, &sa, NULL) != 0)
        fatal("cannot install the SIGTERM/SIGUSR1 handlers: %s", strerror(errno));
}

long preemption_signalled(void) { return signalled; }

void print_stopped_to_be_resumed(const Config *cfg, long step) {
    printf("stopped by a signal after step %ld; checkpoint in %s; run again with the same config "
           "to resume (exit code %d)\n", step, cfg->out_dir, EXIT_TO_BE_RESUMED);
    fflush(stdout);
}
