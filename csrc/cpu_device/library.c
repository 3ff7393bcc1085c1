/* Compiles MSL source into a shared object for the CPU Metal device and loads it (ARCHITECTURE.md,
 * "Compilation pipeline"): `c++ -E` against empty <metal_stdlib> stubs, mcpu_preprocess,
 * `c++ -include msl_shim.h` to LLVM IR, drop_convergent, relax_alignment, then `c++ -shared` of that IR.
 * Libraries are cached in the process (by key, never unloaded) and on disk as <cache>/<key>.so with its
 * manifest <key>.sum, where the key is a SHA-256 of everything that shapes the binary. Several
 * processes may build the same library at once: each builds in its own temporary directory and
 * rename()s the result into place, so nobody ever sees a partial file. What is loaded must be
 * vouched for (docs/security.md): private entries only, never through a link,
 * matching the manifest, reporting its key. */
#define _POSIX_C_SOURCE 200809L
#include "device.h"
#include "shim_files.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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
static mcpu_library *g_libs; /* loaded libraries, guarded by g_lock */

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
    if (!built_for || strncmp(built_for, KEY_MARK, sizeof KEY_MARK - 1) ||
        strcmp(built_for + sizeof KEY_MARK - 1, key)) {
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
                                    const char *key, int32_t damaged, int32_t checked, const char *source,
                                    const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
                                    mcpu_status *st) {
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
    int32_t rc = shim_dir(base, shim, st) || join(tmp, base, "tmp-XXXXXX", st) || join(log, cache, name, st) ? st->code
                                                                                                             : MCPU_OK;
    if (!rc && !mkdtemp(tmp)) rc = io_fail(st, "create directory in", base);
    if (!rc) {
        rc = build(cxx, stack_clash_supported(cxx, timeout), checked, shim, tmp, writable ? log : NULL, key, source,
                   source_name, macros, n_macros, timeout, st);
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
    if (mcpu_cache_dir(cache, sizeof cache, st) || compiler(&cxx, st) || compile_timeout(&timeout, st)) return st->code;
    runs_stop_on_interrupts_from_now();
    char *id = compiler_identity(&cxx, timeout, st);
    if (!id) return st->code;

    build_key(source, source_name, macros, n_macros, &cxx, id, checked, key);

    pthread_mutex_lock(&g_lock);
    mcpu_library *lib = find(key, mode);
    pthread_mutex_unlock(&g_lock);
    int32_t damaged = 0;
    if (!lib && load_cached(cache, key, &lib, &damaged, st) == CACHE_REFUSED) {
        free(id);
        return st->code;
    }
    if (!lib)
        lib =
            build_and_load(cache, &cxx, id, timeout, key, damaged, checked, source, source_name, macros, n_macros, st);
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

int32_t mcpu_compile_library(const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
                             uint32_t mode, mcpu_library **out, mcpu_status *st) {
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
        return mcpu_fail(st, MCPU_ERR_VALUE,
                         "mcpu_compile_library: mode %u has unknown bits (MCPU_CHECKED = 1, "
                         "MCPU_LOCKSTEP = 2)",
                         mode);
    if (!source_name || !*source_name) source_name = "kernel.metal";
    return compile(source, source_name, macros, n_macros, mode, out, st);
}

const char *const *mcpu_library_kernels(const mcpu_library *lib) {
    static const char *const none[] = {NULL};
    return lib ? lib->names : none;
}

uint32_t mcpu_library_mode(const mcpu_library *lib) { return lib ? lib->mode : 0u; }


mcpu_kernel_fn mcpu_library_kernel(const mcpu_library *lib, const char *name) {
    for (uint64_t i = 0; lib && name && i < lib->n; i++)
        if (!strcmp(lib->names[i], name)) return lib->fns[i];
    return NULL;
}
