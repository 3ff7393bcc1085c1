/* Files of the cache: private writes, atomic replacement, reads, removal. */
#define _POSIX_C_SOURCE 200809L
#include "device.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>


int32_t io_fail(mcpu_status *st, const char *what, const char *path) {
    int32_t e = errno;
    return mcpu_fail(st, MCPU_ERR_RUNTIME, "CPU Metal device: cannot %s %s: %s%s", what, path, strerror(e),
                     e == ENOSPC || e == EDQUOT ? " (the disk is full)" : "");
}

int32_t join(char *out, const char *a, const char *b, mcpu_status *st) {
    int n = snprintf(out, PATH_BYTES, "%s/%s", a, b);
    if (n < 0 || n >= PATH_BYTES) return mcpu_fail(st, MCPU_ERR_VALUE, "CPU Metal device: path too long: %s/%s", a, b);
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
int32_t write_file(const char *path, const char *data, uint64_t n, mcpu_status *st) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return io_fail(st, "create", path);
    if (write_fd(fd, data, n)) {
        io_fail(st, "write", path);
        close(fd);
        return st->code;
    }
    return close(fd) ? io_fail(st, "write", path) : MCPU_OK;
}

void sync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* dir/name replaced atomically and durably by data: a private temporary file, fsync, rename,
 * fsync of the directory. A crash leaves the old file or the new one, never a torn one. */
int32_t write_atomic(const char *dir, const char *name, const char *data, uint64_t n, mcpu_status *st) {
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
char *read_fd(int fd, uint64_t max, uint64_t *len) {
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
void rm_tree(const char *path) {
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

int32_t mkdir_p(const char *path, mcpu_status *st) {
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
