/* Status reporting, the tables of the contract (options, tensor slots), the registry of kernel
 * sources, and the profiling switch. */
#include "fa_backend.h"
#include "../metal/fa_params.h"

#include <stddef.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A message truncated to fit may end inside a UTF-8 sequence (compiler output quotes with ‘’):
 * drop the partial character, so the message stays valid UTF-8 for Python. */
static void cut_at_character(char *message) {
    size_t end = strlen(message), lead = end;
    while (lead > 0 && ((unsigned char)message[lead - 1] & 0xC0) == 0x80) {
        --lead; /* continuation bytes */
    }
    if (lead == 0) {
        return;
    }
    const unsigned char first = (unsigned char)message[lead - 1];
    const size_t length = first >= 0xF0 ? 4 : first >= 0xE0 ? 3 : first >= 0xC0 ? 2 : 1;
    if (end - (lead - 1) < length) {
        message[lead - 1] = '\0';
    }
}

int32_t fa_fail(fa_status *st, int32_t code, const char *fmt, ...) {
    if (st != NULL) {
        va_list ap;
        va_start(ap, fmt);
        const int n = vsnprintf(st->message, sizeof st->message, fmt, ap);
        va_end(ap);
        if (n >= (int)sizeof st->message) {
            cut_at_character(st->message);
        }
        st->code = code;
    }
    return code;
}

#define OPTION(field, type) \
    { #field, type, (int32_t)offsetof(fa_options, field) }
const fa_option_field fa_option_fields[FA_OPTION_COUNT] = {
    OPTION(scale, FA_OPTION_DOUBLE),       OPTION(causal, FA_OPTION_BOOL),
    OPTION(bottom_right, FA_OPTION_BOOL),  OPTION(window_left, FA_OPTION_INT64),
    OPTION(window_right, FA_OPTION_INT64), OPTION(softcap, FA_OPTION_DOUBLE),
    OPTION(dropout_p, FA_OPTION_DOUBLE),   OPTION(kernel, FA_OPTION_INT32),
    OPTION(num_splits, FA_OPTION_INT32),   OPTION(write_probs, FA_OPTION_BOOL),
    OPTION(max_q_len, FA_OPTION_INT64),    OPTION(max_kv_len, FA_OPTION_INT64),
    OPTION(unbatched, FA_OPTION_BOOL),     OPTION(diagonal_offset, FA_OPTION_INT64),
    OPTION(k_bits, FA_OPTION_INT32),       OPTION(k_group_size, FA_OPTION_INT32),
    OPTION(v_bits, FA_OPTION_INT32),       OPTION(v_group_size, FA_OPTION_INT32),
    OPTION(gpu_family, FA_OPTION_INT64),
};
#undef OPTION

#define NONE FA_SLOT_NONE
#define FWD(field) (int32_t) offsetof(fa_forward_args, field)
#define BWD(field) (int32_t) offsetof(fa_backward_args, field)
/* name, rank, dtype rule, optional, required with, forward role, backward role, in plan key, forward buffer, backward
 * buffer, forward offset, backward offset, batched. The order is the order of the storage checks and
 * of the bindings' slot names. */
const fa_tensor_slot fa_tensor_slots[FA_SLOT_COUNT] = {
    [FA_SLOT_Q] = {"q", 4, FA_RULE_ANY, 0, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1, FA_FORWARD_BUFFER_Q,
                   FA_BACKWARD_BUFFER_Q, FWD(q), BWD(q), 1},
    [FA_SLOT_K] = {"k", 4, FA_RULE_ANY, 0, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1, FA_FORWARD_BUFFER_K,
                   FA_BACKWARD_BUFFER_K, FWD(k), BWD(k), 1},
    [FA_SLOT_V] = {"v", 4, FA_RULE_ANY, 0, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1, FA_FORWARD_BUFFER_V,
                   FA_BACKWARD_BUFFER_V, FWD(v), BWD(v), 1},
    [FA_SLOT_OUT] = {"out", 4, FA_RULE_ANY, 0, NONE, FA_ROLE_OUTPUT, FA_ROLE_INPUT, 1, FA_FORWARD_BUFFER_OUT,
                     FA_BACKWARD_BUFFER_OUT, FWD(out), BWD(out), 1},
    /* lse: optional in the forward (present when it has storage), required in the backward */
    [FA_SLOT_LSE] = {"lse", 3, FA_RULE_FLOAT32, FA_OPTIONAL_FORWARD, NONE, FA_ROLE_OUTPUT, FA_ROLE_INPUT, 1,
                     FA_FORWARD_BUFFER_LSE, FA_BACKWARD_BUFFER_LSE, FWD(lse), BWD(lse), 1},
    [FA_SLOT_WORKSPACE] = {"workspace", 1, FA_RULE_FLOAT32, FA_OPTIONAL, NONE, FA_ROLE_OUTPUT, FA_ROLE_OUTPUT, 0,
                           FA_FORWARD_BUFFER_WORKSPACE, FA_BACKWARD_BUFFER_WORKSPACE, FWD(workspace), BWD(workspace),
                           0},
    [FA_SLOT_DOUT] = {"dout", 4, FA_RULE_ANY, 0, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1, NONE, FA_BACKWARD_BUFFER_DOUT,
                      NONE, BWD(dout), 1},
    [FA_SLOT_DELTA] = {"delta", 3, FA_RULE_FLOAT32, 0, NONE, FA_ROLE_INPUT, FA_ROLE_OUTPUT, 1, NONE,
                       FA_BACKWARD_BUFFER_DELTA, NONE, BWD(delta), 1},
    [FA_SLOT_DQ] = {"dq", 4, FA_RULE_ANY, 0, NONE, FA_ROLE_INPUT, FA_ROLE_OUTPUT, 1, NONE, FA_BACKWARD_BUFFER_DQ, NONE,
                    BWD(dq), 1},
    [FA_SLOT_DK] = {"dk", 4, FA_RULE_ANY, 0, NONE, FA_ROLE_INPUT, FA_ROLE_OUTPUT, 1, NONE, FA_BACKWARD_BUFFER_DK, NONE,
                    BWD(dk), 1},
    [FA_SLOT_DV] = {"dv", 4, FA_RULE_ANY, 0, NONE, FA_ROLE_INPUT, FA_ROLE_OUTPUT, 1, NONE, FA_BACKWARD_BUFFER_DV, NONE,
                    BWD(dv), 1},
    [FA_SLOT_MASK] = {"mask", 4, FA_RULE_ANY, FA_OPTIONAL, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1,
                      FA_FORWARD_BUFFER_MASK, FA_BACKWARD_BUFFER_MASK, FWD(mask), BWD(mask), 1},
    [FA_SLOT_ALIBI_SLOPES] = {"alibi_slopes", 2, FA_RULE_FLOAT32, FA_OPTIONAL, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1,
                              FA_FORWARD_BUFFER_ALIBI, FA_BACKWARD_BUFFER_ALIBI, FWD(alibi_slopes), BWD(alibi_slopes),
                              0},
    [FA_SLOT_RNG_STATE] = {"rng_state", 1, FA_RULE_FLOAT32, FA_OPTIONAL, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1,
                           FA_FORWARD_BUFFER_RNG, FA_BACKWARD_BUFFER_RNG, FWD(rng_state), BWD(rng_state), 0},
    [FA_SLOT_SINKS] = {"sinks", 1, FA_RULE_FLOAT32, FA_OPTIONAL, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1,
                       FA_FORWARD_BUFFER_SINKS, FA_BACKWARD_BUFFER_SINKS, FWD(sinks), BWD(sinks), 0},
    [FA_SLOT_SINK_GRAD] = {"sink_grad", 3, FA_RULE_FLOAT32, FA_OPTIONAL, FA_SLOT_SINKS, FA_ROLE_INPUT, FA_ROLE_OUTPUT,
                           1, NONE, FA_BACKWARD_BUFFER_SINK_GRAD, NONE, BWD(sink_grad), 1},
    /* the sequence table is read by the table kernel only; the kernels read what it wrote into the
     * scratch, bound at the sequences buffer */
    [FA_SLOT_SEQUENCES] = {"sequences", 2, FA_RULE_TABLE, FA_OPTIONAL, NONE, FA_ROLE_SCRATCH, FA_ROLE_SCRATCH, 1, NONE,
                           NONE, FWD(sequences.table), BWD(sequences.table), 0},
    [FA_SLOT_SEQUENCE_SCRATCH] = {"sequence_scratch", 1, FA_RULE_TABLE, FA_OPTIONAL, FA_SLOT_SEQUENCES, FA_ROLE_SCRATCH,
                                  FA_ROLE_SCRATCH, 0, FA_FORWARD_BUFFER_SEQUENCES, FA_BACKWARD_BUFFER_SEQUENCES,
                                  FWD(sequences.scratch), BWD(sequences.scratch), 0},
    [FA_SLOT_BLOCK_TABLE] = {"block_table", 2, FA_RULE_TABLE, FA_OPTIONAL, NONE, FA_ROLE_SCRATCH, FA_ROLE_SCRATCH, 1,
                             FA_FORWARD_BUFFER_BLOCK_TABLE, NONE, FWD(sequences.block_table),
                             BWD(sequences.block_table), 0},
    /* quantized K/V's groups (fa_options.k_bits, v_bits): forward only */
    [FA_SLOT_K_SCALES] = {"k_scales", 4, FA_RULE_ANY, FA_OPTIONAL, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1,
                          FA_FORWARD_BUFFER_K_SCALES, NONE, FWD(k_scales), NONE, 1},
    [FA_SLOT_K_BIASES] = {"k_biases", 4, FA_RULE_ANY, FA_OPTIONAL, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1,
                          FA_FORWARD_BUFFER_K_BIASES, NONE, FWD(k_biases), NONE, 1},
    [FA_SLOT_V_SCALES] = {"v_scales", 4, FA_RULE_ANY, FA_OPTIONAL, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1,
                          FA_FORWARD_BUFFER_V_SCALES, NONE, FWD(v_scales), NONE, 1},
    [FA_SLOT_V_BIASES] = {"v_biases", 4, FA_RULE_ANY, FA_OPTIONAL, NONE, FA_ROLE_INPUT, FA_ROLE_INPUT, 1,
                          FA_FORWARD_BUFFER_V_BIASES, NONE, FWD(v_biases), NONE, 1},
};
#undef NONE
#undef FWD
#undef BWD

/* Sources are few (one per .metal file) and registered once, so a list under a mutex is enough.
 * Re-registering a name with different text replaces it under a new id; old text stays allocated
 * because pointers handed out by fa_find_source must stay valid. */
typedef struct source_entry {
    char *name;
    char *text;
    int32_t id;
    struct source_entry *next;
} source_entry;

static pthread_mutex_t sources_lock = PTHREAD_MUTEX_INITIALIZER;
static source_entry *sources_head = NULL;
static atomic_int last_source_id = 0; /* written under sources_lock */

static source_entry *find_source(const char *name) {
    for (source_entry *e = sources_head; e != NULL; e = e->next) {
        if (strcmp(e->name, name) == 0) {
            return e;
        }
    }
    return NULL;
}

int32_t fa_register_source(const char *name, const char *text, fa_status *st) {
    if (name == NULL || name[0] == '\0' || text == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_register_source: name and text must be non-empty");
    }
    char *text_copy = strdup(text);
    if (text_copy == NULL) {
        return fa_fail(st, FA_ERR_RUNTIME, "fa_register_source: out of memory");
    }
    pthread_mutex_lock(&sources_lock);
    source_entry *e = find_source(name);
    if (e != NULL && strcmp(e->text, text) == 0) { /* unchanged: keep its id and its pipelines */
        pthread_mutex_unlock(&sources_lock);
        free(text_copy);
        return FA_OK;
    }
    if (e == NULL) {
        e = calloc(1, sizeof *e);
        char *name_copy = strdup(name);
        if (e == NULL || name_copy == NULL) {
            pthread_mutex_unlock(&sources_lock);
            free(e);
            free(name_copy);
            free(text_copy);
            return fa_fail(st, FA_ERR_RUNTIME, "fa_register_source: out of memory");
        }
        e->name = name_copy;
        e->next = sources_head;
        sources_head = e;
    }
    e->text = text_copy;
    e->id = atomic_fetch_add(&last_source_id, 1) + 1;
    pthread_mutex_unlock(&sources_lock);
    return FA_OK;
}

int32_t fa_find_source(const char *name, fa_source *out) {
    if (name == NULL) {
        return 0;
    }
    pthread_mutex_lock(&sources_lock);
    const source_entry *e = find_source(name);
    if (e != NULL) {
        out->id = e->id;
        out->name = e->name;
        out->text = e->text;
    }
    pthread_mutex_unlock(&sources_lock);
    return e != NULL;
}

int32_t fa_sources_generation(void) { return atomic_load(&last_source_id); }

int32_t fa_skip_execution(void) {
    static atomic_int skip = -1; /* -1: not read yet */
    int32_t value = atomic_load_explicit(&skip, memory_order_relaxed);
    if (value < 0) {
        const char *env = getenv("FLASHATTN_MPS_SKIP_EXECUTION");
        value = env != NULL && strcmp(env, "1") == 0;
        atomic_store_explicit(&skip, value, memory_order_relaxed);
    }
    return value;
}
