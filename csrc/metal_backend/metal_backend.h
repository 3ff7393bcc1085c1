/* Metal backend controls beyond fa_backend.h (macOS builds only; see metal_backend.m). */
#ifndef FA_METAL_BACKEND_H
#define FA_METAL_BACKEND_H

#include "../fa_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How dispatches reach the GPU.
 *   1 (default): encode on PyTorch's MPS stream (torch::mps::get_dispatch_queue /
 *     get_command_buffer, resolved at run time); no commit, no wait, ordered with torch's own work.
 *     Needs PR #164093 (the Python layer uses it from torch 2.10): before it a new encoder can
 *     collide with torch's coalesced one.
 *   0: the backend's own command queue; the caller runs torch.mps.synchronize() first, and each
 *     dispatch commits and waits, reporting GPU errors as FA_ERR_RUNTIME.
 * Returns the mode in effect: 1 only if requested and both torch symbols were found. */
int32_t fa_metal_set_stream_mode(int32_t use_torch_stream);

/* Checks that an MPS storage handle is an id<MTLBuffer> of at least needed_bytes bytes.
 * FA_OK, or FA_ERR_TYPE with a message (e.g. when torch hands out buffer contents instead). */
int32_t fa_metal_check_buffer(void *handle, int64_t needed_bytes, fa_status *st);

#ifdef __cplusplus
}
#endif
#endif
