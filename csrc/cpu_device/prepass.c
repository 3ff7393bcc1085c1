/* Rewrites preprocessed MSL into C++ for the shim (ARCHITECTURE.md, "Compilation pipeline", step 3).
 *
 * A hand-written scanner: tokens carry their .metal line (from `# N "file"` line markers), a walk
 * over namespace/class scopes and function bodies finds the constructs, and in-place edits rewrite
 * them without adding or removing a line, so compiler diagnostics keep the .metal line numbers.
 * Launchers are appended at the end, each after a #line naming its kernel's line. The generated
 * shapes are documented in shim/msl_kernel.h, which defines what they use. */
#include "metal_cpu.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct sbuf {
    char *p;
    uint64_t n, cap;
    int32_t oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, uint64_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        uint64_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *q = realloc(b->p, (size_t)cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, (size_t)n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int32_t n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((uint64_t)n < sizeof tmp) {
        sb_put(b, tmp, (uint64_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = 1;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_put(b, big, (uint64_t)n);
    free(big);
}

/* k: 'w' word, 'n' number, 's' string, 'c' character literal, 'D' "::", 'A' "->", else the
 * punctuation character itself. line and file are the .metal position the line markers give. */
typedef struct tok {
    uint64_t a, b;
    uint32_t line, col, file;
    char k;
} tok;

/* Replace [a, b) by text followed by the span's newlines; text NULL blanks the span to spaces. */
typedef struct edit {
    uint64_t a, b;
    char *text;
    int64_t order; /* of insertions (a == b) at one place: ascending */
} edit;

typedef struct tmpl {
    char *name, *args; /* a kernel template's name and the launcher arguments its parameters need */
    char *check;       /* and the statement its launcher runs first (params) */
} tmpl;

typedef struct pp {
    const char *src;
    uint64_t len;
    int32_t strict;
    tok *t;
    uint64_t n, tcap;
    char **files; /* file names as written in the markers (C string contents, still escaped) */
    uint64_t nfiles, fcap;
    edit *ed;
    uint64_t ned, edcap;
    char **ns; /* openers of the enclosing namespaces ("namespace a", "inline namespace b") */
    uint64_t nns, nscap;
    tmpl *tm;
    uint64_t ntm, tmcap;
    char **fc; /* function constants and constants computed from them */
    uint64_t nfc, fccap;
    char **hosts; /* kernel host names, in order */
    uint64_t nhosts, hcap;
    sbuf launchers;
    sbuf violations;   /* MSL rules broken, one "file:line:col: error: ... [rule: name]" line each */
    uint64_t cast_end; /* strict: the address-space casts rewritten so far end here */
    int64_t nconds;    /* conditional operators rewritten so far */
    int32_t failed;
    char err[1024];
} pp;

static void oom(pp *P) {
    if (!P->failed) snprintf(P->err, sizeof P->err, "out of memory in the MSL prepass");
    P->failed = 1;
}

/* arr reallocated for twice its capacity, or unchanged (capacity too) when out of memory. */
static void *grown(pp *P, void *arr, uint64_t *cap, uint64_t size) {
    uint64_t c = *cap ? *cap * 2 : 16;
    void *q = realloc(arr, (size_t)(c * size));
    if (!q) {
        oom(P);
        return arr;
    }
    *cap = c;
    return q;
}
/* Whether the growable array arr (n used of cap) has room for one more element. */
#define ROOM(P, arr, n, cap) ((n) < (cap) || ((arr) = grown((P), (arr), &(cap), sizeof *(arr)), (n) < (cap)))

static void fail_at(pp *P, uint64_t i, const char *fmt, ...) {
    if (P->failed) return;
    P->failed = 1;
    tok t = {0, 0, 1, 1, 0, 0};
    if (P->n) t = P->t[i < P->n ? i : P->n - 1];
    int32_t n = snprintf(P->err, sizeof P->err, "%s:%u:%u: error: ", P->files[t.file], t.line, t.col);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (uint64_t)n < sizeof P->err) vsnprintf(P->err + n, sizeof P->err - (uint64_t)n, fmt, ap);
    va_end(ap);
}

/* A broken MSL rule at token i: collected, so that one run reports every violation; the source
 * is then refused as a whole (mcpu_preprocess). */
static void violation(pp *P, uint64_t i, const char *rule, const char *fmt, ...) {
    tok t = P->t[i < P->n ? i : P->n - 1];
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sb_printf(&P->violations, "%s:%u:%u: error: %s [rule: %s]\n", P->files[t.file], t.line, t.col, msg, rule);
}

static char *dup_n(pp *P, const char *s, uint64_t n) {
    char *d = malloc((size_t)n + 1);
    if (!d) {
        oom(P);
        return NULL;
    }
    memcpy(d, s, (size_t)n);
    d[n] = 0;
    return d;
}

/* Source text of tokens [i, j), on one line. */
static char *text(pp *P, uint64_t i, uint64_t j) {
    if (i >= j) return dup_n(P, "", 0);
    char *d = dup_n(P, P->src + P->t[i].a, P->t[j - 1].b - P->t[i].a);
    for (char *c = d; c && *c; c++)
        if (*c == '\n' || *c == '\r') *c = ' ';
    return d;
}

static void add_edit(pp *P, uint64_t a, uint64_t b, char *text_or_null) {
    if (!ROOM(P, P->ed, P->ned, P->edcap)) {
        free(text_or_null);
        return;
    }
    P->ed[P->ned++] = (edit){a, b, text_or_null, 0};
}

/* Insert text at byte a; of several insertions at one place, lower order first. */
static void add_insertion(pp *P, uint64_t a, char *text, int64_t order) {
    add_edit(P, a, a, text);
    if (!P->failed) P->ed[P->ned - 1].order = order;
}

static void push_str(pp *P, char ***arr, uint64_t *n, uint64_t *cap, char *s) {
    if (!s) return;
    if (!ROOM(P, *arr, *n, *cap)) {
        free(s);
        return;
    }
    (*arr)[(*n)++] = s;
}

/* ---- tokenizer ---- */

static int32_t is_ident(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
static int32_t is_digit(char c) { return c >= '0' && c <= '9'; }

static uint32_t file_index(pp *P, const char *s, uint64_t n) {
    for (uint64_t i = 0; i < P->nfiles; i++)
        if (strlen(P->files[i]) == n && !memcmp(P->files[i], s, (size_t)n)) return (uint32_t)i;
    push_str(P, &P->files, &P->nfiles, &P->fcap, dup_n(P, s, n));
    return P->failed ? 0 : (uint32_t)(P->nfiles - 1);
}

/* A directive line from i (at '#') to its end: `# N "file" ...` and `#line N "file"` set where
 * the next line comes from; anything else (#pragma) is skipped. */
static uint64_t directive(pp *P, uint64_t i, uint32_t *line, uint32_t *file) {
    const char *s = P->src;
    uint64_t n = P->len, e = i;
    for (; e < n && s[e] != '\n'; e++)
        if (s[e] == '\\' && e + 1 < n && s[e + 1] == '\n') e++, (*line)++; /* continued */
    i++;
    while (i < e && (s[i] == ' ' || s[i] == '\t')) i++;
    if (e - i > 4 && !memcmp(s + i, "line", 4) && !is_ident(s[i + 4])) i += 4;
    while (i < e && (s[i] == ' ' || s[i] == '\t')) i++;
    if (i >= e || !is_digit(s[i])) return e;
    uint64_t num = 0;
    while (i < e && is_digit(s[i])) num = num * 10 + (uint64_t)(s[i++] - '0');
    while (i < e && (s[i] == ' ' || s[i] == '\t')) i++;
    if (i < e && s[i] == '"') {
        uint64_t a = ++i;
        while (i < e && s[i] != '"') i += s[i] == '\\' ? 2 : 1;
        *file = file_index(P, s + a, (i < e ? i : e) - a);
    }
    *line = (uint32_t)num - 1; /* the directive's own newline advances to num */
    return e;
}

static int32_t encoding_prefix(const char *w, uint64_t n) {
    return (n == 1 && strchr("LuU", w[0])) || (n == 2 && w[0] == 'u' && w[1] == '8');
}

/* Past a quoted literal starting at i (the quote); stops at an unterminated line's end. */
static uint64_t quoted(const char *s, uint64_t n, uint64_t i) {
    char q = s[i++];
    while (i < n && s[i] != q && s[i] != '\n') i += (s[i] == '\\' && i + 1 < n) ? 2 : 1;
    return i < n && s[i] == q ? i + 1 : i;
}

static void tokenize(pp *P) {
    const char *s = P->src;
    uint64_t n = P->len, i = 0, bol = 0; /* bol: offset of the current line's start */
    uint32_t line = 1, file = 0;
    int32_t line_start = 1; /* only blanks so far on this line */
    while (i < n && !P->failed) {
        char c = s[i];
        if (c == '\n') {
            line++;
            bol = ++i;
            line_start = 1;
            continue;
        }
        if (c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v') {
            i++;
            continue;
        }
        if (c == '#' && line_start) {
            i = directive(P, i, &line, &file);
            continue;
        }
        line_start = 0;
        if (c == '/' && i + 1 < n && s[i + 1] == '/') {
            while (i < n && s[i] != '\n') i++;
            continue;
        }
        if (c == '/' && i + 1 < n && s[i + 1] == '*') {
            for (i += 2; i < n && !(s[i] == '*' && i + 1 < n && s[i + 1] == '/'); i++)
                if (s[i] == '\n') line++, bol = i + 1;
            i = i < n ? i + 2 : n;
            continue;
        }
        tok t = {i, 0, line, (uint32_t)(i - bol + 1), file, 0};
        if (is_ident(c) && !is_digit(c)) {
            while (i < n && is_ident(s[i])) i++;
            uint64_t w = i - t.a;
            int32_t prefix = encoding_prefix(s + t.a, w); /* u8"x", L'x' */
            int32_t raw = s[i - 1] == 'R' && (w == 1 || encoding_prefix(s + t.a, w - 1));
            if (i < n && s[i] == '"' && raw) {
                /* raw string: R"delim( ... )delim" */
                uint64_t d = i + 1;
                while (d < n && s[d] != '(' && d - i < 18) d++;
                uint64_t dl = d - i - 1, k = d + 1;
                for (; k < n; k++) {
                    if (s[k] == '\n') line++, bol = k + 1;
                    if (s[k] == ')' && k + dl + 1 < n && !memcmp(s + k + 1, s + i + 1, (size_t)dl) &&
                        s[k + 1 + dl] == '"')
                        break;
                }
                i = k < n ? k + dl + 2 : n;
                t.k = 's';
            } else if (i < n && (s[i] == '"' || s[i] == '\'') && prefix) {
                t.k = s[i] == '"' ? 's' : 'c';
                i = quoted(s, n, i);
            } else {
                t.k = 'w';
            }
        } else if (is_digit(c) || (c == '.' && i + 1 < n && is_digit(s[i + 1]))) {
            for (i++; i < n; i++) {
                char d = s[i];
                if ((d == '+' || d == '-') && strchr("eEpP", s[i - 1])) continue;
                if (!is_ident(d) && d != '.' && !(d == '\'' && i + 1 < n && is_ident(s[i + 1]))) break;
            }
            t.k = 'n';
        } else if (c == '"' || c == '\'') {
            t.k = c == '"' ? 's' : 'c';
            i = quoted(s, n, i);
        } else if (c == ':' && i + 1 < n && s[i + 1] == ':') {
            t.k = 'D';
            i += 2;
        } else if (c == '-' && i + 1 < n && s[i + 1] == '>') {
            t.k = 'A';
            i += 2;
        } else {
            t.k = c;
            i++;
        }
        t.b = i;
        if (!ROOM(P, P->t, P->n, P->tcap)) return;
        P->t[P->n++] = t;
    }
}

/* ---- token helpers ---- */

static int32_t is(const pp *P, uint64_t i, char k) { return i < P->n && P->t[i].k == k; }

static int32_t word(const pp *P, uint64_t i, const char *w) {
    uint64_t n = strlen(w);
    return is(P, i, 'w') && P->t[i].b - P->t[i].a == n && !memcmp(P->src + P->t[i].a, w, (size_t)n);
}

static int32_t opens(const pp *P, uint64_t i) { return is(P, i, '(') || is(P, i, '[') || is(P, i, '{'); }

/* i at ( [ or {: index after the matching close (counting all three kinds), or P->n. */
static uint64_t skip_group(const pp *P, uint64_t i) {
    uint64_t depth = 0;
    for (; i < P->n; i++) {
        char k = P->t[i].k;
        if (k == '(' || k == '[' || k == '{') depth++;
        if ((k == ')' || k == ']' || k == '}') && --depth == 0) return i + 1;
    }
    return P->n;
}

/* i at '<': index after the matching '>' (groups skipped), or P->n. */
static uint64_t skip_angles(const pp *P, uint64_t i) {
    uint64_t depth = 0;
    while (i < P->n) {
        if (opens(P, i)) {
            i = skip_group(P, i);
            continue;
        }
        if (is(P, i, '<')) depth++;
        if (is(P, i, '>') && --depth == 0) return i + 1;
        if (is(P, i, ';') || is(P, i, '}')) return P->n;
        i++;
    }
    return P->n;
}

static int32_t attr_at(const pp *P, uint64_t i) { return is(P, i, '[') && is(P, i + 1, '['); }

/* One item of an attribute list: its name token, and its argument tokens [a, b) if it has (...). */
typedef struct item {
    uint64_t name, a, b;
} item;

enum { MAX_ITEMS = 8 };

/* Items of the attribute list [[...]] starting at i; *end gets the index after it. */
static uint32_t attr_items(const pp *P, uint64_t i, uint64_t *end, item *it) {
    uint64_t e = skip_group(P, i), last = e - 2, k = i + 2;
    uint32_t n = 0;
    *end = e;
    while (k < last) {
        while (is(P, k, 'w') && is(P, k + 1, 'D') && is(P, k + 2, 'w')) k += 2; /* ns::name */
        item x = {k, 0, 0};
        k++;
        if (is(P, k, '(')) {
            uint64_t c = skip_group(P, k);
            x.a = k + 1;
            x.b = c - 1;
            k = c;
        }
        if (n < MAX_ITEMS && is(P, x.name, 'w')) it[n++] = x;
        while (k < last && !is(P, k, ',')) k = opens(P, k) ? skip_group(P, k) : k + 1;
        k++;
    }
    return n;
}

/* The string-literal arguments of host_name(...) concatenated ("a" "b" -> ab). */
static char *string_args(pp *P, uint64_t a, uint64_t b) {
    sbuf s = {0};
    sb_puts(&s, "");
    for (uint64_t i = a; i < b; i++) {
        if (!is(P, i, 's')) {
            fail_at(P, i, "host_name expects a string literal");
            break;
        }
        const char *q = memchr(P->src + P->t[i].a, '"', (size_t)(P->t[i].b - P->t[i].a));
        uint64_t from = (uint64_t)(q - P->src) + 1, to = P->t[i].b - 1;
        if (to < from || P->src[to] != '"') {
            fail_at(P, i, "unterminated string");
            break;
        }
        sb_put(&s, P->src + from, to - from);
    }
    if (s.oom) oom(P);
    if (P->failed || s.oom) {
        free(s.p);
        return NULL;
    }
    return s.p;
}

/* ---- kernels ---- */

/* What the head of a declaration [s, e) says, up to its first parameter list. */
typedef struct head {
    int32_t kernel, is_template, explicit_inst;
    uint64_t paren; /* first top-level '(' outside attributes and decltype(...), or e */
    char *host;     /* [[host_name("x")]], or NULL */
} head;

static void scan_head(pp *P, uint64_t s, uint64_t e, head *h) {
    memset(h, 0, sizeof *h);
    h->paren = e;
    uint64_t i = s;
    if (word(P, s, "template")) {
        h->is_template = is(P, s + 1, '<');
        h->explicit_inst = !h->is_template;
        i = h->is_template ? skip_angles(P, s + 1) : s + 1;
    }
    while (i < e && !P->failed) {
        if (attr_at(P, i)) {
            item it[MAX_ITEMS];
            uint64_t end;
            uint32_t n = attr_items(P, i, &end, it);
            for (uint32_t k = 0; k < n; k++) {
                if (word(P, it[k].name, "kernel")) h->kernel = 1;
                if (word(P, it[k].name, "host_name") && it[k].b > it[k].a && !h->host)
                    h->host = string_args(P, it[k].a, it[k].b);
            }
            i = end;
        } else if (word(P, i, "decltype") && is(P, i + 1, '(')) {
            i = skip_group(P, i + 1);
        } else if (is(P, i, '(')) {
            h->paren = i;
            return;
        } else {
            if (word(P, i, "kernel")) h->kernel = 1;
            i = opens(P, i) ? skip_group(P, i) : i + 1;
        }
    }
}

/* Blanks every [[...]] in [i, e) at this level (attributes the shim would misread). */
static void blank_attrs(pp *P, uint64_t i, uint64_t e) {
    while (i < e) {
        if (attr_at(P, i)) {
            uint64_t end = skip_group(P, i);
            add_edit(P, P->t[i].a, P->t[end - 1].b, NULL);
            i = end;
        } else {
            i = opens(P, i) ? skip_group(P, i) : i + 1;
        }
    }
}

/* Metal's argument tables: [[buffer(n)]] and [[threadgroup(n)]] take n in 0..30. */
enum { MAX_ARG_INDEX = 30 };

/* Whether [a, b) is one integer literal (decimal, hex, octal; suffixes ignored); its value in *v,
 * UINT64_MAX when it does not fit in 64 bits. */
static int32_t literal_value(const pp *P, uint64_t a, uint64_t b, uint64_t *v) {
    if (b != a + 1 || !is(P, a, 'n')) return 0;
    const char *c = P->src + P->t[a].a, *end = P->src + P->t[a].b;
    uint64_t base = 10, x = 0;
    if (c + 1 < end && c[0] == '0' && (c[1] == 'x' || c[1] == 'X')) base = 16, c += 2;
    else if (c[0] == '0') base = 8;
    for (; c < end && *c != 'u' && *c != 'U' && *c != 'l' && *c != 'L'; c++) {
        if (*c == '\'') continue;
        uint64_t d = is_digit(*c) ? (uint64_t)(*c - '0') : (uint64_t)((*c | 0x20) - 'a' + 10);
        if (d >= base) return 0; /* a floating literal */
        x = x > (UINT64_MAX - d) / base ? UINT64_MAX : x * base + d;
    }
    *v = x;
    return 1;
}

/* Buffer and threadgroup parameters without an index attribute take the one after the previous
 * parameter's of their kind (0 first), as Metal assigns them (MLX relies on it). */
typedef struct slots {
    char *last[2];    /* the last explicit index of buffers [0] and threadgroup memory [1] */
    uint32_t next[2]; /* parameters of that kind since */
    int32_t known[2]; /* whether the last index is a literal, of value value[kind] */
    uint64_t value[2];
    uint32_t used[2];  /* bit n: a non-optional parameter of that kind has index n */
    uint32_t count[2]; /* parameters of that kind */
} slots;

static int32_t address_space_word(const pp *P, uint64_t k) {
    return word(P, k, "device") || word(P, k, "constant") || word(P, k, "threadgroup") ||
           word(P, k, "threadgroup_imageblock") || word(P, k, "object_data") || word(P, k, "ray_data");
}

/* One kernel parameter [a, b): appends its launcher argument and blanks its attributes. Checks
 * Metal's rules for it: an address space on pointers and references, an index in the argument
 * table (0..30), used once. A buffer in constant memory adds its index to `constants`, a device
 * pointer or reference without const (one the kernel may write) to `written`, as `| (1u << (n))`. */
static void param(pp *P, uint64_t a, uint64_t b, uint32_t index, const char *fn, slots *sl, sbuf *out, sbuf *constants,
                  sbuf *written) {
    int32_t ptr = 0, ref = 0, optional = 0, angle = 0, bound = 0, tg = 0, space = 0;
    int32_t in_constant = 0, in_device = 0, is_const = 0;
    const char *role = NULL; /* "buffer", "threadgroup", or NULL for a builtin */
    uint64_t role_item = 0, role_a = 0, role_b = 0;
    for (uint64_t k = a; k < b && !P->failed;) {
        if (attr_at(P, k)) {
            item it[MAX_ITEMS];
            uint64_t end;
            uint32_t n = attr_items(P, k, &end, it);
            for (uint32_t m = 0; m < n; m++) {
                uint64_t w = it[m].name;
                if (word(P, w, "function_constant")) {
                    optional = 1; /* bound only when the constant is true */
                    continue;
                }
                int32_t args = it[m].b > it[m].a;
                if (args && !word(P, w, "buffer") && !word(P, w, "threadgroup")) {
                    fail_at(P, w, "kernel '%s': unsupported parameter attribute '%.*s' on the CPU Metal device", fn,
                            (int)(P->t[w].b - P->t[w].a), P->src + P->t[w].a);
                    return;
                }
                if (bound++) {
                    fail_at(P, w, "kernel '%s': parameter %u has more than one binding attribute", fn, index);
                    return;
                }
                role = !args ? NULL : word(P, w, "buffer") ? "buffer" : "threadgroup";
                role_item = w;
                role_a = it[m].a;
                role_b = it[m].b;
            }
            add_edit(P, P->t[k].a, P->t[end - 1].b, NULL);
            k = end;
            continue;
        }
        if (is(P, k, '<')) angle++;
        if (is(P, k, '>') && angle > 0) angle--;
        if (!angle && is(P, k, '*')) ptr = 1;
        if (!angle && is(P, k, '&')) ref = 1;
        if (word(P, k, "threadgroup")) tg = 1;
        if (!angle && address_space_word(P, k)) space = 1;
        if (!angle && word(P, k, "constant")) in_constant = 1;
        if (!angle && word(P, k, "device")) in_device = 1;
        if (!angle && word(P, k, "const")) is_const = 1;
        k = opens(P, k) ? skip_group(P, k) : k + 1;
    }
    if (P->failed) return;
    if ((ptr || ref) && !space)
        violation(P, a, "pointer-address-space",
                  "kernel '%s': pointer or reference parameter %u has no address space (device, constant or "
                  "threadgroup)",
                  fn, index);
    sb_puts(out, index ? ", " : "");
    if (bound && !role) {
        sb_printf(out, "::msl_rt::builtin::%.*s(__t)", (int)(P->t[role_item].b - P->t[role_item].a),
                  P->src + P->t[role_item].a);
        return;
    }
    int32_t kind = bound ? role[0] == 't' : tg;
    const char *table = kind ? "threadgroup" : "buffer";
    if (bound) {
        free(sl->last[kind]);
        sl->last[kind] = text(P, role_a, role_b);
        sl->next[kind] = 0;
        sl->known[kind] = literal_value(P, role_a, role_b, &sl->value[kind]);
    }
    uint32_t plus = bound ? 0 : ++sl->next[kind];
    /* the index: a number when known here, else checked by the compiler (msl_kernel.h) */
    sbuf at = {0};
    uint64_t v = 0;
    int32_t known = 1;
    if (!sl->last[kind]) v = plus - 1;
    else if (sl->known[kind]) v = sl->value[kind] > UINT64_MAX - plus ? UINT64_MAX : sl->value[kind] + plus;
    else known = 0;
    if (known) sb_printf(&at, "%llu", (unsigned long long)v);
    else if (plus) sb_printf(&at, "::msl_rt::argument_index<(%s) + %u>()", sl->last[kind], plus);
    else sb_printf(&at, "::msl_rt::argument_index<(%s)>()", sl->last[kind]);
    if (known && v > MAX_ARG_INDEX) {
        violation(P, bound ? role_a : a, kind ? "threadgroup-index" : "buffer-index",
                  "kernel '%s': parameter %u is bound to [[%s(%llu)]], beyond Metal's argument table (%s "
                  "indices are 0 to %d)",
                  fn, index, table, (unsigned long long)v, table, MAX_ARG_INDEX);
    } else if (known && !optional && (sl->used[kind] >> v & 1u)) {
        violation(P, bound ? role_a : a, kind ? "threadgroup-index-reused" : "buffer-index-reused",
                  "kernel '%s': parameter %u is bound to [[%s(%llu)]], which another parameter already uses", fn, index,
                  table, (unsigned long long)v);
    } else if (known && !optional) {
        sl->used[kind] |= 1u << v;
    }
    if (++sl->count[kind] == MAX_ARG_INDEX + 2)
        violation(P, a, kind ? "threadgroup-count" : "buffer-count",
                  "kernel '%s': more than %d %s parameters (Metal's argument table has %d entries)", fn,
                  MAX_ARG_INDEX + 1, table, MAX_ARG_INDEX + 1);
    /* value parameters bind like references: the proxy's T& converts to T */
    sb_printf(out, "::msl_rt::%s_%s(__t, %s", table, ptr && !ref ? "ptr" : "ref", at.p ? at.p : "0");
    sb_puts(out, optional && !kind ? ", true)" : ")");
    if (!kind && (in_constant || (in_device && !is_const && (ptr || ref))))
        sb_printf(in_constant ? constants : written, " | (1u << (%s))", at.p ? at.p : "0");
    if (at.oom) oom(P);
    free(at.p);
}

/* Launcher arguments for the parameter list at p (its '('), and in *check the statement the launcher
 * runs before the call: the runtime's check that no constant buffer aliases a written one ("" when
 * the kernel has no buffer of either kind). */
static char *params(pp *P, uint64_t p, const char *fn, char **check) {
    *check = NULL;
    uint64_t close = skip_group(P, p) - 1;
    if (!is(P, close, ')')) {
        fail_at(P, p, "kernel '%s': unterminated parameter list", fn);
        return NULL;
    }
    sbuf out = {0};
    sb_puts(&out, "");
    slots sl = {{NULL, NULL}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}};
    sbuf constants = {0}, written = {0};
    uint64_t a = p + 1;
    uint32_t index = 0;
    if (word(P, a, "void") && a + 1 == close) a = close;
    while (a < close && !P->failed) {
        uint64_t b = a;
        int32_t angle = 0;
        while (b < close && !(angle == 0 && is(P, b, ','))) {
            if (opens(P, b)) {
                b = skip_group(P, b);
                continue;
            }
            if (is(P, b, '<')) angle++;
            if (is(P, b, '>') && angle > 0) angle--;
            b++;
        }
        param(P, a, b, index++, fn, &sl, &out, &constants, &written);
        a = b + 1;
    }
    free(sl.last[0]);
    free(sl.last[1]);
    sbuf statement = {0};
    sb_puts(&statement, "");
    if (constants.p && written.p)
        sb_printf(&statement, "::msl_rt::check_constant_aliases(__t, 0u%s, 0u%s); ", constants.p, written.p);
    if (out.oom || constants.oom || written.oom || statement.oom) oom(P);
    free(constants.p);
    free(written.p);
    if (P->failed) {
        free(out.p);
        free(statement.p);
        return NULL;
    }
    *check = statement.p;
    return out.p;
}

/* Appends the launcher `__msl_launch_<host>` calling `call(args)`, inside the kernel's namespaces. */
static void launcher(pp *P, uint64_t at, const char *host, const char *call, const char *args, const char *check) {
    int32_t ident = host[0] && !is_digit(host[0]);
    for (const char *c = host; *c; c++) ident &= is_ident(*c);
    if (!ident) {
        fail_at(P, at, "kernel host name '%s' is not an identifier", host);
        return;
    }
    for (uint64_t i = 0; i < P->nhosts; i++)
        if (!strcmp(P->hosts[i], host)) {
            fail_at(P, at, "kernel host name '%s' is defined twice", host);
            return;
        }
    push_str(P, &P->hosts, &P->nhosts, &P->hcap, dup_n(P, host, strlen(host)));
    if (P->strict) return;
    sbuf *L = &P->launchers;
    sb_printf(L, "#line %u \"%s\"\n", P->t[at].line, P->files[P->t[at].file]);
    for (uint64_t i = 0; i < P->nns; i++) sb_printf(L, "%s { ", P->ns[i]);
    /* A global kernel is called as ::name: `using namespace metal;` would make a kernel named like
     * a metal:: entity (vec, min, ...) ambiguous, while Metal itself never names it in a call. */
    const char *scope = P->nns == 0 && (is_ident(call[0]) && !is_digit(call[0])) ? "::" : "";
    sb_printf(L, "extern \"C\" void __msl_launch_%s(void) { msl_thread *__t = ::msl_rt::api->current(); %s%s%s(%s); }",
              host, check, scope, call, args);
    for (uint64_t i = 0; i < P->nns; i++) sb_puts(L, " }");
    sb_puts(L, "\n");
}

/* A kernel declaration or definition [s, e) (e at '{' or ';'). */
static void kernel_fn(pp *P, uint64_t s, uint64_t e, head *h, int32_t definition) {
    uint64_t name = h->paren - 1;
    if (h->paren >= e || h->paren == s || !is(P, name, 'w')) {
        fail_at(P, s, "cannot find the kernel's name and parameter list");
        return;
    }
    char *fn = text(P, name, name + 1);
    if (!fn) return;
    if (!strcmp(fn, "main")) violation(P, name, "kernel-main", "a kernel function may not be named main");
    blank_attrs(P, s, h->paren);
    char *check = NULL;
    char *args = params(P, h->paren, fn, &check);
    if (args && h->is_template) {
        if (ROOM(P, P->tm, P->ntm, P->tmcap)) {
            P->tm[P->ntm++] = (tmpl){fn, args, check};
            return;
        }
    } else if (args && definition) {
        launcher(P, name, h->host ? h->host : fn, fn, args, check);
    }
    free(fn);
    free(args);
    free(check);
}

/* Tokens [i, j) on one line, without attribute lists (and without `const` if drop_const). */
static char *joined(pp *P, uint64_t i, uint64_t j, int32_t drop_const) {
    sbuf r = {0};
    sb_puts(&r, "");
    for (uint64_t k = i; k < j;) {
        if (attr_at(P, k) || (drop_const && word(P, k, "const"))) {
            k = attr_at(P, k) ? skip_group(P, k) : k + 1;
            continue;
        }
        char *w = text(P, k, k + 1);
        if (w) sb_printf(&r, "%s%s", r.n ? " " : "", w);
        free(w);
        k++;
    }
    if (r.oom) oom(P);
    return r.p;
}

/* `template [[host_name("x")]] [[kernel]] decltype(f<A, B>) f<A, B>;`: becomes blank, and a
 * launcher calls `(&f<A, B>)`, which names the specialization even when defaulted template
 * arguments are left out. The older form with f's signature (`void f<A>(params);`, template
 * arguments possibly deduced) calls `(static_cast<void (*)(params)>(&f<A>))`. In strict mode only
 * the attributes go. */
static void instantiation(pp *P, uint64_t s, uint64_t e, head *h) {
    if (!h->host) {
        fail_at(P, s, "explicit kernel instantiation without [[host_name(\"...\")]]");
        return;
    }
    uint64_t q = h->paren - 1, name = q; /* walk back over f<...> */
    int32_t angle = 0, paren = 0;
    if (is(P, q, '>')) {
        for (uint64_t k = q + 1; k-- > s && name == q;) {
            char c = P->t[k].k;
            if (c == ')' || c == ']') paren++;
            if ((c == '(' || c == '[') && paren) paren--;
            if (paren) continue;
            if (c == '>') angle++;
            if (c == '<' && --angle == 0) name = k - 1;
        }
    }
    if (name <= s || !is(P, name, 'w') || (name == q && h->paren == e)) {
        fail_at(P, s, "cannot parse the kernel instantiation (expected decltype(f<...>) f<...>)");
        return;
    }
    uint64_t start = name;
    while (start >= s + 2 && is(P, start - 1, 'D') && is(P, start - 2, 'w')) start -= 2;
    char *callee = text(P, start, q + 1), *tname = text(P, name, name + 1), *args = NULL, *sig = NULL;
    char *check = NULL;
    sbuf call = {0};
    for (uint64_t i = P->ntm; tname && i-- > 0;)
        if (!strcmp(P->tm[i].name, tname)) {
            args = dup_n(P, P->tm[i].args, strlen(P->tm[i].args));
            check = dup_n(P, P->tm[i].check, strlen(P->tm[i].check));
            break;
        }
    if (tname && h->paren < e) {
        if (!args || P->strict) { /* the signature's own attributes go too */
            char *own_check = NULL;
            char *own = params(P, h->paren, tname, &own_check);
            if (args) {
                free(own);
                free(own_check);
            } else {
                args = own;
                free(check);
                check = own_check;
            }
        }
        sig = joined(P, h->paren + 1, skip_group(P, h->paren) - 1, 0);
    }
    if (!args && !P->failed)
        fail_at(P, s, "kernel template '%s' (for host_name \"%s\") is not defined before its instantiation",
                tname ? tname : "", h->host);
    if (args && callee) {
        if (sig) sb_printf(&call, "(static_cast<void (*)(%s)>(&%s))", sig, callee);
        else sb_printf(&call, "(&%s)", callee);
        if (call.oom) oom(P);
        else launcher(P, s, h->host, call.p, args, check ? check : "");
        if (P->strict) /* kept as a plain explicit instantiation, so clang checks the body */
            blank_attrs(P, s, h->paren);
        else add_edit(P, P->t[s].a, P->t[e].b, NULL);
    }
    free(callee);
    free(tname);
    free(args);
    free(check);
    free(sig);
    free(call.p);
}

/* ---- function constants ---- */

static int32_t known_constant(const pp *P, uint64_t i, uint64_t e) {
    for (; i < e; i++)
        for (uint64_t k = 0; is(P, i, 'w') && k < P->nfc; k++)
            if (word(P, i, P->fc[k]) && !is(P, i - 1, '.') && !is(P, i - 1, 'A')) return 1;
    return 0;
}

/* A namespace-scope `constant ...;` statement [s, e): a function constant, or a constant computed
 * from function constants; anything else stays. */
static void constant_decl(pp *P, uint64_t s, uint64_t e) {
    uint64_t eq = e, attr = e;
    for (uint64_t i = s + 1; i < e; i = opens(P, i) ? skip_group(P, i) : i + 1) {
        if (attr_at(P, i) && attr == e) attr = i;
        if (is(P, i, '=') && eq == e) eq = i;
    }
    if (attr < e && attr < eq) {
        item it[MAX_ITEMS];
        uint64_t end;
        uint32_t n = attr_items(P, attr, &end, it);
        if (n != 1 || !word(P, it[0].name, "function_constant") || it[0].b <= it[0].a) return;
        if (attr < s + 3 || !is(P, attr - 1, 'w') || end != e) {
            fail_at(P, s, "expected `constant T name [[function_constant(n)]];`");
            return;
        }
        char *type = joined(P, s + 1, attr - 1, 1), *name = text(P, attr - 1, attr), *index = text(P, it[0].a, it[0].b);
        if (type && name && index) {
            sbuf r = {0};
            sb_printf(&r, "const ::msl_rt::function_constant<%s, %s> %s{\"%s\", __FILE__, __LINE__};", type, index,
                      name, name);
            if (r.oom) oom(P);
            add_edit(P, P->t[s].a, P->t[e].b, r.p);
            push_str(P, &P->fc, &P->nfc, &P->fccap, name);
            name = NULL;
        }
        free(type);
        free(name);
        free(index);
        return;
    }
    if (eq >= e || eq < s + 3 || !is(P, eq - 1, 'w') || !known_constant(P, eq + 1, e)) return;
    char *type = joined(P, s + 1, eq - 1, 1), *name = text(P, eq - 1, eq);
    if (type && name) {
        sbuf r = {0};
        sb_printf(&r, "const auto %s = ::msl_rt::make_derived_constant<%s>([] { return (", name, type);
        if (r.oom) oom(P);
        add_edit(P, P->t[s].a, P->t[eq].b, r.p);
        add_edit(P, P->t[e].a, P->t[e].b, dup_n(P, "); });", 6));
        push_str(P, &P->fc, &P->nfc, &P->fccap, name);
        name = NULL;
    }
    free(type);
    free(name);
}

/* ---- scopes ---- */

/* What walk_body knows of the function it walks. */
enum { MAX_TG_VARS = 64 };
typedef struct body {
    const char *kernel; /* the kernel's name; NULL in any other function */
    const char *fn;     /* a namespace-scope function's name (to find direct recursion), or NULL */
    uint32_t min_args, max_args;
    uint32_t depth; /* of the block being walked; the body's own is 1 */
    /* the kernel-scope threadgroup variables of the open blocks, with their blocks' depths */
    char *tg[MAX_TG_VARS];
    uint32_t tg_depth[MAX_TG_VARS], ntg;
} body;

/* Strict mode, after the declaration ending at token e: the check refuses the kernel when the
 * threadgroup variables in scope exceed Metal's 32 KiB, naming the kernel and the bytes
 * (msl_kernel.h). The executed build refuses it where Metal's pipeline creation does: at its
 * dispatch (runtime.c), so the library's other kernels still run. */
static void threadgroup_budget(pp *P, uint64_t e, body *B) {
    sbuf r = {0};
    sb_printf(&r, " struct __msl_kernel_%s; static_assert(::msl_rt::threadgroup_memory<__msl_kernel_%s, 0", B->kernel,
              B->kernel);
    for (uint32_t k = 0; k < B->ntg; k++) sb_printf(&r, " + sizeof(%s)", B->tg[k]);
    sb_puts(&r, ">::fits, \"\");");
    if (r.oom) oom(P);
    add_edit(P, P->t[e].b, P->t[e].b, r.p);
}

/* Kernel-scope `threadgroup T a[N][M], b;` at i: storage per threadgroup instead of per thread
 * (strict mode: `static`, which clang accepts in an address space). Pointer declarations
 * (`threadgroup T *p = ...;`) stay. Outside a kernel such variables break MSL's rules. Returns
 * the index to continue from. */
static uint64_t threadgroup_decl(pp *P, uint64_t i, body *B) {
    uint64_t e = i + 1;
    while (e < P->n && !is(P, e, ';') && !is(P, e, '{') && !is(P, e, '}')) e = opens(P, e) ? skip_group(P, e) : e + 1;
    if (!is(P, e, ';')) return i;
    /* declarators: type name dims, then ", name dims" ... */
    sbuf r = {0};
    uint64_t a = i + 1;
    int32_t first = 1, stays = 0;
    char *type = NULL;
    while (a < e && !stays) {
        uint64_t b = a, name = 0, dims = 0;
        int32_t angle = 0;
        for (; b < e && !(angle == 0 && is(P, b, ',')); b = opens(P, b) ? skip_group(P, b) : b + 1) {
            if (is(P, b, '<')) angle++;
            if (is(P, b, '>') && angle > 0) angle--;
            if (angle || dims) continue;
            if (is(P, b, '*') || is(P, b, '&') || is(P, b, '=') || is(P, b, '(')) stays = 1;
            if (is(P, b, 'w')) name = b;
            if (is(P, b, '[')) dims = b;
        }
        if (!dims) dims = b;
        if (stays || !name || (first && name == a) || (!first && name != a)) {
            if (!first) fail_at(P, a, "declare each kernel-scope threadgroup variable separately");
            stays = 1;
            break;
        }
        if (first) type = text(P, i + 1, name);
        char *nm = text(P, name, name + 1), *dm = text(P, dims, b);
        if (!B->kernel && first)
            violation(P, name, "threadgroup-scope",
                      "threadgroup variable '%s' declared outside a kernel function's scope (pass a threadgroup "
                      "pointer from the kernel instead)",
                      nm ? nm : "");
        if (B->kernel && nm && B->ntg < MAX_TG_VARS) {
            B->tg_depth[B->ntg] = B->depth;
            B->tg[B->ntg++] = dup_n(P, nm, strlen(nm));
        }
        if (type && nm && dm)
            sb_printf(&r, "%sauto &%s = ::msl_rt::threadgroup_static<%s%s>([] {});", first ? "" : " ", nm, type, dm);
        free(nm);
        free(dm);
        first = 0;
        a = b + 1;
    }
    free(type);
    if (stays || P->failed) {
        free(r.p);
        return e;
    }
    if (r.oom) oom(P);
    if (P->strict) {
        free(r.p);
        add_edit(P, P->t[i].a, P->t[i].a, dup_n(P, "static ", 7));
    } else {
        add_edit(P, P->t[i].a, P->t[e].b, r.p);
    }
    if (B->kernel && P->strict) threadgroup_budget(P, e, B);
    return e;
}

/* Arguments of the call whose '(' is at i: top-level commas + 1, 0 for an empty list. */
static uint32_t call_args(const pp *P, uint64_t i) {
    uint64_t close = skip_group(P, i) - 1;
    if (close == i + 1) return 0;
    uint32_t n = 1;
    int32_t angle = 0;
    for (uint64_t k = i + 1; k < close; k = opens(P, k) ? skip_group(P, k) : k + 1) {
        if (is(P, k, '<')) angle++;
        if (is(P, k, '>') && angle > 0) angle--;
        if (is(P, k, ',') && !angle) n++;
    }
    return n;
}

/* How many functions named fn the source defines (`fn(...) {`): a call from one overload to
 * another is no recursion, and which one a call picks is the compiler's business. */
static uint32_t definitions(const pp *P, const char *fn) {
    uint32_t n = 0;
    for (uint64_t i = 0; i + 1 < P->n; i++)
        if (word(P, i, fn) && is(P, i + 1, '(')) {
            uint64_t k = skip_group(P, i + 1);
            while (word(P, k, "const") || word(P, k, "noexcept")) k++;
            n += is(P, k, '{');
        }
    return n;
}

/* How many arguments a call to the function whose parameter list opens at p takes. */
static void param_counts(const pp *P, uint64_t p, uint32_t *min_args, uint32_t *max_args) {
    uint32_t n = call_args(P, p), defaults = 0;
    if (n == 1 && word(P, p + 1, "void") && is(P, p + 2, ')')) n = 0;
    int32_t angle = 0;
    for (uint64_t k = p + 1; k < skip_group(P, p) - 1; k = opens(P, k) ? skip_group(P, k) : k + 1) {
        if (is(P, k, '<')) angle++;
        if (is(P, k, '>') && angle > 0) angle--;
        if (is(P, k, '=') && !angle) defaults++;
    }
    *min_args = n - (defaults < n ? defaults : n);
    *max_args = n;
}

/* A statement-start `static` in a function body: MSL has no static locals but constants. */
static void static_local(pp *P, uint64_t i) {
    for (uint64_t k = i + 1; k < P->n && !is(P, k, ';') && !is(P, k, '{') && !is(P, k, '='); k++)
        if (word(P, k, "constexpr") || word(P, k, "constant")) return;
    violation(P, i, "static-local", "static local variable (MSL allows static only for constexpr or constant)");
}

/* ---- the conditional operator ---- */

/* i at ) ] or }: the index of the matching opener (counting all three kinds), or P->n. */
static uint64_t group_start(const pp *P, uint64_t i) {
    uint64_t depth = 0;
    for (;; i--) {
        char k = P->t[i].k;
        if (k == ')' || k == ']' || k == '}') depth++;
        if ((k == '(' || k == '[' || k == '{') && --depth == 0) return i;
        if (i == 0) return P->n;
    }
}

static int32_t adjacent(const pp *P, uint64_t i, uint64_t j) { return i < P->n && j < P->n && P->t[i].b == P->t[j].a; }

/* '=' at k assigns (=, +=, <<=, ...) rather than compares (==, !=, <=, >=). */
static int32_t assigns(const pp *P, uint64_t k) {
    if (is(P, k + 1, '=') && adjacent(P, k, k + 1)) return 0;
    if (k == 0 || !adjacent(P, k - 1, k)) return 1;
    char p = P->t[k - 1].k;
    if (p == '=' || p == '!') return 0;
    if (p == '<' || p == '>') return k >= 2 && P->t[k - 2].k == p && adjacent(P, k - 2, k - 1);
    return 1;
}

/* Whether what follows the '>' at g lets it close a template argument list: a token that cannot
 * start an operand, so that a greater-than there would leave it without one (the rule C# states for
 * its generics): `is_same_v<A, B> ? x : y`, `f<T>(x)`, `S<T>::v`, `v<T> == w`, `t<A, B> && c`.
 * Before an operand (`a > b`, `a > -1`, the first '>' of `a >> b`) or as part of `>=` it compares or
 * shifts. Without a symbol table this is the whole decision: MSL code writes `T<A, B>(x)` far more
 * often than `f(a < b, c > (d))`, which it reads as a template-id. */
static int32_t template_follows(const pp *P, uint64_t g) {
    uint64_t n = g + 1;
    if (n >= P->n) return 1;
    char c = P->t[n].k;
    int32_t pair = adjacent(P, n, n + 1);
    if (adjacent(P, g, n) && (c == '=' || c == '>')) return 0; /* >=, >>, >>= */
    if (c && strchr(";,)]}?:([{.DA|^", c)) return 1;
    if (c == '=' || c == '!') return pair && is(P, n + 1, '='); /* == != */
    if (c == '&') return pair && is(P, n + 1, '&');             /* && */
    return 0;
}

/* g at '>': the '<' of the template argument list it closes (after a name), or P->n when it
 * compares or shifts instead (template_follows) or no such '<' opens it within the expression. */
static uint64_t template_open(const pp *P, uint64_t g) {
    if (!template_follows(P, g)) return P->n;
    uint64_t depth = 0;
    for (uint64_t k = g;; k--) {
        char c = P->t[k].k;
        if (c == ')' || c == ']' || c == '}') {
            k = group_start(P, k);
            if (k == P->n || k == 0) return P->n;
            continue;
        }
        if ((c && strchr(";([{?:", c)) || (c == '=' && assigns(P, k))) return P->n;
        if (c == '>') depth++;
        if (c == '<') {
            if ((k > 0 && is(P, k - 1, '<') && adjacent(P, k - 1, k)) || (is(P, k + 1, '<') && adjacent(P, k, k + 1)))
                return P->n; /* a shift */
            if (--depth == 0) return k > 0 && is(P, k - 1, 'w') ? k : P->n;
        }
        if (k == 0) return P->n;
    }
}

/* The first token of the condition of the '?' at q, or P->n when it cannot be delimited; *angle set
 * when the condition holds a '<' after a name with no '>' to close it: a less-than, or the
 * conditional is a template argument (f<c ? 1 : 2>, told by the '>' after it). */
static uint64_t condition_start(const pp *P, uint64_t q, int32_t *angle) {
    uint64_t k = q, angles = 0;
    while (k > 0) {
        uint64_t j = k - 1;
        char c = P->t[j].k;
        if (c == ')' || c == ']' || c == '}') {
            uint64_t o = group_start(P, j);
            if (o == P->n) return P->n;
            /* `if (x) c ? a : b;`: the condition starts after the statement's parentheses */
            if (c == ')' && o > 0 &&
                (word(P, o - 1, "if") || word(P, o - 1, "while") || word(P, o - 1, "for") || word(P, o - 1, "switch")))
                break;
            /* a block ends the expression; a braced initialiser (T{...}, after a name or '>') is in it */
            if (c == '}' && !(o > 0 && (is(P, o - 1, 'w') || is(P, o - 1, '>')))) break;
            k = o;
            continue;
        }
        if (c == ';' || c == '{' || c == '(' || c == '[' || c == ',' || c == '?' || c == ':') break;
        if (c == '=' && assigns(P, j)) break;
        if (word(P, j, "return") || word(P, j, "case") || word(P, j, "else") || word(P, j, "do")) break;
        if (c == '>') {
            uint64_t o = template_open(P, j);
            if (o != P->n) { /* a template-id's arguments, commas and all: the name before them is next */
                k = o;
                continue;
            }
            angles++;
        }
        if (c == '<') {
            if (j > 0 && is(P, j - 1, '<') && adjacent(P, j - 1, j)) { /* << */
                k = j - 1;
                continue;
            }
            if (angles) angles--;
            else if (j > 0 && is(P, j - 1, 'w') && !(is(P, j + 1, '=') && adjacent(P, j, j + 1))) *angle = 1;
        }
        k = j;
    }
    return k < q ? k : P->n;
}

/* From i, the end of a conditional's operand: the ':' matching the '?' for the middle one
 * (colon set), else the first ',' ';' ')' ']' '}' or unmatched ':' outside groups. P->n if none. */
static uint64_t operand_stop(const pp *P, uint64_t i, int32_t middle) {
    uint64_t pending = 0;
    while (i < P->n) {
        char c = P->t[i].k;
        if (c == '(' || c == '[' || c == '{') {
            i = skip_group(P, i);
            continue;
        }
        if (c == ')' || c == ']' || c == '}' || c == ';') return middle ? P->n : i;
        if (c == ',' && !middle) return i;
        if (c == '?') pending++;
        if (c == ':') {
            if (!pending) return i;
            pending--;
        }
        /* a template-id's arguments (vec<float, 4>(x), as_type<uint>(y), is_same_v<A, B>) */
        if (!middle && c == '<' && i > 0 && is(P, i - 1, 'w')) {
            uint64_t g = skip_angles(P, i);
            if (g < P->n && template_follows(P, g - 1)) {
                i = g;
                continue;
            }
        }
        i++;
    }
    return P->n;
}

/* Half, bfloat and the vectors are classes in the executed build, so `C ? A : B` with one of them
 * in device, constant or threadgroup memory (or const) and a value of its type, or a half and a
 * float or an int, follows C++'s rules for classes (incompatible, ambiguous) instead of MSL's for
 * builtin types. A conditional in a function body becomes
 *     ::msl_rt::cond_unwrap(C ? ((A), ::msl_rt::cond_mark()) : ((B), ::msl_rt::cond_mark()))
 * whose operands meet as in MSL (msl_kernel.h), without a line added. */
static void conditional(pp *P, uint64_t q) {
    if (P->strict || is(P, q + 1, ':')) return; /* strict types are clang's own; GNU's a ?: b */
    int32_t angle = 0;
    uint64_t c = condition_start(P, q, &angle);
    if (c == P->n) return;
    uint64_t colon = operand_stop(P, q + 1, 1);
    if (colon == P->n || colon == q + 1) return;
    uint64_t end = operand_stop(P, colon + 1, 0);
    if (end == P->n || end == colon + 1) return;
    for (uint64_t k = colon + 1; angle && k < end; k = opens(P, k) ? skip_group(P, k) : k + 1) {
        uint64_t g = is(P, k, '<') && is(P, k - 1, 'w') ? skip_angles(P, k) : P->n;
        if (g <= end && template_follows(P, g - 1)) { /* the operand's own template-id */
            k = g - 1;
            continue;
        }
        if (is(P, k, '>') && !adjacent(P, k, k + 1) && !(k > 0 && adjacent(P, k - 1, k) && strchr("->", P->t[k - 1].k)))
            return; /* a template argument (a lone '>' after it) */
    }
    int64_t seq = ++P->nconds;
    add_insertion(P, P->t[c].a, dup_n(P, "::msl_rt::cond_unwrap(", 22), seq);
    add_insertion(P, P->t[q + 1].a, dup_n(P, "((", 2), seq);
    add_insertion(P, P->t[colon - 1].b, dup_n(P, "), ::msl_rt::cond_mark())", 25), -seq);
    add_insertion(P, P->t[colon + 1].a, dup_n(P, "((", 2), seq);
    add_insertion(P, P->t[end - 1].b, dup_n(P, "), ::msl_rt::cond_mark()))", 26), -seq);
}

/* A function body from just after its '{'; returns the index after its '}'. */
static uint64_t walk_body(pp *P, uint64_t i, body *B) {
    B->depth = 1;
    for (; i < P->n && !P->failed; i++) {
        char k = P->t[i].k;
        if (k == '{') B->depth++;
        if (k == '}') {
            while (B->ntg && B->tg_depth[B->ntg - 1] >= B->depth) free(B->tg[--B->ntg]);
            if (--B->depth == 0) return i + 1;
        }
        int32_t stmt = is(P, i - 1, ';') || is(P, i - 1, '{') || is(P, i - 1, '}');
        if (word(P, i, "threadgroup") && stmt) i = threadgroup_decl(P, i, B);
        if (is(P, i, '?')) conditional(P, i);
        if (P->strict && word(P, i, "static") && stmt) static_local(P, i);
        if (P->strict && B->fn && word(P, i, B->fn) && is(P, i + 1, '(') && !is(P, i - 1, '.') && !is(P, i - 1, 'A') &&
            !is(P, i - 1, 'D') && definitions(P, B->fn) == 1) {
            uint32_t n = call_args(P, i + 1);
            if (n >= B->min_args && n <= B->max_args)
                violation(P, i, "recursion", "function '%s' calls itself (MSL has no recursion)", B->fn);
        }
    }
    return i;
}

enum { SC_NAMESPACE, SC_LINKAGE, SC_CLASS, SC_FUNCTION, SC_INIT };

/* What the '{' at e opens, given the statement [s, e) before it. */
static int32_t classify(const pp *P, uint64_t s, uint64_t e) {
    uint64_t i = s;
    int32_t paren = 0;
    if (word(P, i, "template") && is(P, i + 1, '<')) i = skip_angles(P, i + 1);
    for (uint64_t k = i; k < e; k = opens(P, k) ? skip_group(P, k) : k + 1) {
        if (word(P, k, "namespace")) return SC_NAMESPACE;
        if (!paren && (word(P, k, "struct") || word(P, k, "class") || word(P, k, "union") || word(P, k, "enum")))
            return SC_CLASS;
        if (is(P, k, '=') && k > i && !word(P, k - 1, "operator") && !strchr("=!<>+-*/%&|^", P->t[k - 1].k))
            return SC_INIT;
        if (is(P, k, '(')) paren = 1;
    }
    if (paren) return SC_FUNCTION;
    return word(P, s, "extern") ? SC_LINKAGE : SC_INIT;
}

/* A namespace-scope statement [s, e) ended by ';'. */
static void statement(pp *P, uint64_t s, uint64_t e) {
    head h;
    scan_head(P, s, e, &h);
    if (h.kernel && h.explicit_inst) instantiation(P, s, e, &h);
    else if (h.kernel) kernel_fn(P, s, e, &h, 0);
    else if (word(P, s, "constant")) constant_decl(P, s, e);
    free(h.host);
}

/* A parameter `constant T a[N]` (an array in an address space, a pointer in MSL) is
 * spelled `constant T *a` for clang, which refuses address-space-qualified parameters. */
static void array_params(pp *P, uint64_t p) {
    uint64_t close = skip_group(P, p) - 1;
    for (uint64_t a = p + 1; a < close;) {
        uint64_t b = a, name = 0, dims = 0;
        int32_t space = 0, angle = 0;
        for (; b < close && !(angle == 0 && is(P, b, ',')); b = opens(P, b) && !dims ? skip_group(P, b) : b + 1) {
            if (is(P, b, '<')) angle++;
            if (is(P, b, '>') && angle > 0) angle--;
            if (address_space_word(P, b)) space = 1;
            if (is(P, b, 'w') && !dims) name = b;
            if (is(P, b, '[') && name == b - 1 && !dims) dims = b;
        }
        if (space && dims && skip_group(P, dims) == b) {
            add_edit(P, P->t[name].a, P->t[name].a, dup_n(P, "*", 1));
            add_edit(P, P->t[dims].a, P->t[b - 1].b, NULL);
        }
        a = b + 1;
    }
}

/* Member functions qualified with the address space of `this` (`f() device`, `S(T x) constant`).
 * C++ outside OpenCL has no such qualifiers, so each overload set keeps one member callable on
 * objects in every address space (which the executed build's default address space reaches): the
 * unqualified (thread) one, else the first qualified one without its qualifier. That is faithful
 * only when the set's bodies agree (up to address-space words): a set whose bodies differ is
 * refused, rather than one body silently serving every object. */

/* Where the member [s, h) names its address space (after its parameters and cv-qualifiers), or 0;
 * *name: its name token, the one before the parameters. */
static uint64_t member_space(const pp *P, uint64_t s, uint64_t h, uint64_t *name) {
    while ((word(P, s, "public") || word(P, s, "private") || word(P, s, "protected")) && is(P, s + 1, ':')) s += 2;
    uint64_t k = s;
    if (word(P, k, "template") && is(P, k + 1, '<')) k = skip_angles(P, k + 1);
    while (k < h && !is(P, k, '(')) k = is(P, k, '[') ? skip_group(P, k) : k + 1;
    if (k >= h || k == s) return 0;
    *name = k - 1;
    k = skip_group(P, k);
    while (word(P, k, "const") || word(P, k, "volatile")) k++;
    return k < h && (word(P, k, "device") || word(P, k, "constant") || word(P, k, "threadgroup")) ? k : 0;
}

static int32_t same_tokens(const pp *P, uint64_t a, uint64_t b, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        const tok *x = &P->t[a + i], *y = &P->t[b + i];
        if (x->k != y->k || x->b - x->a != y->b - y->a || memcmp(P->src + x->a, P->src + y->a, (size_t)(x->b - x->a)))
            return 0;
    }
    return 1;
}

/* Where the class body opening at `open` ('{') declares, at its own level, a member with the
 * tokens [name, space) that is unqualified (`thread` counts as unqualified) or comes before `name`:
 * that twin's name token, or 0. */
static uint64_t find_twin(const pp *P, uint64_t open, uint64_t name, uint64_t space) {
    uint64_t n = space - name, close = skip_group(P, open) - 1;
    for (uint64_t k = open + 1; k + n < close; k = is(P, k, '{') ? skip_group(P, k) : k + 1)
        if (k != name && same_tokens(P, k, name, n) && (k < name || !address_space_word(P, k + n))) return k;
    return 0;
}

/* Whether the tokens [a, e) (a qualified member's rest: initialisers and body) and those from b on
 * (its twin's rest) are the same, address-space words and `thread` skipped on both sides. */
static int32_t same_rest(const pp *P, uint64_t a, uint64_t e, uint64_t b) {
    for (;;) {
        while (a < e && (address_space_word(P, a) || word(P, a, "thread"))) a++;
        while (b < P->n && (address_space_word(P, b) || word(P, b, "thread"))) b++;
        if (a >= e) return 1;
        if (b >= P->n || !same_tokens(P, a, b, 1)) return 0;
        a++, b++;
    }
}

/* The member [s, e) of the class whose body opens at `open`, its head ending at h: in strict mode
 * every qualified member goes (calls on such objects are not checked); else a qualified member with
 * a twin goes (refused when their bodies differ), one without loses its qualifier. */
static void space_member(pp *P, uint64_t open, uint64_t s, uint64_t h, uint64_t e) {
    uint64_t name = 0, space = member_space(P, s, h, &name);
    if (!space) return;
    uint64_t twin = P->strict ? 0 : find_twin(P, open, name, space);
    if (twin && !same_rest(P, space + 1, e, twin + (space - name)))
        fail_at(P, name,
                "member '%.*s' is overloaded on the address space of `this` with bodies that differ: the CPU "
                "device runs one body for objects in every address space (C++ has no such overloads outside "
                "OpenCL), so it refuses the set rather than run the wrong body",
                (int)(P->t[name].b - P->t[name].a), P->src + P->t[name].a);
    if (P->strict || twin) add_edit(P, P->t[s].a, P->t[e - 1].b, NULL);
    else add_edit(P, P->t[space].a, P->t[space].b, NULL);
}

/* Declarations of a namespace (or class) body from i; returns the index after its '}'. in_class:
 * for a class body, the index after its '{'; 0 otherwise. */
static uint64_t walk_scope(pp *P, uint64_t i, uint64_t in_class) {
    while (i < P->n && !P->failed) {
        if (is(P, i, '}')) return i + 1;
        if (is(P, i, ';')) {
            i++;
            continue;
        }
        uint64_t s = i, j = i;
        for (;;) {
            if (j >= P->n) return j;
            if (is(P, j, '(') || is(P, j, '[')) {
                j = skip_group(P, j);
                continue;
            }
            if (is(P, j, '}')) return j + 1; /* unbalanced: leave it to the compiler */
            if (is(P, j, ';')) {
                if (!in_class) statement(P, s, j);
                if (in_class) space_member(P, in_class - 1, s, j, j + 1);
                i = j + 1;
                break;
            }
            if (!is(P, j, '{')) {
                j++;
                continue;
            }
            int32_t kind = classify(P, s, j);
            if (kind == SC_INIT) {
                j = skip_group(P, j); /* an initializer: the statement goes on */
                continue;
            }
            if (kind == SC_NAMESPACE) {
                uint64_t o = s;
                while (!word(P, o, "namespace")) o++;
                if (o > s && word(P, o - 1, "inline")) o--;
                push_str(P, &P->ns, &P->nns, &P->nscap, text(P, o, j));
                i = walk_scope(P, j + 1, 0);
                if (P->nns) free(P->ns[--P->nns]);
            } else if (kind == SC_LINKAGE || kind == SC_CLASS) {
                i = walk_scope(P, j + 1, kind == SC_CLASS ? j + 1 : 0);
            } else {
                body B = {0};
                char *name = NULL;
                if (!in_class) {
                    head h;
                    scan_head(P, s, j, &h);
                    if (h.kernel && !h.explicit_inst) kernel_fn(P, s, j, &h, 1);
                    if (!h.kernel && h.paren < j) array_params(P, h.paren);
                    if (h.paren < j && h.paren > s && is(P, h.paren - 1, 'w') && !word(P, h.paren - 1, "operator")) {
                        name = text(P, h.paren - 1, h.paren);
                        B.fn = name;
                        param_counts(P, h.paren, &B.min_args, &B.max_args);
                        if (h.kernel) B.kernel = name;
                    }
                    free(h.host);
                }
                i = walk_body(P, j + 1, &B);
                free(name);
                if (in_class) space_member(P, in_class - 1, s, j, i);
            }
            break;
        }
    }
    return i;
}

/* `[[threadgroup(n)]]` on helper functions' parameters, anywhere in the source (MLX writes them;
 * Metal ignores them): the shim's threadgroup macro would break them. */
static void clashes(pp *P) {
    for (uint64_t i = 0; i < P->n; i++) {
        if (!attr_at(P, i)) continue;
        item it[MAX_ITEMS];
        uint64_t end;
        uint32_t n = attr_items(P, i, &end, it);
        for (uint32_t k = 0; k < n; k++)
            if (word(P, it[k].name, "threadgroup")) {
                add_edit(P, P->t[i].a, P->t[end - 1].b, NULL);
                break;
            }
    }
}

/* ---- MSL's restrictions (strict mode) ---- */

/* C++ that MSL lacks, by keyword (MSL specification, 1.5.4 "Restrictions", and 2.1: no double). */
static const char *const FORBIDDEN[][3] = {
    {"double", "double", "MSL has no double; use float"},
    {"goto", "goto", "MSL has no goto"},
    {"virtual", "virtual", "MSL has no virtual functions"},
    {"new", "new-delete", "MSL has no new"},
    {"delete", "new-delete", "MSL has no delete"},
    {"try", "exceptions", "MSL has no exceptions (try)"},
    {"catch", "exceptions", "MSL has no exceptions (catch)"},
    {"throw", "exceptions", "MSL has no exceptions (throw)"},
    {"dynamic_cast", "dynamic-cast", "MSL has no dynamic_cast"},
    {"typeid", "typeid", "MSL has no typeid (type identification)"},
    {"thread_local", "storage-class", "MSL has no thread_local storage"},
    {"register", "storage-class", "MSL has no register storage"},
};

static int32_t prefix_op(const pp *P, uint64_t k) {
    return is(P, k, '&') || is(P, k, '*') || is(P, k, '-') || is(P, k, '+') || is(P, k, '!') || is(P, k, '~');
}

/* The end of the operand a C-style cast at k applies to: prefix operators, a primary expression
 * (a name, a literal, a parenthesised group) and its postfix operators. */
static uint64_t operand_end(const pp *P, uint64_t k) {
    while (k < P->n && prefix_op(P, k)) k++;
    if (is(P, k, '(')) {
        k = skip_group(P, k);
        if (k < P->n && (is(P, k, 'w') || is(P, k, 'n') || is(P, k, '('))) return operand_end(P, k); /* a cast */
    } else if (is(P, k, 'w') || is(P, k, 'n') || is(P, k, 's') || is(P, k, 'c')) {
        k++;
        while (is(P, k, 'D') && is(P, k + 1, 'w')) k += 2;
        if (is(P, k, '<')) {
            uint64_t g = skip_angles(P, k);
            if (g < P->n && (is(P, g, '(') || is(P, g, 'D'))) k = g;
        }
    } else {
        return k;
    }
    for (;;) {
        if (is(P, k, '[') || is(P, k, '(')) k = skip_group(P, k);
        else if ((is(P, k, '.') || is(P, k, 'A') || is(P, k, 'D')) && is(P, k + 1, 'w')) k += 2;
        else if ((is(P, k, '+') || is(P, k, '-')) && P->t[k + 1].k == P->t[k].k && P->t[k + 1].a == P->t[k].b) k += 2;
        else return k;
    }
}

/* A C-style cast to a device, constant or threadgroup pointer at c (its '('): clang lets such a
 * cast change the address space, Metal does not, so it becomes a call that accepts only a
 * pointer of the same address space (msl_kernel.h). */
static void address_space_cast(pp *P, uint64_t c) {
    if (c < P->cast_end) return;
    if (c > 0 && (is(P, c - 1, ')') || is(P, c - 1, ']') || is(P, c - 1, '>') ||
                  (is(P, c - 1, 'w') && !word(P, c - 1, "return"))))
        return; /* a call, sizeof, decltype, a parameter list */
    uint64_t k = c + 1;
    while (word(P, k, "const") || word(P, k, "volatile")) k++;
    if (!word(P, k, "device") && !word(P, k, "constant") && !word(P, k, "threadgroup")) return;
    uint64_t close = skip_group(P, c) - 1, stars = 0;
    for (k++; k < close; k++) {
        if (is(P, k, '<')) {
            k = skip_angles(P, k) - 1;
            continue;
        }
        if (is(P, k, '*')) stars++;
        else if (!(is(P, k, 'w') || is(P, k, 'D')) || stars) {
            if (!(stars && (word(P, k, "const") || word(P, k, "volatile")))) return;
        }
    }
    if (!stars || !is(P, close, ')')) return;
    uint64_t n = close + 1;
    if (!(is(P, n, 'w') || is(P, n, 'n') || is(P, n, '(') || prefix_op(P, n))) return;
    uint64_t end = operand_end(P, n);
    if (end == n) return;
    char *type = text(P, c + 1, close);
    sbuf r = {0};
    sb_printf(&r, "::msl_strict::address_space_cast<%s>(", type ? type : "");
    free(type);
    if (r.oom) oom(P);
    add_edit(P, P->t[c].a, P->t[close].b, r.p);
    add_edit(P, P->t[end - 1].b, P->t[end - 1].b, dup_n(P, ")", 1));
    P->cast_end = end;
}

/* The rules a token pass can see: forbidden keywords, the C++ standard library, function
 * pointers, address-space casts. */
static void strict_rules(pp *P) {
    for (uint64_t i = 0; i < P->n && !P->failed; i++) {
        for (uint64_t f = 0; f < sizeof FORBIDDEN / sizeof *FORBIDDEN; f++)
            if (word(P, i, FORBIDDEN[f][0]) && !(word(P, i, "delete") && is(P, i - 1, '='))) /* = delete */
                violation(P, i, FORBIDDEN[f][1], "%s", FORBIDDEN[f][2]);
        if (word(P, i, "std") && is(P, i + 1, 'D'))
            violation(P, i, "std-library", "MSL has no C++ standard library (std::); use metal::");
        if (is(P, i, '(') && is(P, i + 1, '*') &&
            ((is(P, i + 2, 'w') && is(P, i + 3, ')') && is(P, i + 4, '(')) || (is(P, i + 2, ')') && is(P, i + 3, '('))))
            violation(P, i, "function-pointer", "function pointer (MSL has none outside [[visible]] functions)");
        if (is(P, i, '(')) address_space_cast(P, i);
    }
}

/* ---- output ---- */

/* By place; at one place insertions first (by order), then the longest replacement (the others
 * start inside it and are dropped). */
static int cmp_edit(const void *x, const void *y) {
    const edit *a = x, *b = y;
    if (a->a != b->a) return a->a < b->a ? -1 : 1;
    if ((a->a == a->b) != (b->a == b->b)) return a->a == a->b ? -1 : 1;
    if (a->order != b->order) return a->order < b->order ? -1 : 1;
    return a->b > b->b ? -1 : a->b < b->b; /* longer first */
}

static char *render(pp *P) {
    sbuf out = {0};
    uint64_t pos = 0;
    if (P->ned) qsort(P->ed, (size_t)P->ned, sizeof *P->ed, cmp_edit);
    for (uint64_t i = 0; i < P->ned; i++) {
        edit *d = &P->ed[i];
        if (d->a < pos) continue; /* inside a rewritten statement (its parameters' attributes) */
        sb_put(&out, P->src + pos, d->a - pos);
        if (d->text) sb_puts(&out, d->text);
        for (uint64_t k = d->a; k < d->b; k++)
            if (P->src[k] == '\n' || !d->text) sb_put(&out, P->src[k] == '\n' ? "\n" : " ", 1);
        pos = d->b;
    }
    sb_put(&out, P->src + pos, P->len - pos);
    if (!P->strict) {
        if (out.n && out.p[out.n - 1] != '\n') sb_puts(&out, "\n");
        sb_puts(&out, "#line 1 \"<msl launchers>\"\n");
        if (P->launchers.n) sb_put(&out, P->launchers.p, P->launchers.n);
        if (P->launchers.oom) out.oom = 1;
        sb_puts(&out, "#line 1 \"<msl kernel names>\"\nextern \"C\" const char *const __msl_kernel_names[] = {");
        for (uint64_t i = 0; i < P->nhosts; i++) sb_printf(&out, "\"%s\", ", P->hosts[i]);
        sb_puts(&out, "NULL};\n");
    }
    if (out.oom) {
        free(out.p);
        oom(P);
        return NULL;
    }
    return out.p;
}

static void free_strs(char **a, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) free(a[i]);
    free(a);
}

char *mcpu_preprocess(const char *source, const char *source_name, int32_t strict, mcpu_status *st) {
    if (!source) {
        mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_preprocess: source is NULL");
        return NULL;
    }
    pp P = {0};
    P.src = source;
    P.len = strlen(source);
    P.strict = strict;
    /* the file name before any line marker, escaped as a string literal's contents */
    sbuf name = {0};
    for (const char *c = source_name && *source_name ? source_name : "<source>"; *c; c++) {
        if (*c == '"' || *c == '\\') sb_put(&name, "\\", 1);
        sb_put(&name, c, 1);
    }
    push_str(&P, &P.files, &P.nfiles, &P.fcap, name.oom ? NULL : name.p);
    if (P.nfiles != 1) oom(&P);
    if (!P.failed) tokenize(&P);
    if (!P.failed) walk_scope(&P, 0, 0);
    if (!P.failed) clashes(&P);
    if (!P.failed && P.strict) strict_rules(&P);
    if (P.violations.oom) oom(&P);
    if (!P.failed && P.violations.n) {
        P.violations.p[--P.violations.n] = 0; /* the last newline */
        mcpu_fail(st, MCPU_ERR_COMPILE, "%s", P.violations.p);
    }
    char *out = P.failed || P.violations.n ? NULL : render(&P);
    if (P.failed) mcpu_fail(st, MCPU_ERR_COMPILE, "%s", P.err);
    free(P.t);
    for (uint64_t i = 0; i < P.ned; i++) free(P.ed[i].text);
    free(P.ed);
    for (uint64_t i = 0; i < P.ntm; i++) free(P.tm[i].name), free(P.tm[i].args), free(P.tm[i].check);
    free(P.tm);
    free_strs(P.files, P.nfiles);
    free_strs(P.ns, P.nns);
    free_strs(P.fc, P.nfc);
    free_strs(P.hosts, P.nhosts);
    free(P.launchers.p);
    free(P.violations.p);
    return out;
}
