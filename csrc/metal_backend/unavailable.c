/* Builds without Metal (everything but macOS): MPS tensors cannot exist there, so asking for the
 * Metal backend is an error, not a crash. */
#include "../fa_backend.h"

#if !defined(__APPLE__)
const fa_backend *fa_metal_backend(fa_status *st) {
    fa_fail(st, FA_ERR_UNSUPPORTED, "the Metal backend exists only in macOS builds");
    return NULL;
}
#endif
