/* The torch symbols the Metal backend resolves at run time, by index (metal_backend.h). Plain C,
 * built everywhere, so the doctor lists the same names on every system. Mangled Itanium names of
 * functions exported by libtorch_cpu.dylib: the first five are in torch's macOS arm64 wheels 2.4.0,
 * 2.8.0 and 2.9.0, the last two also in 2.10 to 2.14; torch::mps::commit in 2.4.0 and 2.13.0 (read
 * with llvm-nm). */
#include "metal_backend.h"

const char *fa_metal_torch_symbol_name(int32_t i) {
    static const char *const names[FA_TORCH_N_SYMBOLS] = {
        [FA_TORCH_GET_COMMAND_BUFFER] = "_ZN5torch3mps18get_command_bufferEv",
        [FA_TORCH_GET_DISPATCH_QUEUE] = "_ZN5torch3mps18get_dispatch_queueEv",
        [FA_TORCH_SYNCHRONIZE] = "_ZN5torch3mps11synchronizeEv",
        [FA_TORCH_CURRENT_STREAM] = "_ZN2at3mps19getCurrentMPSStreamEv",
        [FA_TORCH_END_COALESCING] = "_ZN2at3mps9MPSStream19endKernelCoalescingEv",
        [FA_TORCH_COMMIT] = "_ZN5torch3mps6commitEv",
    };
    return i >= 0 && i < FA_TORCH_N_SYMBOLS ? names[i] : NULL;
}
