/* Status reporting, the registry of kernel sources, and the profiling switch. */
#include "fa_backend.h"

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

/* Sources are few (one per .metal file) and registered once, so a list under a mutex is enough.
 * Re-registering a name with different text replaces it under a new id; old text stays allocated
 * because pointers handed out by fa_lookup_source must stay valid. */
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

const char *fa_lookup_source(const char *name) {
    if (name == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&sources_lock);
    const source_entry *e = find_source(name);
    const char *text = e != NULL ? e->text : NULL;
    pthread_mutex_unlock(&sources_lock);
    return text;
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
