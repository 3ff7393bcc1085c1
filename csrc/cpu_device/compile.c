/* Compiles MSL source into a shared object for the CPU Metal device and loads it (ARCHITECTURE.md,
 * "Compilation pipeline"): `c++ -E` against empty <metal_stdlib> stubs, mcpu_preprocess, then
 * `c++ -shared -include msl_shim.h`. Libraries are cached in the process (by key, never unloaded)
 * and on disk as <cache>/<key>.so, where the key is a SHA-256 of everything that shapes the
 * binary. Several processes may build the same library at once: each builds in its own temporary
 * directory and rename()s the result into place, so nobody ever sees a partial file. */
#define _POSIX_C_SOURCE 200809L
#include "cpu_device.h"
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
#include <sys/stat.h>
#include <sys/wait.h>
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
    struct mcpu_library *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static mcpu_library *g_libs;   /* loaded libraries, guarded by g_lock */
static char *g_cxx, *g_cxx_id; /* the compiler last asked for and its --version output, ditto */

static const char *const PRE_FLAGS[] = {
    "-E", "-x", "c++", "-std=gnu++17", "-nostdinc", "-D__METAL_VERSION__=310", "-D__HAVE_BFLOAT__=1"};
/* Kernels view buffers through other types (half* as half4*): no type-based alias analysis.
 * MSL's char is signed, which aarch64 Linux's is not by default. */
static const char *const CC_FLAGS[] = {"-x",    "c++",    "-std=gnu++17", "-O2", "-fno-strict-aliasing",
                                       "-fsigned-char", "-fPIC", "-shared"};
static const char *const STUBS[] = {"metal_stdlib", "metal_simdgroup", "metal_simdgroup_matrix",
                                    "metal_atomic", "metal_math",      "metal_compute",
                                    "metal_integer"};
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
    for (uint64_t i = 0; i < n; i++) {
        s->buf[s->len++ % 64] = p[i];
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

static int32_t io_fail(fa_status *st, const char *what, const char *path) {
    return fa_fail(st, FA_ERR_RUNTIME, "CPU Metal device: cannot %s %s: %s", what, path, strerror(errno));
}

static int32_t join(char *out, const char *a, const char *b, fa_status *st) {
    int n = snprintf(out, PATH_BYTES, "%s/%s", a, b);
    if (n < 0 || n >= PATH_BYTES)
        return fa_fail(st, FA_ERR_VALUE, "CPU Metal device: path too long: %s/%s", a, b);
    return FA_OK;
}

static int32_t write_file(const char *path, const char *data, uint64_t n, fa_status *st) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return io_fail(st, "create", path);
    for (uint64_t done = 0; done < n;) {
        ssize_t w = write(fd, data + done, (size_t)(n - done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            close(fd);
            return io_fail(st, "write", path);
        }
        done += (uint64_t)w;
    }
    return close(fd) ? io_fail(st, "write", path) : FA_OK;
}

/* The file's contents (at most max bytes), NUL-terminated, or NULL. */
static char *read_file(const char *path, uint64_t max) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *p = NULL;
    uint64_t n = 0, cap = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            char *q = realloc(p, (size_t)(cap = 2 * cap + 4096 + 1));
            if (!q) break;
            p = q;
        }
        size_t r = fread(p + n, 1, 4096, f);
        n += r;
        if (r == 0 || n >= max) break;
    }
    fclose(f);
    if (p) p[n < max ? n : max] = 0;
    return p;
}

static void rm_tree(const char *path) {
    DIR *d = opendir(path);
    if (d) {
        struct dirent *e;
        char sub[PATH_BYTES];
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
                snprintf(sub, sizeof sub, "%s/%s", path, e->d_name) < PATH_BYTES)
                rm_tree(sub);
        closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static int32_t mkdir_p(const char *path, fa_status *st) {
    char p[PATH_BYTES];
    snprintf(p, sizeof p, "%s", path);
    for (char *c = p + 1;; c++) {
        if (*c != '/' && *c) continue;
        char end = *c;
        *c = 0;
        if (mkdir(p, 0700) && errno != EEXIST) return io_fail(st, "create directory", p);
        if (!(*c = end)) break;
    }
    struct stat sb;
    if (stat(path, &sb) || !S_ISDIR(sb.st_mode)) return io_fail(st, "use directory", path);
    return FA_OK;
}

/* Runs argv (no shell: paths may hold spaces) with stdout to out_path (or /dev/null) and stderr to
 * err_path. Returns the exit status, 256 + the signal if one killed it, or -1 (errno set) if it
 * could not be started. */
static int32_t run(char *const argv[], const char *out_path, const char *err_path) {
    posix_spawn_file_actions_t fa;
    if (posix_spawn_file_actions_init(&fa)) return -1;
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, out_path ? out_path : "/dev/null", O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_addopen(&fa, 2, err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc) {
        errno = rc;
        return -1;
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 256 + WTERMSIG(status);
}

static const char *compiler(void) {
    const char *c = getenv("FLASHATTN_MPS_CXX");
    if (!c || !*c) c = getenv("CXX");
    return c && *c ? c : "c++";
}

/* ---- cache directory, compiler identity, shim directory ---- */

int32_t mcpu_cache_dir(char *out, size_t out_len, fa_status *st) {
    fa_status local;
    if (!st) st = &local;
    if (!out || out_len == 0) return fa_fail(st, FA_ERR_VALUE, "mcpu_cache_dir: no output buffer");
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
        return fa_fail(st, FA_ERR_RUNTIME, "CPU Metal device: no cache directory (set FLASHATTN_MPS_CACHE)");
    if (n < 0 || (uint64_t)n >= out_len || n >= PATH_BYTES - 128)
        return fa_fail(st, FA_ERR_VALUE, "CPU Metal device: cache directory path too long");
    return mkdir_p(out, st);
}

/* `<cxx> --version`, run once per process (again only if the compiler asked for changes). Returns
 * a malloc'ed copy. */
static char *compiler_identity(const char *cache, const char *cxx, fa_status *st) {
    char *id = NULL;
    pthread_mutex_lock(&g_lock);
    if (g_cxx && !strcmp(g_cxx, cxx)) id = strdup(g_cxx_id);
    pthread_mutex_unlock(&g_lock);
    if (id) return id;
    char dir[PATH_BYTES], out[PATH_BYTES], err[PATH_BYTES];
    if (join(dir, cache, "tmp-XXXXXX", st)) return NULL;
    if (!mkdtemp(dir)) {
        io_fail(st, "create directory in", cache);
        return NULL;
    }
    join(out, dir, "version.txt", st);
    join(err, dir, "stderr.txt", st);
    char *argv[] = {(char *)cxx, "--version", NULL};
    int32_t rc = run(argv, out, err);
    int32_t saved = errno;
    if (rc == 0) id = read_file(out, MAX_OUTPUT);
    rm_tree(dir);
    if (!id || !*id) {
        fa_fail(st, FA_ERR_UNSUPPORTED,
                "CPU Metal device: cannot run the C++ compiler '%s' (%s); set FLASHATTN_MPS_CXX or CXX", cxx,
                rc < 0 ? strerror(saved)
                : rc   ? "`--version` failed"
                       : "no `--version` output");
        free(id);
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    char *c = strdup(cxx), *i = strdup(id);
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

/* <cache>/shim-<hash>/ with the shim headers and include/ with empty <metal_*> stubs. Built in a
 * temporary directory and renamed into place, so an existing one is always complete. */
static int32_t shim_dir(const char *cache, char *dir, fa_status *st) {
    char hash[33], name[64], tmp[PATH_BYTES], path[PATH_BYTES], inc[PATH_BYTES];
    struct stat sb;
    shim_hash(hash);
    snprintf(name, sizeof name, "shim-%.16s", hash);
    if (join(dir, cache, name, st)) return st->code;
    if (!stat(dir, &sb) && S_ISDIR(sb.st_mode)) return FA_OK;
    if (join(tmp, cache, "tmp-XXXXXX", st)) return st->code;
    if (!mkdtemp(tmp)) return io_fail(st, "create directory in", cache);
    int32_t rc = join(inc, tmp, "include", st);
    if (!rc && mkdir(inc, 0755)) rc = io_fail(st, "create directory", inc);
    for (uint32_t i = 0; !rc && i < mcpu_shim_file_count; i++)
        if (!(rc = join(path, tmp, mcpu_shim_files[i].name, st)))
            rc = write_file(path, mcpu_shim_files[i].text, strlen(mcpu_shim_files[i].text), st);
    for (uint32_t i = 0; !rc && i < COUNT(STUBS); i++)
        if (!(rc = join(path, inc, STUBS[i], st))) rc = write_file(path, "", 0, st);
    if (!rc && chmod(tmp, 0755)) rc = io_fail(st, "set permissions of", tmp);
    if (!rc && rename(tmp, dir) && !(errno == EEXIST || errno == ENOTEMPTY)) rc = io_fail(st, "create", dir);
    rm_tree(tmp); /* nothing left if the rename happened; another process's copy won otherwise */
    return rc;
}

int32_t mcpu_shim_dir(char *out, size_t out_len, fa_status *st) {
    char cache[PATH_BYTES], dir[PATH_BYTES];
    if (out == NULL || out_len == 0) return fa_fail(st, FA_ERR_VALUE, "mcpu_shim_dir: no output buffer");
    if (mcpu_cache_dir(cache, sizeof cache, st) || shim_dir(cache, dir, st)) return st->code;
    if (strlen(dir) >= out_len) return fa_fail(st, FA_ERR_VALUE, "mcpu_shim_dir: path longer than %zu bytes", out_len);
    snprintf(out, out_len, "%s", dir);
    return FA_OK;
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

static const char *prev_line(const char *start, const char *line) {
    for (line--; line > start && line[-1] != '\n';) line--;
    return line;
}

static int32_t mentions(const char *line, const char *what) {
    const char *hit = strstr(line, what);
    return hit && hit < line + strcspn(line, "\n");
}

/* The end of one diagnostic's block of lines. */
static int32_t boundary(const char *line) { return mentions(line, "error:") || mentions(line, "warning:"); }

/* FA_ERR_COMPILE with the compiler's output, temporary-directory prefixes removed: first the first
 * error as .metal file:line:col (line markers give those; an error inside the shim is reported at
 * the first .metal location the compiler names for it), then the whole output. */
static int32_t compile_error(fa_status *st, const char *what, int32_t rc, const char *err_path,
                             const char *tmp, const char *shim) {
    char *out = read_file(err_path, MAX_OUTPUT);
    if (!out) return fa_fail(st, FA_ERR_COMPILE, "%s failed (status %d)", what, rc);
    char prefix[PATH_BYTES];
    uint64_t pn = (uint64_t)snprintf(prefix, sizeof prefix, "%s/", tmp), w = 0, sn = strlen(shim);
    for (uint64_t r = 0; out[r];) {
        if (!strncmp(out + r, prefix, (size_t)pn)) {
            r += pn;
            continue;
        }
        out[w++] = out[r++];
    }
    out[w] = 0;
    const char *first = NULL, *from = NULL;
    for (const char *line = out; *line && !first; line = next_line(line))
        if (mentions(line, "error:")) first = line;
    /* inside the shim: g++ names the kernel's line before the error ("required from here"),
     * clang after it (notes) */
    for (const char *line = first; line && line > out && !strncmp(first, shim, (size_t)sn) && !from;) {
        line = prev_line(out, line);
        if (boundary(line)) break;
        if (strncmp(line, shim, (size_t)sn) && location(line)) from = line;
    }
    for (const char *line = first; line && *line && !strncmp(first, shim, (size_t)sn) && !from;) {
        line = next_line(line);
        if (boundary(line)) break;
        if (strncmp(line, shim, (size_t)sn) && location(line)) from = line;
    }
    if (from) {
        const char *msg = strstr(first, "error:");
        fa_fail(st, FA_ERR_COMPILE, "%.*s: %.*s\n%s", (int)location(from), from, (int)strcspn(msg, "\n"), msg,
                out);
    } else if (first) {
        fa_fail(st, FA_ERR_COMPILE, "%.*s\n%s", (int)strcspn(first, "\n"), first, out);
    } else {
        fa_fail(st, FA_ERR_COMPILE, "%s failed (status %d)\n%s", what, rc, out);
    }
    free(out);
    return FA_ERR_COMPILE;
}

/* A file name for the source inside the temporary directory: source_name without path separators. */
static void safe_name(const char *source_name, char out[128]) {
    uint64_t n = 0;
    for (const char *c = source_name; *c && n < 100; c++)
        out[n++] = (*c == '/' || *c == '\\' || *c == '\n' || (c == source_name && *c == '.')) ? '_' : *c;
    out[n] = 0;
}

/* Builds <cache>/<key>.so from source in the temporary directory tmp. */
static int32_t build(const char *cxx, int32_t clang, const char *shim, const char *tmp, const char *so_path,
                     const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
                     fa_status *st) {
    char base[128], src[PATH_BYTES], pre[PATH_BYTES], cpp[PATH_BYTES], err[PATH_BYTES], so[PATH_BYTES],
        inc[PATH_BYTES], shim_h[PATH_BYTES];
    safe_name(source_name, base);
    if (join(src, tmp, base, st) || join(pre, tmp, "preprocessed.ii", st) ||
        join(cpp, tmp, "kernels.cpp", st) || join(err, tmp, "stderr.txt", st) ||
        join(so, tmp, "library.so", st) || join(inc, shim, "include", st) ||
        join(shim_h, shim, "msl_shim.h", st))
        return st->code;

    /* 1. the source, with a #line so diagnostics name source_name */
    const char *s = source + strspn(source, " \t");
    int32_t has_line = s[0] == '#' && !strncmp(s + 1 + strspn(s + 1, " \t"), "line", 4);
    FILE *f = fopen(src, "wb");
    if (!f) return io_fail(st, "create", src);
    if (!has_line) {
        fputs("#line 1 \"", f);
        for (const char *c = source_name; *c; c++) {
            if (*c == '"' || *c == '\\') fputc('\\', f);
            fputc(*c == '\n' ? ' ' : *c, f);
        }
        fputs("\"\n", f);
    }
    fputs(source, f);
    if (fclose(f)) return io_fail(st, "write", src);

    /* 2. c++ -E with the macros */
    uint64_t argc = 0, cap = COUNT(PRE_FLAGS) + n_macros + 8;
    char **argv = calloc((size_t)cap, sizeof *argv), **defs = calloc((size_t)n_macros + 1, sizeof *defs);
    int32_t rc = argv && defs ? FA_OK : fa_fail(st, FA_ERR_RUNTIME, "out of memory");
    if (!rc) {
        argv[argc++] = (char *)cxx;
        for (uint64_t i = 0; i < COUNT(PRE_FLAGS); i++) argv[argc++] = (char *)PRE_FLAGS[i];
        for (uint32_t i = 0; i < n_macros && !rc; i++) {
            const char *v = macros[i].value && *macros[i].value ? macros[i].value : "1";
            uint64_t n = strlen(macros[i].name) + strlen(v) + 4;
            if (!(defs[i] = malloc((size_t)n))) {
                rc = fa_fail(st, FA_ERR_RUNTIME, "out of memory");
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
    int32_t status = rc ? 0 : run(argv, NULL, err);
    if (!rc && status < 0)
        rc = fa_fail(st, FA_ERR_UNSUPPORTED, "cannot run the C++ compiler '%s': %s", cxx, strerror(errno));
    if (!rc && status) rc = compile_error(st, "preprocessing", status, err, tmp, shim);
    for (uint32_t i = 0; defs && i < n_macros; i++) free(defs[i]);
    free(defs);
    free(argv);
    if (rc) return rc;

    /* 3. the prepass */
    char *text = read_file(pre, UINT64_MAX);
    if (!text) return io_fail(st, "read", pre);
    char *out = mcpu_preprocess(text, source_name, 0, st);
    free(text);
    if (!out) return st->code;
    rc = write_file(cpp, out, strlen(out), st);
    free(out);
    if (rc) return rc;

    /* 4. compile and link, then move into place atomically */
    char *cc[COUNT(CC_FLAGS) + 10];
    uint64_t n = 0;
    cc[n++] = (char *)cxx;
    for (uint64_t i = 0; i < COUNT(CC_FLAGS); i++) cc[n++] = (char *)CC_FLAGS[i];
    cc[n++] = clang ? "-Wno-unknown-attributes" : "-Wno-attributes";
    cc[n++] = "-include";
    cc[n++] = shim_h;
    cc[n++] = cpp;
    cc[n++] = "-o";
    cc[n++] = so;
    cc[n++] = "-lm";
    cc[n] = NULL;
    status = run(cc, NULL, err);
    if (status < 0)
        return fa_fail(st, FA_ERR_UNSUPPORTED, "cannot run the C++ compiler '%s': %s", cxx, strerror(errno));
    if (status) return compile_error(st, "compiling", status, err, tmp, shim);
    if (rename(so, so_path)) return io_fail(st, "move the compiled library to", so_path);
    return FA_OK;
}

static mcpu_library *load(const char *path, const char *key, fa_status *st) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fa_fail(st, FA_ERR_COMPILE, "CPU Metal device: cannot load %s: %s", path, dlerror());
        return NULL;
    }
    void (*bind)(const msl_runtime_api *);
    *(void **)&bind = dlsym(h, "__msl_bind_runtime"); /* POSIX's way to get a function pointer */
    const char *const *names = (const char *const *)dlsym(h, "__msl_kernel_names");
    const msl_runtime_api *api = mcpu_runtime_api();
    mcpu_library *lib = calloc(1, sizeof *lib);
    uint64_t n = 0;
    while (names && names[n]) n++;
    if (lib) lib->fns = calloc((size_t)n + 1, sizeof *lib->fns);
    if (!bind || !names || !api || api->abi_version != MSL_ABI_VERSION || !lib || !lib->fns) {
        fa_fail(st, FA_ERR_COMPILE, "CPU Metal device: %s is not a kernel library for runtime ABI %u", path,
                MSL_ABI_VERSION);
        goto fail;
    }
    for (uint64_t i = 0; i < n; i++) {
        char sym[1024];
        snprintf(sym, sizeof sym, "__msl_launch_%s", names[i]);
        *(void **)&lib->fns[i] = dlsym(h, sym);
        if (!lib->fns[i]) {
            fa_fail(st, FA_ERR_COMPILE, "CPU Metal device: %s lacks %s", path, sym);
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

static mcpu_library *find(const char *key) {
    mcpu_library *l = g_libs;
    while (l && strcmp(l->key, key)) l = l->next;
    return l;
}

static int32_t valid_macro(const mcpu_macro *m) {
    const char *c = m->name;
    if (!c || !((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || *c == '_')) return 0;
    for (; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_'))
            return 0;
    return !m->value || !strpbrk(m->value, "\r\n");
}

int32_t mcpu_compile_library(const char *source, const char *source_name, const mcpu_macro *macros,
                             uint32_t n_macros, mcpu_library **out, fa_status *st) {
    fa_status local;
    if (!st) st = &local;
    if (out) *out = NULL;
    if (!source || !out || (n_macros && !macros))
        return fa_fail(st, FA_ERR_VALUE, "mcpu_compile_library: source, out and macros must not be NULL");
    for (uint32_t i = 0; i < n_macros; i++)
        if (!valid_macro(&macros[i]))
            return fa_fail(st, FA_ERR_VALUE, "mcpu_compile_library: bad macro %u ('%s')", i,
                           macros[i].name ? macros[i].name : "(null)");
    if (!source_name || !*source_name) source_name = "kernel.metal";

    char cache[PATH_BYTES], shim[PATH_BYTES], key[33], so_path[PATH_BYTES], tmp[PATH_BYTES];
    if (mcpu_cache_dir(cache, sizeof cache, st)) return st->code;
    const char *cxx = compiler();
    char *id = compiler_identity(cache, cxx, st);
    if (!id) return st->code;
    int32_t clang = strstr(id, "clang") != NULL;

    sha256 s;
    sha_init(&s);
    sha_field(&s, "flashattn_mps CPU Metal library");
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
    sha_field(&s, cxx);
    sha_field(&s, id);
    for (uint64_t i = 0; i < COUNT(PRE_FLAGS); i++) sha_field(&s, PRE_FLAGS[i]);
    for (uint64_t i = 0; i < COUNT(CC_FLAGS); i++) sha_field(&s, CC_FLAGS[i]);
    sha_hex(&s, key);
    free(id);

    pthread_mutex_lock(&g_lock);
    mcpu_library *lib = find(key);
    pthread_mutex_unlock(&g_lock);
    if (lib) {
        *out = lib;
        return FA_OK;
    }

    char so_name[64];
    snprintf(so_name, sizeof so_name, "%s.so", key);
    if (shim_dir(cache, shim, st) || join(so_path, cache, so_name, st)) return st->code;
    fa_status ignored; /* a cached object that does not load is rebuilt */
    if (!access(so_path, R_OK)) lib = load(so_path, key, &ignored); /* maybe built by another process */
    if (!lib) {
        if (join(tmp, cache, "tmp-XXXXXX", st)) return st->code;
        if (!mkdtemp(tmp)) return io_fail(st, "create directory in", cache);
        int32_t rc = build(cxx, clang, shim, tmp, so_path, source, source_name, macros, n_macros, st);
        rm_tree(tmp);
        if (rc) return rc;
        if (!(lib = load(so_path, key, st))) return st->code;
    }

    pthread_mutex_lock(&g_lock);
    mcpu_library *raced = find(key); /* another thread finished first: same object, keep theirs */
    if (!raced) {
        lib->next = g_libs;
        g_libs = lib;
    }
    pthread_mutex_unlock(&g_lock);
    if (raced) {
        dlclose(lib->handle); /* drops our reference; theirs keeps it loaded */
        free(lib->fns);
        free(lib);
        lib = raced;
    }
    *out = lib;
    return FA_OK;
}

const char *const *mcpu_library_kernels(const mcpu_library *lib) {
    static const char *const none[] = {NULL};
    return lib ? lib->names : none;
}

mcpu_kernel_fn mcpu_library_kernel(const mcpu_library *lib, const char *name) {
    for (uint64_t i = 0; lib && name && i < lib->n; i++)
        if (!strcmp(lib->names[i], name)) return lib->fns[i];
    return NULL;
}
