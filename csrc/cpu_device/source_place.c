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

/* "file:line" of a kernel's code address: the innermost inlined frame in the kernel's own source
 * (a shim function such as simdgroup_load names its caller), from the library's line tables, read
 * by addr2line (binutils, installed with the linker that built the library). */
void mcpu_source_place(const void *pc, char *out, size_t n) {
    Dl_info info;
    if (!pc || !dladdr(pc, &info) || !info.dli_fname) {
        snprintf(out, n, "%p", pc);
        return;
    }
    char address[32], *text = NULL;
    snprintf(address, sizeof address, "0x%llx",
             (unsigned long long)((uintptr_t)pc - 1 - (uintptr_t)info.dli_fbase)); /* the call itself */
    char *argv[] = {"addr2line", "-i", "-e", (char *)info.dli_fname, address, NULL};
    int found = 0;
    if (mcpu_run_tool(argv, &text, 30.0) == 0 && text) {
        char *rest = NULL;
        for (char *line = strtok_r(text, "\n", &rest); line && !found; line = strtok_r(NULL, "\n", &rest)) {
            char *extra = strstr(line, " (discriminator");
            if (extra) *extra = 0;
            if (!strncmp(line, "./", 2)) line += 2;
            char *colon = strrchr(line, ':');
            if (line[0] == '?' || !colon || colon[1] == '?' || !strcmp(colon, ":0") || is_shim_file(line)) continue;
            snprintf(out, n, "%s", line);
            found = 1;
        }
    }
    free(text);
    if (!found)
        snprintf(out, n, "%s+0x%lx (no line: addr2line could not tell)", info.dli_sname ? info.dli_sname : "?",
                 (unsigned long)((uintptr_t)pc - (uintptr_t)(info.dli_sname ? info.dli_saddr : info.dli_fbase)));
}
