/* Running the compiler and other tools: no shell, output through pipes, a time limit, Ctrl-C. */
#define _POSIX_C_SOURCE 200809L
#include "device.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef __APPLE__
#include <crt_externs.h> /* a dylib cannot link against environ */
#define environ (*_NSGetEnviron())
#else
extern char **environ;
#endif

enum { DEFAULT_COMPILE_TIMEOUT = 600 };

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int make_pipe(int p[2]) {
#ifdef __linux__
    return pipe2(p, O_CLOEXEC);
#else
    if (pipe(p)) return -1;
    fcntl(p[0], F_SETFD, FD_CLOEXEC);
    fcntl(p[1], F_SETFD, FD_CLOEXEC);
    return 0;
#endif
}

typedef struct capture {
    int fd;
    char *text;
    uint64_t len;
} capture;

/* Reads what is available; closes the pipe at its end. Keeps at most MAX_OUTPUT bytes. */
static void drain(capture *c) {
    char chunk[16384];
    ssize_t r = read(c->fd, chunk, sizeof chunk);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (r <= 0) {
        close(c->fd);
        c->fd = -1;
        return;
    }
    uint64_t keep = c->len + (uint64_t)r > MAX_OUTPUT ? MAX_OUTPUT - c->len : (uint64_t)r;
    char *t = keep ? realloc(c->text, (size_t)(c->len + keep + 1)) : c->text;
    if (!t) return;
    memcpy(t + c->len, chunk, (size_t)keep);
    c->text = t;
    c->len += keep;
    t[c->len] = 0;
}

/* SIGINTs counted when this thread's compile started: one Ctrl-C stops all its compiler runs. */
static _Thread_local uint64_t tls_interrupts;

void runs_stop_on_interrupts_from_now(void) { tls_interrupts = mcpu_interrupts(); }

/* Runs argv (no shell: paths may hold spaces) in its own process group, stdin from /dev/null.
 * stdout (when out != NULL) and stderr are captured through pipes, never files: on a full disk
 * the compiler's message must still arrive. The whole process group is killed after `timeout`
 * seconds or on SIGINT (since the compile began). Returns the exit status, 256 + the signal that killed it,
 * RUN_TIMEOUT, RUN_INTERRUPTED, or -1 (errno set) if it could not be started. *err and *out
 * receive malloc'ed text (possibly NULL). */
int32_t run(char *const argv[], char **out, char **err, double timeout) {
    capture cap[2] = {{-1, NULL, 0}, {-1, NULL, 0}}; /* stderr, stdout */
    int p[2][2] = {{-1, -1}, {-1, -1}};
    *err = NULL;
    if (out) *out = NULL;
    if (make_pipe(p[0]) || (out && make_pipe(p[1]))) {
        for (int i = 0; i < 4; i++)
            if (p[i / 2][i % 2] >= 0) close(p[i / 2][i % 2]);
        return -1;
    }
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    posix_spawn_file_actions_init(&fa);
    posix_spawnattr_init(&attr);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    if (out) posix_spawn_file_actions_adddup2(&fa, p[1][1], 1);
    else posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, p[0][1], 2);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    int reset[] = {SIGINT, SIGPIPE, SIGTERM, SIGQUIT, SIGURG, SIGXFSZ};
    for (uint64_t i = 0; i < COUNT(reset); i++) sigaddset(&defaults, reset[i]);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, &attr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    close(p[0][1]);
    if (out) close(p[1][1]);
    cap[0].fd = p[0][0];
    cap[1].fd = out ? p[1][0] : -1;
    if (rc) {
        for (int i = 0; i < 2; i++)
            if (cap[i].fd >= 0) close(cap[i].fd);
        errno = rc;
        return -1;
    }
    double deadline = now_seconds() + timeout;
    int status = 0, result = 0, reaped = 0;
    while (!reaped) {
        struct pollfd fds[2];
        nfds_t n = 0;
        for (int i = 0; i < 2; i++)
            if (cap[i].fd >= 0) fds[n++] = (struct pollfd){cap[i].fd, POLLIN, 0};
        if (n) {
            if (poll(fds, n, 50) > 0)
                for (int i = 0; i < 2; i++)
                    for (nfds_t k = 0; k < n; k++)
                        if (cap[i].fd >= 0 && fds[k].fd == cap[i].fd && fds[k].revents) drain(&cap[i]);
        } else {
            pid_t w = waitpid(pid, &status, WNOHANG);
            if (w == pid || (w < 0 && errno != EINTR)) {
                reaped = 1;
                break;
            }
            nanosleep(&(struct timespec){0, 20000000}, NULL);
        }
        int32_t stop = mcpu_interrupts() != tls_interrupts ? RUN_INTERRUPTED
                       : now_seconds() > deadline          ? RUN_TIMEOUT
                                                           : 0;
        if (stop) {
            kill(-pid, SIGKILL); /* the compiler's own children (cc1plus, ld) too */
            kill(pid, SIGKILL);
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
            }
            result = stop;
            break;
        }
    }
    for (int i = 0; i < 2; i++)
        if (cap[i].fd >= 0) close(cap[i].fd);
    *err = cap[0].text;
    if (out) *out = cap[1].text;
    else free(cap[1].text);
    if (result) return result;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 256 + WTERMSIG(status);
}

/* Seconds a compiler run may take: $FLASHATTN_MPS_COMPILE_TIMEOUT, else 600. */
int32_t compile_timeout(double *seconds, mcpu_status *st) {
    const char *env = getenv("FLASHATTN_MPS_COMPILE_TIMEOUT");
    *seconds = DEFAULT_COMPILE_TIMEOUT;
    if (!env || !*env) return MCPU_OK;
    char *end;
    double v = strtod(env, &end);
    if (*end || !(v > 0))
        return mcpu_fail(st, MCPU_ERR_VALUE, "FLASHATTN_MPS_COMPILE_TIMEOUT='%s': expected a number of seconds > 0",
                         env);
    *seconds = v;
    return MCPU_OK;
}

/* Why a compiler run failed to produce a status: for messages. */
const char *run_failure(int32_t status, double timeout, char buf[96]) {
    if (status == RUN_TIMEOUT) snprintf(buf, 96, "it ran longer than %g s (FLASHATTN_MPS_COMPILE_TIMEOUT)", timeout);
    else if (status == RUN_INTERRUPTED) snprintf(buf, 96, "interrupted (SIGINT)");
    else snprintf(buf, 96, "%s", strerror(errno));
    return buf;
}

int32_t mcpu_run_tool(char *const argv[], char **out, double timeout) {
    char *err = NULL;
    runs_stop_on_interrupts_from_now();
    int32_t status = run(argv, out, &err, timeout);
    free(err);
    return status;
}
