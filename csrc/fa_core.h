/* flashattn-mps C core: the contract between the Python layer and the core.
 *
 * Everything crosses as plain integers: tensors are described by their storage handle, a byte
 * offset, dtype, sizes and strides (in elements), all 64-bit. The core validates every descriptor
 * (dtype, rank, shape agreement, that every addressed element lies inside the storage) before any
 * kernel runs, so malformed input is rejected with a message instead of crashing. */
#ifndef FA_CORE_H
#define FA_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { FA_STATUS_MESSAGE_BYTES = 8192 };

typedef enum fa_code {
    FA_OK = 0,
    FA_ERR_VALUE = 1,      /* bad argument: shapes, strides, sizes, flags (Python ValueError) */
    FA_ERR_TYPE = 2,       /* bad dtype or device (Python TypeError) */
    FA_ERR_COMPILE = 3,    /* a kernel failed to compile */
    FA_ERR_RUNTIME = 4,    /* a dispatch failed (divergence, deadlock, backend error) */
    FA_ERR_UNSUPPORTED = 5 /* the backend is not available in this build or on this machine */
} fa_code;

typedef struct fa_status {
    int32_t code; /* fa_code */
    char message[FA_STATUS_MESSAGE_BYTES];
} fa_status;

/* Sets *st and returns code; message is printf-formatted and truncated to fit. */
int32_t fa_fail(fa_status *st, int32_t code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* FA_BOOL (one byte, nonzero = true) is for attention masks only; FA_I32 for sequence tables only;
 * FA_U8 for the data of quantized K/V only (fa_options.k_bits). */
typedef enum fa_dtype { FA_F32 = 0, FA_F16 = 1, FA_BF16 = 2, FA_BOOL = 3, FA_I32 = 4, FA_U8 = 5 } fa_dtype;

typedef enum fa_device { FA_DEVICE_CPU = 0, FA_DEVICE_MPS = 1 } fa_device;

enum { FA_MAX_DIMS = 4 };

/* A strided view of a storage. For FA_DEVICE_CPU `storage` is the host address of the storage's
 * first byte; for FA_DEVICE_MPS it is the storage's id<MTLBuffer>. */
typedef struct fa_tensor {
    void *storage;
    int64_t storage_bytes; /* size of the whole storage, for bounds checks */
    int64_t byte_offset;   /* offset of element [0,...,0] from the storage start */
    int32_t dtype;         /* fa_dtype */
    int32_t ndim;
    int64_t sizes[FA_MAX_DIMS];
    int64_t strides[FA_MAX_DIMS]; /* in elements; any sign-free layout, overlapping views allowed
                                     for inputs */
} fa_tensor;

typedef enum fa_kernel_choice {
    FA_KERNEL_AUTO = 0,    /* let the planner choose */
    FA_KERNEL_SIMPLE = 1,  /* one query row per SIMD-group: the reference baseline */
    FA_KERNEL_FORWARD = 2, /* FlashAttention-2 on simdgroup matrices: the prefill kernel */
    FA_KERNEL_DECODE = 3,  /* vector kernel for few query rows, keys split over threadgroups when
                              long (AUTO's choice for small L) */
    FA_KERNEL_TENSOR = 4   /* the prefill on Metal 4 tensor operations (fa_forward_tensor.h): AUTO's
                              choice on Apple10 with tensor support (fa_plan_forward.c) */
} fa_kernel_choice;

/* The options of an attention call, one value for the forward and the backward (the backward reads
 * the forward's). Laid out with no padding (doubles, int64s, an even count of int32s) so that a
 * plan key can copy it as bytes; fa_default_options() is SDPA's behaviour.
 *
 * The band: which keys each query row sees besides attn_mask. Row i's diagonal key is d_i = i
 * (top-left, SDPA's is_causal) or d_i = i + S - L (bottom_right, flash-attn's), plus
 * diagonal_offset (a block of a longer sequence whose rows start diagonal_offset keys after its
 * keys do: context parallelism's blocks, flashattn_mps/distributed.py). causal hides the
 * keys past d_i; window_left / window_right >= 0 hide the keys outside [d_i - window_left,
 * d_i + window_right] (-1: unbounded on that side; with causal the right side is 0, as
 * flash-attn; below -1 is an error). A row that sees no key gives zeros; kernels skip the key
 * tiles wholly outside. */
typedef struct fa_options {
    double scale;
    double softcap; /* > 0: each scaled score s becomes softcap * tanh(s / softcap) before masks; 0: none */
    /* Dropout (metal/fa_dropout.h): each probability is dropped with probability dropout_p in [0, 1]
     * (0: none) and kept ones are scaled by 1 / (1 - dropout_p), after the softmax statistics (lse
     * is of the undropped probabilities). The rng_state slot, required when dropout_p > 0 or
     * write_probs, is a (4,) float32 view of four random 32-bit words on the call's device
     * (FA_DROPOUT_RNG_WORDS: seed low, high, offset low, high): which elements are dropped is a pure
     * function of them and of (batch, head, row, key), so the backward given the same words drops
     * the same. */
    double dropout_p;
    int64_t window_left, window_right;
    /* Added to every row's diagonal (band and ALiBi's origin); |offset| + L + S must be below 2^31.
     * Not with a sequence table. */
    int64_t diagonal_offset;
    /* With a sequence table: the grid's rows and keys per sequence (0 without one). */
    int64_t max_q_len, max_kv_len;
    int32_t causal;       /* hide keys past each row's diagonal */
    int32_t bottom_right; /* the diagonal is i + S - L (flash-attn's), else i */
    int32_t kernel;       /* fa_kernel_choice (forward only) */
    /* Split-K of the decode kernel, as flash-attn's num_splits: 0 the planner's heuristic, 1 no
     * split, n > 1 that many splits of the keys (at most 128; fewer when there are too few keys
     * for n shares of whole key-pair turns). The prefill kernel never splits. Forward only. */
    int32_t num_splits;
    /* Nonzero: the probability pass of flash-attn's return_attn_probs instead of attention. It runs
     * the simple kernel over the arguments of a forward call (q, k, v, mask, sinks, options are read;
     * out and lse are untouched) and writes into the workspace, as a contiguous (B, Hq, L, S) float32
     * array of fa_forward_workspace_bytes, each visible probability exp(s_ij - lse_i) with the row's
     * softmax taken again there (so a row's largest score has exactly exp(0) / its sum), negated
     * where dropout drops it; entries a row does not see are left as they are. With
     * sequences, B is the table's sequences and L, S are max_q_len, max_kv_len: sequence b's
     * probabilities fill the top-left L_b x S_b block of its slice (flash-attn's padded S_dmask).
     * Not with a block table (the simple kernel reads keys in place). Forward only. */
    int32_t write_probs;
    /* Read by the bindings only: 3-D q, k, v, out, lse and mask get a batch dim of 1. */
    int32_t unbatched;
    /* Quantized K and V, read in place (forward only; prefill and decode kernels): 0 when the slot
     * holds q's dtype, else 8 or 4. Then k (v) is uint8 data, (B, Hkv, S, E) for 8 bits and
     * (B, Hkv, S, E / 2) for 4 bits (element 2i in the low nibble of byte i), and the k_scales and
     * k_biases slots (v_...) are (B, Hkv, S, E / group_size) of q's dtype: element c of a row is
     * scale[c / group_size] * q_c + bias[c / group_size] (MLX's affine quantization). group_size
     * is 32, 64 or 128 and divides the head dim (0 when not quantized). */
    int32_t k_bits, k_group_size;
    int32_t v_bits, v_group_size;
    /* The GPU family the planner chooses for (fa_gpu_family.h): 0 the device's, 7 to 10 Apple7 ..
     * Apple10 (explain_plan(gpu=...); a run on another family's device is valid, only slower).
     * 64-bit so the options keep no padding. */
    int64_t gpu_family;
} fa_options;

#ifdef __cplusplus
static_assert(
#else
_Static_assert(
#endif
    sizeof(fa_options) == 3 * sizeof(double) + 6 * sizeof(int64_t) + 10 * sizeof(int32_t),
    "fa_options has no padding: it is hashed and compared as bytes");

static inline fa_options fa_default_options(void) {
    fa_options o = {0};
    o.window_left = -1;
    o.window_right = -1;
    return o;
}

/* The options' fields in the order the bindings take them (the Python options tuple). */
typedef enum fa_option_type {
    FA_OPTION_DOUBLE = 0,
    FA_OPTION_BOOL = 1, /* stored as int32 */
    FA_OPTION_INT32 = 2,
    FA_OPTION_INT64 = 3
} fa_option_type;

typedef struct fa_option_field {
    const char *name;
    int32_t type;   /* fa_option_type */
    int32_t offset; /* in fa_options */
} fa_option_field;

enum { FA_OPTION_COUNT = 19 };
extern const fa_option_field fa_option_fields[FA_OPTION_COUNT];

/* The tensors of a call. One table (fa_tensor_slots, indexed by fa_slot) says for each its name,
 * rank, dtype rule, whether it is optional, which [[buffer(n)]] it binds in the forward and the
 * backward kernels, and where it lives in fa_forward_args / fa_backward_args: the storage checks,
 * the alias checks, the bindings and the plan key all read this one table. */
typedef enum fa_slot {
    FA_SLOT_Q = 0,
    FA_SLOT_K,
    FA_SLOT_V,
    FA_SLOT_OUT,
    FA_SLOT_LSE,
    FA_SLOT_WORKSPACE,
    FA_SLOT_DOUT,
    FA_SLOT_DELTA,
    FA_SLOT_DQ,
    FA_SLOT_DK,
    FA_SLOT_DV,
    FA_SLOT_MASK,
    FA_SLOT_ALIBI_SLOPES,
    FA_SLOT_RNG_STATE,
    FA_SLOT_SINKS,
    FA_SLOT_SINK_GRAD,
    FA_SLOT_SEQUENCES,
    FA_SLOT_SEQUENCE_SCRATCH,
    FA_SLOT_BLOCK_TABLE,
    FA_SLOT_K_SCALES,
    FA_SLOT_K_BIASES,
    FA_SLOT_V_SCALES,
    FA_SLOT_V_BIASES,
    FA_SLOT_COUNT
} fa_slot;

typedef enum fa_dtype_rule {
    FA_RULE_ANY = 0,     /* any dtype the storage check knows; the planner checks agreement */
    FA_RULE_FLOAT32 = 1, /* float32 only */
    FA_RULE_TABLE = 2    /* a sequence table's own checks (fa_plan_sequences.h) */
} fa_dtype_rule;

typedef enum fa_slot_role {
    FA_ROLE_INPUT = 0,  /* read (or absent from the direction): outputs must not alias it */
    FA_ROLE_OUTPUT = 1, /* written: must alias nothing */
    FA_ROLE_SCRATCH = 2 /* the sequence tables: the table kernel checks its scratch against the rest */
} fa_slot_role;

enum { FA_SLOT_NONE = -1, FA_OPTIONAL_FORWARD = 1, FA_OPTIONAL_BACKWARD = 2, FA_OPTIONAL = 3 };

typedef struct fa_tensor_slot {
    const char *name;
    int32_t rank;
    int32_t dtype_rule;                  /* fa_dtype_rule */
    int32_t optional;                    /* FA_OPTIONAL_FORWARD | FA_OPTIONAL_BACKWARD: absent allowed; 0: required */
    int32_t required_with;               /* optional, but required when this slot is present (FA_SLOT_NONE: never) */
    int32_t forward_role, backward_role; /* fa_slot_role */
    int32_t in_plan_key;                 /* 0: pointer-only, checked on every call (workspace, sequence scratch) */
    int32_t forward_buffer, backward_buffer; /* [[buffer(n)]] (FA_FORWARD_BUFFER_*, FA_BACKWARD_BUFFER_* of
                                                  metal/fa_params.h), FA_SLOT_NONE if not bound */
    int32_t forward_offset, backward_offset; /* offsetof in the args, FA_SLOT_NONE if not an argument */
    int32_t batched; /* its first dim is the batch: an unbatched call's 3-D tensor gets one of 1 */
} fa_tensor_slot;

extern const fa_tensor_slot fa_tensor_slots[FA_SLOT_COUNT];

typedef enum fa_direction { FA_FORWARD = 0, FA_BACKWARD = 1 } fa_direction;

/* The slot's tensor in forward (direction FA_FORWARD) or backward args, or NULL when the direction
 * has no such slot. */
static inline const fa_tensor *fa_slot_tensor(const void *args, int32_t direction, int32_t slot) {
    const int32_t offset =
        direction == FA_FORWARD ? fa_tensor_slots[slot].forward_offset : fa_tensor_slots[slot].backward_offset;
    return offset < 0 ? (const fa_tensor *)0 : (const fa_tensor *)((const char *)args + offset);
}

/* Packed sequences (flash_attn_varlen_func) and KV caches (flash_attn_with_kvcache): when
 * `table` is present (ndim 2), grid batch entry b is sequence b of table (B, 6) int32, contiguous:
 * (q batch, first q row, q rows, k batch, first k row, keys) (metal/fa_sequence.h). Its query rows
 * are q[q batch, :, first .. first + rows) (out and lse alike), its keys k and v[k batch, :, ...];
 * causal, windows and ALiBi apply per sequence (its own diagonal, S_b - L_b with bottom_right).
 * The table lives in device memory and is not read by the host: a kernel clamps each entry into
 * q's and k's views and into the options' max_q_len / max_kv_len (the grid's rows and keys), so a
 * bad entry can only cut a sequence short, never address outside a view; the Python layer
 * validates the contents first. `scratch` is a float32 1-D tensor on the same device of at least
 * B * sizeof(fa_params) bytes, 16-byte aligned, that receives the per-sequence kernel arguments.
 * No attn_mask with sequences. ALiBi slopes are (B, Hq) over the sequences. */
typedef struct fa_sequence_args {
    fa_tensor table;   /* slot "sequences" */
    fa_tensor scratch; /* slot "sequence_scratch" */
    /* Paged KV (ndim 0 when absent): (B, pages per sequence) int32, contiguous. k and v are then
     * (pages, Hkv, page_size, D) views of the pool; key position t of sequence b (t counted from
     * its table entry's first key row) is row t % page_size of page block_table[b][t / page_size].
     * Entries are clamped into the pool by the kernel; the prefill or decode kernel reads it (forward
     * only: the backward refuses a block table). */
    fa_tensor block_table;
} fa_sequence_args;

/* Forward attention, SDPA semantics: q (B,Hq,L,E), k (B,Hkv,S,E), v (B,Hkv,S,Ev),
 * out (B,Hq,L,Ev), query head h reads kv head h / (Hq/Hkv), under the options' band. lse, when
 * lse.storage is not NULL, is (B,Hq,L) float32 and receives the natural-log log-sum-exp of each
 * row's scaled scores.
 * The core allocates nothing: a call that needs scratch memory (split-K partial results) says how
 * much through fa_forward_workspace_bytes, and the caller passes it as `workspace`, a 1-D float32
 * tensor on the same device of at least that many bytes (storage NULL when none is needed). */
typedef struct fa_forward_args {
    int32_t device; /* fa_device: which backend runs it */
    fa_options options;
    fa_tensor q, k, v, out, lse;
    fa_tensor workspace;
    /* Optional attn_mask (ndim 0 when absent) as a (B, Hq, L, S) view, broadcast dims with stride 0:
     * bool (true takes part) or additive float32 or q's dtype (added to the scaled scores). */
    fa_tensor mask;
    /* ALiBi (ndim 0 when absent): (B, Hq) float32 slopes (stride 0 where broadcast); adds
     * -slope[b, h] * |i + d - j| to the scaled (and capped) score of query i and key j, d = S - L
     * with bottom_right, else 0. */
    fa_tensor alibi_slopes;
    fa_tensor rng_state; /* dropout's generator state (fa_options.dropout_p) */
    /* Attention sinks (ndim 0 when absent): (Hq,) float32 logits; each row's softmax also counts
     * exp(sinks[h]) in its denominator, with no value. lse includes it; a row that sees no key gives
     * zeros and lse = sinks[h]. */
    fa_tensor sinks;
    fa_sequence_args sequences; /* packed sequences / KV caches; all zero: none */
    /* Quantized K and V (fa_options.k_bits, v_bits): each group's scales and biases, ndim 0 when
     * that operand is not quantized. Sequences and block tables address them as they address k and v. */
    fa_tensor k_scales, k_biases, v_scales, v_biases;
} fa_forward_args;

/* Validate, plan and run. Returns FA_OK or an error code with st->message set. */
int32_t fa_forward(const fa_forward_args *args, fa_status *st);

/* Bytes of workspace fa_forward needs for these arguments (their workspace is not looked at), or
 * -1 with st set when they are invalid. */
int64_t fa_forward_workspace_bytes(const fa_forward_args *args, fa_status *st);

/* Gradients of attention: given the forward's q, k, v and options, its out and lse (written by
 * fa_forward for exactly these arguments) and dout, the gradient of out (B,Hq,L,Ev), writes dq, dk,
 * dv (the shapes of q, k, v; any strides; all of q's dtype). delta is (B,Hq,L) float32 scratch the
 * core fills with rowsum(dout * out) and then reads. Neither an L x S matrix nor float atomics:
 * one kernel parallel over key blocks accumulates dk and dv (over every query head of a GQA group),
 * another parallel over query blocks accumulates dq. */
typedef struct fa_backward_args {
    int32_t device;     /* fa_device */
    fa_options options; /* the forward's (kernel, num_splits and write_probs are not read) */
    fa_tensor q, k, v, out, lse, dout;
    fa_tensor delta;
    fa_tensor dq, dk, dv;
    fa_tensor mask;         /* the forward's attn_mask (ndim 0 when absent), as in fa_forward_args */
    fa_tensor alibi_slopes; /* the forward's (no gradient flows to the slopes) */
    fa_tensor rng_state;    /* the forward's: the same elements are dropped */
    /* The forward's sinks (ndim 0 when absent) and, with them, sink_grad: (B, Hq, L) float32 that
     * receives each row's term -exp(sinks[h] - lse) * delta of the sinks' gradient, which is its
     * sum over B and L (the caller sums, deterministically). */
    fa_tensor sinks, sink_grad;
    fa_sequence_args sequences; /* the forward's */
} fa_backward_args;

/* Validate, plan and run. Returns FA_OK or an error code with st->message set. */
int32_t fa_backward(const fa_backward_args *args, fa_status *st);

/* Kernel sources are registered by the Python layer (which reads the metal/ sources and inlines their
 * #includes) before the first call; the core keeps its own copy. Thread-safe. */
int32_t fa_register_source(const char *name, const char *text, fa_status *st);

#ifdef __cplusplus
}
#endif
#endif
