/* The Apple GPU families the planner chooses configurations for, and what it assumes of each.
 *
 * One table (fa_gpu_profiles, fa_gpu_family.c) holds every per-family figure the planner and
 * explain_plan read; the planners take their tiles from it (fa_plan_forward.c, fa_plan_backward.c)
 * and explain_plan turns a dispatch's cost into resident threadgroups, SIMD-groups and an estimated
 * fraction of peak with it (fa_gpu_estimate). Which family a call plans for: fa_options.gpu_family
 * when nonzero (explain_plan(gpu=...)), else the device's (fa_device_gpu_family). */
#ifndef FA_GPU_FAMILY_H
#define FA_GPU_FAMILY_H

#include "fa_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* MTLGPUFamilyApple<N>: the values are N. FA_FAMILY_DEVICE (0) asks for the device's own. */
typedef enum fa_gpu_family {
    FA_FAMILY_DEVICE = 0,
    FA_FAMILY_APPLE7 = 7,  /* M1, A14 */
    FA_FAMILY_APPLE8 = 8,  /* M2, A15, A16 */
    FA_FAMILY_APPLE9 = 9,  /* M3, M4, A17 Pro, A18: dynamic caching */
    FA_FAMILY_APPLE10 = 10 /* M5, A19 */
} fa_gpu_family;

/* What the planner assumes of one family (fa_gpu_family.c says where each figure comes from). */
typedef struct fa_gpu_profile {
    int32_t family;
    const char *name;                 /* "apple7": what explain_plan(gpu=) and the env var take */
    const char *chips;                /* for people */
    int64_t register_file_bytes;      /* per core */
    int64_t threadgroup_memory_bytes; /* per core, shared by the resident threadgroups */
    int32_t max_simd_groups;          /* resident per core at the least register use */
    int32_t saturating_simd_groups;   /* resident SIMD-groups at which the ALUs stay busy */
    int32_t fragment_register_budget; /* most 32-bit fragment registers per thread a tile may take */
    int64_t tile_bytes_cap;           /* most threadgroup bytes the tiled kernels' tiles may take */
    int32_t overhead_registers;       /* registers beside the fragments: addresses, loop state, softmax */
    double flops_per_core_clock;      /* FP16 and FP32 FMA throughput x 2, per core per clock */
    double dram_bytes_per_core_clock; /* memory bandwidth per core per GPU clock of the family's widest-bus chip */
    int32_t bfloat_fragments;         /* bfloat16 operand fragments: the GPU does bfloat arithmetic itself */
} fa_gpu_profile;

enum { FA_GPU_PROFILES = 4 };
extern const fa_gpu_profile fa_gpu_profiles[FA_GPU_PROFILES];

/* The profile of family (7..10); NULL for any other value. */
const fa_gpu_profile *fa_gpu_profile_of(int32_t family);

/* The family a call on `device` plans for, into *family: `requested` when nonzero; else the one the
 * FLASHATTN_MPS_GPU_FAMILY environment variable names (apple7 .. apple10, read once), on either
 * device (so a Mac can run another family's configurations to compare them); else the Metal
 * device's (MTLDevice supportsFamily) for MPS, FA_FAMILY_CPU_DEFAULT for the CPU Metal device.
 * FA_ERR_VALUE with st set on a bad value. */
/* The CPU device's default: Apple9's tiles are the table the suite has always run (every plan-shape
 * test holds as it was); FLASHATTN_MPS_GPU_FAMILY=apple7 runs an M1's configurations. */
enum { FA_FAMILY_CPU_DEFAULT = FA_FAMILY_APPLE9 };
int32_t fa_resolve_gpu_family(int32_t device, int64_t requested, int32_t *family, fa_status *st);

/* The Metal device's family (7..10, 0 when there is no Metal device): metal_backend.m, 0 in
 * builds without Metal. */
int32_t fa_metal_gpu_family(void);

/* Whether `device` runs Metal 4 tensor operations (MPP's matmul2d, cooperative tensors), as the
 * family whose cooperative-tensor lanes it has, 0 when it does not: MPS, macOS 26.2 or later on an
 * Apple9 or Apple10 GPU (fa_metal_tensor_family, metal_backend.m; 0 in builds without Metal); the
 * CPU Metal device, the family it emulates (FLASHATTN_MPS_CPU_GPU_FAMILY: apple10 unless apple9;
 * 0 for another value, which its compiler refuses). */
int32_t fa_device_tensor_family(int32_t device);
int32_t fa_metal_tensor_family(void);
int32_t fa_cpu_tensor_family(void);

/* The pipeline-key macro of a library written in Metal 4 (its value the language version, "400"):
 * the backends compile it as such (MTLLanguageVersion4_0; the CPU device's Metal 4 build of the
 * family fa_cpu_tensor_family names, in the layout FLASHATTN_MPS_CPU_TENSOR_LAYOUT asks for). */
#define FA_LANGUAGE_MACRO "FA_LANGUAGE_VERSION"
#define FA_LANGUAGE_METAL4 "400"

/* explain_plan's estimate for one dispatch of `threads` threads per threadgroup, from its cost's
 * fragment registers and threadgroup bytes (fa_gpu_family.c names the assumptions). */
typedef struct fa_gpu_estimate {
    int32_t registers;             /* per thread: fragments + the profile's overhead */
    int32_t resident_threadgroups; /* per core: the least the registers, threadgroup memory allow */
    int32_t resident_simd_groups;
    double occupancy;        /* min(1, resident SIMD-groups / saturating SIMD-groups) */
    double fraction_of_peak; /* useful / issued FLOPs x occupancy (tiled kernels); 0 without FLOPs */
} fa_gpu_estimate;
#define FA_GPU_ESTIMATE_ASSUMPTIONS                                                                             \
    "registers: the fragments the cost counts, all live at once, plus the family's overhead (addresses, loop "  \
    "state, softmax statistics, temporaries); resident threadgroups: the fewest the register file, the "        \
    "threadgroup memory and the thread limit per core allow (Apple9+ allocate registers as used: a worst case " \
    "there); fraction_of_peak: useful / issued FLOPs x min(1, resident SIMD-groups / saturating SIMD-groups), " \
    "assuming no spill, MMAs at peak while the ALUs are busy and device memory hidden behind them: an upper "   \
    "bound a Mac's timing is compared with (benchmarks/bench_attention.py --fractions)"
/* The fraction of the memory bandwidth a dispatch that must read `bytes` and issues `issue_slots`
 * SIMD-group instructions can reach: 1 when reading takes longer than issuing (at
 * flops_per_core_clock / 64 instructions per core per clock, dram_bytes_per_core_clock), else
 * the ratio of the two times; 0 when the issue is not modelled. */
#define FA_GPU_BANDWIDTH_ASSUMPTIONS                                                                          \
    "fraction_of_bandwidth (decode): min(1, time to read the inputs once / time to issue the modelled "       \
    "instructions), both spread evenly over the cores, at the family's widest-bus chip's bytes per core per " \
    "clock; latency assumed hidden"
double fa_gpu_bandwidth_fraction(const fa_gpu_profile *profile, double issue_slots, double bytes);
fa_gpu_estimate fa_gpu_estimate_dispatch(const fa_gpu_profile *profile, int32_t fragment_registers,
                                         int64_t threadgroup_bytes, uint32_t threads, double flops,
                                         double useful_flops);

#ifdef __cplusplus
}
#endif
#endif
