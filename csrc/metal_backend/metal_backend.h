/* Metal backend controls beyond fa_backend.h. metal_backend.m implements them on macOS;
 * unavailable.c elsewhere (every call reports FA_ERR_UNSUPPORTED or "nothing found"). Which mode
 * to ask for is decided in Python (flashattn_mps/_metal_mode.py), where it is tested. */
#ifndef FA_METAL_BACKEND_H
#define FA_METAL_BACKEND_H

#include "../fa_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How dispatches reach the GPU. */
typedef enum fa_metal_stream_mode {
    /* The backend's own MTLCommandQueue: the caller runs torch.mps.synchronize() first; each
     * dispatch commits and waits, reporting a failed command buffer as FA_ERR_RUNTIME. The
     * fallback when torch's symbols are missing. */
    FA_METAL_OWN_QUEUE = 0,
    /* Encode on torch's MPS stream (torch::mps::get_dispatch_queue / get_command_buffer) and
     * commit it there (torch::mps::commit, in the same dispatch_sync, as PyTorch's own custom-kernel
     * example does); no wait. torch >= 2.9, whose get_command_buffer ends torch's coalesced
     * encoder. */
    FA_METAL_TORCH_STREAM = 1,
    /* The same, ending torch's coalesced encoder first through
     * at::mps::getCurrentMPSStream()->endKernelCoalescing() (torch 2.4 to 2.8). */
    FA_METAL_TORCH_STREAM_END_COALESCING = 2,
} fa_metal_stream_mode;

/* torch's symbols, resolved at run time (bit i of fa_metal_torch_symbols is symbol i). */
enum {
    FA_TORCH_GET_COMMAND_BUFFER = 0, /* torch::mps::get_command_buffer() */
    FA_TORCH_GET_DISPATCH_QUEUE = 1, /* torch::mps::get_dispatch_queue() */
    FA_TORCH_SYNCHRONIZE = 2,        /* torch::mps::synchronize() (debug mode) */
    FA_TORCH_CURRENT_STREAM = 3,     /* at::mps::getCurrentMPSStream() */
    FA_TORCH_END_COALESCING = 4,     /* at::mps::MPSStream::endKernelCoalescing() */
    FA_TORCH_COMMIT = 5,             /* torch::mps::commit() */
    FA_TORCH_N_SYMBOLS = 6,
};
/* The mangled name of symbol i (NULL out of range). */
const char *fa_metal_torch_symbol_name(int32_t i);
/* Resolves the symbols (again, since torch may be imported after this library) and returns the
 * bitmask of those found; 0 on builds without Metal. */
uint32_t fa_metal_torch_symbols(void);

/* Sets how dispatches run:
 *   mode: fa_metal_stream_mode;
 *   debug: in a torch stream mode, every dispatch also waits on torch's stream
 *     (torch::mps::synchronize) and a failed command buffer becomes FA_ERR_RUNTIME naming the
 *     kernel; in FA_METAL_OWN_QUEUE every dispatch already waits. Without it, a command buffer of
 *     ours that fails is reported on stderr naming the kernel when it completes, and by the next
 *     dispatch (FA_ERR_RUNTIME);
 *   check_buffers: 0 skips the "is this an id<MTLBuffer>" test of fa_metal_check_buffer
 *     (malloc_size, conformsToProtocol) on every binding; lengths and devices are still checked.
 * Returns the mode in effect: a torch mode only when every symbol it calls was found (with
 * debug, torch::mps::synchronize too), else FA_METAL_OWN_QUEUE. */
int32_t fa_metal_configure(int32_t mode, int32_t debug, int32_t check_buffers);

/* Checks that an MPS storage handle is an id<MTLBuffer> of at least needed_bytes bytes.
 * FA_OK, or FA_ERR_TYPE with a message naming the object's class where it is an object. */
int32_t fa_metal_check_buffer(void *handle, int64_t needed_bytes, fa_status *st);

/* The Objective-C class of an MPS storage handle, into out (size n): "" when the handle does not
 * start a malloc block (then it is not messaged). FA_OK or FA_ERR_UNSUPPORTED. */
int32_t fa_metal_object_class(void *handle, char *out, size_t n);

/* How the device was chosen (torch's own rule, most specific first). */
enum {
    FA_METAL_DEVICE_OF_TORCH_COMMAND_BUFFER = 1, /* the device of torch's MPS command buffer */
    FA_METAL_DEVICE_FIRST_NOT_LOW_POWER = 2,     /* MTLCopyAllDevices(): first non-low-power Mac2 */
    FA_METAL_DEVICE_SYSTEM_DEFAULT = 3,          /* MTLCreateSystemDefaultDevice() */
};
/* GPU families, as bits of fa_metal_device_info.families. */
enum {
    FA_GPU_APPLE7 = 1u << 0, /* simdgroup_matrix needs Apple7+ (M1) */
    FA_GPU_APPLE8 = 1u << 1,
    FA_GPU_APPLE9 = 1u << 2,
    FA_GPU_MAC2 = 1u << 3,
    FA_GPU_METAL3 = 1u << 4,
};

typedef struct fa_metal_device_info {
    char name[128];
    uint64_t registry_id;
    int32_t chosen_by; /* FA_METAL_DEVICE_* */
    int32_t low_power;
    uint32_t families; /* FA_GPU_* */
    uint64_t max_threadgroup_memory;
    int32_t torch_device_known; /* 1 if torch's command buffer was asked for its device */
    uint64_t torch_registry_id; /* its registryID when known */
    /* Read back from the MTLCompileOptions kernels compile with: */
    int32_t language_version;    /* MSL version x 100: 300 or 310; 0 if left to Metal */
    int32_t fast_math;           /* fastMathEnabled */
    int32_t math_mode;           /* MTLMathMode (0 safe, 1 relaxed, 2 fast); -1 before macOS 15 */
    int32_t math_fp32_functions; /* MTLMathFloatingPointFunctions (0 fast, 1 precise); -1 before 15 */
    int32_t stream_mode;         /* fa_metal_stream_mode in effect */
    int32_t debug;
    int32_t check_buffers;
} fa_metal_device_info;

/* Chooses the device if not yet done and describes it; FA_ERR_UNSUPPORTED without Metal.
 * Call only when torch reports MPS available: it may ask torch for its command buffer. */
int32_t fa_metal_device_info_get(fa_metal_device_info *out, fa_status *st);

/* What Metal decided for one pipeline (the doctor's pipeline check). */
typedef struct fa_metal_pipeline_info {
    uint64_t max_total_threads_per_threadgroup;
    uint64_t static_threadgroup_memory_length;
    uint64_t thread_execution_width;
} fa_metal_pipeline_info;

/* Builds the pipeline of `key` (a registered source) as a dispatch would, through the backend's
 * caches, and describes it: FA_OK, FA_ERR_COMPILE with Metal's message (compile, missing function
 * or constant, pipeline creation), or FA_ERR_UNSUPPORTED without Metal. */
int32_t fa_metal_pipeline_info_get(const fa_pipeline_key *key, fa_metal_pipeline_info *out, fa_status *st);

#ifdef __cplusplus
}
#endif
#endif
