/* Compiles MSL source into a shared object for the CPU Metal device and loads it (ARCHITECTURE.md,
 * "Compilation pipeline"): `c++ -E` against empty <metal_stdlib> stubs, mcpu_preprocess,
 * `c++ -include msl_shim.h` to LLVM IR, drop_convergent, relax_alignment, then `c++ -shared` of that IR.
 * Libraries are cached in the process (by key, never unloaded) and on disk as <cache>/<key>.so with its
 * manifest <key>.sum, where the key is a SHA-256 of everything that shapes the binary. Several
 * processes may build the same library at once: each builds in its own temporary directory and
 * rename()s the result into place, so nobody ever sees a partial file. What is loaded must be
 * vouched for (README, "Security and robustness"): private entries only, never through a link,
 * matching the manifest, reporting its key. */
#define _POSIX_C_SOURCE 200809L
#include "metal_cpu.h"
#include "shim_files.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <pwd.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef __APPLE__
#include <crt_externs.h> /* a dylib cannot link against environ */
#define environ (*_NSGetEnviron())
#else
extern char **environ;
#endif

enum { PATH_BYTES = 4096, MAX_OUTPUT = 1 << 20 };

struct mcpu_library {
    char key[33];
    void *handle;
    const char *const *names; /* __msl_kernel_names, inside the loaded object */
    mcpu_kernel_fn *fns;      /* __msl_launch_<names[i]> */
    uint64_t n;
    uint32_t mode; /* MCPU_CHECKED, MCPU_LOCKSTEP: built instrumented (MSL_CHECKED) if any */
    struct mcpu_library *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static mcpu_library *g_libs;   /* loaded libraries, guarded by g_lock */
static char *g_cxx, *g_cxx_id; /* the compiler last asked for and its --version output, ditto */

/* -fms-extensions: -E expands macros in pragmas (`#pragma unroll (MIN(N, 4))`), as the compiler proper
 * does where the pragma is read; the two macros it predefines are taken back. */
static const char *const PRE_FLAGS[] = {"-E", "-x", "c++", "-std=gnu++17", "-nostdinc", "-fms-extensions",
                                        "-U_WCHAR_T_DEFINED", "-U_NATIVE_WCHAR_T_DEFINED",
                                        "-D__METAL_VERSION__=310", "-D__HAVE_BFLOAT__=1"};
/* -fsycl-is-device gives clang's language address spaces the default one converts from (msl_shim.h);
 * without device code to diagnose, it changes nothing else the kernels see. Kernels view buffers
 * through other types (half* as half4*): no type-based alias analysis. MSL's char is signed, which
 * aarch64 Linux's is not by default. `const constant T` reads const twice: allowed. Every error
 * goes to the log (clang stops at 20 by default); a crashing clang leaves no reproducer in /tmp.
 * The front end stops at unoptimised LLVM IR (IR_FLAGS), whose convergent attributes go (below). */
static const char *const CC_FLAGS[] = {"-x", "c++", "-std=gnu++17", "-Xclang", "-fsycl-is-device", "-O3",
                                       "-fno-strict-aliasing", "-fsigned-char", "-fPIC",
                                       "-Wno-unknown-attributes", "-Wno-duplicate-decl-specifier", "-ferror-limit=0",
                                       "-fno-crash-diagnostics"};
/* -fsycl-is-device also marks every function and call convergent, as for a SIMT target, and clang
 * 16 has no -fno-convergent-functions. Here each GPU thread is a fiber that runs its code
 * sequentially, so no transformation that is sound for one thread can change which barrier a
 * thread reaches. Yet convergent calls stay put: the const self() and function-constant lookups
 * (msl_sync.h, msl_kernel.h) run again at every loop iteration, loops are not unswitched on a
 * function constant. So the front end writes IR, drop_convergent takes the attribute out, and
 * clang optimises and compiles that IR (the same passes and code as one clang run, minus it). */
static const char *const IR_FLAGS[] = {"-S", "-emit-llvm", "-Xclang", "-disable-llvm-passes"};
static const char *const CODEGEN_FLAGS[] = {"-x", "ir", "-O3", "-fPIC", "-shared", "-fno-crash-diagnostics"};
static const char NOT_CONVERGENT[] = "\"msl-not-convergent\""; /* an attribute group may not be empty */
static const char STACK_CLASH_FLAG[] = "-fstack-clash-protection";
/* Checked mode: every load and store calls the shim's __tsan_* hooks (msl_kernel.h), without the
 * sanitizer's runtime (clang links none into a shared object); line tables, in a DWARF version
 * addr2line reads, name the accesses' source lines. */
static const char *const CHECKED_FLAGS[] = {"-DMSL_CHECKED", "-fsanitize=thread", "-g1", "-gdwarf-4"};
static const char CODEGEN_CHECKED_FLAG[] = "-fsanitize=thread"; /* the instrumentation is a pass */
static const char *const STUBS[] = {"metal_stdlib",    "metal_simdgroup", "metal_simdgroup_matrix",
                                    "metal_atomic",    "metal_math",      "metal_compute",
                                    "metal_integer",   "metal_common",    "metal_geometric",
                                    "metal_relational", "metal_matrix",   "metal_array",
                                    "metal_uniform",   "metal_types"};
#define COUNT(a) (sizeof(a) / sizeof *(a))

/* ---- SHA-256 (FIPS 180-4) ---- */

typedef struct sha256 {
    uint32_t h[8];
    uint8_t buf[64];
    uint64_t len;
} sha256;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) ((x) >> (n) | (x) << (32 - (n)))

static void sha_block(sha256 *s, const uint8_t *p) {
    uint32_t w[64], a[8];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 |
               p[4 * i + 3];
    for (int i = 16; i < 64; i++)
        w[i] = w[i - 16] + (ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3)) + w[i - 7] +
               (ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10));
    memcpy(a, s->h, sizeof a);
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = a[7] + (ROR(a[4], 6) ^ ROR(a[4], 11) ^ ROR(a[4], 25)) +
                      ((a[4] & a[5]) ^ (~a[4] & a[6])) + K256[i] + w[i];
        uint32_t t2 =
            (ROR(a[0], 2) ^ ROR(a[0], 13) ^ ROR(a[0], 22)) + ((a[0] & a[1]) ^ (a[0] & a[2]) ^ (a[1] & a[2]));
        memmove(a + 1, a, 7 * sizeof *a);
        a[4] += t1;
        a[0] = t1 + t2;
    }
    for (int i = 0; i < 8; i++) s->h[i] += a[i];
}

static void sha_init(sha256 *s) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof h0);
    s->len = 0;
}

static void sha_update(sha256 *s, const void *data, uint64_t n) {
    const uint8_t *p = data;
    for (uint64_t i = 0; i < n;) {
        if (s->len % 64 == 0 && n - i >= 64) { /* whole blocks straight from the input */
            sha_block(s, p + i);
            s->len += 64, i += 64;
            continue;
        }
        s->buf[s->len++ % 64] = p[i++];
        if (s->len % 64 == 0) sha_block(s, s->buf);
    }
}

/* Hex of the first 16 bytes of the digest (128 bits: plenty for a cache key). */
static void sha_hex(sha256 *s, char out[33]) {
    uint64_t bits = s->len * 8;
    uint8_t pad = 0x80, len[8];
    sha_update(s, &pad, 1);
    pad = 0;
    while (s->len % 64 != 56) sha_update(s, &pad, 1);
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)(bits >> (56 - 8 * i));
    sha_update(s, len, 8);
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", (unsigned)(s->h[i / 4] >> (24 - 8 * (i % 4))) & 0xffu);
}

/* A length-prefixed field, so that no two different inputs hash alike. */
static void sha_field(sha256 *s, const char *str) {
    uint64_t n = str ? strlen(str) : 0;
    sha_update(s, &n, sizeof n);
    sha_update(s, str ? str : "", n);
}

static void shim_hash(char out[33]) {
    sha256 s;
    sha_init(&s);
    for (uint32_t i = 0; i < mcpu_shim_file_count; i++) {
        sha_field(&s, mcpu_shim_files[i].name);
        sha_field(&s, mcpu_shim_files[i].text);
    }
    sha_hex(&s, out);
}

/* ---- files and processes ---- */

static int32_t io_fail(mcpu_status *st, const char *what, const char *path) {
    int32_t e = errno;
    return mcpu_fail(st, MCPU_ERR_RUNTIME, "CPU Metal device: cannot %s %s: %s%s", what, path, strerror(e),
                   e == ENOSPC || e == EDQUOT ? " (the disk is full)" : "");
}

static int32_t join(char *out, const char *a, const char *b, mcpu_status *st) {
    int n = snprintf(out, PATH_BYTES, "%s/%s", a, b);
    if (n < 0 || n >= PATH_BYTES)
        return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: path too long: %s/%s", a, b);
    return MCPU_OK;
}

static int32_t write_fd(int fd, const char *data, uint64_t n) {
    for (uint64_t done = 0; done < n;) {
        ssize_t w = write(fd, data + done, (size_t)(n - done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        done += (uint64_t)w;
    }
    return 0;
}

/* A new private file (inside a temporary directory). */
static int32_t write_file(const char *path, const char *data, uint64_t n, mcpu_status *st) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return io_fail(st, "create", path);
    if (write_fd(fd, data, n)) {
        io_fail(st, "write", path);
        close(fd);
        return st->code;
    }
    return close(fd) ? io_fail(st, "write", path) : MCPU_OK;
}

static void sync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* dir/name replaced atomically and durably by data: a private temporary file, fsync, rename,
 * fsync of the directory. A crash leaves the old file or the new one, never a torn one. */
static int32_t write_atomic(const char *dir, const char *name, const char *data, uint64_t n, mcpu_status *st) {
    char tmp[PATH_BYTES], path[PATH_BYTES];
    if (join(tmp, dir, "tmp-XXXXXX", st) || join(path, dir, name, st)) return st->code;
    int fd = mkstemp(tmp);
    if (fd < 0) return io_fail(st, "create a file in", dir);
    int32_t rc = write_fd(fd, data, n) || fsync(fd) ? io_fail(st, "write", tmp) : MCPU_OK;
    if (close(fd) && !rc) rc = io_fail(st, "write", tmp);
    if (!rc && rename(tmp, path)) rc = io_fail(st, "create", path);
    if (rc) unlink(tmp);
    else sync_dir(dir);
    return rc;
}

/* The rest of fd's file (at most max bytes), NUL-terminated, its length in *len; NULL on error. */
static char *read_fd(int fd, uint64_t max, uint64_t *len) {
    char *p = NULL;
    uint64_t n = 0, cap = 0;
    for (;;) {
        if (n + 65536 + 1 > cap) {
            char *q = realloc(p, (size_t)(cap = 2 * cap + 65536 + 1));
            if (!q) {
                free(p);
                return NULL;
            }
            p = q;
        }
        ssize_t r = read(fd, p + n, 65536);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            free(p);
            return NULL;
        }
        n += (uint64_t)r;
        if (r == 0 || n >= max) break;
    }
    n = n < max ? n : max;
    p[n] = 0;
    if (len) *len = n;
    return p;
}

/* Deletes path and, for a directory, everything below it, never following symbolic links. */
static void rm_tree(const char *path) {
    struct stat sb;
    if (lstat(path, &sb)) return;
    DIR *d = S_ISDIR(sb.st_mode) ? opendir(path) : NULL;
    if (!d) {
        unlink(path);
        return;
    }
    struct dirent *e;
    char sub[PATH_BYTES];
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
            snprintf(sub, sizeof sub, "%s/%s", path, e->d_name) < PATH_BYTES)
            rm_tree(sub);
    closedir(d);
    rmdir(path);
}

static int32_t mkdir_p(const char *path, mcpu_status *st) {
    char p[PATH_BYTES];
    snprintf(p, sizeof p, "%s", path);
    for (char *c = p + 1;; c++) {
        if (*c != '/' && *c) continue;
        char end = *c;
        *c = 0;
        if (mkdir(p, 0700) && errno != EEXIST) return io_fail(st, "create directory", p);
        if (!(*c = end)) break;
    }
    return MCPU_OK;
}

/* ---- what the cache trusts ---- */

/* Why a cache entry cannot be trusted, or NULL: the cache trusts only what the current user alone
 * can have written (code in it runs as this user). */
static const char *untrusted(const struct stat *sb, char why[160]) {
    if (S_ISLNK(sb->st_mode)) return "it is a symbolic link";
    if (sb->st_uid != geteuid()) {
        snprintf(why, 160, "it is owned by uid %u, not by the current user (uid %u)", (unsigned)sb->st_uid,
                 (unsigned)geteuid());
        return why;
    }
    if (sb->st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(why, 160, "it is %s-writable (mode %03o)", sb->st_mode & S_IWOTH ? "world" : "group",
                 (unsigned)(sb->st_mode & 0777));
        return why;
    }
    return NULL;
}

static int32_t refuse(mcpu_status *st, const char *path, const char *why) {
    return mcpu_fail(st, MCPU_ERR_COMPILE,
                   "CPU Metal device: refusing to use %s from the kernel cache: %s; the cache trusts only "
                   "entries that are not symbolic links, are owned by the current user and are writable by "
                   "nobody else (fix or remove it, or set FLASHATTN_MPS_CACHE to a private directory)",
                   path, why);
}

/* A directory the cache may use: refused if it is a symbolic link, not a directory, someone
 * else's or writable by others. */
static int32_t trusted_dir(const char *path, mcpu_status *st) {
    struct stat sb;
    char why[160];
    if (lstat(path, &sb)) return io_fail(st, "use directory", path);
    const char *bad = S_ISLNK(sb.st_mode) ? "it is a symbolic link" : !S_ISDIR(sb.st_mode) ? "it is not a directory"
                                                                                          : untrusted(&sb, why);
    return bad ? refuse(st, path, bad) : MCPU_OK;
}

/* The cache directory, created private (0700) if absent, then checked as trusted_dir. */
static int32_t private_dir(const char *path, mcpu_status *st) {
    struct stat sb;
    if (lstat(path, &sb) && errno == ENOENT && mkdir_p(path, st)) return st->code;
    return trusted_dir(path, st);
}

/* Opens a cache file for reading without following a symbolic link. Returns the descriptor, -1
 * (errno ENOENT) when the file is absent, or -2 with st set when it is refused or unreadable. */
static int open_trusted(const char *path, mcpu_status *st) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK); /* O_NONBLOCK: a planted FIFO */
    if (fd < 0) {
        if (errno == ENOENT) return -1;
        if (errno == ELOOP || errno == EMLINK) refuse(st, path, "it is a symbolic link");
        else io_fail(st, "open", path);
        return -2;
    }
    struct stat sb;
    char why[160];
    const char *bad = fstat(fd, &sb) ? strerror(errno) : !S_ISREG(sb.st_mode) ? "it is not a regular file"
                                                                                : untrusted(&sb, why);
    if (bad) {
        refuse(st, path, bad);
        close(fd);
        return -2;
    }
    return fd;
}

/* ---- processes ---- */

enum { RUN_TIMEOUT = -2, RUN_INTERRUPTED = -3, DEFAULT_COMPILE_TIMEOUT = 600 };

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

/* Runs argv (no shell: paths may hold spaces) in its own process group, stdin from /dev/null.
 * stdout (when out != NULL) and stderr are captured through pipes, never files: on a full disk
 * the compiler's message must still arrive. The whole process group is killed after `timeout`
 * seconds or on SIGINT (since the compile began). Returns the exit status, 256 + the signal that killed it,
 * RUN_TIMEOUT, RUN_INTERRUPTED, or -1 (errno set) if it could not be started. *err and *out
 * receive malloc'ed text (possibly NULL). */
static int32_t run(char *const argv[], char **out, char **err, double timeout) {
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
        int32_t stop = mcpu_interrupts() != tls_interrupts ? RUN_INTERRUPTED : now_seconds() > deadline ? RUN_TIMEOUT : 0;
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
static int32_t compile_timeout(double *seconds, mcpu_status *st) {
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
static const char *run_failure(int32_t status, double timeout, char buf[96]) {
    if (status == RUN_TIMEOUT) snprintf(buf, 96, "it ran longer than %g s (FLASHATTN_MPS_COMPILE_TIMEOUT)", timeout);
    else if (status == RUN_INTERRUPTED) snprintf(buf, 96, "interrupted (SIGINT)");
    else snprintf(buf, 96, "%s", strerror(errno));
    return buf;
}

/* The compiler command: $FLASHATTN_MPS_CXX, split into words at blanks, with '...' and "..."
 * quoting as in a shell (no expansions), so that "ccache clang++" works; else the first of
 * compilers.txt's names (mcpu_compiler_names) on PATH. It must be clang 16 or newer (checked on its
 * identity, compiler_identity): kernels keep Metal's address spaces apart through clang's
 * (msl_shim.h), which g++ lacks. */
#define CLANG_ADVICE "install clang (Debian/Ubuntu: apt-get install clang-16) or set FLASHATTN_MPS_CXX"

/* The first of mcpu_compiler_names that PATH holds as an executable, or NULL. */
static const char *clang_on_path(void) {
    const char *path = getenv("PATH");
    for (uint64_t i = 0; path && i < mcpu_compiler_name_count; i++)
        for (const char *d = path; *d;) {
            uint64_t n = strcspn(d, ":");
            char file[PATH_BYTES];
            if (n + strlen(mcpu_compiler_names[i]) + 3 < sizeof file) { /* an empty entry is the current directory */
                snprintf(file, sizeof file, "%.*s/%s", n ? (int)n : 1, n ? d : ".", mcpu_compiler_names[i]);
                if (access(file, X_OK) == 0) return mcpu_compiler_names[i];
            }
            d += n + (d[n] == ':');
        }
    return NULL;
}
enum { MAX_WORDS = 32 };
typedef struct command {
    char text[PATH_BYTES];
    char *argv[MAX_WORDS + 1];
    uint32_t argc;
    const char *source; /* the variable it came from, for messages */
} command;

static int32_t compiler(command *c, mcpu_status *st) {
    const char *env = getenv("FLASHATTN_MPS_CXX");
    c->source = "FLASHATTN_MPS_CXX";
    if (!env || !*env) env = clang_on_path(), c->source = "PATH";
    if (!env) {
        char names[512] = "";
        for (uint32_t i = 0; i < mcpu_compiler_name_count; i++)
            snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "", mcpu_compiler_names[i]);
        return mcpu_fail(st, MCPU_ERR_COMPILE,
                         "CPU Metal device: kernels compile with clang++ 16 or newer, and PATH holds none of %s; "
                         CLANG_ADVICE, names);
    }
    if (strlen(env) >= sizeof c->text)
        return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: the compiler command (%s) is longer than %zu bytes",
                       c->source, sizeof c->text - 1);
    char *w = c->text, quote = 0;
    const char *r = env;
    c->argc = 0;
    for (;;) {
        while (!quote && (*r == ' ' || *r == '\t')) r++;
        if (!*r) break;
        if (c->argc == MAX_WORDS)
            return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: the compiler command '%s' (%s) has more than %d words",
                           env, c->source, MAX_WORDS);
        c->argv[c->argc++] = w;
        for (; *r && (quote || (*r != ' ' && *r != '\t')); r++) {
            if (quote ? *r == quote : (*r == '\'' || *r == '"')) quote = quote ? 0 : *r;
            else if (*r == '\\' && quote != '\'' && r[1]) *w++ = *++r;
            else *w++ = *r;
        }
        if (quote)
            return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: the compiler command '%s' (%s) has an unterminated %c",
                           env, c->source, quote);
        *w++ = 0;
    }
    if (c->argc == 0)
        return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: the compiler command (%s) is blank", c->source);
    c->argv[c->argc] = NULL;
    return MCPU_OK;
}

/* argv: the command's words, then `extra` (NULL-terminated). */
static char **with_args(const command *c, char *const extra[], uint64_t n_extra) {
    char **argv = calloc((size_t)(c->argc + n_extra + 1), sizeof *argv);
    if (!argv) return NULL;
    memcpy(argv, c->argv, c->argc * sizeof *argv);
    memcpy(argv + c->argc, extra, (size_t)n_extra * sizeof *argv);
    return argv;
}

/* ---- cache directory, compiler identity, shim directory ---- */

int32_t mcpu_cache_dir(char *out, size_t out_len, mcpu_status *st) {
    mcpu_status local;
    if (!st) st = &local;
    if (!out || out_len == 0) return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_cache_dir: no output buffer");
    const char *env = getenv("FLASHATTN_MPS_CACHE"), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char pwbuf[4096];
    struct passwd pw, *found = NULL;
    if ((!home || !*home) && !getpwuid_r(getuid(), &pw, pwbuf, sizeof pwbuf, &found) && found)
        home = found->pw_dir;
    int n;
    if (env && *env)
        n = snprintf(out, out_len, "%s", env);
    else if (xdg && *xdg)
        n = snprintf(out, out_len, "%s/flashattn_mps", xdg);
    else if (home && *home)
        n = snprintf(out, out_len, "%s/.cache/flashattn_mps", home);
    else
        return mcpu_fail(st, MCPU_ERR_RUNTIME, "CPU Metal device: no cache directory (set FLASHATTN_MPS_CACHE)");
    if (n < 0 || (uint64_t)n >= out_len || n >= PATH_BYTES - 128)
        return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: cache directory path too long: %s", out);
    while (n > 1 && out[n - 1] == '/') out[--n] = 0; /* lstat("link/") would follow the link */
    return private_dir(out, st);
}

/* `<cxx> --version`, run once per process (again only if the compiler asked for changes). Returns
 * a malloc'ed copy. */
static char *compiler_identity(const command *cxx, double timeout, mcpu_status *st) {
    char *id = NULL;
    pthread_mutex_lock(&g_lock);
    if (g_cxx && !strcmp(g_cxx, cxx->text)) id = strdup(g_cxx_id);
    pthread_mutex_unlock(&g_lock);
    if (id) return id;
    mcpu_signals_ensure(); /* Ctrl-C stops the compiler */
    char *version[] = {"--version"}, **argv = with_args(cxx, version, 1), *err = NULL, why[96];
    int32_t rc = argv ? run(argv, &id, &err, timeout) : -1;
    int32_t saved = errno;
    free(argv);
    if (rc || !id || !*id) {
        errno = saved;
        mcpu_fail(st, MCPU_ERR_UNSUPPORTED,
                "CPU Metal device: cannot run the C++ compiler '%s' (from %s): %s%s%s; " CLANG_ADVICE,
                cxx->text, cxx->source,
                rc < 0 ? run_failure(rc, timeout, why) : rc ? "`--version` failed" : "no `--version` output",
                err && *err ? ": " : "", err ? err : "");
        free(id);
        free(err);
        return NULL;
    }
    free(err);
    /* Apple's clang 15 is LLVM's 16 */
    const char *clang = strstr(id, "clang version ");
    int32_t apple = clang && clang - id >= 6 && !strncmp(clang - 6, "Apple ", 6);
    if (!clang || atoi(clang + strlen("clang version ")) < (apple ? 15 : 16)) {
        mcpu_fail(st, MCPU_ERR_COMPILE,
                "CPU Metal device: the C++ compiler '%s' (from %s) is not clang 16 or newer (it says: %.*s); "
                "kernels compile with clang's address spaces; " CLANG_ADVICE,
                cxx->text, cxx->source, (int)strcspn(id, "\n"), id);
        free(id);
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    char *c = strdup(cxx->text), *i = strdup(id);
    if (c && i) {
        free(g_cxx);
        free(g_cxx_id);
        g_cxx = c;
        g_cxx_id = i;
    } else {
        free(c);
        free(i);
    }
    pthread_mutex_unlock(&g_lock);
    return id;
}

/* Whether dir/name holds exactly `text` and the cache may trust it. */
static int32_t holds(const char *dir, const char *name, const char *text) {
    char path[PATH_BYTES];
    mcpu_status ignored;
    if (join(path, dir, name, &ignored)) return 0;
    int fd = open_trusted(path, &ignored);
    if (fd < 0) return 0;
    uint64_t n, want = strlen(text);
    char *got = read_fd(fd, want + 1, &n);
    close(fd);
    int32_t same = got && n == want && !memcmp(got, text, (size_t)n);
    free(got);
    return same;
}

/* Number of entries of a directory other than . and .., or -1. */
static int64_t entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int64_t n = 0;
    for (struct dirent *e; (e = readdir(d));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

/* Whether dir is a complete shim directory holding nothing else, every entry trusted. Every
 * compiled library includes these headers: a planted or edited one must never be used. */
static int32_t shim_intact(const char *dir) {
    char inc[PATH_BYTES];
    mcpu_status ignored;
    if (trusted_dir(dir, &ignored) || join(inc, dir, "include", &ignored) || trusted_dir(inc, &ignored)) return 0;
    if (entries(dir) != (int64_t)mcpu_shim_file_count + 1 || entries(inc) != (int64_t)COUNT(STUBS)) return 0;
    for (uint32_t i = 0; i < mcpu_shim_file_count; i++)
        if (!holds(dir, mcpu_shim_files[i].name, mcpu_shim_files[i].text)) return 0;
    for (uint32_t i = 0; i < COUNT(STUBS); i++)
        if (!holds(inc, STUBS[i], "")) return 0;
    return 1;
}

/* <base>/shim-<hash>/ with the shim headers and include/ with empty <metal_*> stubs. Built in a
 * temporary directory and renamed into place; an existing one is used only if it holds exactly
 * these files with exactly this text, otherwise it is replaced (or refused if it is not ours). */
static int32_t shim_dir(const char *base, char *dir, mcpu_status *st) {
    char hash[33], name[64], tmp[PATH_BYTES], path[PATH_BYTES], inc[PATH_BYTES];
    struct stat sb;
    shim_hash(hash);
    snprintf(name, sizeof name, "shim-%.16s", hash);
    if (join(dir, base, name, st)) return st->code;
    for (int attempt = 0; attempt < 2; attempt++) {
        if (!lstat(dir, &sb)) {
            if (shim_intact(dir)) return MCPU_OK;
            char why[160];
            const char *bad = untrusted(&sb, why);
            if (bad) return refuse(st, dir, bad);
            rm_tree(dir); /* ours but incomplete or edited: rebuild it */
        }
        if (join(tmp, base, "tmp-XXXXXX", st)) return st->code;
        if (!mkdtemp(tmp)) return io_fail(st, "create directory in", base);
        int32_t rc = join(inc, tmp, "include", st);
        if (!rc && mkdir(inc, 0700)) rc = io_fail(st, "create directory", inc);
        for (uint32_t i = 0; !rc && i < mcpu_shim_file_count; i++)
            if (!(rc = join(path, tmp, mcpu_shim_files[i].name, st)))
                rc = write_file(path, mcpu_shim_files[i].text, strlen(mcpu_shim_files[i].text), st);
        for (uint32_t i = 0; !rc && i < COUNT(STUBS); i++)
            if (!(rc = join(path, inc, STUBS[i], st))) rc = write_file(path, "", 0, st);
        if (!rc && rename(tmp, dir) && !(errno == EEXIST || errno == ENOTEMPTY)) rc = io_fail(st, "create", dir);
        rm_tree(tmp); /* nothing left if the rename happened; another process's copy won otherwise */
        if (rc) return rc;
    }
    if (shim_intact(dir)) return MCPU_OK;
    return mcpu_fail(st, MCPU_ERR_RUNTIME, "CPU Metal device: %s keeps changing while it is written", dir);
}

int32_t mcpu_shim_dir(char *out, size_t out_len, mcpu_status *st) {
    char cache[PATH_BYTES], dir[PATH_BYTES];
    if (out == NULL || out_len == 0) return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_shim_dir: no output buffer");
    if (mcpu_cache_dir(cache, sizeof cache, st) || shim_dir(cache, dir, st)) return st->code;
    if (strlen(dir) >= out_len) return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_shim_dir: path longer than %zu bytes", out_len);
    snprintf(out, out_len, "%s", dir);
    return MCPU_OK;
}

/* ---- building ---- */

/* Length of a line's "file:line:col" prefix, or 0. */
static uint64_t location(const char *line) {
    if (*line == ' ' || *line == '\t') return 0;
    for (const char *c = strchr(line, ':'); c && c > line && c < line + strcspn(line, "\n");
         c = strchr(c + 1, ':')) {
        uint64_t a = strspn(c + 1, "0123456789"),
                 b = a && c[1 + a] == ':' ? strspn(c + 2 + a, "0123456789") : 0;
        if (b && c[2 + a + b] == ':') return (uint64_t)(c - line) + 2 + a + b;
    }
    return 0;
}

static const char *next_line(const char *line) {
    line += strcspn(line, "\n");
    return *line ? line + 1 : line;
}

static int32_t mentions(const char *line, const char *what) {
    const char *hit = strstr(line, what);
    return hit && hit < line + strcspn(line, "\n");
}

/* The end of one diagnostic's block of lines. */
static int32_t boundary(const char *line) { return mentions(line, "error:") || mentions(line, "warning:"); }

/* The whole output in file `log` (written in tmp, renamed into place), and the line that names it
 * in `note`; note is "" when log is NULL (a read-only cache) or cannot be written. */
static void keep_log(const char *out, uint64_t n, const char *tmp, const char *log, char note[PATH_BYTES + 96]) {
    char path[PATH_BYTES];
    mcpu_status ignored;
    uint64_t errors = 0;
    note[0] = 0;
    if (!log || join(path, tmp, ".compiler-output.log", &ignored) || write_file(path, out, n, &ignored) ||
        rename(path, log))
        return;
    for (const char *line = out; *line; line = next_line(line)) errors += (uint64_t)mentions(line, "error:");
    snprintf(note, PATH_BYTES + 96, "the whole compiler output (%llu errors, %llu bytes): %s\n",
             (unsigned long long)errors, (unsigned long long)n, log);
}

/* MCPU_ERR_COMPILE with the compiler's output, temporary-directory prefixes removed: first the first
 * error as .metal file:line:col (line markers give those; an error inside the shim is reported at
 * the first .metal location the compiler names for it), then where the whole output is kept (log),
 * then as much of it as the message holds. */
static int32_t ident_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

static int32_t compile_error(mcpu_status *st, const char *what, int32_t rc, char *out, const char *tmp,
                             const char *shim, const char *log) {
    if (!out || !*out) {
        free(out);
        return mcpu_fail(st, MCPU_ERR_COMPILE, "%s failed (status %d) without a message", what, rc);
    }
    /* without the temporary directory's prefix, and with clang's names of the address spaces
     * (msl_shim.h) spelled as in MSL; a name grows by at most 11/7 */
    static const char *const SPACES[][2] = {{"__global_device", "device"}, {"__global_host", "constant"},
                                            {"__local", "threadgroup"}};
    char prefix[PATH_BYTES], *text = malloc(strlen(out) * 2 + 1);
    if (!text) {
        free(out);
        return mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    }
    uint64_t pn = (uint64_t)snprintf(prefix, sizeof prefix, "%s/", tmp), w = 0, sn = strlen(shim);
    for (uint64_t r = 0; out[r];) {
        if (!strncmp(out + r, prefix, (size_t)pn)) {
            r += pn;
            continue;
        }
        int32_t starts = r == 0 || !ident_char(out[r - 1]);
        uint64_t k = 0, n = 0;
        for (; starts && k < COUNT(SPACES); k++)
            if (!strncmp(out + r, SPACES[k][0], (size_t)(n = strlen(SPACES[k][0]))) && !ident_char(out[r + n])) break;
        if (starts && k < COUNT(SPACES)) {
            w += (uint64_t)sprintf(text + w, "%s", SPACES[k][1]);
            r += n;
            continue;
        }
        text[w++] = out[r++];
    }
    text[w] = 0;
    free(out);
    out = text;
    char note[PATH_BYTES + 96];
    keep_log(out, w, tmp, log, note);
    const char *first = NULL, *from = NULL;
    for (const char *line = out; *line && !first; line = next_line(line))
        if (mentions(line, "error:")) first = line;
    /* inside the shim: clang names the kernel's line after the error (notes) */
    for (const char *line = first; line && *line && !strncmp(first, shim, (size_t)sn) && !from;) {
        line = next_line(line);
        if (boundary(line)) break;
        if (strncmp(line, shim, (size_t)sn) && location(line)) from = line;
    }
    if (from) {
        const char *msg = strstr(first, "error:");
        mcpu_fail(st, MCPU_ERR_COMPILE, "%.*s: %.*s\n%s%s", (int)location(from), from, (int)strcspn(msg, "\n"), msg,
                note, out);
    } else if (first) {
        mcpu_fail(st, MCPU_ERR_COMPILE, "%.*s\n%s%s", (int)strcspn(first, "\n"), first, note, out);
    } else {
        mcpu_fail(st, MCPU_ERR_COMPILE, "%s failed (status %d)\n%s%s", what, rc, note, out);
    }
    free(out);
    return MCPU_ERR_COMPILE;
}

/* A file name for the source inside the temporary directory: source_name without path separators
 * and without a leading '.', which the build's own files (.preprocessed.ii, ...) start with. */
static void safe_name(const char *source_name, char out[128]) {
    uint64_t n = 0;
    for (const char *c = source_name; *c && n < 100; c++)
        out[n++] = (*c == '/' || *c == '\\' || *c == '\n' || (c == source_name && *c == '.')) ? '_' : *c;
    out[n] = 0;
}

/* "note: ..." when the file system holding dir is (nearly) full, else "". */
static void disk_note(const char *dir, char note[PATH_BYTES + 96]) {
    struct statvfs fs;
    uint64_t free_bytes = 0;
    note[0] = 0;
    if (!statvfs(dir, &fs) && (free_bytes = (uint64_t)fs.f_bavail * fs.f_frsize) < (64u << 20))
        snprintf(note, PATH_BYTES + 96, "note: the file system holding %s has only %llu bytes free\n", dir,
                 (unsigned long long)free_bytes);
}

/* One compiler run of the build; MCPU_OK or the failure in st. */
static int32_t compiler_step(const command *cxx, char *const args[], uint64_t n_args, const char *what,
                             const char *tmp, const char *shim, const char *log, double timeout, mcpu_status *st) {
    char **argv = with_args(cxx, args, n_args), *err = NULL, why[96];
    if (!argv) return mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    int32_t status = run(argv, NULL, &err, timeout);
    int32_t saved = errno;
    free(argv);
    if (status == 0) {
        free(err);
        return MCPU_OK;
    }
    if (status < 0) {
        errno = saved;
        mcpu_fail(st, status == -1 ? MCPU_ERR_UNSUPPORTED : MCPU_ERR_COMPILE,
                "CPU Metal device: %s with '%s' (from %s) failed: %s", what, cxx->text, cxx->source,
                run_failure(status, timeout, why));
        free(err);
        return st->code;
    }
    char note[PATH_BYTES + 96];
    disk_note(tmp, note);
    if (*note) { /* a full disk explains what the compiler says about it */
        uint64_t n = strlen(note), m = err ? strlen(err) : 0;
        char *both = malloc((size_t)(n + m + 1));
        if (both) {
            memcpy(both, note, (size_t)n);
            memcpy(both + n, err ? err : "", (size_t)m + 1);
            free(err);
            err = both;
        }
    }
    return compile_error(st, what, status, err, tmp, shim, log);
}

static const char KEY_MARK[] = "flashattn_mps CPU Metal library ";

/* LLVM IR text without the attribute `convergent` (CC_FLAGS): in the attribute groups (lines
 * "attributes #N = { ... }"), outside quoted strings, the word becomes NOT_CONVERGENT. NULL when
 * out of memory. */
static char *drop_convergent(const char *ir) {
    static const char word[] = "convergent";
    const uint64_t k = sizeof word - 1, grow = sizeof NOT_CONVERGENT - sizeof word;
    uint64_t count = 0;
    for (const char *c = ir; (c = strstr(c, word)); c += k) count++;
    char *out = malloc((size_t)(strlen(ir) + count * grow + 1)), *w = out;
    if (!out) return NULL;
    for (const char *line = ir; *line;) {
        const char *end = line + strcspn(line, "\n");
        end += *end == '\n';
        int32_t group = !strncmp(line, "attributes #", 12), quoted = 0;
        for (const char *c = line; c < end;) {
            if (*c == '"') quoted = !quoted;
            int32_t here = group && !quoted && c > line && c[-1] == ' ' && !strncmp(c, word, k);
            if (here && (c[k] == ' ' || c[k] == '}')) {
                memcpy(w, NOT_CONVERGENT, sizeof NOT_CONVERGENT - 1);
                w += sizeof NOT_CONVERGENT - 1, c += k;
            } else {
                *w++ = *c++;
            }
        }
        line = end;
    }
    *w = 0;
    return out;
}

/* Apple GPUs load and store a vector at any address aligned to its element (ggml's kernel_mul_mm
 * writes float4s into output rows of any length), but the front end promises every access through a
 * pointer the alignment of the pointee's type, and x86 faults on a 16-byte access so promised
 * (movaps). So every ordinary load and store, memory intrinsic, pointer argument and returned
 * pointer promises alignment 1 here, and the optimiser infers what it can prove (stack slots and
 * globals, aligned where they are allocated: they and their accesses run at full speed). Kept:
 * allocations (alloca, globals), atomics (their alignment decides whether they are lock-free), the
 * ABI's stack slots (byval and kin) and a function's own alignment. */
static const char ALIGNMENT_RULE[] = "align 1: load, store, call, define, declare"; /* in the cache key */

/* Where the access promises of an IR line end (the line itself when it holds none): an ordinary
 * load or store, a call, a function's header up to its parameter list's end. */
static const char *promises_end(const char *line, const char *end) {
    const char *c = line + strspn(line, " ");
    int32_t header = c == line && (!strncmp(c, "define ", 7) || !strncmp(c, "declare ", 8));
    if (header) { /* after the name, the parameters' parentheses (names and types hold none unquoted) */
        int32_t quoted = 0, depth = 0;
        for (const char *at = strchr(c, '@'); at && at < end; at++) {
            if (*at == '"') quoted = !quoted;
            else if (!quoted && *at == '(') depth++;
            else if (!quoted && *at == ')' && !--depth) return at;
        }
        return line;
    }
    if (c == line) return line; /* globals, types, attribute groups, metadata */
    if (*c == '%') {
        const char *eq = strstr(c, " = ");
        if (!eq || eq >= end) return line;
        c = eq + 3;
    }
    static const char *const calls[] = {"call ", "tail call ", "musttail call ", "notail call ", "invoke "};
    for (uint64_t i = 0; i < COUNT(calls); i++)
        if (!strncmp(c, calls[i], strlen(calls[i]))) return end;
    if (!strncmp(c, "load ", 5) || !strncmp(c, "store ", 6)) /* `load atomic`, `store atomic` keep theirs */
        return strncmp(c + 5 + (*c == 's'), "atomic ", 7) ? end : line;
    return line;
}

/* IR text whose access promises say align 1 (ALIGNMENT_RULE). NULL when out of memory. */
static char *relax_alignment(const char *ir) {
    static const char *const abi[] = {"byval(", "byref(", "inalloca(", "preallocated("};
    char *out = malloc(strlen(ir) + 1), *w = out; /* never longer: align N becomes align 1 */
    if (!out) return NULL;
    for (const char *line = ir; *line;) {
        const char *end = line + strcspn(line, "\n");
        end += *end == '\n';
        const char *stop = promises_end(line, end), *c = line;
        for (int32_t quoted = 0; c < stop;) {
            if (*c == '"') quoted = !quoted;
            uint64_t k = 0;
            for (uint64_t i = 0; !quoted && i < COUNT(abi) && !k; i++)
                if (c[0] == ' ' && !strncmp(c + 1, abi[i], strlen(abi[i]))) k = 1 + strlen(abi[i]);
            if (k) { /* `byval(T) align N` as it is */
                for (int32_t depth = 1; c + k < stop && depth; k++) depth += (c[k] == '(') - (c[k] == ')');
                if (!strncmp(c + k, " align ", 7)) k += 7 + strspn(c + k + 7, "0123456789");
                memcpy(w, c, k);
                w += k, c += k;
            } else if (!quoted && !strncmp(c, " align ", 7) && c[7] >= '0' && c[7] <= '9') {
                memcpy(w, " align 1", 8);
                w += 8, c += 7 + strspn(c + 7, "0123456789");
            } else {
                *w++ = *c++;
            }
        }
        memcpy(w, c, (size_t)(end - c));
        w += end - c, line = end;
    }
    *w = 0;
    return out;
}

/* Builds tmp/.library.so from source, with the shim in `shim`. The library exports
 * __msl_library_key = KEY_MARK + key: what it was built for, checked when it is loaded. A failing
 * compiler's whole output goes to file `log` (NULL: nowhere). */
static int32_t build(const command *cxx, int32_t clash, int32_t checked, const char *shim, const char *tmp,
                     const char *log, const char *key, const char *source, const char *source_name, const mcpu_macro *macros,
                     uint32_t n_macros, double timeout, mcpu_status *st) {
    char base[128], src[PATH_BYTES], pre[PATH_BYTES], cpp[PATH_BYTES], ll[PATH_BYTES], rewritten_ll[PATH_BYTES],
        so[PATH_BYTES], inc[PATH_BYTES], shim_h[PATH_BYTES];
    safe_name(source_name, base);
    if (join(src, tmp, base, st) || join(pre, tmp, ".preprocessed.ii", st) || join(cpp, tmp, ".kernels.cpp", st) ||
        join(ll, tmp, ".kernels.ll", st) || join(rewritten_ll, tmp, ".rewritten.ll", st) ||
        join(so, tmp, ".library.so", st) || join(inc, shim, "include", st) || join(shim_h, shim, "msl_shim.h", st))
        return st->code;

    /* 1. the source, with a #line so diagnostics name source_name */
    const char *s = source + strspn(source, " \t");
    int32_t has_line = s[0] == '#' && !strncmp(s + 1 + strspn(s + 1, " \t"), "line", 4);
    int fd = open(src, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        return io_fail(st, "create", src);
    }
    if (!has_line) {
        fputs("#line 1 \"", f);
        for (const char *c = source_name; *c; c++) {
            if (*c == '"' || *c == '\\') fputc('\\', f);
            fputc(*c == '\n' ? ' ' : *c, f);
        }
        fputs("\"\n", f);
    }
    fputs(source, f);
    if (ferror(f) | fclose(f)) return io_fail(st, "write", src);

    /* 2. c++ -E with the macros */
    uint64_t argc = 0, cap = COUNT(PRE_FLAGS) + n_macros + 8;
    char **argv = calloc((size_t)cap, sizeof *argv), **defs = calloc((size_t)n_macros + 1, sizeof *defs);
    int32_t rc = argv && defs ? MCPU_OK : mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    if (!rc) {
        for (uint64_t i = 0; i < COUNT(PRE_FLAGS); i++) argv[argc++] = (char *)PRE_FLAGS[i];
        for (uint32_t i = 0; i < n_macros && !rc; i++) {
            const char *v = macros[i].value && *macros[i].value ? macros[i].value : "1";
            uint64_t n = strlen(macros[i].name) + strlen(v) + 4;
            if (!(defs[i] = malloc((size_t)n))) {
                rc = mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
            } else {
                snprintf(defs[i], (size_t)n, "-D%s=%s", macros[i].name, v);
                argv[argc++] = defs[i];
            }
        }
        argv[argc++] = "-I";
        argv[argc++] = inc;
        argv[argc++] = src;
        argv[argc++] = "-o";
        argv[argc++] = pre;
    }
    if (!rc) rc = compiler_step(cxx, argv, argc, "preprocessing", tmp, shim, log, timeout, st);
    for (uint32_t i = 0; defs && i < n_macros; i++) free(defs[i]);
    free(defs);
    free(argv);
    if (rc) return rc;

    /* 3. the prepass, plus the key the library is built for */
    fd = open(pre, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    char *text = fd >= 0 ? read_fd(fd, UINT64_MAX, NULL) : NULL;
    if (fd >= 0) close(fd);
    if (!text) return io_fail(st, "read", pre);
    char *out = mcpu_preprocess(text, source_name, 0, st);
    free(text);
    if (!out) return st->code;
    char mark[160];
    int n_mark = snprintf(mark, sizeof mark,
                          "\nextern \"C\" __attribute__((visibility(\"default\"))) const char __msl_library_key[] ="
                          " \"%s%s\";\n",
                          KEY_MARK, key);
    uint64_t n_out = strlen(out);
    char *all = realloc(out, (size_t)(n_out + (uint64_t)n_mark + 1));
    if (!all) {
        free(out);
        return mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    }
    memcpy(all + n_out, mark, (size_t)n_mark + 1);
    rc = write_file(cpp, all, n_out + (uint64_t)n_mark, st);
    free(all);
    if (rc) return rc;

    /* 4. the front end, to IR */
    char *cc[COUNT(CC_FLAGS) + COUNT(IR_FLAGS) + COUNT(CHECKED_FLAGS) + 12], cwd[PATH_BYTES],
        prefix_map[PATH_BYTES + 32];
    uint64_t n = 0;
    for (uint64_t i = 0; i < COUNT(CC_FLAGS); i++) cc[n++] = (char *)CC_FLAGS[i];
    for (uint64_t i = 0; i < COUNT(IR_FLAGS); i++) cc[n++] = (char *)IR_FLAGS[i];
    if (clash) cc[n++] = (char *)STACK_CLASH_FLAG;
    if (checked) {
        for (uint64_t i = 0; i < COUNT(CHECKED_FLAGS); i++) cc[n++] = (char *)CHECKED_FLAGS[i];
        /* source names as the #line directives give them, not under the compiler's directory */
        if (getcwd(cwd, sizeof cwd) && snprintf(prefix_map, sizeof prefix_map, "-fdebug-prefix-map=%s=.", cwd) <
                                           (int)sizeof prefix_map)
            cc[n++] = prefix_map;
    }
    cc[n++] = "-include";
    cc[n++] = shim_h;
    cc[n++] = cpp;
    cc[n++] = "-o";
    cc[n++] = ll;
    if ((rc = compiler_step(cxx, cc, n, "compiling", tmp, shim, log, timeout, st))) return rc;

    /* 5. without convergent, with the alignment vectors have on Apple GPUs */
    fd = open(ll, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    text = fd >= 0 ? read_fd(fd, UINT64_MAX, NULL) : NULL;
    if (fd >= 0) close(fd);
    if (!text) return io_fail(st, "read", ll);
    char *sequential = drop_convergent(text);
    free(text);
    char *rewritten = sequential ? relax_alignment(sequential) : NULL;
    free(sequential);
    if (!rewritten) return mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    rc = write_file(rewritten_ll, rewritten, strlen(rewritten), st);
    free(rewritten);
    if (rc) return rc;

    /* 6. optimise, generate code and link */
    n = 0;
    for (uint64_t i = 0; i < COUNT(CODEGEN_FLAGS); i++) cc[n++] = (char *)CODEGEN_FLAGS[i];
    if (checked) cc[n++] = (char *)CODEGEN_CHECKED_FLAG;
    cc[n++] = rewritten_ll;
    cc[n++] = "-o";
    cc[n++] = so;
    cc[n++] = "-lm";
    return compiler_step(cxx, cc, n, "generating code", tmp, shim, log, timeout, st);
}

/* Whether the compiler takes STACK_CLASH_FLAG (probe each page of a large frame, so a frame larger
 * than the fiber stack still lands on its guard). Decided by the compiler's identity, which is
 * in the cache key; asked once per process and compiler. */
static int32_t stack_clash_supported(const command *cxx, double timeout) {
    static char *asked;
    static int32_t answer;
    pthread_mutex_lock(&g_lock);
    int32_t known = asked && !strcmp(asked, cxx->text);
    int32_t result = answer;
    pthread_mutex_unlock(&g_lock);
    if (known) return result;
    char *args[] = {(char *)STACK_CLASH_FLAG, "-Werror", "-x", "c++", "-S", "-o", "/dev/null", "/dev/null"};
    char **argv = with_args(cxx, args, COUNT(args)), *err = NULL;
    int32_t status = argv ? run(argv, NULL, &err, timeout) : -1;
    free(argv);
    free(err);
    if (status < 0) return 0; /* not an answer (stopped): the build's own runs say why */
    pthread_mutex_lock(&g_lock);
    free(asked);
    asked = strdup(cxx->text);
    answer = status == 0;
    pthread_mutex_unlock(&g_lock);
    return status == 0;
}

/* dlopens a library built for key (its __msl_library_key must say so) and binds it. */
static mcpu_library *load(const char *path, const char *key, mcpu_status *st) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        mcpu_fail(st, MCPU_ERR_COMPILE, "CPU Metal device: cannot load %s: %s", path, dlerror());
        return NULL;
    }
    void (*bind)(const msl_runtime_api *);
    *(void **)&bind = dlsym(h, "__msl_bind_runtime"); /* POSIX's way to get a function pointer */
    const char *const *names = (const char *const *)dlsym(h, "__msl_kernel_names");
    const char *built_for = (const char *)dlsym(h, "__msl_library_key");
    const msl_runtime_api *api = mcpu_runtime_api();
    mcpu_library *lib = calloc(1, sizeof *lib);
    uint64_t n = 0;
    while (names && names[n]) n++;
    if (lib) lib->fns = calloc((size_t)n + 1, sizeof *lib->fns);
    if (!bind || !names || !api || api->abi_version != MSL_ABI_VERSION || !lib || !lib->fns) {
        mcpu_fail(st, MCPU_ERR_COMPILE, "CPU Metal device: %s is not a kernel library for runtime ABI %u", path,
                MSL_ABI_VERSION);
        goto fail;
    }
    if (!built_for || strncmp(built_for, KEY_MARK, sizeof KEY_MARK - 1) || strcmp(built_for + sizeof KEY_MARK - 1, key)) {
        mcpu_fail(st, MCPU_ERR_COMPILE, "CPU Metal device: %s was built for another key than %s", path, key);
        goto fail;
    }
    for (uint64_t i = 0; i < n; i++) {
        char sym[1024];
        snprintf(sym, sizeof sym, "__msl_launch_%s", names[i]);
        *(void **)&lib->fns[i] = dlsym(h, sym);
        if (!lib->fns[i]) {
            mcpu_fail(st, MCPU_ERR_COMPILE, "CPU Metal device: %s lacks %s", path, sym);
            goto fail;
        }
    }
    bind(api);
    snprintf(lib->key, sizeof lib->key, "%s", key);
    lib->handle = h;
    lib->names = names;
    lib->n = n;
    return lib;
fail:
    if (lib) free(lib->fns);
    free(lib);
    dlclose(h);
    return NULL;
}

/* <key>.sum, what the cache knows of <key>.so: its key, size and digest. */
static void manifest(char out[256], const char *key, const char *data, uint64_t n) {
    sha256 s;
    char digest[33];
    sha_init(&s);
    sha_update(&s, data, n);
    sha_hex(&s, digest);
    snprintf(out, 256, "%skey %s\nbytes %llu\nsha256-128 %s\n", KEY_MARK, key, (unsigned long long)n, digest);
}

enum { CACHE_MISS = 0, CACHE_HIT = 1, CACHE_REFUSED = -1 };

/* <dir>/<key>.so, loaded only if the cache vouches for it: both it and <key>.sum are regular files
 * only the current user can write (else CACHE_REFUSED, st says why), and the library's size and
 * digest match the manifest, which names key (else CACHE_MISS with *damaged = 1: a truncated or
 * swapped library is rebuilt, never loaded: dlopen of a truncated file dies of SIGBUS). */
static int32_t load_cached(const char *dir, const char *key, mcpu_library **lib, int32_t *damaged, mcpu_status *st) {
    char so[PATH_BYTES], sum[PATH_BYTES], name[64], want[256];
    *lib = NULL;
    *damaged = 0;
    snprintf(name, sizeof name, "%s.so", key);
    if (join(so, dir, name, st)) return CACHE_REFUSED;
    snprintf(name, sizeof name, "%s.sum", key);
    if (join(sum, dir, name, st)) return CACHE_REFUSED;
    int fd_so = open_trusted(so, st);
    if (fd_so == -2) return CACHE_REFUSED;
    int fd_sum = fd_so >= 0 ? open_trusted(sum, st) : -1;
    if (fd_sum == -2) {
        close(fd_so);
        return CACHE_REFUSED;
    }
    if (fd_so < 0 || fd_sum < 0) {
        *damaged = fd_so >= 0; /* a library without its manifest: an interrupted install */
        if (fd_so >= 0) close(fd_so);
        return CACHE_MISS;
    }
    uint64_t n_so = 0, n_sum = 0;
    char *data = read_fd(fd_so, UINT64_MAX, &n_so), *got = read_fd(fd_sum, 256, &n_sum);
    close(fd_so);
    close(fd_sum);
    if (data && got) manifest(want, key, data, n_so);
    *damaged = !data || !got || strcmp(got, want);
    free(data);
    free(got);
    if (*damaged) return CACHE_MISS;
    mcpu_status ignored;
    *lib = load(so, key, &ignored);
    *damaged = !*lib;
    return *lib ? CACHE_HIT : CACHE_MISS;
}

/* Moves the built library into the cache as <key>.so (private, fsync'ed, renamed, directory
 * fsync'ed), then writes its manifest <key>.sum the same way. */
static int32_t install(const char *built, const char *dir, const char *key, mcpu_status *st) {
    char so[PATH_BYTES], name[64], text[256];
    snprintf(name, sizeof name, "%s.so", key);
    if (join(so, dir, name, st)) return st->code;
    int fd = open(built, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    uint64_t n = 0;
    char *data = fd >= 0 ? read_fd(fd, UINT64_MAX, &n) : NULL;
    int32_t rc = !data || fchmod(fd, 0700) || fsync(fd) ? io_fail(st, "read", built) : MCPU_OK;
    if (fd >= 0) close(fd);
    if (!rc) manifest(text, key, data, n);
    free(data);
    if (!rc && rename(built, so)) rc = io_fail(st, "move the compiled library to", so);
    if (rc) return rc;
    sync_dir(dir);
    snprintf(name, sizeof name, "%s.sum", key);
    return write_atomic(dir, name, text, strlen(text), st);
}

static mcpu_library *find(const char *key, uint32_t mode) {
    mcpu_library *l = g_libs;
    while (l && (strcmp(l->key, key) || l->mode != mode)) l = l->next;
    return l;
}

static int32_t valid_macro(const mcpu_macro *m) {
    const char *c = m->name;
    if (!c || !ident_char(*c) || (*c >= '0' && *c <= '9')) return 0;
    for (; *c; c++)
        if (!ident_char(*c)) return 0;
    return !m->value || !strpbrk(m->value, "\r\n");
}

/* Builds the library for key into the cache, or, when the cache is read-only, into a private
 * temporary directory it is loaded from (and not kept). */
static mcpu_library *build_and_load(const char *cache, const command *cxx, const char *id, double timeout,
                                    const char *key, int32_t damaged, int32_t checked, const char *source, const char *source_name,
                                    const mcpu_macro *macros, uint32_t n_macros, mcpu_status *st) {
    char base[PATH_BYTES], shim[PATH_BYTES], tmp[PATH_BYTES], built[PATH_BYTES], name[64], log[PATH_BYTES];
    mcpu_signals_ensure(); /* Ctrl-C stops the compiler */
    int32_t writable = access(cache, W_OK) == 0;
    if (writable) {
        snprintf(base, sizeof base, "%s", cache);
    } else {
        const char *t = getenv("TMPDIR");
        if (snprintf(base, sizeof base, "%s/flashattn_mps-XXXXXX", t && *t ? t : "/tmp") >= PATH_BYTES - 128 ||
            !mkdtemp(base)) {
            io_fail(st, "create a private build directory for the read-only cache", cache);
            return NULL;
        }
    }
    if (damaged && writable)
        for (int i = 0; i < 2; i++) {
            snprintf(name, sizeof name, i ? "%s.sum" : "%s.so", key);
            if (!join(tmp, cache, name, st)) unlink(tmp);
        }
    mcpu_library *lib = NULL;
    snprintf(name, sizeof name, "%s.log", key); /* a failed build's compiler output, in a writable cache */
    int32_t rc = shim_dir(base, shim, st) || join(tmp, base, "tmp-XXXXXX", st) || join(log, cache, name, st)
                     ? st->code
                     : MCPU_OK;
    if (!rc && !mkdtemp(tmp)) rc = io_fail(st, "create directory in", base);
    if (!rc) {
        rc = build(cxx, stack_clash_supported(cxx, timeout), checked, shim, tmp,
                   writable ? log : NULL, key, source, source_name, macros, n_macros, timeout, st);
        if (!rc) rc = join(built, tmp, ".library.so", st);
        if (!rc && writable && !(rc = install(built, cache, key, st))) {
            int32_t again;
            if (load_cached(cache, key, &lib, &again, st) == CACHE_MISS)
                mcpu_fail(st, MCPU_ERR_COMPILE, "CPU Metal device: the library just built for %s does not load from %s",
                        key, cache);
        } else if (!rc) {
            lib = load(built, key, st);
        }
        rm_tree(tmp);
    }
    if (!writable) rm_tree(base);
    return lib;
}

static int32_t compile(const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
                       uint32_t mode, mcpu_library **out, mcpu_status *st) {
    const int32_t checked = mode != 0; /* instrumented: checked mode and lockstep share the build */
    char cache[PATH_BYTES], key[33];
    command cxx;
    double timeout;
    if (mcpu_cache_dir(cache, sizeof cache, st) || compiler(&cxx, st) || compile_timeout(&timeout, st))
        return st->code;
    tls_interrupts = mcpu_interrupts();
    char *id = compiler_identity(&cxx, timeout, st);
    if (!id) return st->code;

    sha256 s;
    sha_init(&s);
    sha_field(&s, "flashattn_mps CPU Metal library v2");
    sha_update(&s, &(uint32_t){MSL_ABI_VERSION}, 4);
    sha_field(&s, source);
    sha_field(&s, source_name);
    for (uint32_t i = 0; i < n_macros; i++) {
        sha_field(&s, macros[i].name);
        sha_field(&s, macros[i].value && *macros[i].value ? macros[i].value : "1");
    }
    for (uint32_t i = 0; i < mcpu_shim_file_count; i++) {
        sha_field(&s, mcpu_shim_files[i].name);
        sha_field(&s, mcpu_shim_files[i].text);
    }
    for (uint32_t i = 0; i < cxx.argc; i++) sha_field(&s, cxx.argv[i]);
    sha_field(&s, id);
    for (uint64_t i = 0; i < COUNT(PRE_FLAGS); i++) sha_field(&s, PRE_FLAGS[i]);
    for (uint64_t i = 0; i < COUNT(CC_FLAGS); i++) sha_field(&s, CC_FLAGS[i]);
    for (uint64_t i = 0; i < COUNT(IR_FLAGS); i++) sha_field(&s, IR_FLAGS[i]);
    sha_field(&s, NOT_CONVERGENT); /* drop_convergent */
    sha_field(&s, ALIGNMENT_RULE); /* relax_alignment */
    for (uint64_t i = 0; i < COUNT(CODEGEN_FLAGS); i++) sha_field(&s, CODEGEN_FLAGS[i]);
    if (checked)
        for (uint64_t i = 0; i < COUNT(CHECKED_FLAGS); i++) sha_field(&s, CHECKED_FLAGS[i]);
    if (checked) sha_field(&s, CODEGEN_CHECKED_FLAG);
    sha_hex(&s, key);

    pthread_mutex_lock(&g_lock);
    mcpu_library *lib = find(key, mode);
    pthread_mutex_unlock(&g_lock);
    int32_t damaged = 0;
    if (!lib && load_cached(cache, key, &lib, &damaged, st) == CACHE_REFUSED) {
        free(id);
        return st->code;
    }
    if (!lib)
        lib = build_and_load(cache, &cxx, id, timeout, key, damaged, checked, source, source_name, macros, n_macros, st);
    free(id);
    if (!lib) return st->code;
    lib->mode = mode;

    pthread_mutex_lock(&g_lock);
    mcpu_library *raced = find(key, mode); /* another thread finished first: same object, keep theirs */
    if (!raced) {
        lib->next = g_libs;
        g_libs = lib;
    }
    pthread_mutex_unlock(&g_lock);
    if (raced && raced != lib) {
        dlclose(lib->handle); /* drops our reference; theirs keeps it loaded */
        free(lib->fns);
        free(lib);
        lib = raced;
    }
    *out = lib;
    return MCPU_OK;
}

int32_t mcpu_compile_library(const char *source, const char *source_name, const mcpu_macro *macros,
                             uint32_t n_macros, uint32_t mode, mcpu_library **out, mcpu_status *st) {
    mcpu_status local;
    if (!st) st = &local;
    if (out) *out = NULL;
    if (!source || !out || (n_macros && !macros))
        return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_compile_library: source, out and macros must not be NULL");
    for (uint32_t i = 0; i < n_macros; i++)
        if (!valid_macro(&macros[i]))
            return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_compile_library: bad macro %u ('%s')", i,
                           macros[i].name ? macros[i].name : "(null)");
    if (mode & ~(uint32_t)MCPU_MODES)
        return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_compile_library: mode %u has unknown bits (MCPU_CHECKED = 1, "
                       "MCPU_LOCKSTEP = 2)", mode);
    if (!source_name || !*source_name) source_name = "kernel.metal";
    return compile(source, source_name, macros, n_macros, mode, out, st);
}

const char *const *mcpu_library_kernels(const mcpu_library *lib) {
    static const char *const none[] = {NULL};
    return lib ? lib->names : none;
}

uint32_t mcpu_library_mode(const mcpu_library *lib) { return lib ? lib->mode : 0u; }

uint32_t mcpu_preprocessor_flags(const char *const **flags) {
    *flags = PRE_FLAGS;
    return (uint32_t)COUNT(PRE_FLAGS);
}

int32_t mcpu_run_tool(char *const argv[], char **out, double timeout) {
    char *err = NULL;
    tls_interrupts = mcpu_interrupts();
    int32_t status = run(argv, out, &err, timeout);
    free(err);
    return status;
}

mcpu_kernel_fn mcpu_library_kernel(const mcpu_library *lib, const char *name) {
    for (uint64_t i = 0; lib && name && i < lib->n; i++)
        if (!strcmp(lib->names[i], name)) return lib->fns[i];
    return NULL;
}
