/* The forward planner: checks a forward call's shapes and options, chooses the kernel and its
 * specialisation, tiles and grid, and counts what each dispatch costs. */
#include "fa_plan_forward.h"
#include "fa_plan_sequences.h"
#include "../metal/fa_sequence.h"

#include <stdio.h>
#include <string.h>

static const char *simple_source = "fa_simple.metal";
static const char *forward_source = "fa_forward.metal";
static const char *decode_source = "fa_decode.metal";
static const char *tensor_source = "fa_forward_tensor.metal";

/* The forward kernel's tile table.
 *
 * Head dims are padded (inside the kernel, never by copying) to one of these widths, so a handful of
 * specialisations cover every E and Ev in 0..256: steps of 16 up to 128, where common models live,
 * then 32. A width only sizes registers and threadgroup tiles: the kernels skip the 8-wide slices
 * that hold no data (fa_slices() in fa_fragments.h), so matrix work is ceil(E / 8) slices whatever
 * the width (72 in 80, 40 in 48, 136 in 160 do no padded products) and a width per common head dim
 * would add specialisations (and compile time) without saving work. What padding still costs:
 * zeros written into the tiles, and registers of fragments never touched.
 *
 * Head dims above 256 (up to FA_MAX_HEAD_DIM = 576: 320, 448, 512, DeepSeek's absorbed MLA with
 * E = 576, Ev = 512) are blocked along D (metal/fa_head_blocks.h) with the same specialisations:
 *   E > 256 (or E > 128 beside Ev > 256): BD = FORWARD_STREAM_WIDTH = 64. Q and K stream
 *             through registers and the K tile in 64-column blocks per key tile (Q does not fit
 *             threadgroup memory: 32 rows of 576 halves are 36 KiB alone), S accumulating over
 *             the blocks;
 *   Ev > 256: the output splits into ceil(Ev / 256) column blocks of equal padded width (320: 2 x
 *             160, 448: 2 x 224, 512: 2 x 256, 576: 3 x 192), one per threadgroup (the grid's head
 *             axis is Hq x blocks); each recomputes its rows' scores.
 * metal-flash-attention blocks D too (16 to 32 wide at these dims) and keeps no operand in
 * registers above about 160 to 384 (its tables), round-tripping O through memory; here O stays in
 * registers, one column block per threadgroup.
 *
 * Keys per tile (BK) by element size and the wider tile width, max(BD, BDV), then halved (down to 8)
 * while the K and V tiles, BK * (BD + 8 + BDV + 8) elements of threadgroup memory, exceed the GPU
 * family's tile cap (fa_gpu_family.c: 15 KiB on Apple7/8, so four threadgroups share a core's
 * ~60 KiB; 18.5 KiB on Apple9/10):
 *                                 table                       Apple7/8 (15 KiB)
 *   4-byte elements: D <= 64:     BK 32 (18.0 KiB)            BK 16 (9.0 KiB)
 *                    D <= 128:    BK 16 (17.0 KiB)            BK 8 (8.5 KiB)
 *                    D <= 256:    BK 8 (16.5 KiB)             BK 8 (16.5 KiB: BK stops at 8)
 *   2-byte elements: D <= 128:    BK 32 (17.0 KiB)            BK 16 (8.5 KiB)
 *                    D <= 256:    BK 16 (16.5 KiB)            BK 8 (8.3 KiB)
 *   blocked (BD 64, BDV <= 256): 10.8 KiB in every dtype
 * (MLX's steel attention takes BK 16 at D = 128, 14.8 KiB; metal-flash-attention about 8 KiB.)
 * Registers per thread, counted for the live fragments alone (explain_plan adds the family's
 * overhead for addresses, loop state and temporaries: fa_gpu_estimate_dispatch). An 8x8 fragment
 * costs a lane 2 registers in float, 1 in half or bfloat: Q is an operand fragment (half for fp16
 * inputs, bfloat for bf16 on Apple9/10, float for fp32 and for bf16 on Apple7/8:
 * fa_plan_operand_registers, fa_fragments.h), O and S are float, plus one K/V fragment in flight
 * (table BK; Apple7/8's smaller BK takes 2 to 4 fewer). bf16 counts as fp16 on Apple9/10 and as
 * fp32 (with 2-byte tiles) on Apple7/8:
 *                        Q        O       S (BK)    total
 *   D = 64               16 / 8   16      8 (32)    42 fp32, 33 fp16 (bf16 on Apple7/8, BK 32: 42)
 *   D = 128              32 / 16  32      4 (16)    70 fp32; fp16 (BK 32): 16 + 32 + 8 + 1 = 57
 *   D = 256              64 / 32  64      2 (8)     132 fp32; fp16 (BK 16): 32 + 64 + 4 + 1 = 101
 *   E 320, Ev 320        16 / 8   40      2 (8)     60 fp32; fp16 (BK 16): 8 + 40 + 4 + 1 = 53
 *   E 448, Ev 448        16 / 8   56      2 (8)     76 fp32; fp16: 69
 *   E 512 or 576, Ev 512 16 / 8   64      2 (8)     84 fp32; fp16 (BK 16): 8 + 64 + 4 + 1 = 77
 *   E 128, Ev 512        32 / 16  64      2 (8)     100 fp32, 102 bf16 on Apple7/8 (BK 16): the most of any blocked one
 * With the overhead (about 32), 128 registers per thread is not "full occupancy": it leaves about 13
 * SIMD-groups per core of Apple7/8's ~208 KiB register file, the fewest that keep a core issuing;
 * the ALUs stay busy from about 24 (69 registers). Every forward configuration at D <= 128 stays
 * within Apple7/8's budget of 96 fragment registers; fp32 (and bf16 on Apple7/8) at 128 < D <= 256 take up to 132
 * (fewer resident SIMD-groups, or a spill: to be measured on a Mac; the blocked configuration
 * serves them too, at the price of a barrier pair per 64-column block and per key tile).
 * WM = 4 SIMD-groups, so 32 query rows per threadgroup (MLX uses the same), 128 threads. */
static const int32_t padded_head_dims[] = {16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256};
enum {
    N_PADDED_HEAD_DIMS = sizeof padded_head_dims / sizeof padded_head_dims[0],
    FORWARD_WM = 4,
    FORWARD_MIN_BK = 8,          /* one 8x8 fragment of keys */
    FORWARD_TILE_PAD = 8,        /* FA_TILE_PAD of metal/fa_loader.h: row padding of threadgroup tiles */
    RESIDENT_MAX_HEAD_DIM = 256, /* the widest tile */
    FORWARD_STREAM_WIDTH = 64,
    RESIDENT_BESIDE_BLOCKED_EV = 128, /* Q of E <= 128 beside a 256-wide O block: at most 100 registers */
};

static int32_t padded_head_dim(int64_t d) {
    for (int32_t i = 0; i < N_PADDED_HEAD_DIMS; ++i) {
        if (d <= padded_head_dims[i]) {
            return padded_head_dims[i];
        }
    }
    return -1; /* validated away before */
}

int32_t fa_plan_head_blocks(int64_t dim, int32_t width) {
    const int64_t blocks = (dim + width - 1) / width;
    return blocks > 1 ? (int32_t)blocks : 1;
}

int32_t fa_plan_block_width(int64_t dim, int32_t max_width) {
    const int64_t blocks = fa_plan_head_blocks(dim, max_width);
    return padded_head_dim((dim + blocks - 1) / blocks);
}

int32_t fa_plan_operand_registers(int32_t dtype, const fa_gpu_profile *gpu) {
    return dtype == FA_F16 || (dtype == FA_BF16 && gpu->bfloat_fragments) ? 1 : 2;
}

void fa_plan_set_operand_fragments(fa_plan_dispatch *d, int32_t dtype, const fa_gpu_profile *gpu) {
    if (dtype == FA_BF16 && gpu->bfloat_fragments) {
        fa_plan_add_macro(d, "FA_BFLOAT_FRAGMENTS", 1);
    }
}

fa_tiles fa_plan_tiles(int32_t bd, int32_t bdv, int32_t element_bytes, const fa_gpu_profile *gpu) {
    fa_tiles t = {bd, bdv, 0, FORWARD_WM};
    const int32_t widest = t.bd > t.bdv ? t.bd : t.bdv;
    if (element_bytes == 4) {
        t.bk = widest <= 64 ? 32 : widest <= 128 ? 16 : 8;
    } else {
        t.bk = widest <= 128 ? 32 : 16;
    }
    while (t.bk > FORWARD_MIN_BK && fa_plan_tile_bytes(t, element_bytes) > gpu->tile_bytes_cap) {
        t.bk /= 2;
    }
    return t;
}

static fa_tiles choose_forward_tiles(int64_t e, int64_t ev, int32_t element_bytes, const fa_gpu_profile *gpu) {
    const int64_t resident_e = ev <= RESIDENT_MAX_HEAD_DIM ? RESIDENT_MAX_HEAD_DIM : RESIDENT_BESIDE_BLOCKED_EV;
    const int32_t bd = e <= resident_e ? padded_head_dim(e) : FORWARD_STREAM_WIDTH;
    return fa_plan_tiles(bd, fa_plan_block_width(ev, RESIDENT_MAX_HEAD_DIM), element_bytes, gpu);
}

/* The decode kernel (fa_decode.metal): one threadgroup of FA_DECODE_SIMD_GROUPS SIMD-groups per kv
 * head serves the rows of every query head sharing it, each SIMD-group scoring a batch of
 * KEYS keys per pass, lanes holding chunks of contiguous columns of the head dims.
 *
 * AUTO takes it for L <= DECODE_MAX_QUERY_LEN = 8: below that a prefill block of 8-row fragments is
 * mostly padding and its one threadgroup per head leaves the GPU idle (MLX and PyTorch switch to
 * their vector kernels at the same length).
 *
 * Specialisation: FA_DECODE_COLS columns per lane, the power of two 2, 4 or 8 covering
 * max(E, Ev) / 32, above 256 the multiple of 4 (12, 16, 20: head dims to 576) covering it (one
 * value for both dims keeps the variants few; columns past a dim are
 * predicated off, never loaded), read in chunks of min(COLS, 4) contiguous elements: one 4- to
 * 16-byte vector load per chunk when K and V allow it (FA_FC_DECODE_VECTOR_LOADS: unit column
 * stride, every row start aligned to the chunk; otherwise the same layout is read element by
 * element through the strides). A lane's registers (decode_lane_floats): per row 2 * COLS floats
 * (query slice and output accumulator) and KEYS partial scores, plus 2 * COLS for the K or V rows
 * in flight, at most FA_DECODE_LANE_BUDGET = 104 32-bit registers per thread (the rest hold softmax
 * state, indices and pointers: about 136 in all, 12 SIMD-groups per Apple7/8 core,
 * fa_gpu_family.c). FA_DECODE_ROWS rows per threadgroup: the next power of two >= (Hq / Hkv) * L,
 * so a plain multi-head decode keeps its registers free, capped where two keys per batch still
 * fit: 16 rows up to E = 64, 8 up to 128, 4 up to 256, 2 up to 512, 1 beyond; more rows take
 * several threadgroups per kv head. KEYS (FA_DECODE_KEYS, metal/fa_params.h): the most keys per batch, a power of two up to
 * 32, the remaining registers hold (8 rows at E = 128: 4; one row: 32).
 *
 * Why batches on the SIMD lanes and not simdgroup matrices when 8 GQA rows fill a fragment: an
 * 8x8x8 simdgroup MMA does 16 multiply-adds per lane, the rate of plain FMAs on Apple7-9 (no
 * separate matrix units before Apple10), so Q K^T and P V cost D / 32 multiply-adds per key and
 * row either way; what MMAs would save is the reduction, which a batch already brings from 5
 * shuffles per key and row (a simd_sum) to about (KEYS - 1 + log2(32 / KEYS)) / KEYS (1.5 at 4
 * keys, 1 at 32), and the exp2, from 2 per key and row to 2 per batch and row, for any GQA factor
 * and without the fragment layout's row reductions. Per key and row at E = 128 and 8 rows: about
 * 8 multiply-adds, 6 shuffle-and-adds and 1 exp2 then, against 8, 10 and 2 plus the per-key
 * rescale of the accumulator (4 multiplies) before.
 *
 * Split-K: with G = B * Hkv * ceil(rows / FA_DECODE_ROWS) threadgroups a long KV would run on a few
 * cores while the rest idle. When G is below what fits at once on DECODE_CORES = 40 cores (the
 * largest single-die GPU) -- the family's resident threadgroups per core by registers and
 * threadgroup memory (fa_gpu_estimate_dispatch) times 40 -- the visible keys (S, or under a band
 * the keys from row 0's first to row L - 1's last: a window's, not S) are split into about that
 * many / G shares of at least DECODE_MIN_SPLIT_KEYS = 256 keys, at most DECODE_MAX_SPLITS = 128 of
 * them: one wave on the largest GPU, whole waves on smaller ones, where a target of 4 resident
 * threadgroups per core split short KV caches twice as finely as fits. 256 keys keep the partial
 * results' round trip through the workspace to about 1/16 of the K/V traffic at 8 rows of Ev =
 * 128. Each share's length is a multiple of KEYS * FA_DECODE_SIMD_GROUPS (a batch per
 * SIMD-group) so its SIMD-groups get equal work; a requested count (num_splits) takes multiples of
 * DECODE_MIN_KEYS * FA_DECODE_SIMD_GROUPS = 16 keys instead, to come as close to it as the keys
 * allow (a share's last turn may then be partial). These numbers are estimates to be tuned on a
 * Mac. */
enum {
    DECODE_MAX_QUERY_LEN = 8,
    DECODE_MIN_COLS = 2,
    DECODE_MAX_ROWS = 16,
    DECODE_MIN_KEYS = 2,
    DECODE_CORES = 40,
    DECODE_MIN_SPLIT_KEYS = 256,
    DECODE_MAX_SPLITS = 128,
};

/* The columns per lane after `cols` (the specialisations' sequence: 2, 4, 8, 12, 16, 20). */
static int32_t next_decode_columns(int32_t cols) { return cols < 8 ? 2 * cols : cols + 4; }

static int32_t decode_columns(int64_t e, int64_t ev) {
    const int64_t widest = e > ev ? e : ev;
    int32_t cols = DECODE_MIN_COLS;
    while (32 * cols < widest) {
        cols = next_decode_columns(cols);
    }
    return cols;
}

/* Floats a lane keeps in registers (see above). */
static int32_t decode_lane_floats(int32_t cols, int32_t rows, int32_t keys) {
    return FA_DECODE_LANE_FLOATS(cols, rows, keys);
}

/* The most rows per threadgroup COLS columns per lane allow (a power of two). */
static int32_t decode_row_cap(int32_t cols) {
    int32_t rows = DECODE_MAX_ROWS;
    while (rows > 1 && !FA_DECODE_FITS(cols, rows, DECODE_MIN_KEYS)) {
        rows /= 2;
    }
    return rows;
}

static int32_t decode_rows(int32_t cols, int64_t head_rows) {
    const int32_t cap = decode_row_cap(cols);
    int32_t rows = 1;
    while (rows < cap && rows < head_rows) {
        rows *= 2;
    }
    return rows;
}

/* Keys per batch (the kernel derives the same from its COLS and ROWS). */
static int32_t decode_keys(int32_t cols, int32_t rows) { return FA_DECODE_KEYS(cols, rows); }

/* Whether the decode kernel may read t's rows `chunk` contiguous elements at a time: unit column
 * stride and every row start a multiple of the chunk from the buffer start (which Metal and torch
 * align to far more), through the byte offset and the batch, head and row strides. */
static int32_t decode_vector_loadable(const fa_tensor *t, int32_t chunk) {
    if (t->sizes[3] > 1 && t->strides[3] != 1) {
        return 0;
    }
    if (t->byte_offset % (chunk * fa_dtype_bytes(t->dtype)) != 0) {
        return 0;
    }
    for (int32_t d = 0; d < 3; ++d) {
        if (t->sizes[d] > 1 && t->strides[d] % chunk != 0) {
            return 0;
        }
    }
    return 1;
}

/* The same for an operand quantized to `bits` (0: not), whose strides count bytes of its data: a
 * chunk is chunk * bits / 8 bytes (fa_decode_load_quantized reads 8-bit chunks of 4 or 2 and
 * 4-bit chunks of 4 elements as vectors, others element by element). */
static int32_t decode_operand_vector_loadable(const fa_tensor *t, int32_t bits, int32_t chunk) {
    if (bits == 0) {
        return decode_vector_loadable(t, chunk);
    }
    const int64_t bytes = (int64_t)chunk * bits / 8;
    if ((bits == 4 && chunk != 4) || (t->sizes[3] > 1 && t->strides[3] != 1) || t->byte_offset % bytes != 0) {
        return 0;
    }
    for (int32_t d = 0; d < 3; ++d) {
        if (t->sizes[d] > 1 && t->strides[d] % bytes != 0) {
            return 0;
        }
    }
    return 1;
}

/* Keys per split; *splits receives their number (1: no split). requested > 0 asks for that many
 * (flash-attn's num_splits, capped at DECODE_MAX_SPLITS); 0 takes the heuristic above, aiming at
 * `target` threadgroups in all. Shares are whole turns of `turn` keys. */
static int32_t decode_split_keys(int64_t threadgroups, int64_t target, int64_t keys, int64_t turn, int32_t requested,
                                 int32_t *splits) {
    int64_t n = 1;
    if (requested > 0) {
        n = requested < DECODE_MAX_SPLITS ? requested : DECODE_MAX_SPLITS;
    } else if (threadgroups < target && keys >= 2 * DECODE_MIN_SPLIT_KEYS) {
        n = (target + threadgroups - 1) / threadgroups;
        n = n < keys / DECODE_MIN_SPLIT_KEYS ? n : keys / DECODE_MIN_SPLIT_KEYS;
        n = n < DECODE_MAX_SPLITS ? n : DECODE_MAX_SPLITS;
    }
    if (n == 1 || keys <= turn) { /* one turn of batches cannot be shared */
        *splits = 1;
        return (int32_t)keys;
    }
    const int64_t per_split = ((keys + n - 1) / n + turn - 1) / turn * turn;
    *splits = (int32_t)((keys + per_split - 1) / per_split);
    return (int32_t)per_split;
}

/* Quantized K or V (fa_options.k_bits, fa_core.h): the uint8 data, the scales and the biases must
 * agree with each other and with q; *logical becomes the operand as the planner sees it (q's dtype,
 * the logical head dim) with the data's strides, which the kernels read in bytes. */
static int32_t check_quantized(const fa_tensor *data, const fa_tensor *scales, const fa_tensor *biases, int32_t bits,
                               int32_t group_size, const fa_tensor *q, const char *name, fa_tensor *logical,
                               fa_status *st) {
    *logical = *data;
    if (bits == 0) {
        if (fa_tensor_present(scales) || fa_tensor_present(biases) || group_size != 0) {
            return fa_fail(st, FA_ERR_VALUE,
                           "%s_scales, %s_biases, %s_group_size: given for a %s that is not quantized", name, name,
                           name, name);
        }
        return FA_OK;
    }
    if (bits != 8 && bits != 4) {
        return fa_fail(st, FA_ERR_VALUE, "%s_bits: must be 0 (not quantized), 8 or 4, got %d", name, bits);
    }
    if (group_size != 32 && group_size != 64 && group_size != 128) {
        return fa_fail(st, FA_ERR_VALUE, "%s_group_size: must be 32, 64 or 128, got %d", name, group_size);
    }
    if (data->dtype != FA_U8) {
        return fa_fail(st, FA_ERR_TYPE, "%s: quantized data must be uint8, got %s", name, fa_dtype_name(data->dtype));
    }
    if (!fa_tensor_present(scales) || !fa_tensor_present(biases)) {
        return fa_fail(st, FA_ERR_VALUE, "%s_scales and %s_biases: required for a quantized %s", name, name, name);
    }
    const int64_t columns = data->sizes[3] * (8 / bits);
    char ds[96], ss[96], bs[96];
    fa_describe_shape(data, ds, sizeof ds);
    fa_describe_shape(scales, ss, sizeof ss);
    fa_describe_shape(biases, bs, sizeof bs);
    if (scales->dtype != q->dtype || biases->dtype != q->dtype) {
        return fa_fail(st, FA_ERR_TYPE, "%s_scales and %s_biases must have q's dtype %s, got %s and %s", name, name,
                       fa_dtype_name(q->dtype), fa_dtype_name(scales->dtype), fa_dtype_name(biases->dtype));
    }
    if (columns % group_size != 0) {
        return fa_fail(st, FA_ERR_VALUE, "%s: head dim %lld (data %s at %d bits) is not a multiple of group size %d",
                       name, (long long)columns, ds, bits, group_size);
    }
    for (int32_t d = 0; d < 4; ++d) {
        const int64_t want = d < 3 ? data->sizes[d] : columns / group_size;
        if (scales->sizes[d] != want || biases->sizes[d] != want) {
            return fa_fail(st, FA_ERR_VALUE,
                           "%s_scales %s and %s_biases %s must be (..., %lld) for data %s at %d bits in groups of %d",
                           name, ss, name, bs, (long long)(columns / group_size), ds, bits, group_size);
        }
    }
    logical->dtype = q->dtype;
    logical->sizes[3] = columns;
    return FA_OK;
}

/* log2 of a group size of 32, 64 or 128 (0 when not quantized). */
static int32_t group_shift(int32_t group_size) { return group_size == 0 ? 0 : __builtin_ctz((uint32_t)group_size); }

int32_t fa_plan_check_forward_aliases(const fa_forward_args *a, int32_t with_workspace, fa_status *st) {
    return fa_check_slot_aliases(a, FA_FORWARD, with_workspace, st);
}

static int32_t check_shapes(const fa_forward_args *a, fa_status *st) {
    const int64_t *q = a->q.sizes, *k = a->k.sizes, *v = a->v.sizes, *o = a->out.sizes;
    char qs[96], ks[96], vs[96], os[96];
    fa_describe_shape(&a->q, qs, sizeof qs);
    fa_describe_shape(&a->k, ks, sizeof ks);
    fa_describe_shape(&a->v, vs, sizeof vs);
    fa_describe_shape(&a->out, os, sizeof os);
    if (a->q.dtype != FA_F32 && a->q.dtype != FA_F16 && a->q.dtype != FA_BF16) { /* bool, int32, a quantized q */
        return fa_fail(st, FA_ERR_TYPE, "q: %s is not an attention dtype; attention takes float32, float16 or bfloat16",
                       fa_dtype_name(a->q.dtype));
    }
    if (a->k.dtype != a->q.dtype || a->v.dtype != a->q.dtype || a->out.dtype != a->q.dtype) {
        return fa_fail(st, FA_ERR_TYPE, "q, k, v and out must share one dtype, got %s, %s, %s, %s",
                       fa_dtype_name(a->q.dtype), fa_dtype_name(a->k.dtype), fa_dtype_name(a->v.dtype),
                       fa_dtype_name(a->out.dtype));
    }
    if (k[0] != q[0] || v[0] != q[0]) {
        return fa_fail(st, FA_ERR_VALUE, "batch sizes differ: q %s, k %s, v %s", qs, ks, vs);
    }
    if (k[1] != v[1] || k[2] != v[2]) {
        return fa_fail(st, FA_ERR_VALUE, "k %s and v %s must have the same heads and sequence length", ks, vs);
    }
    if (k[3] != q[3]) {
        return fa_fail(st, FA_ERR_VALUE, "q %s and k %s must have the same head dim", qs, ks);
    }
    if (k[1] < 1 || q[1] % k[1] != 0) {
        return fa_fail(st, FA_ERR_VALUE, "q heads (%lld) must be a multiple of k/v heads (%lld): q %s, k %s",
                       (long long)q[1], (long long)k[1], qs, ks);
    }
    if (q[3] > FA_MAX_HEAD_DIM || v[3] > FA_MAX_HEAD_DIM) {
        return fa_fail(st, FA_ERR_VALUE, "head dims must be at most %d: q %s, v %s", FA_MAX_HEAD_DIM, qs, vs);
    }
    if (o[0] != q[0] || o[1] != q[1] || o[2] != q[2] || o[3] != v[3]) {
        return fa_fail(st, FA_ERR_VALUE, "out %s must be (B, Hq, L, Ev) for q %s and v %s", os, qs, vs);
    }
    if (a->lse.storage != NULL && (a->lse.sizes[0] != q[0] || a->lse.sizes[1] != q[1] || a->lse.sizes[2] != q[2])) {
        return fa_fail(st, FA_ERR_VALUE, "lse must be (B, Hq, L) for q %s", qs);
    }
    /* Grid dimensions and kernel arguments are 32-bit. */
    const int64_t limit = INT32_MAX;
    if (q[0] > limit || q[1] > limit || q[2] > limit || k[2] > limit) {
        return fa_fail(st, FA_ERR_VALUE, "sizes beyond 2^31-1 are not supported: q %s, k %s", qs, ks);
    }
    return FA_OK;
}

/* The mask, when present, is a (B, Hq, L, S) view of bool, float32 or q's dtype. */
static int32_t check_mask(const fa_forward_args *a, fa_status *st) {
    if (!fa_tensor_present(&a->mask)) {
        return FA_OK; /* no mask; a 0-D descriptor with storage is refused below */
    }
    int32_t rc = fa_check_tensor(&a->mask, "mask", 4, 0, st);
    if (rc != FA_OK) {
        return rc;
    }
    const int64_t *m = a->mask.sizes;
    if (m[0] != a->q.sizes[0] || m[1] != a->q.sizes[1] || m[2] != a->q.sizes[2] || m[3] != a->k.sizes[2]) {
        char ms[96], qs[96], ks[96];
        fa_describe_shape(&a->mask, ms, sizeof ms);
        fa_describe_shape(&a->q, qs, sizeof qs);
        fa_describe_shape(&a->k, ks, sizeof ks);
        return fa_fail(st, FA_ERR_VALUE, "mask %s must be (B, Hq, L, S) for q %s and k %s (broadcast with stride 0)",
                       ms, qs, ks);
    }
    if (a->mask.dtype != FA_BOOL && a->mask.dtype != FA_F32 && a->mask.dtype != a->q.dtype) { /* int32 too */
        return fa_fail(st, FA_ERR_TYPE, "mask: dtype %s; masks are bool, float32 or q's dtype (%s)",
                       fa_dtype_name(a->mask.dtype), fa_dtype_name(a->q.dtype));
    }
    return FA_OK;
}

/* FA_FC_MASK_KIND for the arguments' mask. */
static int32_t mask_kind(const fa_forward_args *a) {
    if (a->mask.ndim == 0) {
        return FA_MASK_NONE;
    }
    switch (a->mask.dtype) {
    case FA_BOOL: return FA_MASK_BOOL;
    case FA_F16: return FA_MASK_HALF;
    case FA_BF16: return FA_MASK_BFLOAT;
    default: return FA_MASK_FLOAT;
    }
}

/* Appends a dispatch of function `<kernel>_<dtype>` of `source`; the caller sets macros and geometry. */
static fa_plan_dispatch *add_dispatch(fa_plan *plan, const fa_forward_args *a, const char *source, const char *kernel) {
    fa_plan_dispatch *d = &plan->dispatches[plan->n_dispatches++];
    fa_plan_start_dispatch(d, source, kernel, a->q.dtype);
    fa_plan_add_constant_bool(d, FA_FC_BAND, plan->banded);
    fa_plan_add_constant_bool(d, FA_FC_SOFTCAP, plan->params.softcap_log2 != 0.0f);
    fa_plan_add_constant_bool(d, FA_FC_ALIBI, fa_tensor_present(&a->alibi_slopes));
    fa_plan_add_constant_bool(d, FA_FC_SINKS, fa_tensor_present(&a->sinks));
    fa_plan_add_constant_bool(d, FA_FC_WRITE_LSE,
                              a->lse.storage != NULL && !a->options.write_probs); /* the pass writes none */
    fa_plan_add_constant_int(d, FA_FC_MASK_KIND, mask_kind(a));
    fa_plan_add_constant_int(d, FA_FC_DROPOUT,
                             a->options.write_probs       ? FA_DROPOUT_PROBS
                             : a->options.dropout_p > 0.0 ? FA_DROPOUT_APPLY
                                                          : FA_DROPOUT_NONE);
    fa_plan_add_constant_bool(d, FA_FC_SEQUENCES, plan->sequences);
    fa_plan_add_constant_bool(d, FA_FC_PAGED, plan->sequences && fa_sequence_paged(&a->sequences));
    fa_plan_add_constant_int(d, FA_FC_K_BITS, a->options.k_bits);
    fa_plan_add_constant_int(d, FA_FC_V_BITS, a->options.v_bits);
    fa_plan_add_constant_bool(d, FA_FC_MASK_BLOCKS, 0); /* plan_prefill sets it with the pre-pass */
    return d;
}

/* A grid of (ceil(L / rows_per_group), Hq, B) threadgroups. */
static void set_row_blocks(fa_plan_dispatch *d, const fa_forward_args *a, int64_t rows_per_group, uint32_t threads) {
    fa_plan_set_geometry(d, (uint32_t)((a->q.sizes[2] + rows_per_group - 1) / rows_per_group), (uint32_t)a->q.sizes[1],
                         (uint32_t)a->q.sizes[0], threads);
}

/* ---- What a dispatch costs (fa_dispatch_cost, shown by explain_plan) ----
 * Counted from the shapes alone; keys an attn_mask hides count as visible. FLOPs are 2 x the
 * multiply-adds the kernel issues over its padded dims, rows and tiles; the useful FLOPs are SDPA's
 * 2 (E + Ev) per visible (query, key) pair, so flops / useful_flops is the padding waste. The minimum
 * bytes read are every distinct input element once (broadcast dims once, keys outside every row's
 * band not); the bytes written are the outputs (or a split's partial results). */


/* The keys some row of rows [row0, row0 + rows) sees under the band (fa_visible_keys of
 * metal/fa_mask.h), as [*begin, *end); all S without one. */
static void band_keys(const fa_plan *plan, int64_t row0, int64_t rows, int64_t *begin, int64_t *end) {
    const fa_params *p = &plan->params;
    *begin = 0;
    *end = p->kv_len;
    if (plan->banded) {
        const int64_t last = (row0 + rows < p->q_len ? row0 + rows : p->q_len) - 1;
        *begin = row0 + p->band_lo > 0 ? row0 + p->band_lo : 0;
        *end = last + p->band_hi + 1 < p->kv_len ? last + p->band_hi + 1 : p->kv_len;
    }
}

/* Keys some row can see. */
static int64_t visible_keys(const fa_plan *plan) {
    int64_t begin, end;
    band_keys(plan, 0, plan->params.q_len, &begin, &end);
    return end > begin ? end - begin : 0;
}

/* Sum of clamp(x, 0, s) over x = a .. a + n - 1. */
static double clamped_sum(int64_t a, int64_t n, int64_t s) {
    const int64_t first = a > 0 ? a : 0, last = a + n - 1 < s ? a + n - 1 : s;
    double sum = first <= last ? ((double)first + (double)last) * (double)(last - first + 1) / 2 : 0;
    const int64_t above_from = a > s + 1 ? a : s + 1; /* x > s count s each */
    if (a + n > above_from) {
        sum += (double)s * (double)(a + n - above_from);
    }
    return sum;
}

/* Visible (query, key) pairs of one (batch, query head): row i sees the keys
 * [max(0, i + lo), min(S, i + hi + 1)), a range never negative since lo <= hi + 1. */
static double visible_pairs(const fa_plan *plan) {
    const fa_params *p = &plan->params;
    const double l = (double)p->q_len, s = (double)p->kv_len;
    if (!plan->banded) {
        return l * s;
    }
    return clamped_sum(p->band_hi + 1, p->q_len, p->kv_len) - clamped_sum(p->band_lo, p->q_len, p->kv_len);
}

double fa_plan_visible_pairs(const fa_plan *plan) { return visible_pairs(plan); }

/* Elements of a view that are distinct in memory (a dim of stride 0 is one element deep). */
static int64_t distinct_elements(const fa_tensor *t) {
    int64_t n = 1;
    for (int32_t d = 0; d < t->ndim; ++d) {
        n *= t->strides[d] == 0 && t->sizes[d] > 0 ? 1 : t->sizes[d];
    }
    return n;
}

/* Bytes of n elements of a K or V row: of its dtype, or quantized to `bits` with a scale and a bias
 * of q's dtype per group. */
static int64_t kv_bytes(int64_t n, int64_t elem, int32_t bits, int32_t group_size) {
    return bits == 0 ? n * elem : n * bits / 8 + 2 * elem * (n / group_size);
}

/* q, the visible keys' rows of k and v (quantized: data, scales and biases), and the mask, each
 * element once. */
static int64_t min_input_bytes(const fa_plan *plan, const fa_forward_args *a) {
    const int64_t elem = fa_dtype_bytes(a->q.dtype), keys = a->k.sizes[2];
    const fa_options *o = &a->options;
    int64_t bytes = distinct_elements(&a->q) * elem;
    if (keys > 0) {
        bytes += kv_bytes(distinct_elements(&a->k) / keys * visible_keys(plan), elem, o->k_bits, o->k_group_size) +
                 kv_bytes(distinct_elements(&a->v) / keys * visible_keys(plan), elem, o->v_bits, o->v_group_size);
    }
    if (a->mask.ndim != 0) {
        bytes += distinct_elements(&a->mask) * fa_dtype_bytes(a->mask.dtype);
    }
    return bytes;
}

static int64_t output_bytes(const fa_forward_args *a) {
    const int64_t rows = a->q.sizes[0] * a->q.sizes[1] * a->q.sizes[2];
    return rows * a->v.sizes[3] * fa_dtype_bytes(a->q.dtype) + (a->lse.storage != NULL ? rows * 4 : 0);
}

static void set_cost(fa_plan_dispatch *d, int64_t threadgroup_bytes, int32_t registers, double flops, double tiles,
                     double useful_flops, int64_t bytes_read, int64_t bytes_written) {
    const fa_dispatch_cost cost = {threadgroup_bytes, registers, flops, tiles, useful_flops, bytes_read, bytes_written};
    d->cost = cost;
}

/* SDPA's work: 2 (E + Ev) per visible pair of every (batch, query head). */
static double useful_flops(const fa_plan *plan, const fa_forward_args *a) {
    return 2.0 * (double)(a->q.sizes[3] + a->v.sizes[3]) * (double)(a->q.sizes[0] * a->q.sizes[1]) *
           visible_pairs(plan);
}

/* The forward kernel: per (batch, head), every query block of 8 WM rows multiplies S = Q K^T and
 * P V over each key tile it visits (all of them, or under a band those from its first row's first
 * key to its last row's last: band_keys),
 * over E and Ev rounded up to 8 (the 8-wide slices it multiplies); with Ev in several column blocks
 * each block's threadgroups visit the tiles and recompute S. Threadgroup memory: the K and V
 * tiles and the mask's tile votes. Registers: the tile table's count (Q, O and S fragments and one K/V fragment). */
/* Key tiles of bk keys the query blocks of bq rows of one (batch, head) visit. */
static double key_tiles(const fa_plan *plan, int64_t bq, int64_t bk) {
    double tiles = 0;
    for (int64_t q0 = 0; q0 < plan->params.q_len; q0 += bq) {
        int64_t begin, end;
        band_keys(plan, q0, bq, &begin, &end);
        tiles += end > begin ? (double)((end - begin + bk - 1) / bk) : 0;
    }
    return tiles;
}

double fa_plan_key_tiles(const fa_plan *plan, fa_tiles t) { return key_tiles(plan, 8 * t.wm, t.bk); }

int64_t fa_plan_tile_bytes(fa_tiles t, int64_t element_bytes) {
    return (int64_t)t.bk * (t.bd + FORWARD_TILE_PAD + t.bdv + FORWARD_TILE_PAD) * element_bytes;
}

static void set_forward_cost(fa_plan *plan, fa_plan_dispatch *d, const fa_forward_args *a, fa_tiles t) {
    const int64_t bq = 8 * t.wm, elem = fa_dtype_bytes(a->q.dtype);
    const int64_t column_blocks = fa_plan_head_blocks(a->v.sizes[3], t.bdv);
    const double tiles = fa_plan_key_tiles(plan, t);
    /* The products skip 8-wide slices of the padded widths that hold only padding (fa_fragments.h). */
    const int64_t issued_width = column_blocks * ((a->q.sizes[3] + 7) / 8 * 8) + (a->v.sizes[3] + 7) / 8 * 8;
    const double flops = 2.0 * (double)(a->q.sizes[0] * a->q.sizes[1]) * tiles * (double)(bq * t.bk * issued_width);
    /* The tile table's register count: per lane 2 registers per float 8x8 fragment, 1 per half or
     * bfloat one (Q and the K/V fragment in flight: operand fragments); O and S are float. */
    const int32_t operand = fa_plan_operand_registers(a->q.dtype, fa_gpu_profile_of(plan->gpu_family));
    const int32_t registers = t.bd / 8 * operand + t.bdv / 8 * 2 + t.bk / 8 * 2 + operand;
    set_cost(d, fa_plan_tile_bytes(t, elem) + 2 * t.wm /* the SIMD-groups' tile votes (fa_mask.h) */, registers, flops,
             tiles * (double)(column_blocks * a->q.sizes[0] * a->q.sizes[1]), useful_flops(plan, a),
             min_input_bytes(plan, a), output_bytes(a));
}

/* The simple kernel: per visible pair, q.k over the 32-column slices E reaches and the accumulator
 * update over those Ev reaches; it keeps a query row and an accumulator of FA_SIMPLE_MAX_PER_LANE
 * slices per lane. */
static void set_simple_cost(fa_plan *plan, fa_plan_dispatch *d, const fa_forward_args *a) {
    const int64_t slices = (a->q.sizes[3] + 31) / 32, v_slices = (a->v.sizes[3] + 31) / 32;
    const double per_pair = 2.0 * 32 * (double)(slices + v_slices);
    const double pairs = (double)(a->q.sizes[0] * a->q.sizes[1]) * visible_pairs(plan);
    set_cost(d, 0, 2 * FA_SIMPLE_MAX_PER_LANE, per_pair * pairs, pairs, useful_flops(plan, a), min_input_bytes(plan, a),
             output_bytes(a));
}

/* The decode kernel's threadgroup memory: the SIMD-groups' (max, sum) per row and one output row
 * each (fa_decode.h's sg_max, sg_sum, sg_out). */
static int64_t decode_threadgroup_bytes(int32_t cols, int32_t rows) {
    return (int64_t)(2 * FA_DECODE_SIMD_GROUPS * rows + FA_DECODE_SIMD_GROUPS * 32 * cols) * 4;
}

/* The decode kernel's issue in SIMD-group instructions, for explain_plan's fraction_of_bandwidth
 * (an estimate: no Mac has counted them). Per row and key scored: 2 COLS multiply-adds (score and
 * value), the weight's broadcast and test, and its share of the batch's butterfly (4 per scatter
 * element: 2 selects, a shuffle, an add; 2 per reduce step) and of the batch's softmax (a shuffle
 * and a max or add per step of the maximum's and the sum's butterflies, two exp2 at 4 each, about
 * 6 for bounds, masks and selects, COLS multiplies of the rescale). Per key and threadgroup: its K
 * and V chunk loads and 4 address operations. At 8 rows of E = 128 that is 21 per row and key
 * (batches of 4); the kernel scoring one key at a time took about 40 (a 5-step simd_sum, two exp2
 * and a COLS rescale per key and row): 1.2 to 1.6 times the time to read fp16 K and V, ALU-bound,
 * where batches leave it memory-bound on every family's table figures. */
static double decode_issue_slots(int32_t cols, int32_t keys, double row_keys, double keys_read) {
    int32_t steps = 0; /* log2(keys) */
    for (int32_t k = keys; k > 1; k /= 2) {
        ++steps;
    }
    const int32_t chunk = cols < 4 ? cols : 4;
    const double butterfly = 4.0 * (keys - 1) + 2.0 * (5 - steps);
    const double softmax = 4.0 * steps + 2 * 4 + 6 + cols;
    return row_keys * (2.0 * cols + 2 + (butterfly + softmax) / keys) + keys_read * (2.0 * cols / chunk + 4);
}

/* The decode kernel: every row takes the scores of each batch of its kv range (a trailing partial
 * batch whole) at the padded width 32 COLS, and accumulates the values of its visible keys. The
 * merge: one multiply-add per padded column and split for each row (no SDPA work of its own). */
static void set_decode_costs(fa_plan *plan, const fa_forward_args *a, int32_t cols, int32_t rows, int32_t keys) {
    const fa_params *p = &plan->params;
    const int64_t kv_end = p->split_begin + visible_keys(plan), width = 32 * cols;
    double scored = 0; /* keys each row scores, over all splits (at most: a threadgroup's rows may see fewer) */
    for (int64_t begin = p->split_begin; begin < kv_end; begin += p->split_keys) {
        const int64_t n = kv_end - begin < p->split_keys ? kv_end - begin : p->split_keys;
        scored += (double)(keys * ((n + keys - 1) / keys));
    }
    const double heads = (double)((int64_t)p->batch * p->q_heads), all_rows = heads * p->q_len;
    const double flops = 2.0 * (double)width * (all_rows * scored + heads * visible_pairs(plan));
    const int64_t split_bytes = plan->workspace_bytes;
    set_cost(&plan->dispatches[0], decode_threadgroup_bytes(cols, rows), decode_lane_floats(cols, rows, keys), flops,
             all_rows * scored, useful_flops(plan, a), min_input_bytes(plan, a),
             p->split_count > 1 ? split_bytes : output_bytes(a));
    const double keys_read = (double)plan->dispatches[0].grid[1] * p->batch * scored;
    plan->dispatches[0].issue_slots = decode_issue_slots(cols, keys, all_rows * scored, keys_read);
    if (plan->n_dispatches > 1) {
        set_cost(&plan->dispatches[1], 0, cols, 2.0 * (double)width * p->split_count * all_rows, 0, 0, split_bytes,
                 output_bytes(a));
    }
}

/* Dropout's fields of the params (metal/fa_params.h) and its generator state, and the probability
 * pass (fa_core.h): that pass runs the simple kernel, computes each row's softmax itself, and writes
 * the (B, Hq, L, S) float32 probabilities into the workspace (with sequences the grid's B, L and S:
 * a is its view). */
static int32_t set_dropout(const fa_forward_args *a, fa_plan *plan, fa_status *st) {
    fa_params *p = &plan->params;
    const double rate = a->options.dropout_p;
    if (!(rate >= 0.0 && rate <= 1.0)) { /* NaN fails too */
        return fa_fail(st, FA_ERR_VALUE, "dropout_p: must be in [0, 1], got %g", rate);
    }
    const double words = 4294967296.0; /* 2^32 */
    const double drop_below = rate * words + 0.5;
    p->dropout_drop_below = drop_below >= words ? UINT32_MAX : (fa_u32)drop_below;
    p->dropout_scale = rate >= 1.0 ? 0.0f : (float)(1.0 / (1.0 - rate));
    if (rate > 0.0 || a->options.write_probs) {
        int32_t rc = fa_check_tensor(&a->rng_state, "rng_state", 1, 1, st);
        if (rc != FA_OK) {
            return rc;
        }
        if (a->rng_state.sizes[0] != FA_DROPOUT_RNG_WORDS) {
            return fa_fail(st, FA_ERR_VALUE, "rng_state: must hold %d words, got %lld", FA_DROPOUT_RNG_WORDS,
                           (long long)a->rng_state.sizes[0]);
        }
    }
    if (!a->options.write_probs) {
        return FA_OK;
    }
    if (a->options.kernel != FA_KERNEL_AUTO && a->options.kernel != FA_KERNEL_SIMPLE) {
        return fa_fail(st, FA_ERR_VALUE, "write_probs: the probability pass runs the simple kernel, got kernel %d",
                       a->options.kernel);
    }
    int64_t bytes;
    if (__builtin_mul_overflow((int64_t)p->batch * p->q_heads, (int64_t)p->q_len * p->kv_len, &bytes) ||
        __builtin_mul_overflow(bytes, (int64_t)sizeof(float), &bytes)) {
        return fa_fail(st, FA_ERR_VALUE, "write_probs: B * Hq * L * S probabilities overflow 64-bit sizes");
    }
    plan->workspace_bytes = bytes;
    return FA_OK;
}

/* The band of row i is [i + band_lo, i + band_hi] (fa_params.h; fa_core.h says what the args
 * mean). Unbounded sides become -L and S, so every bound stays within [-L, S]. */
static int32_t set_band(const fa_forward_args *a, fa_plan *plan, fa_status *st) {
    fa_params *p = &plan->params;
    const fa_options *o = &a->options;
    if (o->window_left < -1 || o->window_right < -1) {
        return fa_fail(st, FA_ERR_VALUE, "window_size: each side must be -1 (unbounded) or >= 0, got (%lld, %lld)",
                       (long long)o->window_left, (long long)o->window_right);
    }
    const int64_t l = p->q_len, s = p->kv_len, offset = o->diagonal_offset;
    if (offset != 0 &&
        (offset <= -INT32_MAX || offset >= INT32_MAX || l + s + (offset < 0 ? -offset : offset) > INT32_MAX)) {
        return fa_fail(st, FA_ERR_VALUE,
                       "diagonal_offset: |offset| + L + S must be below 2^31, got offset %lld, L = %lld, S = %lld",
                       (long long)offset, (long long)l, (long long)s);
    }
    const int64_t diagonal = (o->bottom_right ? s - l : 0) + offset;
    p->diagonal = (fa_i32)diagonal;
    const int64_t left = o->window_left, right = o->causal ? 0 : o->window_right;
    plan->banded = a->options.causal || left >= 0 || right >= 0;
    if (!plan->banded) {
        return FA_OK;
    }
    if (l + s > INT32_MAX) {
        return fa_fail(st, FA_ERR_VALUE, "causal or window_size: L + S must be below 2^31, got L = %lld, S = %lld",
                       (long long)l, (long long)s);
    }
    const fa_band_bounds bounds = fa_band_around(l, s, diagonal, left, right);
    p->band_lo = bounds.lo;
    p->band_hi = bounds.hi;
    return FA_OK;
}

/* The additive mask's block classes (metal/fa_mask_blocks.h): a pre-pass of one thread per distinct
 * 8 x 8 block of the mask and per 8 rows of q and of k (their maxima), run before the forward,
 * which then skips blocks of -inf whose scores are finite and adds nothing for blocks of zeros.
 * Only for an additive mask over plain K (quantized K's bytes have no maxima here) and a workspace
 * whose items fit the grid; without it the forward adds the mask everywhere, as before. */
static void plan_mask_blocks(const fa_forward_args *a, fa_plan *plan) {
    fa_params *p = &plan->params;
    const int32_t kind = mask_kind(a);
    if (kind == FA_MASK_NONE || kind == FA_MASK_BOOL || a->options.k_bits != 0 || plan->sequences || plan->empty ||
        p->kv_len == 0) {
        return;
    }
    const int64_t q_blocks = ((int64_t)p->q_len + 7) / 8, k_blocks = ((int64_t)p->kv_len + 7) / 8;
    const int64_t blocks[4] = {p->batch, p->q_heads, q_blocks, k_blocks};
    int64_t classes = 1;
    for (int32_t i = 3; i >= 0; --i) {
        p->mask_block_counts[i] = (fa_i32)(a->mask.strides[i] == 0 ? 1 : blocks[i]);
        p->mask_block_strides[i] = a->mask.strides[i] == 0 ? 0 : classes;
        classes *= p->mask_block_counts[i];
    }
    const int64_t q_items = (int64_t)p->batch * p->q_heads * q_blocks,
                  k_items = (int64_t)p->batch * p->kv_heads * k_blocks;
    const int64_t items = classes + q_items + k_items, threads = FA_MASK_BLOCK_THREADS;
    if ((items + threads - 1) / threads > UINT32_MAX) {
        return;
    }
    p->q_block_max_offset = (classes + 3) / 4; /* floats: the classes' bytes, rounded up */
    p->k_block_max_offset = p->q_block_max_offset + q_items;
    plan->workspace_bytes = (p->k_block_max_offset + k_items) * (int64_t)sizeof(float);
    fa_plan_dispatch *d = add_dispatch(plan, a, forward_source, "fa_forward_mask_blocks");
    fa_plan_add_constant_bool(d, FA_FC_MASK_BLOCKS, 1);
    fa_plan_set_geometry(d, (uint32_t)((items + threads - 1) / threads), 1, 1, (uint32_t)threads);
    const int64_t elem = fa_dtype_bytes(a->q.dtype);
    set_cost(d, 0, 4, 0, 0, 0,
             classes * 64 * fa_dtype_bytes(a->mask.dtype) +
                 (distinct_elements(&a->q) + distinct_elements(&a->k)) * elem,
             plan->workspace_bytes);
}

static int32_t plan_prefill(const fa_forward_args *a, fa_plan *plan, fa_status *st) {
    const fa_tiles t = choose_forward_tiles(a->q.sizes[3], a->v.sizes[3], (int32_t)fa_dtype_bytes(a->q.dtype),
                                            fa_gpu_profile_of(plan->gpu_family));
    int32_t rc = fa_plan_check_column_grid(a->q.sizes[1], fa_plan_head_blocks(a->v.sizes[3], t.bdv), st);
    if (rc != FA_OK) {
        return rc;
    }
    plan_mask_blocks(a, plan);
    const int32_t mask_blocks = plan->n_dispatches > 0;
    if (mask_blocks) { /* the pre-pass is compiled into the forward's library: the same macros */
        fa_plan_set_tile_macros(&plan->dispatches[0], t);
    }
    fa_plan_dispatch *d = add_dispatch(plan, a, forward_source, "fa_forward");
    fa_plan_add_constant_bool(d, FA_FC_MASK_BLOCKS, mask_blocks);
    fa_plan_set_tile_macros(d, t);
    fa_plan_set_exact_head_dims(d, t, a->q.sizes[3], a->v.sizes[3]);
    fa_plan_set_operand_fragments(d, a->q.dtype, fa_gpu_profile_of(plan->gpu_family));
    /* a quantized operand has its own loads (fa_quant.h): only the other decides */
    const fa_tensor *k_tiles = a->options.k_bits != 0 ? &a->v : &a->k,
                    *v_tiles = a->options.v_bits != 0 ? &a->k : &a->v;
    if (a->options.k_bits != 0 && a->options.v_bits != 0) {
        fa_plan_add_constant_bool(d, FA_FC_CONTIGUOUS_TILES, 0);
    } else {
        fa_plan_set_contiguous_tiles(d, k_tiles, v_tiles, a->device);
    }
    /* Ev in several column blocks: one threadgroup per block of each head (fa_head_blocks.h). */
    const uint32_t heads = (uint32_t)a->q.sizes[1] * (uint32_t)fa_plan_head_blocks(a->v.sizes[3], t.bdv);
    fa_plan_set_block_grid(d, a->q.sizes[2], 8 * t.wm, heads, (uint32_t)a->q.sizes[0], plan->banded,
                           32u * (uint32_t)t.wm);
    set_forward_cost(plan, d, a, t);
    return FA_OK;
}

/* ---- The tensor path (metal/fa_forward_tensor.h) ----
 * The prefill on Metal 4 tensor operations: MPP's matmul2d at SIMD-group scope, 16 query rows per
 * SIMD-group, TENSOR_WM = 4 of them (BQ = 64 rows per threadgroup, as torch 2.14's MPP prefill and
 * MLX's NAX kernels take), TENSOR_BK = 32 keys per tile, both head dims padded to one width BD of
 * 64, 96 or 128 (E and Ev up to 128; 64 and 128 are the common models' and the peers' widths, 96
 * lets 72 and 80 reach the path as MLX pads them). Threadgroup memory: one region holding Q's
 * staging tile (64 rows), then the K and V tiles (2 x 32 rows), then O's staging tile, each row
 * BD + 8 wide: 17.0 KiB at BD 128 in 2-byte elements, with 1 KiB of row statistics.
 * Registers per lane (32-bit): Q as the cooperative left input 16 BD / 32 2-byte elements, O 16 BD /
 * 32 floats, S 16 BK / 32 floats and P as many 2-byte ones: 16 + 32 + 16 + 8 = 72 at BD 64, 120 at BD 128.
 *
 * What it takes: fp16 and bf16 (fp32 stays on the simdgroup kernel: the neural accelerators' fast
 * path is for 2-byte operands, and fp32 tiles at BQ 64 would not fit the threadgroup memory), E and
 * Ev <= 128, causal and windows, bool and additive masks, softcap, ALiBi, sinks, GQA, lse, packed
 * sequences, paged and quantized K/V (the tiles load through the same loaders as the simdgroup
 * kernel's); not dropout (nor the probability pass, which is the simple kernel's).
 *
 * Where AUTO takes it: prefill calls (L > DECODE_MAX_QUERY_LEN) it takes, planned for Apple10 (the
 * device's family, or gpu_family / FLASHATTN_MPS_GPU_FAMILY) on a device whose tensor operations are
 * Apple10's (fa_device_tensor_family: an M5 on macOS 26.2+, or the CPU Metal device emulating
 * Apple10). Not on Apple9: MPP runs on the same simdgroup units as the simdgroup kernel there, and
 * nothing measured says it wins (torch ships a9 kernels; an M3/M4 timing of kernel="tensor" against
 * "forward" would argue it, docs/mac-checklist.md). kernel="tensor" forces it wherever the device
 * has tensor operations, and names what the call has that it does not take. */
enum { TENSOR_ROWS = 16, TENSOR_WM = 4, TENSOR_BK = 32, TENSOR_MAX_HEAD_DIM = 128 };

const char *fa_plan_tensor_refusal(const fa_forward_args *a, int32_t tensor_family) {
    if (tensor_family == 0) {
        return "this device (Metal 4 tensor operations need macOS 26.2 or later on an Apple9 or Apple10 GPU)";
    }
    if (a->q.dtype != FA_F16 && a->q.dtype != FA_BF16) {
        return "q's dtype float32 (it takes float16 and bfloat16)";
    }
    if (a->q.sizes[3] > TENSOR_MAX_HEAD_DIM || a->v.sizes[3] > TENSOR_MAX_HEAD_DIM) {
        return "head dims E or Ev above 128";
    }
    if (a->options.dropout_p > 0.0) {
        return "dropout_p > 0";
    }
    return NULL;
}

int32_t fa_plan_tensor_by_default(int32_t gpu_family, int32_t tensor_family, const char *refused) {
    return refused == NULL && gpu_family == FA_FAMILY_APPLE10 && tensor_family == FA_FAMILY_APPLE10;
}

int32_t fa_plan_tensor_width(int64_t e, int64_t ev) {
    const int64_t widest = e > ev ? e : ev;
    return widest <= 64 ? 64 : widest <= 96 ? 96 : 128;
}

static int32_t tensor_width(const fa_forward_args *a) { return fa_plan_tensor_width(a->q.sizes[3], a->v.sizes[3]); }

/* Both products at the padded width over every visited tile; registers and threadgroup bytes as
 * counted above. */
static void set_tensor_cost(fa_plan *plan, fa_plan_dispatch *d, const fa_forward_args *a, int32_t bd) {
    const int64_t bq = TENSOR_ROWS * TENSOR_WM, elem = fa_dtype_bytes(a->q.dtype);
    const double tiles = key_tiles(plan, bq, TENSOR_BK);
    const double flops = 2.0 * (double)(a->q.sizes[0] * a->q.sizes[1]) * tiles * (double)(bq * TENSOR_BK * 2 * bd);
    /* 16-row matrices over 32 lanes: Q's 2-byte elements two to a register, O and S float, P 2-byte */
    const int32_t registers = bd / 4 + bd / 2 + TENSOR_ROWS * TENSOR_BK / 32 + TENSOR_ROWS * TENSOR_BK / 64;
    const int64_t rows = bq > 2 * TENSOR_BK ? bq : 2 * TENSOR_BK;
    set_cost(d, rows * (bd + FORWARD_TILE_PAD) * elem + 4 * bq * (int64_t)sizeof(float), registers, flops,
             tiles * (double)(a->q.sizes[0] * a->q.sizes[1]), useful_flops(plan, a), min_input_bytes(plan, a),
             output_bytes(a));
}

static void set_tensor_macros(fa_plan_dispatch *d, int32_t bd) {
    fa_plan_add_macro_text(d, FA_LANGUAGE_MACRO, FA_LANGUAGE_METAL4);
    fa_plan_add_macro(d, "FA_BD", bd);
    fa_plan_add_macro(d, "FA_BK", TENSOR_BK);
    fa_plan_add_macro(d, "FA_WM", TENSOR_WM);
}

static int32_t plan_tensor(const fa_forward_args *a, fa_plan *plan) {
    const int32_t bd = tensor_width(a);
    fa_plan_dispatch *d = add_dispatch(plan, a, tensor_source, "fa_forward_tensor");
    set_tensor_macros(d, bd);
    const fa_tensor *k_tiles = a->options.k_bits != 0 ? &a->v : &a->k,
                    *v_tiles = a->options.v_bits != 0 ? &a->k : &a->v;
    if (a->options.k_bits != 0 && a->options.v_bits != 0) {
        fa_plan_add_constant_bool(d, FA_FC_CONTIGUOUS_TILES, 0);
    } else {
        fa_plan_set_contiguous_tiles(d, k_tiles, v_tiles, a->device);
    }
    fa_plan_set_block_grid(d, a->q.sizes[2], TENSOR_ROWS * TENSOR_WM, (uint32_t)a->q.sizes[1], (uint32_t)a->q.sizes[0],
                           plan->banded, 32u * TENSOR_WM);
    set_tensor_cost(plan, d, a, bd);
    return FA_OK;
}

static int32_t plan_simple(const fa_forward_args *a, fa_plan *plan) {
    fa_plan_dispatch *d = add_dispatch(plan, a, simple_source, "fa_simple");
    set_row_blocks(d, a, FA_SIMPLE_ROWS_PER_GROUP, 32u * FA_SIMPLE_ROWS_PER_GROUP);
    set_simple_cost(plan, d, a);
    return FA_OK;
}

static void set_decode_macros(fa_plan_dispatch *d, int32_t cols, int32_t rows) {
    fa_plan_add_macro(d, "FA_DECODE_COLS", cols);
    fa_plan_add_macro(d, "FA_DECODE_ROWS", rows);
}

/* Threadgroups of the decode kernel one core holds at once on the plan's family (at least 1), from
 * its registers and threadgroup memory as explain_plan estimates them. */
static int64_t decode_resident_threadgroups(const fa_plan *plan, int32_t cols, int32_t rows) {
    const fa_gpu_estimate e = fa_gpu_estimate_dispatch(
        fa_gpu_profile_of(plan->gpu_family), decode_lane_floats(cols, rows, decode_keys(cols, rows)),
        decode_threadgroup_bytes(cols, rows), 32u * FA_DECODE_SIMD_GROUPS, 0.0, 0.0);
    return e.resident_threadgroups > 1 ? e.resident_threadgroups : 1;
}

static int32_t plan_decode(const fa_forward_args *a, fa_plan *plan, fa_status *st) {
    fa_params *p = &plan->params;
    if (plan->empty) {
        return FA_OK; /* no rows: nothing to size */
    }
    const int64_t head_rows = (int64_t)p->gqa_factor * p->q_len; /* rows sharing one kv head */
    const int32_t cols = decode_columns(p->head_dim, p->v_head_dim);
    const int32_t rows = decode_rows(cols, head_rows);
    const int64_t chunks = (head_rows + rows - 1) / rows;
    if (head_rows > INT32_MAX || chunks * p->kv_heads > UINT32_MAX) {
        return fa_fail(st, FA_ERR_VALUE,
                       "too many query rows for the decode kernel: %lld per kv head (at most 2^31-1) on %d kv heads",
                       (long long)head_rows, p->kv_heads);
    }
    int64_t first_key = 0, end_key = p->kv_len; /* the keys some row sees: the splits share them */
    if (!plan->sequences) { /* each sequence starts its splits at its own first key (fa_sequence.h) */
        band_keys(plan, 0, p->q_len, &first_key, &end_key);
    }
    p->split_begin = (fa_i32)first_key;
    const int32_t keys = decode_keys(cols, rows);
    p->split_keys = decode_split_keys(
        (int64_t)p->batch * p->kv_heads * chunks, DECODE_CORES * decode_resident_threadgroups(plan, cols, rows),
        end_key > first_key ? end_key - first_key : 0,
        (int64_t)(a->options.num_splits > 0 ? DECODE_MIN_KEYS : keys) * FA_DECODE_SIMD_GROUPS, a->options.num_splits,
        &p->split_count);

    fa_plan_dispatch *d = add_dispatch(plan, a, decode_source, "fa_decode");
    set_decode_macros(d, cols, rows);
    const int32_t chunk = cols < 4 ? cols : 4;
    fa_plan_add_constant_bool(d, FA_FC_DECODE_VECTOR_LOADS,
                              decode_operand_vector_loadable(&a->k, a->options.k_bits, chunk) &&
                                  decode_operand_vector_loadable(&a->v, a->options.v_bits, chunk));
    fa_plan_set_geometry(d, (uint32_t)p->split_count, (uint32_t)(chunks * p->kv_heads), (uint32_t)p->batch,
                         32u * FA_DECODE_SIMD_GROUPS);
    if (p->split_count > 1) {
        const int64_t partial_rows = (int64_t)p->split_count * p->batch * p->q_heads * p->q_len;
        p->split_stats_offset = partial_rows * p->v_head_dim;
        plan->workspace_bytes = partial_rows * (p->v_head_dim + 2) * (int64_t)sizeof(float);
        fa_plan_dispatch *merge = add_dispatch(plan, a, decode_source, "fa_decode_merge");
        set_decode_macros(merge, cols, rows);
        set_row_blocks(merge, a, 1, 32u);
    }
    set_decode_costs(plan, a, cols, rows, keys);
    return FA_OK;
}

int32_t fa_plan_forward(const fa_forward_args *a, fa_plan *plan, fa_status *st) {
    if (a == NULL || plan == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_plan_forward: NULL argument");
    }
    memset(plan, 0, sizeof *plan);
    if (a->device != FA_DEVICE_CPU && a->device != FA_DEVICE_MPS) {
        return fa_fail(st, FA_ERR_TYPE, "unknown device code %d", a->device);
    }
    if (a->options.kernel < FA_KERNEL_AUTO || a->options.kernel > FA_KERNEL_TENSOR) {
        return fa_fail(st, FA_ERR_VALUE, "unknown kernel choice %d", a->options.kernel);
    }
    int32_t rc;
    if ((rc = fa_check_tensor(&a->q, "q", 4, 0, st)) || (rc = fa_check_tensor(&a->k, "k", 4, 0, st)) ||
        (rc = fa_check_tensor(&a->v, "v", 4, 0, st)) || (rc = fa_check_tensor(&a->out, "out", 4, 0, st)) ||
        (a->lse.storage != NULL && (rc = fa_check_tensor(&a->lse, "lse", 3, 1, st)))) {
        return rc;
    }
    /* Quantized K/V: the rest plans them as q's dtype at their logical head dim (strides in bytes). */
    fa_forward_args logical = *a;
    if ((rc = check_quantized(&a->k, &a->k_scales, &a->k_biases, a->options.k_bits, a->options.k_group_size, &a->q, "k",
                              &logical.k, st)) ||
        (rc = check_quantized(&a->v, &a->v_scales, &a->v_biases, a->options.v_bits, a->options.v_group_size, &a->q, "v",
                              &logical.v, st))) {
        return rc;
    }
    const int32_t quantized = a->options.k_bits != 0 || a->options.v_bits != 0;
    if (quantized && (a->options.kernel == FA_KERNEL_SIMPLE || a->options.write_probs)) {
        return fa_fail(st, FA_ERR_VALUE,
                       "k_bits, v_bits: quantized K/V are read by the prefill and decode kernels only (not the "
                       "simple kernel or the probability pass)");
    }
    a = &logical;
    /* With a sequence table the rest plans the grid's view: B sequences of max_seqlen rows. */
    const fa_forward_args *real = a;
    fa_forward_args grid;
    plan->sequences = fa_sequences_present(&a->sequences);
    if (plan->sequences) {
        if ((rc = fa_sequence_grid_args(a, &grid, st)) != FA_OK) {
            return rc;
        }
        a = &grid;
    }
    if ((rc = check_shapes(a, st)) || (rc = check_mask(a, st))) {
        return rc;
    }
    if ((rc = fa_resolve_gpu_family(a->device, a->options.gpu_family, &plan->gpu_family, st)) != FA_OK) {
        return rc;
    }

    fa_params *p = &plan->params;
    p->batch = (fa_i32)a->q.sizes[0];
    p->q_heads = (fa_i32)a->q.sizes[1];
    p->kv_heads = (fa_i32)a->k.sizes[1];
    p->gqa_factor = p->q_heads / p->kv_heads;
    p->q_len = (fa_i32)a->q.sizes[2];
    p->kv_len = (fa_i32)a->k.sizes[2];
    p->head_dim = (fa_i32)a->q.sizes[3];
    p->v_head_dim = (fa_i32)a->v.sizes[3];
    fa_plan_copy_strides(p->q_strides, &a->q, 4);
    fa_plan_copy_strides(p->k_strides, &a->k, 4);
    fa_plan_copy_strides(p->v_strides, &a->v, 4);
    fa_plan_copy_strides(p->o_strides, &a->out, 4);
    if (a->lse.storage != NULL) {
        fa_plan_copy_strides(p->lse_strides, &a->lse, 3);
    }
    if (a->mask.ndim != 0) {
        fa_plan_copy_strides(p->mask_strides, &a->mask, 4);
    }
    if (a->options.k_bits != 0) {
        fa_plan_copy_strides(p->k_scale_strides, &a->k_scales, 4);
        fa_plan_copy_strides(p->k_bias_strides, &a->k_biases, 4);
        p->k_group_shift = group_shift(a->options.k_group_size);
    }
    if (a->options.v_bits != 0) {
        fa_plan_copy_strides(p->v_scale_strides, &a->v_scales, 4);
        fa_plan_copy_strides(p->v_bias_strides, &a->v_biases, 4);
        p->v_group_shift = group_shift(a->options.v_group_size);
    }
    p->scale_log2 = (float)(a->options.scale * 1.4426950408889634);
    if ((rc = set_band(a, plan, st)) != FA_OK) {
        return rc;
    }
    if (!(a->options.softcap >= 0.0 && a->options.softcap <= 1e30)) { /* NaN fails too */
        return fa_fail(st, FA_ERR_VALUE, "softcap: must be 0 (none) or a positive finite number, got %g",
                       a->options.softcap);
    }
    p->softcap_log2 = (float)(a->options.softcap * 1.4426950408889634);
    if (fa_tensor_present(&a->alibi_slopes)) {
        if ((rc = fa_check_tensor(&a->alibi_slopes, "alibi_slopes", 2, 1, st)) != FA_OK) {
            return rc;
        }
        if (a->alibi_slopes.sizes[0] != p->batch || a->alibi_slopes.sizes[1] != p->q_heads) {
            char shape[64];
            fa_describe_shape(&a->alibi_slopes, shape, sizeof shape);
            return fa_fail(st, FA_ERR_VALUE, "alibi_slopes: must be (B, Hq) = (%d, %d), got %s", p->batch, p->q_heads,
                           shape);
        }
        fa_plan_copy_strides(p->alibi_strides, &a->alibi_slopes, 2);
    }
    if (fa_tensor_present(&a->sinks)) {
        if ((rc = fa_check_tensor(&a->sinks, "sinks", 1, 1, st)) != FA_OK) {
            return rc;
        }
        if (a->sinks.sizes[0] != p->q_heads) {
            return fa_fail(st, FA_ERR_VALUE, "sinks: must be (Hq,) = (%d,), got (%lld,)", p->q_heads,
                           (long long)a->sinks.sizes[0]);
        }
        p->sink_stride = a->sinks.strides[0];
    }

    if ((rc = set_dropout(a, plan, st)) != FA_OK) {
        return rc;
    }

    if (plan->sequences) {
        fa_sequence_set_params(real, p);
    }

    plan->empty = p->batch == 0 || p->q_heads == 0 || p->q_len == 0;
    if (!plan->empty && (rc = fa_check_no_empty_slot(real, FA_FORWARD, st)) != FA_OK) {
        return rc;
    }
    const int32_t tensor_family = fa_device_tensor_family(a->device);
    const char *tensor_refused = fa_plan_tensor_refusal(a, tensor_family);
    if (a->options.kernel == FA_KERNEL_TENSOR && tensor_refused != NULL) {
        return fa_fail(st, FA_ERR_VALUE, "kernel='tensor': the tensor-path kernel does not take %s", tensor_refused);
    }
    const int32_t tensor_by_default = fa_plan_tensor_by_default(plan->gpu_family, tensor_family, tensor_refused);
    const int32_t kernel = a->options.write_probs                ? FA_KERNEL_SIMPLE
                           : a->options.kernel != FA_KERNEL_AUTO ? a->options.kernel
                           : p->q_len <= DECODE_MAX_QUERY_LEN    ? FA_KERNEL_DECODE
                           : tensor_by_default                   ? FA_KERNEL_TENSOR
                                                                 : FA_KERNEL_FORWARD;
    switch (kernel) {
    case FA_KERNEL_SIMPLE: rc = plan_simple(a, plan); break;
    case FA_KERNEL_DECODE: rc = plan_decode(a, plan, st); break;
    case FA_KERNEL_TENSOR: rc = plan_tensor(a, plan); break;
    default: rc = plan_prefill(a, plan, st);
    }
    if (rc == FA_OK && plan->sequences && plan->n_dispatches > 0) {
        fa_sequence_set_builder(&plan->sequence_builder, &plan->dispatches[0], plan->dispatches[0].source_name,
                                a->q.dtype, (uint32_t)p->batch);
    }
    return rc;
}

/* Macros decide what a library contains (one element type each, FA_DTYPE), so the strict check
 * visits one key per (source, macro set), built as the planner builds its dispatches and naming
 * the library's first kernel. */
static int32_t visit_dispatch(const fa_plan_dispatch *d, fa_plan_visitor visit, void *ctx) {
    fa_pipeline_key key = {d->source_name, d->function, d->macros, d->n_macros, NULL, 0};
    return visit(&key, ctx);
}

static int32_t each_specialisation_of(int32_t dtype, fa_plan_visitor visit, void *ctx) {
    fa_plan_dispatch d;
    memset(&d, 0, sizeof d);
    fa_plan_start_dispatch(&d, simple_source, "fa_simple", dtype);
    int32_t rc = visit_dispatch(&d, visit, ctx);
    /* Apple8 and Apple10 share Apple7's and Apple9's tiles (fa_gpu_family.c): two tile sets, each
     * configuration visited once. */
    const fa_gpu_profile *apple7 = fa_gpu_profile_of(FA_FAMILY_APPLE7), *apple9 = fa_gpu_profile_of(FA_FAMILY_APPLE9);
    const int32_t elem = (int32_t)fa_dtype_bytes(dtype);
    for (int32_t n = 0; rc == 0 && n < 2 * N_PADDED_HEAD_DIMS * N_PADDED_HEAD_DIMS; ++n) {
        const int32_t i = n / N_PADDED_HEAD_DIMS % N_PADDED_HEAD_DIMS, j = n % N_PADDED_HEAD_DIMS;
        const fa_tiles first = choose_forward_tiles(padded_head_dims[i], padded_head_dims[j], elem, apple7);
        const fa_tiles t = n < N_PADDED_HEAD_DIMS * N_PADDED_HEAD_DIMS
                               ? first
                               : choose_forward_tiles(padded_head_dims[i], padded_head_dims[j], elem, apple9);
        if (n >= N_PADDED_HEAD_DIMS * N_PADDED_HEAD_DIMS && memcmp(&t, &first, sizeof t) == 0 &&
            fa_plan_operand_registers(dtype, apple9) == fa_plan_operand_registers(dtype, apple7)) {
            continue;
        }
        memset(&d, 0, sizeof d);
        fa_plan_start_dispatch(&d, forward_source, "fa_forward", dtype);
        fa_plan_set_tile_macros(&d, t);
        fa_plan_set_operand_fragments(&d, dtype, n < N_PADDED_HEAD_DIMS * N_PADDED_HEAD_DIMS ? apple7 : apple9);
        rc = visit_dispatch(&d, visit, ctx);
        /* The backward kernels take the forward's specialisation (fa_plan_backward.c). */
        snprintf(d.source_name, sizeof d.source_name, "%s", FA_BACKWARD_SOURCE);
        snprintf(d.function, sizeof d.function, "fa_backward_dq_%s", fa_kernel_type_name(dtype));
        rc = rc != 0 ? rc : visit_dispatch(&d, visit, ctx);
    }
    for (int32_t bd = 64; rc == 0 && dtype != FA_F32 && bd <= TENSOR_MAX_HEAD_DIM; bd += 32) { /* tensor_width's */
        memset(&d, 0, sizeof d);
        fa_plan_start_dispatch(&d, tensor_source, "fa_forward_tensor", dtype);
        set_tensor_macros(&d, bd);
        rc = visit_dispatch(&d, visit, ctx);
        memset(&d, 0, sizeof d);
        fa_plan_backward_tensor_dispatch(&d, "dkdv", dtype, bd); /* the tensor backward's (fa_plan_backward.c) */
        rc = rc != 0 ? rc : visit_dispatch(&d, visit, ctx);
    }
    for (int32_t cols = DECODE_MIN_COLS; rc == 0 && cols <= decode_columns(FA_MAX_HEAD_DIM, 0);
         cols = next_decode_columns(cols)) {
        for (int32_t rows = 1; rc == 0 && rows <= decode_row_cap(cols); rows *= 2) {
            memset(&d, 0, sizeof d);
            fa_plan_start_dispatch(&d, decode_source, "fa_decode", dtype);
            set_decode_macros(&d, cols, rows);
            rc = visit_dispatch(&d, visit, ctx);
        }
    }
    return rc;
}

int32_t fa_plan_each_specialisation(fa_plan_visitor visit, void *ctx) {
    int32_t rc = 0;
    for (int32_t dtype = FA_F32; rc == 0 && dtype <= FA_BF16; ++dtype) {
        rc = each_specialisation_of(dtype, visit, ctx);
    }
    return rc;
}
