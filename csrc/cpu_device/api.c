/* The table other extension modules call the device through (metal_cpu.h, mcpu_api). */
#include "metal_cpu.h"

static int32_t default_mode(mcpu_status *st) {
    const int32_t checked = mcpu_checked(st);
    return checked < 0 ? -1 : checked ? (int32_t)MCPU_CHECKED : 0;
}

static uint32_t generation(void) {
    mcpu_status ignored; /* reported by default_mode when a library is next needed */
    return mcpu_checked(&ignored) == 1 ? (uint32_t)MCPU_CHECKED : 0u;
}

static const mcpu_api table = {
    MCPU_API_VERSION, default_mode, generation, mcpu_compile_library, mcpu_library_kernel, mcpu_dispatch,
};

const mcpu_api *mcpu_api_table(void) { return &table; }
