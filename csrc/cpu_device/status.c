/* The device's status: mcpu_fail. */
#include "metal_cpu.h"

#include <stdarg.h>
#include <stdio.h>

int32_t mcpu_fail(mcpu_status *st, int32_t code, const char *fmt, ...) {
    if (st == NULL) return code;
    va_list ap;
    va_start(ap, fmt);
    const int wanted = vsnprintf(st->message, sizeof st->message, fmt, ap);
    va_end(ap);
    st->code = code;
    if (wanted < (int)sizeof st->message) return code;
    /* Truncated: drop a UTF-8 character the cut left incomplete (continuation bytes 10xxxxxx
     * after its lead byte). */
    size_t end = sizeof st->message - 1, lead = end;
    while (lead > 0 && ((unsigned char)st->message[lead - 1] & 0xC0) == 0x80) lead--;
    if (lead == 0) return code;
    const unsigned char first = (unsigned char)st->message[lead - 1];
    const size_t bytes = first >= 0xF0 ? 4 : first >= 0xE0 ? 3 : first >= 0xC0 ? 2 : 1;
    if (end - (lead - 1) < bytes) st->message[lead - 1] = '\0';
    return code;
}
