/* The per-family table and explain_plan's occupancy estimate (fa_gpu_family.h).
 *
 * Where the figures come from (read, not measured here; a Mac measures with
 * benchmarks/bench_attention.py, docs/performance.md):
 *  - register file about 208 KiB and threadgroup memory about 60 KiB per core on Apple7/8; 32 KiB is
 *    the most one threadgroup may take (Apple's Metal feature set tables), not what a core holds;
 *    up to 3072 threads (96 SIMD-groups) resident per core; 128 FP32 or FP16 FMA lanes per core
 *    (256 FLOPs per clock: M1's 2.6 TFLOPS at 8 cores and 1.278 GHz): philipturner/metal-benchmarks.
 *    So 128 registers per thread leave 208 KiB / (128 x 4 B x 32 lanes) = 13 SIMD-groups per core,
 *    about the least that keeps a core issuing at all, not "full occupancy"; the ALUs stay busy from
 *    about 24 SIMD-groups (69 registers per thread) up (the same source's occupancy figures).
 *  - metal-flash-attention's per-family block tables keep no operand resident in its dK/dV pass above
 *    D = 96 on M1/M2, and dK and dV up to D = 144 on Apple9, whose dynamic caching allocates
 *    registers, threadgroup and tile memory from one on-chip pool as a kernel uses them: a large
 *    register budget costs occupancy gradually there instead of spilling on every tile.
 *  - MLX's steel attention keeps 14.8 KiB of threadgroup memory at D = 128 (BK 16); four such
 *    threadgroups (16 SIMD-groups) fit in 60 KiB, where 17 KiB tiles allow three.
 * Apple9's and Apple10's sizes are not published: they are modelled with Apple8's, and the planner's
 * budgets there are the figures of the configurations tested so far (144 fragment registers, which
 * keep dK/dV at D = 128 resident in every dtype: fp32 takes 136; the widest tiles 18 KiB). Apple10
 * adds matrix units these kernels do not use. */
#include "fa_gpu_family.h"

#include <stdlib.h>
#include <string.h>

#define KIB 1024

/* family, name, chips, register file, threadgroup memory, max SIMD-groups, saturating SIMD-groups,
 * fragment register budget, tile bytes cap, overhead registers, FLOPs per core per clock, DRAM bytes
 * per core per clock (Apple's published bandwidth over cores x GPU clock of the chip with the most
 * per core, where an ALU-bound decode shows first: M1 Max 409.6 GB/s / (32 x 1.296 GHz), M2 Max
 * 409.6 / (38 x 1.398), M4 Max 546 / (40 x 1.578), M5 153.6 / (10 x 1.6, the clock an estimate)),
 * bfloat operand fragments (Apple9 added bfloat16 to the GPU's arithmetic; Apple7/8 compile bfloat
 * through float, so their bfloat16 operands stay float fragments: metal/fa_fragments.h) */
const fa_gpu_profile fa_gpu_profiles[FA_GPU_PROFILES] = {
    {FA_FAMILY_APPLE7, "apple7", "M1, A14", 208 * KIB, 60 * KIB, 96, 24, 96, 15 * KIB, 32, 256.0, 9.9, 0},
    {FA_FAMILY_APPLE8, "apple8", "M2, A15, A16", 208 * KIB, 60 * KIB, 96, 24, 96, 15 * KIB, 32, 256.0, 7.7, 0},
    {FA_FAMILY_APPLE9, "apple9", "M3, M4, A17 Pro, A18", 208 * KIB, 60 * KIB, 96, 24, 144, 37 * KIB / 2, 32, 256.0, 8.7,
     1},
    {FA_FAMILY_APPLE10, "apple10", "M5, A19", 208 * KIB, 60 * KIB, 96, 24, 144, 37 * KIB / 2, 32, 256.0, 9.6, 1},
};

const fa_gpu_profile *fa_gpu_profile_of(int32_t family) {
    for (int32_t i = 0; i < FA_GPU_PROFILES; ++i) {
        if (fa_gpu_profiles[i].family == family) {
            return &fa_gpu_profiles[i];
        }
    }
    return NULL;
}

/* FLASHATTN_MPS_GPU_FAMILY's family, read once: 0 when unset or empty, -1 when the value names no
 * profile (*value: the text). */
static int32_t environment_family(const char **value) {
    static int32_t family = -2;
    static const char *text = NULL;
    if (family == -2) {
        text = getenv("FLASHATTN_MPS_GPU_FAMILY");
        family = 0;
        if (text != NULL && text[0] != '\0') {
            family = -1;
            for (int32_t i = 0; i < FA_GPU_PROFILES; ++i) {
                if (strcmp(text, fa_gpu_profiles[i].name) == 0) {
                    family = fa_gpu_profiles[i].family;
                }
            }
        }
    }
    *value = text;
    return family;
}

int32_t fa_resolve_gpu_family(int32_t device, int64_t requested, int32_t *family, fa_status *st) {
    if (requested != FA_FAMILY_DEVICE) {
        if (requested < FA_FAMILY_APPLE7 || requested > FA_FAMILY_APPLE10) {
            return fa_fail(st, FA_ERR_VALUE,
                           "gpu_family: must be 0 (the device's) or 7 to 10 (Apple7 .. Apple10), got %lld",
                           (long long)requested);
        }
        *family = (int32_t)requested;
        return FA_OK;
    }
    const char *value = NULL;
    const int32_t named = environment_family(&value);
    if (named < 0) {
        return fa_fail(st, FA_ERR_VALUE,
                       "FLASHATTN_MPS_GPU_FAMILY: must be apple7, apple8, apple9 or apple10 (or unset), got '%s'",
                       value);
    }
    const int32_t metal = device == FA_DEVICE_MPS && named == 0 ? fa_metal_gpu_family() : 0;
    *family = named != 0 ? named : metal != 0 ? metal : FA_FAMILY_CPU_DEFAULT;
    return FA_OK;
}

int32_t fa_cpu_tensor_family(void) {
    const char *named = getenv("FLASHATTN_MPS_CPU_GPU_FAMILY");
    if (named == NULL || named[0] == '\0' || strcmp(named, "apple10") == 0) {
        return FA_FAMILY_APPLE10;
    }
    return strcmp(named, "apple9") == 0 ? FA_FAMILY_APPLE9 : 0;
}

int32_t fa_device_tensor_family(int32_t device) {
    return device == FA_DEVICE_MPS ? fa_metal_tensor_family() : fa_cpu_tensor_family();
}

/* Assumptions: every fragment register the cost counts is live at once, beside the profile's
 * overhead (addresses, loop state, softmax statistics, temporaries); registers are allocated per
 * thread for the whole kernel (on Apple9+ dynamic caching allocates them as used, so this is the
 * worst case there); no spill; the MMAs issue at peak while the ALUs are busy; device memory is
 * hidden behind them. The fraction is then an upper bound a measurement compares against. */
fa_gpu_estimate fa_gpu_estimate_dispatch(const fa_gpu_profile *profile, int32_t fragment_registers,
                                         int64_t threadgroup_bytes, uint32_t threads, double flops,
                                         double useful_flops) {
    fa_gpu_estimate e = {0, 0, 0, 0.0, 0.0};
    const int64_t simd_groups = threads > 0 ? ((int64_t)threads + 31) / 32 : 1;
    e.registers = fragment_registers + profile->overhead_registers;
    const int64_t by_registers = profile->register_file_bytes / ((int64_t)e.registers * 4 * 32 * simd_groups);
    const int64_t by_memory = threadgroup_bytes > 0 ? profile->threadgroup_memory_bytes / threadgroup_bytes : INT32_MAX;
    const int64_t by_threads = profile->max_simd_groups / simd_groups;
    int64_t resident = by_registers < by_memory ? by_registers : by_memory;
    resident = resident < by_threads ? resident : by_threads;
    e.resident_threadgroups = (int32_t)resident;
    e.resident_simd_groups = (int32_t)(resident * simd_groups);
    const double busy = (double)e.resident_simd_groups / profile->saturating_simd_groups;
    e.occupancy = busy < 1.0 ? busy : 1.0;
    e.fraction_of_peak = flops > 0.0 ? useful_flops / flops * e.occupancy : 0.0;
    return e;
}

double fa_gpu_bandwidth_fraction(const fa_gpu_profile *profile, double issue_slots, double bytes) {
    if (issue_slots <= 0.0) {
        return 0.0;
    }
    const double read_clocks = bytes / profile->dram_bytes_per_core_clock;
    const double issue_clocks = issue_slots / (profile->flops_per_core_clock / 64.0); /* 2 x 32 lanes */
    return read_clocks >= issue_clocks ? 1.0 : read_clocks / issue_clocks;
}
