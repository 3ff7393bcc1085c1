/* Where a kernel's code address is in its MSL source, for the messages of checked mode and of
 * faults of kernel code. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* dladdr under -std=c11 */
#endif
#include "device.h"
#include "shim_files.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int is_shim_file(const char *path) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    for (uint32_t i = 0; i < mcpu_shim_file_count; i++)
        if (!strcmp(base, mcpu_shim_files[i].name)) return 1;
    return 0;
}

/* The symbolizers tried in turn, each with its own command line and output:
 *   addr2line (binutils, installed with the linker on Linux) and llvm-addr2line: "file:line" per
 *     inlined frame, innermost first, for an address relative to the library;
 *   llvm-symbolizer: "function" then "file:line:column" per frame, the same address;
 *   atos (macOS, where there is no addr2line by default): "function (in lib) (file:line)" per
 *     frame, for the absolute address and the library's load address.
 * FLASHATTN_MPS_SYMBOLIZER names one of them to use alone. */
typedef enum { ADDR2LINE, LLVM_ADDR2LINE, LLVM_SYMBOLIZER, ATOS, N_SYMBOLIZERS } symbolizer;
static const char *const symbolizer_names[N_SYMBOLIZERS] = {"addr2line", "llvm-addr2line", "llvm-symbolizer", "atos"};

/* One frame's "file:line" in the tool's output line, or NULL; strips what follows the line number. */
static char *frame_place(symbolizer tool, char *line) {
    if (tool == ATOS) { /* "... (file:line)" at the end */
        size_t len = strlen(line);
        if (len < 3 || line[len - 1] != ')') return NULL;
        line[len - 1] = 0;
        char *open = strrchr(line, '(');
        return open && strchr(open, ':') ? open + 1 : NULL;
    }
    char *extra = strstr(line, " (discriminator");
    if (extra) *extra = 0;
    if (tool == LLVM_SYMBOLIZER) { /* "file:line:column": drop the column */
        char *last = strrchr(line, ':');
        if (!last || last == line) return NULL;
        *last = 0;
    }
    return line;
}

/* Runs one symbolizer on the library's address; 1 with "file:line" in out if it named a line. */
static int symbolize(symbolizer tool, const Dl_info *info, const void *pc, char *out, size_t n) {
    char relative[32], absolute[32], base[32], *text = NULL;
    snprintf(relative, sizeof relative, "0x%llx",
             (unsigned long long)((uintptr_t)pc - 1 - (uintptr_t)info->dli_fbase)); /* the call itself */
    snprintf(absolute, sizeof absolute, "0x%llx", (unsigned long long)((uintptr_t)pc - 1));
    snprintf(base, sizeof base, "0x%llx", (unsigned long long)(uintptr_t)info->dli_fbase);
    char *file = (char *)info->dli_fname, obj[4096];
    snprintf(obj, sizeof obj, "--obj=%s", file);
    char *addr2line[] = {(char *)symbolizer_names[tool], "-i", "-e", file, relative, NULL};
    char *llvm_symbolizer[] = {"llvm-symbolizer", "--inlines", obj, relative, NULL};
    char *atos[] = {"atos", "-i", "-o", file, "-l", base, absolute, NULL};
    char **argv = tool == ATOS ? atos : tool == LLVM_SYMBOLIZER ? llvm_symbolizer : addr2line;
    int found = 0;
    if (mcpu_run_tool(argv, &text, 30.0) == 0 && text) {
        char *rest = NULL;
        for (char *line = strtok_r(text, "\n", &rest); line && !found; line = strtok_r(NULL, "\n", &rest)) {
            char *place = frame_place(tool, line);
            if (!place) continue;
            if (!strncmp(place, "./", 2)) place += 2;
            char *colon = strrchr(place, ':');
            if (place[0] == '?' || !colon || colon[1] == '?' || !strcmp(colon, ":0") || is_shim_file(place)) continue;
            snprintf(out, n, "%s", place);
            found = 1;
        }
    }
    free(text);
    return found;
}

/* "file:line" of a kernel's code address: the innermost inlined frame in the kernel's own source
 * (a shim function such as simdgroup_load names its caller), from the library's line tables, read
 * by the first symbolizer that names a line. */
void mcpu_source_place(const void *pc, char *out, size_t n) {
    Dl_info info;
    if (!pc || !dladdr(pc, &info) || !info.dli_fname) {
        snprintf(out, n, "%p", pc);
        return;
    }
    const char *only = getenv("FLASHATTN_MPS_SYMBOLIZER");
    for (int tool = 0; tool < N_SYMBOLIZERS; tool++) {
        if (only && *only && strcmp(only, symbolizer_names[tool]) != 0) continue;
        if (symbolize((symbolizer)tool, &info, pc, out, n)) return;
    }
    snprintf(out, n, "%s+0x%lx (no line: no symbolizer could tell; tried %s)", info.dli_sname ? info.dli_sname : "?",
             (unsigned long)((uintptr_t)pc - (uintptr_t)(info.dli_sname ? info.dli_saddr : info.dli_fbase)),
             only && *only ? only : "addr2line, llvm-addr2line, llvm-symbolizer, atos");
}
