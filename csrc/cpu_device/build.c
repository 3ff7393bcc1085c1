/* Building one library: the compiler runs of the pipeline (library.c), the rewrites of their IR, and
 * the cache key of everything that shapes the binary. */
#define _POSIX_C_SOURCE 200809L
#include "device.h"
#include "shim_files.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define DEFAULT_VERSION_FLAG "-D__METAL_VERSION__=310"
enum { MAX_SHIM_MACROS = 4 };
/* -fms-extensions: -E expands macros in pragmas (`#pragma unroll (MIN(N, 4))`), as the compiler proper
 * does where the pragma is read; the two macros it predefines are taken back. */
static const char *const PRE_FLAGS[] = {"-E",
                                        "-x",
                                        "c++",
                                        "-std=gnu++17",
                                        "-nostdinc",
                                        "-fms-extensions",
                                        "-U_WCHAR_T_DEFINED",
                                        "-U_NATIVE_WCHAR_T_DEFINED",
                                        DEFAULT_VERSION_FLAG,
                                        "-D__HAVE_BFLOAT__=1"};
/* -fsycl-is-device gives clang's language address spaces the default one converts from (msl_shim.h);
 * without device code to diagnose, it changes nothing else the kernels see. Kernels view buffers
 * through other types (half* as half4*): no type-based alias analysis. MSL's char is signed, which
 * aarch64 Linux's is not by default. `const constant T` reads const twice: allowed. Every error
 * goes to the log (clang stops at 20 by default); a crashing clang leaves no reproducer in /tmp.
 * The front end stops at unoptimised LLVM IR (IR_FLAGS), whose convergent attributes go (below). */
static const char *const CC_FLAGS[] = {"-x",
                                       "c++",
                                       "-std=gnu++17",
                                       "-Xclang",
                                       "-fsycl-is-device",
                                       "-O3",
                                       "-fno-strict-aliasing",
                                       "-fsigned-char",
                                       "-fPIC",
                                       "-Wno-unknown-attributes",
                                       "-Wno-duplicate-decl-specifier",
                                       "-ferror-limit=0",
                                       "-fno-crash-diagnostics"};
/* -fsycl-is-device also marks every function and call convergent, as for a SIMT target, and clang
 * 16 has no -fno-convergent-functions. Here each GPU thread is a fiber that runs its code
 * sequentially, so no transformation that is sound for one thread can change which barrier a
 * thread reaches. Yet convergent calls stay put: the const self() and function-constant lookups
 * (msl_sync.h, msl_kernel.h) run again at every loop iteration, loops are not unswitched on a
 * function constant. So the front end writes IR, drop_convergent takes the attribute out, and
 * clang optimises and compiles that IR (the same passes and code as one clang run, minus it). */
static const char *const IR_FLAGS[] = {"-S", "-emit-llvm", "-Xclang", "-disable-llvm-passes"};
static const char *const CODEGEN_FLAGS[] = {"-x", "ir", "-O3", "-fPIC", "-shared", "-fno-crash-diagnostics"};
static const char NOT_CONVERGENT[] = "\"msl-not-convergent\""; /* an attribute group may not be empty */
/* Checked mode: every load and store calls the shim's __tsan_* hooks (msl_kernel.h), without the
 * sanitizer's runtime (clang links none into a shared object); line tables, in a DWARF version
 * addr2line reads, name the accesses' source lines. */
static const char *const CHECKED_FLAGS[] = {"-DMSL_CHECKED", "-fsanitize=thread", "-g1", "-gdwarf-4"};
static const char CODEGEN_CHECKED_FLAG[] = "-fsanitize=thread"; /* the instrumentation is a pass */


/* The language version a library asks for: the value of its macro __METAL_VERSION__ (compile_library
 * passes 400 for Metal 4, the default, or an older one), NULL for the default flag's 310 (the C API's
 * callers, the project's own kernels). Metal 4's C++ has class-type template arguments (MPP's
 * matmul2d<descriptor, scope>): C++20 from 400 on. */
static const char *language_version(const mcpu_macro *macros, uint32_t n_macros) {
    for (uint32_t i = 0; i < n_macros; i++)
        if (!strcmp(macros[i].name, "__METAL_VERSION__"))
            return macros[i].value && *macros[i].value ? macros[i].value : "1";
    return NULL;
}
static const char *language(const char *flag, const char *version) {
    return version && atol(version) >= 400 && !strcmp(flag, "-std=gnu++17") ? "-std=gnu++20" : flag;
}

/* Length of a line's "file:line:col" prefix, or 0. */
static uint64_t location(const char *line) {
    if (*line == ' ' || *line == '\t') return 0;
    for (const char *c = strchr(line, ':'); c && c > line && c < line + strcspn(line, "\n"); c = strchr(c + 1, ':')) {
        uint64_t a = strspn(c + 1, "0123456789"), b = a && c[1 + a] == ':' ? strspn(c + 2 + a, "0123456789") : 0;
        if (b && c[2 + a + b] == ':') return (uint64_t)(c - line) + 2 + a + b;
    }
    return 0;
}

static const char *next_line(const char *line) {
    line += strcspn(line, "\n");
    return *line ? line + 1 : line;
}

static int32_t mentions(const char *line, const char *what) {
    const char *hit = strstr(line, what);
    return hit && hit < line + strcspn(line, "\n");
}

/* The end of one diagnostic's block of lines. */
static int32_t boundary(const char *line) { return mentions(line, "error:") || mentions(line, "warning:"); }

/* The whole output in file `log` (written in tmp, renamed into place), and the line that names it
 * in `note`; note is "" when log is NULL (a read-only cache) or cannot be written. */
static void keep_log(const char *out, uint64_t n, const char *tmp, const char *log, char note[PATH_BYTES + 96]) {
    char path[PATH_BYTES];
    mcpu_status ignored;
    uint64_t errors = 0;
    note[0] = 0;
    if (!log || join(path, tmp, ".compiler-output.log", &ignored) || write_file(path, out, n, &ignored) ||
        rename(path, log))
        return;
    for (const char *line = out; *line; line = next_line(line)) errors += (uint64_t)mentions(line, "error:");
    snprintf(note, PATH_BYTES + 96, "the whole compiler output (%llu errors, %llu bytes): %s\n",
             (unsigned long long)errors, (unsigned long long)n, log);
}

/* MCPU_ERR_COMPILE with the compiler's output, temporary-directory prefixes removed: first the first
 * error as .metal file:line:col (line markers give those; an error inside the shim is reported at
 * the first .metal location the compiler names for it), then where the whole output is kept (log),
 * then as much of it as the message holds. */
int32_t ident_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

static int32_t compile_error(mcpu_status *st, const char *what, int32_t rc, char *out, const char *tmp,
                             const char *shim, const char *log) {
    if (!out || !*out) {
        free(out);
        return mcpu_fail(st, MCPU_ERR_COMPILE, "%s failed (status %d) without a message", what, rc);
    }
    /* without the temporary directory's prefix, and with clang's names of the address spaces
     * (msl_shim.h) spelled as in MSL; a name grows by at most 11/7 */
    static const char *const SPACES[][2] = {
        {"__global_device", "device"}, {"__global_host", "constant"}, {"__local", "threadgroup"}};
    char prefix[PATH_BYTES], *text = malloc(strlen(out) * 2 + 1);
    if (!text) {
        free(out);
        return mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    }
    uint64_t pn = (uint64_t)snprintf(prefix, sizeof prefix, "%s/", tmp), w = 0, sn = strlen(shim);
    for (uint64_t r = 0; out[r];) {
        if (!strncmp(out + r, prefix, (size_t)pn)) {
            r += pn;
            continue;
        }
        int32_t starts = r == 0 || !ident_char(out[r - 1]);
        uint64_t k = 0, n = 0;
        for (; starts && k < COUNT(SPACES); k++)
            if (!strncmp(out + r, SPACES[k][0], (size_t)(n = strlen(SPACES[k][0]))) && !ident_char(out[r + n])) break;
        if (starts && k < COUNT(SPACES)) {
            w += (uint64_t)sprintf(text + w, "%s", SPACES[k][1]);
            r += n;
            continue;
        }
        text[w++] = out[r++];
    }
    text[w] = 0;
    free(out);
    out = text;
    char note[PATH_BYTES + 96];
    keep_log(out, w, tmp, log, note);
    const char *first = NULL, *from = NULL;
    for (const char *line = out; *line && !first; line = next_line(line))
        if (mentions(line, "error:")) first = line;
    /* inside the shim: clang names the kernel's line after the error (notes) */
    for (const char *line = first; line && *line && !strncmp(first, shim, (size_t)sn) && !from;) {
        line = next_line(line);
        if (boundary(line)) break;
        if (strncmp(line, shim, (size_t)sn) && location(line)) from = line;
    }
    if (from) {
        const char *msg = strstr(first, "error:");
        mcpu_fail(st, MCPU_ERR_COMPILE, "%.*s: %.*s\n%s%s", (int)location(from), from, (int)strcspn(msg, "\n"), msg,
                  note, out);
    } else if (first) {
        mcpu_fail(st, MCPU_ERR_COMPILE, "%.*s\n%s%s", (int)strcspn(first, "\n"), first, note, out);
    } else {
        mcpu_fail(st, MCPU_ERR_COMPILE, "%s failed (status %d)\n%s%s", what, rc, note, out);
    }
    free(out);
    return MCPU_ERR_COMPILE;
}

/* A file name for the source inside the temporary directory: source_name without path separators
 * and without a leading '.', which the build's own files (.preprocessed.ii, ...) start with. */
static void safe_name(const char *source_name, char out[128]) {
    uint64_t n = 0;
    for (const char *c = source_name; *c && n < 100; c++)
        out[n++] = (*c == '/' || *c == '\\' || *c == '\n' || (c == source_name && *c == '.')) ? '_' : *c;
    out[n] = 0;
}

/* "note: ..." when the file system holding dir is (nearly) full, else "". */
static void disk_note(const char *dir, char note[PATH_BYTES + 96]) {
    struct statvfs fs;
    uint64_t free_bytes = 0;
    note[0] = 0;
    if (!statvfs(dir, &fs) && (free_bytes = (uint64_t)fs.f_bavail * fs.f_frsize) < (64u << 20))
        snprintf(note, PATH_BYTES + 96, "note: the file system holding %s has only %llu bytes free\n", dir,
                 (unsigned long long)free_bytes);
}

/* One compiler run of the build; MCPU_OK or the failure in st. */
static int32_t compiler_step(const command *cxx, char *const args[], uint64_t n_args, const char *what, const char *tmp,
                             const char *shim, const char *log, double timeout, mcpu_status *st) {
    char **argv = with_args(cxx, args, n_args), *err = NULL, why[96];
    if (!argv) return mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    int32_t status = run(argv, NULL, &err, timeout);
    int32_t saved = errno;
    free(argv);
    if (status == 0) {
        free(err);
        return MCPU_OK;
    }
    if (status < 0) {
        errno = saved;
        mcpu_fail(st, status == -1 ? MCPU_ERR_UNSUPPORTED : MCPU_ERR_COMPILE,
                  "CPU Metal device: %s with '%s' (from %s) failed: %s", what, cxx->text, cxx->source,
                  run_failure(status, timeout, why));
        free(err);
        return st->code;
    }
    char note[PATH_BYTES + 96];
    disk_note(tmp, note);
    if (*note) { /* a full disk explains what the compiler says about it */
        uint64_t n = strlen(note), m = err ? strlen(err) : 0;
        char *both = malloc((size_t)(n + m + 1));
        if (both) {
            memcpy(both, note, (size_t)n);
            memcpy(both + n, err ? err : "", (size_t)m + 1);
            free(err);
            err = both;
        }
    }
    return compile_error(st, what, status, err, tmp, shim, log);
}


/* LLVM IR text without the attribute `convergent` (CC_FLAGS): in the attribute groups (lines
 * "attributes #N = { ... }"), outside quoted strings, the word becomes NOT_CONVERGENT. NULL when
 * out of memory. */
static char *drop_convergent(const char *ir) {
    static const char word[] = "convergent";
    const uint64_t k = sizeof word - 1, grow = sizeof NOT_CONVERGENT - sizeof word;
    uint64_t count = 0;
    for (const char *c = ir; (c = strstr(c, word)); c += k) count++;
    char *out = malloc((size_t)(strlen(ir) + count * grow + 1)), *w = out;
    if (!out) return NULL;
    for (const char *line = ir; *line;) {
        const char *end = line + strcspn(line, "\n");
        end += *end == '\n';
        int32_t group = !strncmp(line, "attributes #", 12), quoted = 0;
        for (const char *c = line; c < end;) {
            if (*c == '"') quoted = !quoted;
            int32_t here = group && !quoted && c > line && c[-1] == ' ' && !strncmp(c, word, k);
            if (here && (c[k] == ' ' || c[k] == '}')) {
                memcpy(w, NOT_CONVERGENT, sizeof NOT_CONVERGENT - 1);
                w += sizeof NOT_CONVERGENT - 1, c += k;
            } else {
                *w++ = *c++;
            }
        }
        line = end;
    }
    *w = 0;
    return out;
}

/* Apple GPUs load and store a vector at any address aligned to its element (ggml's kernel_mul_mm
 * writes float4s into output rows of any length), but the front end promises every access through a
 * pointer the alignment of the pointee's type, and x86 faults on a 16-byte access so promised
 * (movaps). So every ordinary load and store, memory intrinsic, pointer argument and returned
 * pointer promises alignment 1 here, and the optimiser infers what it can prove (stack slots and
 * globals, aligned where they are allocated: they and their accesses run at full speed). Kept:
 * allocations (alloca, globals), atomics (their alignment decides whether they are lock-free), the
 * ABI's stack slots (byval and kin) and a function's own alignment. */
static const char ALIGNMENT_RULE[] = "align 1: load, store, call, define, declare"; /* in the cache key */

/* Where the access promises of an IR line end (the line itself when it holds none): an ordinary
 * load or store, a call, a function's header up to its parameter list's end. */
static const char *promises_end(const char *line, const char *end) {
    const char *c = line + strspn(line, " ");
    int32_t header = c == line && (!strncmp(c, "define ", 7) || !strncmp(c, "declare ", 8));
    if (header) { /* after the name, the parameters' parentheses (names and types hold none unquoted) */
        int32_t quoted = 0, depth = 0;
        for (const char *at = strchr(c, '@'); at && at < end; at++) {
            if (*at == '"') quoted = !quoted;
            else if (!quoted && *at == '(') depth++;
            else if (!quoted && *at == ')' && !--depth) return at;
        }
        return line;
    }
    if (c == line) return line; /* globals, types, attribute groups, metadata */
    if (*c == '%') {
        const char *eq = strstr(c, " = ");
        if (!eq || eq >= end) return line;
        c = eq + 3;
    }
    static const char *const calls[] = {"call ", "tail call ", "musttail call ", "notail call ", "invoke "};
    for (uint64_t i = 0; i < COUNT(calls); i++)
        if (!strncmp(c, calls[i], strlen(calls[i]))) return end;
    if (!strncmp(c, "load ", 5) || !strncmp(c, "store ", 6)) /* `load atomic`, `store atomic` keep theirs */
        return strncmp(c + 5 + (*c == 's'), "atomic ", 7) ? end : line;
    return line;
}

/* IR text whose access promises say align 1 (ALIGNMENT_RULE). NULL when out of memory. */
static char *relax_alignment(const char *ir) {
    static const char *const abi[] = {"byval(", "byref(", "inalloca(", "preallocated("};
    char *out = malloc(strlen(ir) + 1), *w = out; /* never longer: align N becomes align 1 */
    if (!out) return NULL;
    for (const char *line = ir; *line;) {
        const char *end = line + strcspn(line, "\n");
        end += *end == '\n';
        const char *stop = promises_end(line, end), *c = line;
        for (int32_t quoted = 0; c < stop;) {
            if (*c == '"') quoted = !quoted;
            uint64_t k = 0;
            for (uint64_t i = 0; !quoted && i < COUNT(abi) && !k; i++)
                if (c[0] == ' ' && !strncmp(c + 1, abi[i], strlen(abi[i]))) k = 1 + strlen(abi[i]);
            if (k) { /* `byval(T) align N` as it is */
                for (int32_t depth = 1; c + k < stop && depth; k++) depth += (c[k] == '(') - (c[k] == ')');
                if (!strncmp(c + k, " align ", 7)) k += 7 + strspn(c + k + 7, "0123456789");
                memcpy(w, c, k);
                w += k, c += k;
            } else if (!quoted && !strncmp(c, " align ", 7) && c[7] >= '0' && c[7] <= '9') {
                memcpy(w, " align 1", 8);
                w += 8, c += 7 + strspn(c + 7, "0123456789");
            } else {
                *w++ = *c++;
            }
        }
        memcpy(w, c, (size_t)(end - c));
        w += end - c, line = end;
    }
    *w = 0;
    return out;
}

/* Builds tmp/.library.so from source, with the shim in `shim`. The library exports
 * __msl_library_key = KEY_MARK + key: what it was built for, checked when it is loaded. A failing
 * compiler's whole output goes to file `log` (NULL: nowhere). */
int32_t build(const command *cxx, int32_t clash, int32_t checked, const char *shim, const char *tmp, const char *log,
              const char *key, const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
              double timeout, mcpu_status *st) {
    char base[128], src[PATH_BYTES], pre[PATH_BYTES], cpp[PATH_BYTES], ll[PATH_BYTES], rewritten_ll[PATH_BYTES],
        so[PATH_BYTES], inc[PATH_BYTES], shim_h[PATH_BYTES];
    safe_name(source_name, base);
    if (join(src, tmp, base, st) || join(pre, tmp, ".preprocessed.ii", st) || join(cpp, tmp, ".kernels.cpp", st) ||
        join(ll, tmp, ".kernels.ll", st) || join(rewritten_ll, tmp, ".rewritten.ll", st) ||
        join(so, tmp, ".library.so", st) || join(inc, shim, "include", st) || join(shim_h, shim, "msl_shim.h", st))
        return st->code;

    /* 1. the source, with a #line so diagnostics name source_name */
    const char *s = source + strspn(source, " \t");
    int32_t has_line = s[0] == '#' && !strncmp(s + 1 + strspn(s + 1, " \t"), "line", 4);
    int fd = open(src, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        return io_fail(st, "create", src);
    }
    if (!has_line) {
        fputs("#line 1 \"", f);
        for (const char *c = source_name; *c; c++) {
            if (*c == '"' || *c == '\\') fputc('\\', f);
            fputc(*c == '\n' ? ' ' : *c, f);
        }
        fputs("\"\n", f);
    }
    fputs(source, f);
    if (ferror(f) | fclose(f)) return io_fail(st, "write", src);

    /* 2. c++ -E with the macros */
    const char *version = language_version(macros, n_macros);
    uint64_t argc = 0, cap = COUNT(PRE_FLAGS) + n_macros + 8;
    char **argv = calloc((size_t)cap, sizeof *argv), **defs = calloc((size_t)n_macros + 1, sizeof *defs);
    int32_t rc = argv && defs ? MCPU_OK : mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    if (!rc) {
        for (uint64_t i = 0; i < COUNT(PRE_FLAGS); i++)
            if (!version || strcmp(PRE_FLAGS[i], DEFAULT_VERSION_FLAG))
                argv[argc++] = (char *)language(PRE_FLAGS[i], version);
        for (uint32_t i = 0; i < n_macros && !rc; i++) {
            const char *v = macros[i].value && *macros[i].value ? macros[i].value : "1";
            uint64_t n = strlen(macros[i].name) + strlen(v) + 4;
            if (!(defs[i] = malloc((size_t)n))) {
                rc = mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
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
    if (!rc) rc = compiler_step(cxx, argv, argc, "preprocessing", tmp, shim, log, timeout, st);
    for (uint32_t i = 0; defs && i < n_macros; i++) free(defs[i]);
    free(defs);
    free(argv);
    if (rc) return rc;

    /* 3. the prepass, plus the key the library is built for */
    fd = open(pre, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    char *text = fd >= 0 ? read_fd(fd, UINT64_MAX, NULL) : NULL;
    if (fd >= 0) close(fd);
    if (!text) return io_fail(st, "read", pre);
    char *out = mcpu_preprocess(text, source_name, 0, st);
    free(text);
    if (!out) return st->code;
    char mark[160];
    int n_mark = snprintf(mark, sizeof mark,
                          "\nextern \"C\" __attribute__((visibility(\"default\"))) const char __msl_library_key[] ="
                          " \"%s%s\";\n",
                          KEY_MARK, key);
    uint64_t n_out = strlen(out);
    char *all = realloc(out, (size_t)(n_out + (uint64_t)n_mark + 1));
    if (!all) {
        free(out);
        return mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    }
    memcpy(all + n_out, mark, (size_t)n_mark + 1);
    rc = write_file(cpp, all, n_out + (uint64_t)n_mark, st);
    free(all);
    if (rc) return rc;

    /* 4. the front end, to IR */
    char *cc[COUNT(CC_FLAGS) + COUNT(IR_FLAGS) + COUNT(CHECKED_FLAGS) + 12 + MAX_SHIM_MACROS], cwd[PATH_BYTES],
        prefix_map[PATH_BYTES + 32], shim_macros[MAX_SHIM_MACROS][160];
    uint64_t n = 0;
    /* the language version and the device's own settings (__MSL_CPU_*) reach the shim too */
    for (uint32_t i = 0, m = 0; i < n_macros && m < MAX_SHIM_MACROS; i++)
        if (!strcmp(macros[i].name, "__METAL_VERSION__") || !strncmp(macros[i].name, "__MSL_CPU_", 10)) {
            const char *v = macros[i].value && *macros[i].value ? macros[i].value : "1";
            if (snprintf(shim_macros[m], sizeof shim_macros[m], "-D%s=%s", macros[i].name, v) <
                (int)sizeof shim_macros[m])
                cc[n++] = shim_macros[m++];
        }
    for (uint64_t i = 0; i < COUNT(CC_FLAGS); i++) cc[n++] = (char *)language(CC_FLAGS[i], version);
    for (uint64_t i = 0; i < COUNT(IR_FLAGS); i++) cc[n++] = (char *)IR_FLAGS[i];
    if (clash) cc[n++] = (char *)STACK_CLASH_FLAG;
    if (checked) {
        for (uint64_t i = 0; i < COUNT(CHECKED_FLAGS); i++) cc[n++] = (char *)CHECKED_FLAGS[i];
        /* source names as the #line directives give them, not under the compiler's directory */
        if (getcwd(cwd, sizeof cwd) &&
            snprintf(prefix_map, sizeof prefix_map, "-fdebug-prefix-map=%s=.", cwd) < (int)sizeof prefix_map)
            cc[n++] = prefix_map;
    }
    cc[n++] = "-include";
    cc[n++] = shim_h;
    cc[n++] = cpp;
    cc[n++] = "-o";
    cc[n++] = ll;
    if ((rc = compiler_step(cxx, cc, n, "compiling", tmp, shim, log, timeout, st))) return rc;

    /* 5. without convergent, with the alignment vectors have on Apple GPUs */
    fd = open(ll, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    text = fd >= 0 ? read_fd(fd, UINT64_MAX, NULL) : NULL;
    if (fd >= 0) close(fd);
    if (!text) return io_fail(st, "read", ll);
    char *sequential = drop_convergent(text);
    free(text);
    char *rewritten = sequential ? relax_alignment(sequential) : NULL;
    free(sequential);
    if (!rewritten) return mcpu_fail(st, MCPU_ERR_RUNTIME, "out of memory");
    rc = write_file(rewritten_ll, rewritten, strlen(rewritten), st);
    free(rewritten);
    if (rc) return rc;

    /* 6. optimise, generate code and link */
    n = 0;
    for (uint64_t i = 0; i < COUNT(CODEGEN_FLAGS); i++) cc[n++] = (char *)CODEGEN_FLAGS[i];
    if (checked) cc[n++] = (char *)CODEGEN_CHECKED_FLAG;
    cc[n++] = rewritten_ll;
    cc[n++] = "-o";
    cc[n++] = so;
    cc[n++] = "-lm";
    return compiler_step(cxx, cc, n, "generating code", tmp, shim, log, timeout, st);
}

void build_key(const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
               const command *cxx, const char *id, int32_t checked, char key[33]) {
    sha256 s;
    sha_init(&s);
    sha_field(&s, "flashattn_mps CPU Metal library v2");
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
    for (uint32_t i = 0; i < cxx->argc; i++) sha_field(&s, cxx->argv[i]);
    sha_field(&s, id);
    for (uint64_t i = 0; i < COUNT(PRE_FLAGS); i++) sha_field(&s, PRE_FLAGS[i]);
    for (uint64_t i = 0; i < COUNT(CC_FLAGS); i++) sha_field(&s, CC_FLAGS[i]);
    for (uint64_t i = 0; i < COUNT(IR_FLAGS); i++) sha_field(&s, IR_FLAGS[i]);
    sha_field(&s, mcpu_rewriter_digest); /* the prepass's and this file's rewrites themselves */
    sha_field(&s, NOT_CONVERGENT);       /* drop_convergent */
    sha_field(&s, ALIGNMENT_RULE);       /* relax_alignment */
    for (uint64_t i = 0; i < COUNT(CODEGEN_FLAGS); i++) sha_field(&s, CODEGEN_FLAGS[i]);
    if (checked)
        for (uint64_t i = 0; i < COUNT(CHECKED_FLAGS); i++) sha_field(&s, CHECKED_FLAGS[i]);
    if (checked) sha_field(&s, CODEGEN_CHECKED_FLAG);
    sha_hex(&s, key);
}

uint32_t mcpu_preprocessor_flags(const char *const **flags) {
    *flags = PRE_FLAGS;
    return (uint32_t)COUNT(PRE_FLAGS);
}
