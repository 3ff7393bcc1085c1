/* The runtime's messages: a dispatch's first failure, and text assembled piece by piece. */
#include "runtime.h"

#include <stdio.h>

void job_fail(job *j, int32_t code, const char *message) {
    if (atomic_exchange(&j->failed, 1) == 0) mcpu_fail(j->st, code, "%s", message);
}

void vadd(text *m, const char *fmt, va_list ap) {
    int k = vsnprintf(m->buf + m->len, sizeof m->buf - m->len, fmt, ap);
    if (k > 0) m->len = m->len + (size_t)k < sizeof m->buf ? m->len + (size_t)k : sizeof m->buf - 1;
}

void add(text *m, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vadd(m, fmt, ap);
    va_end(ap);
}
