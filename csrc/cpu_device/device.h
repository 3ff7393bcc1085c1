/* The CPU Metal device's internal declarations, shared by its files (metal_cpu.h is its API).
 *
 * Who calls whom (never both ways; status.c's mcpu_fail everywhere):
 *   python_module.cpp -> api.c, dispatch.c, library.c, modes.c, pool.c, cache.c, build.c, prepass.c
 *   api.c        (the capsule's table)         -> dispatch.c, library.c, modes.c
 *   dispatch.c   (validation, mcpu_dispatch)   -> library.c, pool.c
 *   library.c    (loading, the caches)         -> build.c, cache.c, compiler.c, subprocess.c, files.c,
 *                                                 trust.c, sha256.c, runtime.c (its table), signals.c
 *   build.c      (compiler runs, IR rewrites)  -> compiler.c, prepass.c, subprocess.c, files.c, sha256.c
 *   cache.c      (cache and shim directories)  -> files.c, trust.c, sha256.c
 *   compiler.c   (which compiler, identity)    -> subprocess.c, signals.c
 *   pool.c       (workers, watchdog, mcpu_run) -> runtime.c, checked.c, failures.c, fiber.c, signals.c
 *   runtime.c    (running threadgroups)        -> failures.c, faults.c, fiber.c, source_place.c
 *   checked.c    (guarded buffers, findings)   -> failures.c, source_place.c
 *   source_place.c (addr2line)                 -> subprocess.c
 *   subprocess.c (running tools)               -> signals.c
 *   trust.c -> files.c; files.c, sha256.c, signals.c, faults.c, fiber.c, modes.c, prepass.c,
 *   failures.c: nothing of the device. runtime.h holds what the runtime's files share. */
#ifndef MCPU_DEVICE_INTERNAL_H
#define MCPU_DEVICE_INTERNAL_H

#include "metal_cpu.h"

#include <signal.h>
#include <sys/stat.h>

enum { PATH_BYTES = 4096, MAX_OUTPUT = 1 << 20 };
#define COUNT(a) (sizeof(a) / sizeof *(a))

/* ---- signals.c ---- */

/* SIGINT (Ctrl-C) while the device works: a dispatch fails with MCPU_ERR_RUNTIME ("interrupted"),
 * a compile kills the compiler; the signal still reaches the handler installed before (Python's,
 * which raises KeyboardInterrupt once the call returns). mcpu_signals_ensure installs the
 * device's handlers once; mcpu_interrupts counts SIGINTs. */
void mcpu_signals_ensure(void);
uint64_t mcpu_interrupts(void);
/* What the handlers ask about any other signal first (the runtime's, for faults of kernel code
 * and its preemption): returns 1 when it handled the signal (or does not return), 0 to pass the
 * signal on to the handler installed before. Set before mcpu_signals_ensure by whoever needs it. */
typedef int (*mcpu_signal_hook)(int sig, siginfo_t *info, void *context);
void mcpu_signals_set_hook(mcpu_signal_hook hook);
/* Installs the handlers again where someone replaced them (the watchdog, now and then). */
void mcpu_signals_reinstall(void);

/* ---- sha256.c ---- */

typedef struct sha256 {
    uint32_t h[8];
    uint8_t buf[64];
    uint64_t len;
} sha256;

void sha_init(sha256 *s);
void sha_update(sha256 *s, const void *data, uint64_t n);
void sha_hex(sha256 *s, char out[33]);      /* hex of the first 16 bytes of the digest */
void sha_field(sha256 *s, const char *str); /* length-prefixed */

/* ---- files.c ---- */

int32_t io_fail(mcpu_status *st, const char *what, const char *path);
int32_t join(char *out, const char *a, const char *b, mcpu_status *st);
int32_t write_file(const char *path, const char *data, uint64_t n, mcpu_status *st);
void sync_dir(const char *dir);
int32_t write_atomic(const char *dir, const char *name, const char *data, uint64_t n, mcpu_status *st);
char *read_fd(int fd, uint64_t max, uint64_t *len);
void rm_tree(const char *path);
int32_t mkdir_p(const char *path, mcpu_status *st);

/* ---- trust.c ---- */

const char *untrusted(const struct stat *sb, char why[160]);
int32_t refuse(mcpu_status *st, const char *path, const char *why);
int32_t trusted_dir(const char *path, mcpu_status *st);
int32_t private_dir(const char *path, mcpu_status *st);
int open_trusted(const char *path, mcpu_status *st);

/* ---- subprocess.c ---- */

enum { RUN_TIMEOUT = -2, RUN_INTERRUPTED = -3 };
/* Runs of this thread stop on a SIGINT from now on (one Ctrl-C stops all of a compile's runs). */
void runs_stop_on_interrupts_from_now(void);
int32_t run(char *const argv[], char **out, char **err, double timeout);
int32_t compile_timeout(double *seconds, mcpu_status *st);
const char *run_failure(int32_t status, double timeout, char buf[96]);
/* Runs a tool (argv[0] looked up in PATH, no shell) capturing its stdout into *out (malloc'ed or
 * NULL); returns its exit status, or < 0 if it could not run. */
int32_t mcpu_run_tool(char *const argv[], char **out, double timeout);

/* ---- compiler.c ---- */

#define CLANG_ADVICE "install clang (Debian/Ubuntu: apt-get install clang-16) or set FLASHATTN_MPS_CXX"
#define STACK_CLASH_FLAG "-fstack-clash-protection"
enum { MAX_WORDS = 32 };
typedef struct command {
    char text[PATH_BYTES];
    char *argv[MAX_WORDS + 1];
    uint32_t argc;
    const char *source; /* the variable it came from, for messages */
} command;

int32_t compiler(command *c, mcpu_status *st);
char **with_args(const command *c, char *const extra[], uint64_t n_extra);
char *compiler_identity(const command *cxx, double timeout, mcpu_status *st);
int32_t stack_clash_supported(const command *cxx, double timeout);

/* ---- cache.c ---- */

int32_t shim_dir(const char *base, char *dir, mcpu_status *st);

/* ---- build.c ---- */

#define KEY_MARK "flashattn_mps CPU Metal library " /* what __msl_library_key starts with */
int32_t ident_char(char c);
int32_t build(const command *cxx, int32_t clash, int32_t checked, const char *shim, const char *tmp, const char *log,
              const char *key, const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
              double timeout, mcpu_status *st);
/* The cache key: a hash of everything that shapes the binary. */
void build_key(const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
               const command *cxx, const char *id, int32_t checked, char key[33]);

/* ---- source_place.c ---- */

/* "file:line" of a kernel's code address (the innermost inlined frame in the kernel's own source),
 * else the symbol and offset, into out. */
void mcpu_source_place(const void *pc, char *out, size_t n);

/* ---- faults.c (from a signal handler's context) ---- */

void *mcpu_context_pc(void *context); /* the faulting instruction, or NULL where unknown */
/* Completes a faulting x86-64 DIV/IDIV as a GPU does; 0 where it cannot (aarch64 never traps). */
int mcpu_complete_division(void *context);

/* ---- runtime.c, pool.c ---- */

/* The runtime's function table that compiled libraries bind to (runtime.c). */
const msl_runtime_api *mcpu_runtime_api(void);
/* Runs one prepared launch (after dispatch.c's validation) in the mode of the kernel's library
 * (pool.c). */
int32_t mcpu_run(mcpu_kernel_fn fn, const msl_launch *launch, uint32_t mode, mcpu_status *st);

#endif
