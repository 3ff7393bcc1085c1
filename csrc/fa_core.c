/* Status reporting and the registry of kernel sources. */
#include "fa_core.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int32_t fa_fail(fa_status *st, int32_t code, const char *fmt, ...) {
    if (st != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(st->message, sizeof st->message, fmt, ap);
        va_end(ap);
        st->code = code;
    }
    return code;
}

/* Sources are few (one per .metal file) and registered once, so a list under a mutex is enough.
 * Re-registering a name with different text replaces it; old text stays allocated because
 * pointers handed out by fa_lookup_source must stay valid. */
typedef struct source_entry {
    char *name;
    char *text;
    struct source_entry *next;
} source_entry;

static pthread_mutex_t sources_lock = PTHREAD_MUTEX_INITIALIZER;
static source_entry *sources_head = NULL;

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
    pthread_mutex_unlock(&sources_lock);
    return FA_OK;
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
