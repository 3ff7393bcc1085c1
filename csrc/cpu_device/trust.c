/* What the cache trusts (docs/security.md): entries only the current user can
 * write, never reached through a symbolic link. */
#define _POSIX_C_SOURCE 200809L
#include "device.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>


/* Why a cache entry cannot be trusted, or NULL: the cache trusts only what the current user alone
 * can have written (code in it runs as this user). */
const char *untrusted(const struct stat *sb, char why[160]) {
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

int32_t refuse(mcpu_status *st, const char *path, const char *why) {
    return mcpu_fail(st, MCPU_ERR_COMPILE,
                     "CPU Metal device: refusing to use %s from the kernel cache: %s; the cache trusts only "
                     "entries that are not symbolic links, are owned by the current user and are writable by "
                     "nobody else (fix or remove it, or set FLASHATTN_MPS_CACHE to a private directory)",
                     path, why);
}

/* A directory the cache may use: refused if it is a symbolic link, not a directory, someone
 * else's or writable by others. */
int32_t trusted_dir(const char *path, mcpu_status *st) {
    struct stat sb;
    char why[160];
    if (lstat(path, &sb)) return io_fail(st, "use directory", path);
    const char *bad = S_ISLNK(sb.st_mode)    ? "it is a symbolic link"
                      : !S_ISDIR(sb.st_mode) ? "it is not a directory"
                                             : untrusted(&sb, why);
    return bad ? refuse(st, path, bad) : MCPU_OK;
}

/* The cache directory, created private (0700) if absent, then checked as trusted_dir. */
int32_t private_dir(const char *path, mcpu_status *st) {
    struct stat sb;
    if (lstat(path, &sb) && errno == ENOENT && mkdir_p(path, st)) return st->code;
    return trusted_dir(path, st);
}

/* Opens a cache file for reading without following a symbolic link. Returns the descriptor, -1
 * (errno ENOENT) when the file is absent, or -2 with st set when it is refused or unreadable. */
int open_trusted(const char *path, mcpu_status *st) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK); /* O_NONBLOCK: a planted FIFO */
    if (fd < 0) {
        if (errno == ENOENT) return -1;
        if (errno == ELOOP || errno == EMLINK) refuse(st, path, "it is a symbolic link");
        else io_fail(st, "open", path);
        return -2;
    }
    struct stat sb;
    char why[160];
    const char *bad = fstat(fd, &sb)         ? strerror(errno)
                      : !S_ISREG(sb.st_mode) ? "it is not a regular file"
                                             : untrusted(&sb, why);
    if (bad) {
        refuse(st, path, bad);
        close(fd);
        return -2;
    }
    return fd;
}
