/* listen-first: listen on the sandbox agent's port, then run the agent.
 *
 * The kubelet probes a container as soon as it sees it running. The agent's
 * interpreter and imports take tens of milliseconds, ten times that on a busy
 * node, and a probe refused in that window is an Unhealthy warning on a
 * normal start. This program listens within a millisecond of the container's
 * start, passes the socket on in SANDBOX_AGENT_LISTEN_FD and executes its
 * arguments (the agent), which serves on that socket: a probe that comes
 * early waits in the backlog for its answer.
 *
 * It reads the variables the agent's configuration reads, with the same
 * defaults. What it cannot use as it stands (a host name rather than an
 * address, a port that is not a plain number, a port already taken, another
 * server than the built-in one) it leaves alone: the agent then listens
 * itself and reports any error in its own words.
 * Built statically by devcluster/images.py into the agent's image.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static const char *env_or(const char *name, const char *fallback) {
    const char *value = getenv(name);
    return value != NULL ? value : fallback;
}

/* 1-65535 written as plain digits, else -1 (0 would be any free port, which
 * the agent refuses as not its configured one). */
static int parse_port(const char *text) {
    long port = 0;
    if (*text == '\0' || strlen(text) > 5) {
        return -1;
    }
    for (const char *c = text; *c != '\0'; c++) {
        if (*c < '0' || *c > '9') {
            return -1;
        }
        port = port * 10 + (*c - '0');
    }
    return port >= 1 && port <= 65535 ? (int)port : -1;
}

/* A listening socket on host:port, inherited across exec, or -1. As the
 * agent's own (Python's socket.create_server): SO_REUSEADDR, IPv6 only on an
 * IPv6 address, a backlog of 1024. */
static int listen_on(const char *host, int port) {
    struct sockaddr_in v4;
    struct sockaddr_in6 v6;
    struct sockaddr *addr;
    socklen_t length;
    int family;
    if (strchr(host, ':') != NULL) {
        memset(&v6, 0, sizeof v6);
        if (inet_pton(AF_INET6, host, &v6.sin6_addr) != 1) {
            return -1;
        }
        v6.sin6_family = AF_INET6;
        v6.sin6_port = htons((unsigned short)port);
        family = AF_INET6;
        addr = (struct sockaddr *)&v6;
        length = sizeof v6;
    } else {
        memset(&v4, 0, sizeof v4);
        if (inet_pton(AF_INET, host, &v4.sin_addr) != 1) {
            return -1;
        }
        v4.sin_family = AF_INET;
        v4.sin_port = htons((unsigned short)port);
        family = AF_INET;
        addr = (struct sockaddr *)&v4;
        length = sizeof v4;
    }
    int fd = socket(family, SOCK_STREAM, 0); /* no SOCK_CLOEXEC: the agent inherits it */
    if (fd < 0) {
        return -1;
    }
    int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        (family == AF_INET6 && setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one) != 0) ||
        bind(fd, addr, length) != 0 || listen(fd, 1024) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: listen-first COMMAND [ARGUMENT...]\n");
        return 2;
    }
    if (strcmp(env_or("SANDBOX_AGENT_SERVER", "builtin"), "builtin") == 0) {
        int port = parse_port(env_or("SANDBOX_AGENT_PORT", "8080"));
        int fd = port > 0 ? listen_on(env_or("SANDBOX_AGENT_HOST", "0.0.0.0"), port) : -1;
        if (fd >= 0) {
            char number[16];
            snprintf(number, sizeof number, "%d", fd);
            if (setenv("SANDBOX_AGENT_LISTEN_FD", number, 1) != 0) {
                close(fd); /* the agent listens itself */
            }
        }
    }
    execv(argv[1], argv + 1);
    fprintf(stderr, "listen-first: cannot run %s: %s\n", argv[1], strerror(errno));
    return 127;
}
