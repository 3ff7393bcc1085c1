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
    FA_ERR_VALUE = 1,    /* bad argument: shapes, strides, sizes, flags (Python ValueError) */
    FA_ERR_TYPE = 2,     /* bad dtype or device (Python TypeError) */
    FA_ERR_COMPILE = 3,  /* a kernel failed to compile */
    FA_ERR_RUNTIME = 4,  /* a dispatch failed (divergence, deadlock, backend error) */
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

/* FA_BOOL (one byte, nonzero = true) is for attention masks only; FA_I32 for sequence tables only. */
typedef enum fa_dtype { FA_F32 = 0, FA_F16 = 1, FA_BF16 = 2, FA_BOOL = 3, FA_I32 = 4 } fa_dtype;

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
    FA_KERNEL_AUTO = 0,   /* let the planner choose */
    FA_KERNEL_SIMPLE = 1, /* one query row per SIMD-group: the reference baseline */
    FA_KERNEL_FORWARD = 2, /* FlashAttention-2 on simdgroup matrices: the prefill kernel */
    FA_KERNEL_DECODE = 3   /* vector kernel for few query rows, keys split over threadgroups when
                              long (AUTO's choice for small L) */
} fa_kernel_choice;

/* Forward attention, SDPA semantics: q (B,Hq,L,E), k (B,Hkv,S,E), v (B,Hkv,S,Ev),
 * out (B,Hq,L,Ev), query head h reads kv head h / (Hq/Hkv). The band (causal, window) is that of
 * fa_band_args below. lse, when lse.storage is not NULL, is (B,Hq,L) float32 and receives the
 * natural-log log-sum-exp of each row's scaled scores.
 * The core allocates nothing: a call that needs scratch memory (split-K partial results) says how
 * much through fa_forward_workspace_bytes, and the caller passes it as `workspace`, a 1-D float32
 * tensor on the same device of at least that many bytes (storage NULL when none is needed). */
/* Which keys each query row sees besides attn_mask, with `causal` of the args. Row i's diagonal
 * key is d_i = i (top-left, SDPA's is_causal) or d_i = i + S - L (bottom_right, flash-attn's).
 * causal hides the keys past d_i; when windowed, the keys outside [d_i - window_left,
 * d_i + window_right] are hidden too (-1: unbounded on that side; with causal the right side is 0,
 * as flash-attn). All zero (memset) is SDPA's behaviour. A row that sees no key gives zeros;
 * kernels skip the key tiles wholly outside. */
typedef struct fa_band_args {
    int32_t bottom_right;
    int32_t windowed;
    int64_t window_left, window_right;
} fa_band_args;

/* Packed sequences (flash_attn_varlen_func) and KV caches (flash_attn_with_kvcache): when
 * `table` is present (ndim 2), grid batch entry b is sequence b of table (B, 6) int32, contiguous:
 * (q batch, first q row, q rows, k batch, first k row, keys) (metal/fa_sequence.h). Its query rows
 * are q[q batch, :, first .. first + rows) (out and lse alike), its keys k and v[k batch, :, ...];
 * causal, windows and ALiBi apply per sequence (its own diagonal, S_b - L_b with bottom_right).
 * The table lives in device memory and is not read by the host: a kernel clamps each entry into
 * q's and k's views and into max_q_len / max_kv_len (the grid's rows and keys), so a bad entry
 * can only cut a sequence short, never address outside a view; the Python layer validates the
 * contents first. `scratch` is a float32 1-D tensor on the same device of at least
 * B * sizeof(fa_params) bytes, 16-byte aligned, that receives the per-sequence kernel arguments.
 * No attn_mask with sequences. ALiBi slopes are (B, Hq) over the sequences. */
typedef struct fa_sequence_args {
    fa_tensor table;
    fa_tensor scratch;
    int64_t max_q_len, max_kv_len;
    /* Paged KV (ndim 0 when absent): (B, pages per sequence) int32, contiguous. k and v are then
     * (pages, Hkv, page_size, D) views of the pool; key position t of sequence b (t counted from
     * its table entry's first key row) is row t % page_size of page block_table[b][t / page_size].
     * Entries are clamped into the pool by the kernel; the prefill or decode kernel reads it (forward
     * only: the backward refuses a block table). */
    fa_tensor block_table;
} fa_sequence_args;

typedef struct fa_forward_args {
    int32_t device; /* fa_device: which backend runs it */
    fa_tensor q, k, v, out, lse;
    fa_tensor workspace;
    /* Optional attn_mask (ndim 0 when absent) as a (B, Hq, L, S) view, broadcast dims with stride 0:
     * bool (true takes part) or additive float32 or q's dtype (added to the scaled scores). */
    fa_tensor mask;
    double scale;
    int32_t causal; /* hide keys past each row's diagonal (top-left unless band.bottom_right) */
    int32_t kernel; /* fa_kernel_choice */
    fa_band_args band;
    double softcap; /* > 0: each scaled score s becomes softcap * tanh(s / softcap) before masks; 0: none */
    /* ALiBi (ndim 0 when absent): (B, Hq) float32 slopes (stride 0 where broadcast); adds
     * -slope[b, h] * |i + d - j| to the scaled (and capped) score of query i and key j, d = S - L
     * with band.bottom_right, else 0. */
    fa_tensor alibi_slopes;
    /* Dropout (metal/fa_dropout.h): each probability is dropped with probability dropout_p in [0, 1]
     * (0: none) and kept ones are scaled by 1 / (1 - dropout_p), after the softmax statistics (lse
     * is of the undropped probabilities). rng_state, required when dropout_p > 0 or write_probs,
     * is a (4,) float32 view of four random 32-bit words on the call's device (FA_DROPOUT_RNG_WORDS:
     * seed low, high, offset low, high): which elements are dropped is a pure function of them and
     * of (batch, head, row, key), so the backward given the same words drops the same. */
    double dropout_p;
    fa_tensor rng_state;
    /* Nonzero: the probability pass of flash-attn's return_attn_probs instead of attention. It runs
     * the simple kernel over the arguments of a forward call that wrote lse (read here, as are q, k,
     * v, mask, options; out is untouched) and writes into the workspace, as a contiguous (B, Hq, L, S)
     * float32 array of fa_forward_workspace_bytes, each visible probability exp(s_ij - lse_i),
     * negated where dropout drops it; entries a row does not see are left as they are. With
     * sequences, B is the table's sequences and L, S are max_q_len, max_kv_len: sequence b's
     * probabilities fill the top-left L_b x S_b block of its slice (flash-attn's padded S_dmask).
     * Not with a block table (the simple kernel reads keys in place). */
    int32_t write_probs;
    /* Attention sinks (ndim 0 when absent): (Hq,) float32 logits; each row's softmax also counts
     * exp(sinks[h]) in its denominator, with no value. lse includes it; a row that sees no key gives
     * zeros and lse = sinks[h]. */
    fa_tensor sinks;
    fa_sequence_args sequences; /* packed sequences / KV caches (h23); all zero: none */
    /* Split-K of the decode kernel, as flash-attn's num_splits: 0 the planner's heuristic, 1 no
     * split, n > 1 that many splits of the keys (at most 128; fewer when there are too few keys
     * for n shares of whole key-pair turns). The prefill kernel never splits. */
    int32_t num_splits;
} fa_forward_args;

/* Validate, plan and run. Returns FA_OK or an error code with st->message set. */
int32_t fa_forward(const fa_forward_args *args, fa_status *st);

/* Bytes of workspace fa_forward needs for these arguments (their workspace is not looked at), or
 * -1 with st set when they are invalid. */
int64_t fa_forward_workspace_bytes(const fa_forward_args *args, fa_status *st);

/* Gradients of attention: given the forward's q, k, v, scale, causal and band, its out and lse (written by
 * fa_forward for exactly these arguments) and dout, the gradient of out (B,Hq,L,Ev), writes dq, dk,
 * dv (the shapes of q, k, v; any strides; all of q's dtype). delta is (B,Hq,L) float32 scratch the
 * core fills with rowsum(dout * out) and then reads. Neither an L x S matrix nor float atomics:
 * one kernel parallel over key blocks accumulates dk and dv (over every query head of a GQA group),
 * another parallel over query blocks accumulates dq. */
typedef struct fa_backward_args {
    int32_t device; /* fa_device */
    fa_tensor q, k, v, out, lse, dout;
    fa_tensor delta;
    fa_tensor dq, dk, dv;
    fa_tensor mask; /* the forward's attn_mask (ndim 0 when absent), as in fa_forward_args */
    double scale;
    int32_t causal;
    fa_band_args band; /* the forward's */
    double softcap;    /* the forward's */
    fa_tensor alibi_slopes; /* the forward's (no gradient flows to the slopes) */
    double dropout_p;       /* the forward's, with its rng_state: the same elements are dropped */
    fa_tensor rng_state;
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
/* Returns the registered text, or NULL. The pointer stays valid for the life of the process. */
const char *fa_lookup_source(const char *name);

#ifdef __cplusplus
}
#endif
#endif
