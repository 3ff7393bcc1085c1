// The Metal backend: compiles the registered MSL sources into cached pipelines and encodes
// dispatches on the MTLBuffers behind PyTorch MPS tensors. macOS only, compiled with -fobjc-arc.
// Written against Apple's documentation without hardware access: see README.md for what is unproven.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>
#include <mach-o/dyld.h>
#include <malloc/malloc.h>
#include <os/lock.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "../fa_backend.h"
#include "../fa_cache.h"
#include "../fa_gpu_family.h"
#include "metal_backend.h"

static id<MTLDevice> g_device;
static int32_t g_device_chosen_by;
static id<MTLCommandQueue> g_queue; // FA_METAL_OWN_QUEUE only
// Caches live for the process, keyed by plain values (fa_cache.h): a library by its source id and
// macros, a pipeline by its library, function and constants. Values are retained for good
// (CFBridgingRetain), so callers may hold the pointers.
static fa_cache g_libraries = FA_CACHE_INITIALIZER;
static fa_cache g_pipelines = FA_CACHE_INITIALIZER;
static os_unfair_lock g_lock = OS_UNFAIR_LOCK_INIT; // serializes builds; guards the torch symbols

// torch's symbols (metal_backend.h, torch_symbols.c). get_command_buffer / get_dispatch_queue
// return MTLCommandBuffer_t / DispatchQueue_t, void* in libtorch's C++ build and not part of the
// mangled name, as borrowed (+0) references, hence __bridge below. endKernelCoalescing is a
// non-virtual member function: called with the stream as its only (this) argument.
static void *g_torch[FA_TORCH_N_SYMBOLS];
typedef void *(*torch_getter)(void);
typedef void (*torch_stream_method)(void *stream);
typedef void (*torch_void_fn)(void);

static atomic_int g_mode = FA_METAL_OWN_QUEUE, g_debug = 0, g_check_buffers = 1;

// A command buffer that failed after our dispatch was committed on torch's stream (its completion
// handler runs on a Metal thread): kept here, under its own lock, until the next dispatch reports it.
static os_unfair_lock g_fault_lock = OS_UNFAIR_LOCK_INIT;
static char g_fault[512];

static const char *describe(NSError *e) { return e ? e.localizedDescription.UTF8String : "(no error)"; }

// Looks a symbol up in every loaded image, then in libtorch_cpu by path in case Python loaded
// torch's libraries RTLD_LOCAL (a local image is only visible through its own handle).
static void *find_torch_symbol(const char *name) {
    void *p = dlsym(RTLD_DEFAULT, name);
    for (uint32_t i = 0; !p && i < _dyld_image_count(); ++i) {
        const char *path = _dyld_get_image_name(i);
        const char *base = path ? strrchr(path, '/') : NULL;
        if (base && strcmp(base, "/libtorch_cpu.dylib") == 0) {
            void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD); // already loaded: no side effects
            if (h) {
                p = dlsym(h, name);
                dlclose(h); // torch keeps the image loaded, so p stays valid
            }
        }
    }
    return p;
}

// Never per dispatch, since a miss scans every loaded image: at start-up and on request (torch
// may be imported after this library is loaded).
uint32_t fa_metal_torch_symbols(void) {
    uint32_t found = 0;
    os_unfair_lock_lock(&g_lock);
    for (int32_t i = 0; i < FA_TORCH_N_SYMBOLS; ++i) {
        if (!g_torch[i]) g_torch[i] = find_torch_symbol(fa_metal_torch_symbol_name(i));
        if (g_torch[i]) found |= 1u << i;
    }
    os_unfair_lock_unlock(&g_lock);
    return found;
}

static bool has_torch(uint32_t found, uint32_t needed) { return (found & needed) == needed; }

int32_t fa_metal_configure(int32_t mode, int32_t debug, int32_t check_buffers) {
    const uint32_t found = fa_metal_torch_symbols();
    uint32_t needed = 1u << FA_TORCH_GET_COMMAND_BUFFER | 1u << FA_TORCH_GET_DISPATCH_QUEUE | 1u << FA_TORCH_COMMIT;
    if (mode == FA_METAL_TORCH_STREAM_END_COALESCING) {
        needed |= 1u << FA_TORCH_CURRENT_STREAM | 1u << FA_TORCH_END_COALESCING;
    }
    if (debug) needed |= 1u << FA_TORCH_SYNCHRONIZE;
    const bool torch_mode = mode == FA_METAL_TORCH_STREAM || mode == FA_METAL_TORCH_STREAM_END_COALESCING;
    const int32_t effective = torch_mode && has_torch(found, needed) ? mode : FA_METAL_OWN_QUEUE;
    atomic_store(&g_mode, effective);
    atomic_store(&g_debug, debug ? 1 : 0);
    atomic_store(&g_check_buffers, check_buffers ? 1 : 0);
    return effective;
}

// The device of torch's MPS command buffer, taken on torch's serial queue; nil without the symbols.
static id<MTLDevice> torch_device(void) {
    const uint32_t needed = 1u << FA_TORCH_GET_COMMAND_BUFFER | 1u << FA_TORCH_GET_DISPATCH_QUEUE;
    if (!has_torch(fa_metal_torch_symbols(), needed)) return nil;
    dispatch_queue_t queue = (__bridge dispatch_queue_t)((torch_getter)g_torch[FA_TORCH_GET_DISPATCH_QUEUE])();
    if (!queue) return nil;
    __block id<MTLDevice> device = nil;
    dispatch_sync(queue, ^{
      device = ((__bridge id<MTLCommandBuffer>)((torch_getter)g_torch[FA_TORCH_GET_COMMAND_BUFFER])()).device;
    });
    return device;
}

// torch's rule (aten/src/ATen/mps/MPSDevice.mm): the first device of MTLCopyAllDevices() that is
// not low-power (an Intel iGPU) and supports Mac2 (Metal 2).
static id<MTLDevice> first_not_low_power_device(void) {
    NSArray<id<MTLDevice>> *devices = MTLCopyAllDevices(); // NS_RETURNS_RETAINED: ARC releases it
    for (id<MTLDevice> device in devices) {
        if (!device.isLowPower && [device supportsFamily:MTLGPUFamilyMac2]) return device;
    }
    return nil;
}

// Most specific first: torch's own device, torch's rule, the system default (which needs
// CoreGraphics linked in a command-line process; setup.py links it).
static void choose_device(void) {
    if ((g_device = torch_device())) {
        g_device_chosen_by = FA_METAL_DEVICE_OF_TORCH_COMMAND_BUFFER;
    } else if ((g_device = first_not_low_power_device())) {
        g_device_chosen_by = FA_METAL_DEVICE_FIRST_NOT_LOW_POWER;
    } else if ((g_device = MTLCreateSystemDefaultDevice())) {
        g_device_chosen_by = FA_METAL_DEVICE_SYSTEM_DEFAULT;
    }
}

static int32_t metal_init(fa_status *st) {
    static dispatch_once_t once;
    dispatch_once(&once, ^{
      @autoreleasepool {
          choose_device();
          g_queue = [g_device newCommandQueue]; // nil when g_device is nil
      }
    });
    if (!g_device || !g_queue) {
        return fa_fail(st, FA_ERR_UNSUPPORTED, "Metal backend: no Metal device on this machine");
    }
    return FA_OK;
}

// The newest MTLGPUFamilyApple<N> the device supports (fa_gpu_family.h), 0 without a device. The
// families are asked by value (MTLGPUFamilyApple<N> = 1000 + N) so an SDK without Apple10's name
// still asks; an OS that does not know a family answers NO.
int32_t fa_metal_gpu_family(void) {
    fa_status st;
    if (metal_init(&st) != FA_OK) {
        return 0;
    }
    for (int32_t family = 10; family >= 7; --family) {
        if ([g_device supportsFamily:(MTLGPUFamily)(1000 + family)]) {
            return family;
        }
    }
    return 7; // older than Apple7 cannot run these kernels' SIMD-group matrices; plan as the oldest
}

// Metal 4's tensor operations (MetalPerformancePrimitives) need macOS 26.2 (the release MLX and
// torch gate theirs on) and an Apple9 GPU or newer (MPP runs on the simdgroup units there, on the
// neural accelerators of Apple10), and a build whose SDK compiles Metal 4 (compile_options).
int32_t fa_metal_tensor_family(void) {
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 260000
    if (@available(macOS 26.2, *)) {
        const int32_t family = fa_metal_gpu_family();
        return family >= 9 ? family : 0;
    }
#endif
    return 0;
}

static const char *class_name(id obj) { return NSStringFromClass([obj class]).UTF8String; }

int32_t fa_metal_object_class(void *handle, char *out, size_t n) {
    if (n == 0) return FA_OK;
    out[0] = '\0';
    if (!handle || malloc_size(handle) == 0) return FA_OK;
    @autoreleasepool {
        snprintf(out, n, "%s", class_name((__bridge id)handle));
    }
    return FA_OK;
}

// Messaging a pointer that is not an object (e.g. buffer contents, if torch's MPS data_ptr ever
// changes to that) would crash, and no check is safe for every pointer. Ours: malloc_size() is
// 0 for any pointer that does not start a malloc block (it only consults the zones' bookkeeping,
// never the pointer's memory), and Objective-C objects such as Metal buffers are malloc blocks;
// only then is the pointer messaged. A malloc block that is not an object would still crash, so
// the Python layer additionally checks torch's version/behaviour before handing handles over.
// FLASHATTN_MPS_NO_BUFFER_CHECK=1 (fa_metal_configure's check_buffers = 0) skips the identity
// test, for a torch whose buffers fail it although they are buffers.
int32_t fa_metal_check_buffer(void *handle, int64_t needed_bytes, fa_status *st) {
    const bool identify = atomic_load(&g_check_buffers) != 0;
    if (!handle || (identify && malloc_size(handle) == 0)) {
        return fa_fail(st, FA_ERR_TYPE,
                       "MPS storage handle %p is not an Objective-C object, so not an id<MTLBuffer> "
                       "(torch's MPS data_ptr layout may have changed; this build expects the buffer "
                       "object; FLASHATTN_MPS_NO_BUFFER_CHECK=1 skips this check)",
                       handle);
    }
    @autoreleasepool {
        id obj = (__bridge id)handle;
        if (identify && ![obj conformsToProtocol:@protocol(MTLBuffer)]) {
            return fa_fail(st, FA_ERR_TYPE,
                           "MPS storage handle %p is a %s, not an id<MTLBuffer> "
                           "(FLASHATTN_MPS_NO_BUFFER_CHECK=1 skips this check)",
                           handle, class_name(obj));
        }
        NSUInteger length = ((id<MTLBuffer>)obj).length;
        if (needed_bytes < 0 || (uint64_t)needed_bytes > length) {
            return fa_fail(st, FA_ERR_TYPE, "MTLBuffer %p (a %s) has %llu bytes, %lld are addressed", handle,
                           class_name(obj), (unsigned long long)length, (long long)needed_bytes);
        }
    }
    return FA_OK;
}

// fa_macro fields are fixed arrays that may fill up without a terminating NUL.
static NSString *fixed_string(const char *p, size_t max) {
    return [[NSString alloc] initWithBytes:p length:strnlen(p, max) encoding:NSUTF8StringEncoding];
}

static MTLCompileOptions *compile_options(const fa_pipeline_key *key) {
    MTLCompileOptions *opts = [MTLCompileOptions new];
    NSMutableDictionary<NSString *, NSObject *> *macros = [NSMutableDictionary new];
    bool two_byte_elements = false; // FA_DTYPE half or bfloat: the library's one element type
    bool metal4 = false;            // FA_LANGUAGE_MACRO: a tensor-path library (fa_gpu_family.h)
    for (uint32_t i = 0; i < key->n_macros; ++i) {
        NSString *value = fixed_string(key->macros[i].value, sizeof key->macros[i].value);
        if (strncmp(key->macros[i].name, "FA_DTYPE", sizeof key->macros[i].name) == 0) {
            two_byte_elements = [value isEqualToString:@"half"] || [value isEqualToString:@"bfloat"];
        }
        if (strncmp(key->macros[i].name, FA_LANGUAGE_MACRO, sizeof key->macros[i].name) == 0) {
            metal4 = [value isEqualToString:@FA_LANGUAGE_METAL4];
        }
        // An empty value means "defined", as on the CPU device (which defines it as 1).
        macros[fixed_string(key->macros[i].name, sizeof key->macros[i].name)] = value.length ? value : @"1";
    }
    opts.preprocessorMacros = macros;
    // bfloat needs MSL 3.1 (macOS 14); kernels guard it with __HAVE_BFLOAT__. Tensor-path
    // libraries are Metal 4 (the planner plans them only where fa_metal_tensor_family says so; an
    // SDK without Metal 4 compiles them as 3.1, and the compiler's error names <metal_tensor>).
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 260000
    if (@available(macOS 26.0, *)) {
        if (metal4) {
            opts.languageVersion = MTLLanguageVersion4_0;
        } else {
            opts.languageVersion = MTLLanguageVersion3_1;
        }
    } else
#endif
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 140000
        if (@available(macOS 14.0, *)) {
        opts.languageVersion = MTLLanguageVersion3_1;
    } else
#endif
        if (@available(macOS 13.0, *)) {
        opts.languageVersion = MTLLanguageVersion3_0;
    }
    // No fast math: masked scores are -inf (exp2(-inf) == 0), fully masked rows and NaN inputs
    // must propagate as SDPA does, and fast math lets the compiler assume no inf/NaN exist.
    // macOS 15 replaced fastMathEnabled with mathMode; fastMathEnabled = NO is documented as
    // mathMode safe + precise FP32 functions, so set the same pair for float32 libraries. Those of
    // 2-byte elements take the fast FP32 functions (exp2 of every softmax weight, as MLX's
    // fast::exp2) under the same safe mode: the fast one's few-ulp error is far below a half or
    // bfloat output's rounding, and masked scores (-inf) and unchanged maxima never reach exp2
    // (fa_softmax.h). What still does: exp2(-inf) for a row's first rescale and NaN scores, which
    // rely on the GPU's exp2 giving 0 and NaN as MLX's kernels do (docs/mac-checklist.md item 41
    // checks NaN and fully masked rows on a Mac). Before macOS 15 every library keeps the precise
    // functions.
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
    if (@available(macOS 15.0, *)) {
        opts.mathMode = MTLMathModeSafe;
        opts.mathFloatingPointFunctions =
            two_byte_elements ? MTLMathFloatingPointFunctionsFast : MTLMathFloatingPointFunctionsPrecise;
    } else
#endif
    {
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
        opts.fastMathEnabled = NO;
#pragma clang diagnostic pop
        (void)two_byte_elements;
    }
    return opts;
}

// The pipeline's label is its function's name, so dispatch errors can name the kernel.
static id<MTLComputePipelineState> new_labelled_pipeline(id<MTLFunction> fn, NSString *name, NSError **err) {
    MTLComputePipelineDescriptor *desc = [MTLComputePipelineDescriptor new];
    desc.computeFunction = fn;
    desc.label = name;
    return [g_device newComputePipelineStateWithDescriptor:desc options:MTLPipelineOptionNone reflection:nil error:err];
}

// The cached pipeline of `identity`, or NULL.
static id<MTLComputePipelineState> cached_pipeline(const fa_pipeline_key *key, const void *lib,
                                                   fa_pipeline_identity *identity, size_t *len, fa_status *st) {
    *len = fa_pipeline_identity_of(key, lib, identity, st);
    void *pso = *len ? fa_cache_get(&g_pipelines, identity, *len) : NULL;
    return pso ? (__bridge id<MTLComputePipelineState>)pso : nil;
}

// Called with g_lock held: one compile at a time, and never the same pipeline twice.
static void *build_pipeline(const fa_pipeline_key *key, const fa_source *source, const fa_library_identity *lib_id,
                            size_t lib_len, fa_status *st) {
    NSError *err = nil;
    void *lib_ptr = fa_cache_get(&g_libraries, lib_id, lib_len);
    if (!lib_ptr) {
        NSString *src = [NSString stringWithUTF8String:source->text];
        id<MTLLibrary> built = src ? [g_device newLibraryWithSource:src options:compile_options(key) error:&err] : nil;
        if (!built) { // a library with only warnings is not nil and is fine
            fa_fail(st, FA_ERR_COMPILE, "Metal compile of %s failed: %s", key->source_name,
                    src ? describe(err) : "source is not UTF-8");
            return NULL;
        }
        lib_ptr = (void *)CFBridgingRetain(built); // kept for the process (under g_lock: no race)
        if (!fa_cache_put(&g_libraries, lib_id, lib_len, lib_ptr)) {
            fa_fail(st, FA_ERR_RUNTIME, "out of memory caching a Metal library");
            return NULL;
        }
    }
    fa_pipeline_identity pipe_id;
    size_t pipe_len = 0;
    id<MTLComputePipelineState> pso = cached_pipeline(key, lib_ptr, &pipe_id, &pipe_len, st);
    if (pso) return (__bridge void *)pso; // another thread built it while we waited for g_lock
    if (!pipe_len) return NULL;
    id<MTLLibrary> lib = (__bridge id<MTLLibrary>)lib_ptr;
    MTLFunctionConstantValues *values = [MTLFunctionConstantValues new];
    for (uint32_t i = 0; i < pipe_id.n_constants; ++i) {
        const fa_constant *c = &pipe_id.constants[i];
        bool b = c->i != 0;
        int32_t n = (int32_t)c->i;
        float f = (float)c->f;
        switch (c->kind) { // kinds are checked by fa_pipeline_identity_of
        case FA_CONST_BOOL: [values setConstantValue:&b type:MTLDataTypeBool atIndex:c->index]; break;
        case FA_CONST_INT: [values setConstantValue:&n type:MTLDataTypeInt atIndex:c->index]; break;
        default: [values setConstantValue:&f type:MTLDataTypeFloat atIndex:c->index]; break;
        }
    }
    NSString *name = [NSString stringWithUTF8String:pipe_id.function];
    id<MTLFunction> fn = name ? [lib newFunctionWithName:name constantValues:values error:&err] : nil;
    if (!fn) {
        fa_fail(st, FA_ERR_COMPILE, "Metal function %s of %s: %s", pipe_id.function, key->source_name,
                [lib.functionNames containsObject:name] ? describe(err) : "no such function");
        return NULL;
    }
    pso = new_labelled_pipeline(fn, name, &err);
    if (!pso) {
        fa_fail(st, FA_ERR_COMPILE, "Metal pipeline %s of %s: %s", pipe_id.function, key->source_name, describe(err));
        return NULL;
    }
    void *pso_ptr = (void *)CFBridgingRetain(pso); // kept for the process
    if (!fa_cache_put(&g_pipelines, &pipe_id, pipe_len, pso_ptr)) {
        fa_fail(st, FA_ERR_RUNTIME, "out of memory caching a Metal pipeline");
        return NULL;
    }
    return pso_ptr;
}

static fa_pipeline *metal_get_pipeline(const fa_pipeline_key *key, fa_status *st) {
    if (metal_init(st) != FA_OK) return NULL;
    fa_source source;
    if (!key || !fa_find_source(key->source_name, &source)) {
        fa_fail(st, FA_ERR_COMPILE, "no kernel source registered as %s",
                key && key->source_name ? key->source_name : "(null)");
        return NULL;
    }
    fa_library_identity lib_id;
    const size_t lib_len = fa_library_identity_of(key, source.id, &lib_id, st);
    if (!lib_len) return NULL;
    @autoreleasepool {
        // The hit path: two hashed lookups, no string formatting, no hashing of the source.
        void *lib_ptr = fa_cache_get(&g_libraries, &lib_id, lib_len);
        if (lib_ptr) {
            fa_pipeline_identity pipe_id;
            size_t pipe_len = 0;
            id<MTLComputePipelineState> pso = cached_pipeline(key, lib_ptr, &pipe_id, &pipe_len, st);
            if (pso) return (fa_pipeline *)(__bridge void *)pso;
            if (!pipe_len) return NULL;
        }
        os_unfair_lock_lock(&g_lock);
        void *built = build_pipeline(key, &source, &lib_id, lib_len, st);
        os_unfair_lock_unlock(&g_lock);
        return (fa_pipeline *)built;
    }
}

static NSUInteger round16(uint64_t n) { return (NSUInteger)((n + 15) & ~(uint64_t)15); }

static void encode(id<MTLComputeCommandEncoder> enc, id<MTLComputePipelineState> pso, const fa_dispatch *d) {
    enc.label = pso.label; // Metal's reports of a failed command buffer name encoders by label
    [enc setComputePipelineState:pso];
    for (uint32_t i = 0; i < d->n_bindings; ++i) {
        const fa_binding *b = &d->bindings[i];
        if (b->bytes) {
            [enc setBytes:b->bytes length:(NSUInteger)b->length atIndex:i];
        } else {
            [enc setBuffer:(__bridge id<MTLBuffer>)b->storage offset:(NSUInteger)b->byte_offset atIndex:i];
        }
    }
    for (uint32_t i = 0; i < d->n_threadgroup_args; ++i) {
        [enc setThreadgroupMemoryLength:round16(d->threadgroup_bytes[i]) atIndex:i];
    }
    [enc dispatchThreadgroups:MTLSizeMake(d->grid[0], d->grid[1], d->grid[2])
        threadsPerThreadgroup:MTLSizeMake(d->threadgroup[0], d->threadgroup[1], d->threadgroup[2])];
    [enc endEncoding];
}

// Geometry and bindings are checked before encoding, so a bad one never leaves a half-encoded
// command in torch's command buffer.
static int32_t check_dispatch(id<MTLComputePipelineState> pso, const fa_dispatch *d, fa_status *st) {
    uint64_t threads = (uint64_t)d->threadgroup[0] * d->threadgroup[1] * d->threadgroup[2];
    if (threads == 0 || threads > pso.maxTotalThreadsPerThreadgroup) {
        return fa_fail(st, FA_ERR_VALUE, "threadgroup of %llu threads; this pipeline allows 1 to %lu",
                       (unsigned long long)threads, (unsigned long)pso.maxTotalThreadsPerThreadgroup);
    }
    uint64_t tg_bytes = pso.staticThreadgroupMemoryLength; // kernel-scope threadgroup arrays
    for (uint32_t i = 0; i < d->n_threadgroup_args; ++i) tg_bytes += round16(d->threadgroup_bytes[i]);
    if (tg_bytes > g_device.maxThreadgroupMemoryLength) {
        return fa_fail(st, FA_ERR_VALUE, "%llu bytes of threadgroup memory; the device allows %lu",
                       (unsigned long long)tg_bytes, (unsigned long)g_device.maxThreadgroupMemoryLength);
    }
    // The bindings of the call's earlier dispatch were checked already (fa_dispatch); within one
    // dispatch, a buffer bound twice (an empty tensor's stand-in) is checked once.
    if (d->same_bindings_as_previous) return FA_OK;
    void *checked[FA_MAX_BINDINGS];
    NSUInteger checked_length[FA_MAX_BINDINGS];
    uint32_t n_checked = 0;
    for (uint32_t i = 0; i < d->n_bindings; ++i) {
        const fa_binding *b = &d->bindings[i];
        if (b->bytes ? b->length <= 0 : b->byte_offset < 0) {
            return fa_fail(st, FA_ERR_VALUE, "binding %u: bad length or offset", i);
        }
        if (b->bytes || !b->storage) continue; // a NULL storage binds nil (an unused argument)
        // For a storage binding, length (if > 0) counts the bytes addressed from byte_offset.
        int64_t end = b->byte_offset + (b->length > 0 ? b->length : 0);
        uint32_t j = 0;
        while (j < n_checked && checked[j] != b->storage) ++j;
        if (j < n_checked && (uint64_t)end <= checked_length[j]) continue;
        if (fa_metal_check_buffer(b->storage, end, st) != FA_OK) return st->code;
        id<MTLBuffer> buffer = (__bridge id<MTLBuffer>)b->storage;
        id<MTLDevice> device = buffer.device;
        if (device.registryID != g_device.registryID) {
            return fa_fail(st, FA_ERR_TYPE,
                           "binding %u: the buffer is on Metal device %s (registryID %#llx), "
                           "the backend runs on %s (%#llx)",
                           i, device.name.UTF8String, (unsigned long long)device.registryID, g_device.name.UTF8String,
                           (unsigned long long)g_device.registryID);
        }
        checked[n_checked] = b->storage;
        checked_length[n_checked++] = buffer.length;
    }
    return FA_OK;
}

// Records a failed command buffer of kernel `name` for the next dispatch, and says so at once on
// stderr: torch would otherwise report it later, at its own synchronisation, without our kernel.
static void record_fault(NSString *name, id<MTLCommandBuffer> finished) {
    if (finished.status != MTLCommandBufferStatusError) return;
    const char *error = finished.error ? finished.error.localizedDescription.UTF8String : "(no error)";
    fprintf(stderr, "flashattn_mps: Metal kernel %s failed on the GPU: %s\n", name.UTF8String, error);
    os_unfair_lock_lock(&g_fault_lock);
    if (!g_fault[0]) snprintf(g_fault, sizeof g_fault, "Metal kernel %s failed on the GPU: %s", name.UTF8String, error);
    os_unfair_lock_unlock(&g_fault_lock);
}

// The fault recorded since the last dispatch, as this dispatch's error (once).
static int32_t report_fault(fa_status *st) {
    char fault[sizeof g_fault] = "";
    os_unfair_lock_lock(&g_fault_lock);
    if (g_fault[0]) {
        memcpy(fault, g_fault, sizeof fault);
        g_fault[0] = '\0';
    }
    os_unfair_lock_unlock(&g_fault_lock);
    return fault[0] ? fa_fail(st, FA_ERR_RUNTIME, "%s (an earlier call; its results are not valid)", fault) : FA_OK;
}

// Encodes on torch's stream inside its serial queue and commits there (PyTorch's pattern for custom
// kernels: an encoder on get_command_buffer(), then torch::mps::commit() in the same dispatch_sync),
// so each of our dispatches is submitted at once, in order with torch's work, and a loop of our
// calls alone does not pile up in one command buffer. A completion handler, added before the
// commit, reports a failure naming the kernel; in debug mode it also signals the wait below.
static int32_t dispatch_on_torch_stream(id<MTLComputePipelineState> pso, const fa_dispatch *d, int32_t mode, bool debug,
                                        fa_status *st) {
    dispatch_queue_t queue = (__bridge dispatch_queue_t)((torch_getter)g_torch[FA_TORCH_GET_DISPATCH_QUEUE])();
    if (!queue) return fa_fail(st, FA_ERR_RUNTIME, "torch returned no MPS dispatch queue");
    __block int32_t rc = FA_OK;
    __block MTLCommandBufferStatus status = MTLCommandBufferStatusNotEnqueued;
    __block NSString *error = nil;
    dispatch_semaphore_t done = debug ? dispatch_semaphore_create(0) : nil;
    dispatch_sync(queue, ^{
      @autoreleasepool {
          if (mode == FA_METAL_TORCH_STREAM_END_COALESCING) { // torch < 2.9 leaves its encoder open
              ((torch_stream_method)g_torch[FA_TORCH_END_COALESCING])(
                  ((torch_getter)g_torch[FA_TORCH_CURRENT_STREAM])());
          }
          id<MTLCommandBuffer> cb =
              (__bridge id<MTLCommandBuffer>)((torch_getter)g_torch[FA_TORCH_GET_COMMAND_BUFFER])();
          id<MTLComputeCommandEncoder> enc =
              cb.device.registryID == g_device.registryID ? [cb computeCommandEncoder] : nil;
          if (!enc) {
              rc = fa_fail(st, FA_ERR_RUNTIME, "no compute encoder on torch's MPS command buffer for %s",
                           pso.label.UTF8String);
              return;
          }
          encode(enc, pso, d);
          NSString *name = pso.label;
          [cb addCompletedHandler:^(id<MTLCommandBuffer> finished) {
            record_fault(name, finished);
            if (done) {
                status = finished.status;
                error = finished.error.localizedDescription;
                dispatch_semaphore_signal(done);
            }
          }];
          ((torch_void_fn)g_torch[FA_TORCH_COMMIT])();
      }
    });
    if (rc != FA_OK || !done) return rc;
    ((torch_void_fn)g_torch[FA_TORCH_SYNCHRONIZE])(); // waits for the stream; outside torch's queue
    if (dispatch_semaphore_wait(done, dispatch_time(DISPATCH_TIME_NOW, 60 * NSEC_PER_SEC)) != 0) {
        return fa_fail(st, FA_ERR_RUNTIME, "Metal kernel %s: torch's command buffer did not complete",
                       pso.label.UTF8String);
    }
    if (status != MTLCommandBufferStatusCompleted) {
        return fa_fail(st, FA_ERR_RUNTIME, "Metal kernel %s failed (command buffer status %ld): %s",
                       pso.label.UTF8String, (long)status, error ? error.UTF8String : "(no error)");
    }
    return FA_OK;
}

static int32_t dispatch_on_own_queue(id<MTLComputePipelineState> pso, const fa_dispatch *d, fa_status *st) {
    id<MTLCommandBuffer> cb = [g_queue commandBuffer];
    id<MTLComputeCommandEncoder> enc = [cb computeCommandEncoder];
    if (!enc) return fa_fail(st, FA_ERR_RUNTIME, "could not create a Metal compute encoder");
    encode(enc, pso, d);
    [cb commit];
    [cb waitUntilCompleted];
    if (cb.status != MTLCommandBufferStatusCompleted) {
        return fa_fail(st, FA_ERR_RUNTIME, "Metal kernel %s failed: %s", pso.label.UTF8String, describe(cb.error));
    }
    return FA_OK;
}

static int32_t metal_dispatch(fa_pipeline *pipeline, const fa_dispatch *d, fa_status *st) {
    if (metal_init(st) != FA_OK) return st->code;
    if (!pipeline || !d || d->n_bindings > FA_MAX_BINDINGS || d->n_threadgroup_args > FA_MAX_TG_ARGS) {
        return fa_fail(st, FA_ERR_VALUE, "Metal backend: malformed dispatch");
    }
    if (report_fault(st) != FA_OK) return st->code;
    @autoreleasepool {
        id<MTLComputePipelineState> pso = (__bridge id<MTLComputePipelineState>)(void *)pipeline;
        if (check_dispatch(pso, d, st) != FA_OK) return st->code;
        if (fa_skip_execution()) return FA_OK; // profiling: all host work but the encoding
        if (d->grid[0] == 0 || d->grid[1] == 0 || d->grid[2] == 0) return FA_OK; // nothing to run
        const int32_t mode = atomic_load(&g_mode);
        if (mode == FA_METAL_OWN_QUEUE) return dispatch_on_own_queue(pso, d, st);
        return dispatch_on_torch_stream(pso, d, mode, atomic_load(&g_debug) != 0, st);
    }
}

int32_t fa_metal_device_info_get(fa_metal_device_info *out, fa_status *st) {
    if (!out) return fa_fail(st, FA_ERR_VALUE, "fa_metal_device_info_get: out is NULL");
    memset(out, 0, sizeof *out);
    if (metal_init(st) != FA_OK) return st->code;
    @autoreleasepool {
        snprintf(out->name, sizeof out->name, "%s", g_device.name.UTF8String);
        out->registry_id = g_device.registryID;
        out->chosen_by = g_device_chosen_by;
        out->low_power = g_device.isLowPower ? 1 : 0;
        out->families |= [g_device supportsFamily:MTLGPUFamilyApple7] ? FA_GPU_APPLE7 : 0;
        out->families |= [g_device supportsFamily:MTLGPUFamilyApple8] ? FA_GPU_APPLE8 : 0;
        // MTLGPUFamilyApple9 by value: the name is missing from some Xcode 15 SDKs.
        out->families |= [g_device supportsFamily:(MTLGPUFamily)1009] ? FA_GPU_APPLE9 : 0;
        out->families |= [g_device supportsFamily:MTLGPUFamilyMac2] ? FA_GPU_MAC2 : 0;
        if (@available(macOS 13.0, *)) {
            out->families |= [g_device supportsFamily:MTLGPUFamilyMetal3] ? FA_GPU_METAL3 : 0;
        }
        out->max_threadgroup_memory = g_device.maxThreadgroupMemoryLength;
        id<MTLDevice> torch = torch_device();
        out->torch_device_known = torch ? 1 : 0;
        out->torch_registry_id = torch ? torch.registryID : 0;
        fa_pipeline_key no_macros = {"", "", NULL, 0, NULL, 0};
        MTLCompileOptions *opts = compile_options(&no_macros);
        const NSUInteger version = (NSUInteger)opts.languageVersion; // (major << 16) | minor
        out->language_version = (int32_t)((version >> 16) * 100 + (version & 0xffff) * 10);
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
        out->fast_math = opts.fastMathEnabled ? 1 : 0;
#pragma clang diagnostic pop
        out->math_mode = out->math_fp32_functions = -1;
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
        if (@available(macOS 15.0, *)) {
            out->math_mode = (int32_t)opts.mathMode;
            out->math_fp32_functions = (int32_t)opts.mathFloatingPointFunctions;
        }
#endif
        out->stream_mode = atomic_load(&g_mode);
        out->debug = atomic_load(&g_debug);
        out->check_buffers = atomic_load(&g_check_buffers);
    }
    return FA_OK;
}

int32_t fa_metal_pipeline_info_get(const fa_pipeline_key *key, fa_metal_pipeline_info *out, fa_status *st) {
    if (!out) return fa_fail(st, FA_ERR_VALUE, "fa_metal_pipeline_info_get: out is NULL");
    memset(out, 0, sizeof *out);
    fa_pipeline *pipeline = metal_get_pipeline(key, st);
    if (!pipeline) return st->code;
    id<MTLComputePipelineState> pso = (__bridge id<MTLComputePipelineState>)(void *)pipeline;
    out->max_total_threads_per_threadgroup = pso.maxTotalThreadsPerThreadgroup;
    out->static_threadgroup_memory_length = pso.staticThreadgroupMemoryLength;
    out->thread_execution_width = pso.threadExecutionWidth;
    return FA_OK;
}

static const fa_backend k_metal_backend = {"metal", metal_get_pipeline, metal_dispatch};

const fa_backend *fa_metal_backend(fa_status *st) { return metal_init(st) == FA_OK ? &k_metal_backend : NULL; }
