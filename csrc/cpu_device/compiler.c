/* Which compiler builds the kernels (compilers.txt, $FLASHATTN_MPS_CXX), its identity and what it supports. */
#define _POSIX_C_SOURCE 200809L
#include "device.h"
#include "shim_files.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Guards what is remembered of the compiler last asked for. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char *g_cxx, *g_cxx_id; /* the compiler last asked for and its --version output, ditto */

/* The compiler command: $FLASHATTN_MPS_CXX, split into words at blanks, with '...' and "..."
 * quoting as in a shell (no expansions), so that "ccache clang++" works; else the first of
 * compilers.txt's names (mcpu_compiler_names) on PATH. It must be clang 16 or newer (checked on its
 * identity, compiler_identity): kernels keep Metal's address spaces apart through clang's
 * (msl_shim.h), which g++ lacks. */

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
int32_t compiler(command *c, mcpu_status *st) {
    const char *env = getenv("FLASHATTN_MPS_CXX");
    c->source = "FLASHATTN_MPS_CXX";
    if (!env || !*env) env = clang_on_path(), c->source = "PATH";
    if (!env) {
        char names[512] = "";
        for (uint32_t i = 0; i < mcpu_compiler_name_count; i++)
            snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "",
                     mcpu_compiler_names[i]);
        return mcpu_fail(
            st, MCPU_ERR_COMPILE,
            "CPU Metal device: kernels compile with clang++ 16 or newer, and PATH holds none of %s; " CLANG_ADVICE,
            names);
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
            return mcpu_fail(st, MCPU_ERR_VALUE,
                             "CPU Metal device: the compiler command '%s' (%s) has more than %d words", env, c->source,
                             MAX_WORDS);
        c->argv[c->argc++] = w;
        for (; *r && (quote || (*r != ' ' && *r != '\t')); r++) {
            if (quote ? *r == quote : (*r == '\'' || *r == '"')) quote = quote ? 0 : *r;
            else if (*r == '\\' && quote != '\'' && r[1]) *w++ = *++r;
            else *w++ = *r;
        }
        if (quote)
            return mcpu_fail(st, MCPU_ERR_VALUE,
                             "CPU Metal device: the compiler command '%s' (%s) has an unterminated %c", env, c->source,
                             quote);
        *w++ = 0;
    }
    if (c->argc == 0)
        return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: the compiler command (%s) is blank", c->source);
    c->argv[c->argc] = NULL;
    return MCPU_OK;
}

/* argv: the command's words, then `extra` (NULL-terminated). */
char **with_args(const command *c, char *const extra[], uint64_t n_extra) {
    char **argv = calloc((size_t)(c->argc + n_extra + 1), sizeof *argv);
    if (!argv) return NULL;
    memcpy(argv, c->argv, c->argc * sizeof *argv);
    memcpy(argv + c->argc, extra, (size_t)n_extra * sizeof *argv);
    return argv;
}

/* `<cxx> --version`, run once per process (again only if the compiler asked for changes). Returns
 * a malloc'ed copy. */
char *compiler_identity(const command *cxx, double timeout, mcpu_status *st) {
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
                  "CPU Metal device: cannot run the C++ compiler '%s' (from %s): %s%s%s; " CLANG_ADVICE, cxx->text,
                  cxx->source,
                  rc < 0 ? run_failure(rc, timeout, why)
                  : rc   ? "`--version` failed"
                         : "no `--version` output",
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

/* Whether the compiler takes STACK_CLASH_FLAG (probe each page of a large frame, so a frame larger
 * than the fiber stack still lands on its guard). Decided by the compiler's identity, which is
 * in the cache key; asked once per process and compiler. */
int32_t stack_clash_supported(const command *cxx, double timeout) {
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
