/* Builds without Metal (everything but macOS): MPS tensors cannot exist there, so asking for the
 * Metal backend is an error, not a crash, and its controls report that nothing was found. */
#include "../fa_backend.h"
#include "metal_backend.h"
#include "../fa_gpu_family.h"

#if !defined(__APPLE__)
static const char k_unsupported[] = "the Metal backend exists only in macOS builds";

const fa_backend *fa_metal_backend(fa_status *st) {
    fa_fail(st, FA_ERR_UNSUPPORTED, k_unsupported);
    return NULL;
}

uint32_t fa_metal_torch_symbols(void) { return 0; }

int32_t fa_metal_gpu_family(void) { return 0; }

int32_t fa_metal_tensor_family(void) { return 0; }

int32_t fa_metal_configure(int32_t mode, int32_t debug, int32_t check_buffers) {
    (void)mode, (void)debug, (void)check_buffers;
    return FA_METAL_OWN_QUEUE;
}

int32_t fa_metal_check_buffer(void *handle, int64_t needed_bytes, fa_status *st) {
    (void)handle, (void)needed_bytes;
    return fa_fail(st, FA_ERR_UNSUPPORTED, k_unsupported);
}

int32_t fa_metal_object_class(void *handle, char *out, size_t n) {
    (void)handle;
    if (n > 0) out[0] = '\0';
    return FA_ERR_UNSUPPORTED;
}

int32_t fa_metal_device_info_get(fa_metal_device_info *out, fa_status *st) {
    (void)out;
    return fa_fail(st, FA_ERR_UNSUPPORTED, k_unsupported);
}

int32_t fa_metal_pipeline_info_get(const fa_pipeline_key *key, fa_metal_pipeline_info *out, fa_status *st) {
    (void)key, (void)out;
    return fa_fail(st, FA_ERR_UNSUPPORTED, k_unsupported);
}
#endif
