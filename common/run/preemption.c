// preemption.c: see preemption.h.
#define _XOPEN_SOURCE 700  // sigaltstack, SA_ONSTACK
#include "preemption.h"

#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"

static volatile sig_atomic_t signalled;
static void (*g_also)(int sig);

void preemption_on_signal(void (*hook)(int sig)) { g_also = hook; }

static void note_signal(int sig) {
    signalled = 1;  // the step loop acts on it
    if (g_also) g_also(sig);
}

void signal_handlers_own_stack(void) {
    static char stack[1 << 16];
    static bool given;
    if (given) return;
    stack_t alt = {.ss_sp = stack, .ss_size = sizeof stack};
    if (sigaltstack(&alt, NULL) != 0) fatal("cannot give the signal handlers a stack: %s", strerror(errno));
    given = true;
}

void preemption_watch(void) {
    signal_handlers_own_stack();
    struct sigaction sa = {.sa_handler = note_signal};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_ONSTACK;  // a read or an MPI wait that the signal interrupts carries on
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGUSR1, &sa, NULL) != 0)
        fatal("cannot install the SIGTERM/SIGUSR1 handlers: %s", strerror(errno));
}

long preemption_signalled(void) { return signalled; }

void print_stopped_to_be_resumed(const Config *cfg, long step) {
    printf("stopped by a signal after step %ld; checkpoint in %s; run again with the same config "
           "to resume (exit code %d)\n", step, cfg->out_dir, EXIT_TO_BE_RESUMED);
    fflush(stdout);
}
