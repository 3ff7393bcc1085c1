/* The mode libraries are built in unless said otherwise (mcpu_checked, mcpu_set_checked). */
#define _POSIX_C_SOURCE 200809L
#include "metal_cpu.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Whether libraries are built checked by default: 0 or 1; UNREAD: the environment says, at the
 * next use; BAD: it said checked_env (one atomic load per call otherwise: the plan cache asks). */
enum { CHECKED_UNREAD = -1, CHECKED_BAD = -2 };
static atomic_int checked_default = CHECKED_UNREAD;
static char checked_env[64];

int32_t mcpu_checked(mcpu_status *st) {
    int v = atomic_load(&checked_default);
    if (v == CHECKED_UNREAD) {
        const char *env = getenv("FLASHATTN_MPS_CPU_CHECKED");
        v = !env || !*env || !strcmp(env, "0") ? 0 : !strcmp(env, "1") ? 1 : CHECKED_BAD;
        if (v == CHECKED_BAD) snprintf(checked_env, sizeof checked_env, "%s", env);
        atomic_store(&checked_default, v);
    }
    if (v == CHECKED_BAD) {
        mcpu_fail(st, MCPU_ERR_VALUE, "FLASHATTN_MPS_CPU_CHECKED='%s': expected 0 or 1", checked_env);
        return -1;
    }
    return v;
}

void mcpu_set_checked(int32_t checked) { atomic_store(&checked_default, checked < 0 ? CHECKED_UNREAD : checked != 0); }
