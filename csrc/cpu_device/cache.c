/* The cache directory and the shim directory inside it (the headers every library includes). */
#define _POSIX_C_SOURCE 200809L
#include "device.h"
#include "shim_files.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const STUBS[] = {"metal_stdlib",    "metal_simdgroup",  "metal_simdgroup_matrix", "metal_atomic",
                                    "metal_math",      "metal_compute",    "metal_integer",          "metal_common",
                                    "metal_geometric", "metal_relational", "metal_matrix",           "metal_array",
                                    "metal_uniform",   "metal_types",      "metal_tensor",           "metal_logging"};
/* <MetalPerformancePrimitives/MetalPerformancePrimitives.h>: its contents are the shim's (msl_tensor.h) */
#define MPP_DIR "MetalPerformancePrimitives"
#define MPP_STUB MPP_DIR "/MetalPerformancePrimitives.h"

static void shim_hash(char out[33]) {
    sha256 s;
    sha_init(&s);
    for (uint32_t i = 0; i < mcpu_shim_file_count; i++) {
        sha_field(&s, mcpu_shim_files[i].name);
        sha_field(&s, mcpu_shim_files[i].text);
    }
    sha_hex(&s, out);
}

int32_t mcpu_cache_dir(char *out, size_t out_len, mcpu_status *st) {
    mcpu_status local;
    if (!st) st = &local;
    if (!out || out_len == 0) return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_cache_dir: no output buffer");
    const char *env = getenv("FLASHATTN_MPS_CACHE"), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char pwbuf[4096];
    struct passwd pw, *found = NULL;
    if ((!home || !*home) && !getpwuid_r(getuid(), &pw, pwbuf, sizeof pwbuf, &found) && found) home = found->pw_dir;
    int n;
    if (env && *env) n = snprintf(out, out_len, "%s", env);
    else if (xdg && *xdg) n = snprintf(out, out_len, "%s/flashattn_mps", xdg);
    else if (home && *home) n = snprintf(out, out_len, "%s/.cache/flashattn_mps", home);
    else return mcpu_fail(st, MCPU_ERR_RUNTIME, "CPU Metal device: no cache directory (set FLASHATTN_MPS_CACHE)");
    if (n < 0 || (uint64_t)n >= out_len || n >= PATH_BYTES - 128)
        return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: cache directory path too long: %s", out);
    while (n > 1 && out[n - 1] == '/') out[--n] = 0; /* lstat("link/") would follow the link */
    return private_dir(out, st);
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
    char mpp[PATH_BYTES];
    if (join(mpp, inc, MPP_DIR, &ignored) || trusted_dir(mpp, &ignored) || entries(mpp) != 1 ||
        !holds(inc, MPP_STUB, ""))
        return 0;
    if (entries(dir) != (int64_t)mcpu_shim_file_count + 1 || entries(inc) != (int64_t)COUNT(STUBS) + 1) return 0;
    for (uint32_t i = 0; i < mcpu_shim_file_count; i++)
        if (!holds(dir, mcpu_shim_files[i].name, mcpu_shim_files[i].text)) return 0;
    for (uint32_t i = 0; i < COUNT(STUBS); i++)
        if (!holds(inc, STUBS[i], "")) return 0;
    return 1;
}

/* <base>/shim-<hash>/ with the shim headers and include/ with empty <metal_*> stubs. Built in a
 * temporary directory and renamed into place; an existing one is used only if it holds exactly
 * these files with exactly this text, otherwise it is replaced (or refused if it is not ours). */
int32_t shim_dir(const char *base, char *dir, mcpu_status *st) {
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
        if (!rc && !(rc = join(path, inc, MPP_DIR, st)) && mkdir(path, 0700))
            rc = io_fail(st, "create directory", path);
        if (!rc && !(rc = join(path, inc, MPP_STUB, st))) rc = write_file(path, "", 0, st);
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
    if (strlen(dir) >= out_len)
        return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_shim_dir: path longer than %zu bytes", out_len);
    snprintf(out, out_len, "%s", dir);
    return MCPU_OK;
}
