/* The pod sandbox's process (the "pause" container) of the local node cluster.
 *
 * It holds the pod's namespaces open and does nothing else: it sleeps until a
 * signal comes, reaps every child that is reparented to it (it is PID 1 of
 * the pod when the PID namespace is shared), and exits 0 on SIGTERM or SIGINT
 * so that stopping a pod sandbox is immediate instead of waiting for SIGKILL.
 * Built statically by devcluster/images.py: the image holds this file alone.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int signo) {
    (void)signo;
    _exit(0);
}

static void on_child(int signo) {
    (void)signo;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static int install(int signo, void (*handler)(int), int flags) {
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = handler;
    action.sa_flags = flags;
    sigemptyset(&action.sa_mask);
    return sigaction(signo, &action, NULL);
}

int main(int argc, char **argv) {
    (void)argv;
    if (argc > 1) {
        fprintf(stderr, "pause: no arguments expected\n");
    }
    if (install(SIGTERM, on_stop, 0) < 0 || install(SIGINT, on_stop, 0) < 0 ||
        install(SIGCHLD, on_child, SA_NOCLDSTOP | SA_RESTART) < 0) {
        perror("pause: sigaction");
        return 1;
    }
    if (getpid() != 1) {
        fprintf(stderr, "pause: not PID 1; zombies of the pod are reaped only when it is\n");
    }
    for (;;) {
        pause();
    }
}
