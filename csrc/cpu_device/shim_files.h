/* The files of csrc/cpu_device/shim/ as text, the compiler names of compilers.txt and the digest of
 * the rewriting sources, embedded at build time by tools/embed_shim.py, which writes the same
 * struct definition into the generated C file. */
#ifndef MCPU_SHIM_FILES_H
#define MCPU_SHIM_FILES_H

#include <stdint.h>

typedef struct mcpu_shim_file {
    const char *name; /* file name, e.g. "msl_shim.h" */
    const char *text; /* its exact contents */
} mcpu_shim_file;

extern const mcpu_shim_file mcpu_shim_files[];
extern const uint32_t mcpu_shim_file_count;

/* The compilers looked for on PATH, in order (compilers.txt). */
extern const char *const mcpu_compiler_names[];
extern const uint32_t mcpu_compiler_name_count;

/* SHA-256 (hex) of the device's sources that rewrite kernels before clang (prepass.c, build.c):
 * part of the cache key, so a library built by an older rewrite is not reused. */
extern const char mcpu_rewriter_digest[];

#endif
