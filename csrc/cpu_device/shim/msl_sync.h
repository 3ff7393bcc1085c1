/* Metal's synchronisation functions for kernels compiled for the CPU Metal device: barriers,
 * SIMD-group collectives, simdgroup_matrix and atomics. Included by msl_shim.h after msl_types.h and
 * msl_math.h (it uses vec, ulong2, half, bfloat, max and min).
 *
 * Every GPU thread is a fiber; a barrier or collective calls api->sync, which returns once every
 * live thread of the scope waits at the same construct and line (and fails the dispatch on
 * divergence). Each function takes the caller's line and file as trailing default arguments so that
 * diagnostics name the kernel's source line. */
#ifndef MSL_SYNC_H
#define MSL_SYNC_H

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "msl_abi.h"

#ifndef MSL_RT_API_DEFINED
#define MSL_RT_API_DEFINED
namespace msl_rt {
/* The runtime's table, set by the library's __msl_bind_runtime. */
inline const msl_runtime_api *api = nullptr;
} // namespace msl_rt
#endif

#define MSL_CALLER unsigned line = __builtin_LINE(), const char *file = __builtin_FILE()

namespace msl_rt {

/* The GPU thread this code runs as; NULL outside a dispatch (static initialisers at dlopen). A
 * fiber is one GPU thread for its whole life, so within kernel code the answer never changes:
 * declared const, and kept out of line where the compiler sees the attribute, it is asked once per
 * function rather than at every barrier, collective and function-constant read. */
[[gnu::const, gnu::noinline]] inline msl_thread *self() { return api ? api->current() : nullptr; }

/* One SIMD-group exchange, seen after its sync: the value each participating lane published.
 *
 * One sync per collective is enough with two parities per lane. A lane publishes its collective k
 * into slot[k % 2][lane] and reads its collective's slots before it waits again. It writes
 * slot[k % 2][lane] again only in its collective k + 2, after passing its sync k + 1, which
 * completed only when every live lane of the SIMD-group was waiting, that is, had finished
 * reading. A lane that returns in between reads nothing more; its last value stays readable and
 * `lanes` (the runtime's snapshot at the sync) still counts it. In divergent control flow the
 * active lanes' counts of collectives differ, hence a parity per lane (sync_parity). The cached
 * reduction result[g % 2] of sync g is rewritten at sync g + 2, when every reader of g is done. */
template <class T> struct gathered {
    msl_simd_exchange *x;
    uint32_t parities; /* bit i: the parity lane i published in */
    uint32_t lanes;    /* bit i: lane i took part (was active) */
    uint32_t self;
    uint32_t generation;

    T get(uint32_t lane) const { /* lane must have taken part */
        T v;
        std::memcpy(&v, x->slot[parities >> lane & 1u][lane], sizeof v);
        return v;
    }
    /* A lane that did not take part (exited, beyond a partial SIMD-group, or >= 32) yields the
     * bytes 0xFF (NaN, -1): Metal leaves the value undefined, garbage makes the bug visible. */
    T from(uint32_t lane) const {
        if (lane < MSL_SIMD_WIDTH && (lanes >> lane & 1u)) return get(lane);
        T v;
        std::memset(&v, 0xFF, sizeof v);
        return v;
    }
};

template <class T> gathered<T> exchange(const T &value, const char *what, const char *file, unsigned line) {
    static_assert(sizeof(T) <= MSL_XCHG_BYTES, "value too wide for a SIMD-group exchange");
    static_assert(std::is_trivially_copyable<T>::value, "SIMD-group functions move plain values");
    msl_thread *t = self();
    msl_simd_exchange *x = t->simd_exchange;
    uint32_t parity = t->xchg_parity, lane = t->thread_index_in_simdgroup;
    std::memcpy(x->slot[parity][lane], &value, sizeof value);
    api->sync(t, MSL_SYNC_SIMD_COLLECTIVE, what, file, line);
    t->xchg_parity = parity ^ 1u;
    return {x, x->sync_parity, x->sync_lanes, lane, x->generation};
}

/* A SIMD-group sync without values; returns the lanes that took part. */
inline uint32_t simd_sync(int32_t kind, const char *what, const char *file, unsigned line) {
    msl_thread *t = self();
    api->sync(t, kind, what, file, line);
    return t->simd_exchange->sync_lanes;
}

inline uint32_t lowest(uint32_t lanes) { return (uint32_t)__builtin_ctz(lanes); }

/* What MSL's SIMD-group functions take: a scalar or vector of float, half, bfloat or an integer
 * type (not bool, not a struct, not a pointer); simd_data<T> is T for those only. */
#ifdef MSL_STRICT
template <class T, class = void> struct lane_type {
    using type = T;
};
template <class T>
struct lane_type<T, std::enable_if_t<!std::is_pointer<T>::value, std::void_t<decltype(std::declval<T &>()[0])>>> {
    using type = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<T &>()[0])>>;
};
template <class T> using lane_t = typename lane_type<T>::type;
#else
template <class T> using lane_t = std::conditional_t<(metal::detail::info<T>::n > 0), metal::detail::elem_t<T>, void>;
#endif
template <class E>
constexpr bool simd_element =
    std::is_same<E, float>::value || std::is_same<E, half>::value || std::is_same<E, bfloat>::value ||
    (std::is_integral<E>::value && !std::is_same<E, bool>::value);
template <class T> using simd_data = std::enable_if_t<simd_element<lane_t<T>>, T>;

/* A tree over the participating lanes, as a butterfly would: the upper half is combined into the
 * lower half (lane i with lane i + 16, then + 8, ...). Each op is T's own, so half and bfloat round
 * after every addition. The first lane to get here computes it (out of line); the others, inline,
 * copy its result. */
template <class T, class Op> [[gnu::noinline]] T fold_lanes(const gathered<T> &g, Op op) {
    uint32_t p = g.generation & 1u;
    T v[MSL_SIMD_WIDTH];
    uint32_t n = 0;
    if (g.lanes == 0xFFFFFFFFu)
        for (; n < MSL_SIMD_WIDTH; n++) v[n] = g.get(n);
    else
        for (uint32_t m = g.lanes; m; m &= m - 1) v[n++] = g.get(lowest(m));
    for (uint32_t half = MSL_SIMD_WIDTH / 2; half; half /= 2)
        for (uint32_t i = 0, end = n <= half ? 0 : n - half < half ? n - half : half; i < end; i++)
            v[i] = op(v[i], v[i + half]);
    std::memcpy(g.x->result[p], v, sizeof v[0]);
    g.x->reduced[p] = g.generation;
    return v[0];
}
template <class T, class Op> T fold(const gathered<T> &g, Op op) {
    uint32_t p = g.generation & 1u;
    if (g.x->reduced[p] != g.generation) return fold_lanes(g, op);
    T v;
    std::memcpy(&v, g.x->result[p], sizeof v);
    return v;
}

/* Sequential over the participating lanes in `mask`, for prefix scans. */
template <class T, class Op> T scan(const gathered<T> &g, uint32_t mask, T acc, Op op) {
    for (uint32_t m = g.lanes & mask; m; m &= m - 1) acc = op(acc, g.get(lowest(m)));
    return acc;
}

inline uint32_t below(uint32_t lane) { return (1u << lane) - 1u; }

/* Apple's simdgroup_matrix<T, 8, 8> layout: lane L holds row frag_row(L), columns frag_col(L) and
 * frag_col(L) + 1. */
inline uint32_t frag_row(uint32_t lane) { return lane / 16 * 4 + lane / 2 % 4; }
inline uint32_t frag_col(uint32_t lane) { return lane / 8 % 2 * 4 + lane % 2 * 2; }
inline uint32_t frag_lane(uint32_t row, uint32_t col) { return row / 4 * 16 + col / 4 * 8 + row % 4 * 2 + col % 4 / 2; }

inline uint32_t lane_id() { return self()->thread_index_in_simdgroup; }

/* Memory index of this lane's element j (0 or 1) for simdgroup_load/store. */
inline uint64_t frag_element_index(int j, uint64_t elements_per_row, ulong2 matrix_origin, bool transpose_matrix) {
    uint32_t lane = lane_id();
    uint64_t row = matrix_origin.y + frag_row(lane);
    uint64_t col = matrix_origin.x + frag_col(lane) + j;
    return transpose_matrix ? col * elements_per_row + row : row * elements_per_row + col;
}

} // namespace msl_rt

namespace metal {

/* ---- barriers ---- */

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

/* One OS thread runs a threadgroup's fibers, so memory needs no fence: only execution syncs. The
 * flags go along for checked mode, where only mem_threadgroup orders threadgroup memory. */
inline void threadgroup_barrier(mem_flags flags, MSL_CALLER) {
    msl_thread *t = msl_rt::self();
    msl_rt::api->sync(t, MSL_SYNC_THREADGROUP_BARRIER | int(flags) << MSL_SYNC_FLAGS_SHIFT, "threadgroup_barrier", file,
                      line);
}

inline void simdgroup_barrier(mem_flags flags, MSL_CALLER) {
    msl_rt::simd_sync(MSL_SYNC_SIMDGROUP_BARRIER | int(flags) << MSL_SYNC_FLAGS_SHIFT, "simdgroup_barrier", file, line);
}

/* ---- SIMD-group collectives, over the lanes that have not returned ---- */

template <class T> msl_rt::simd_data<T> simd_sum(T x, MSL_CALLER) {
    return msl_rt::fold(msl_rt::exchange(x, "simd_sum", file, line), [](T a, T b) { return T(a + b); });
}
template <class T> msl_rt::simd_data<T> simd_product(T x, MSL_CALLER) {
    return msl_rt::fold(msl_rt::exchange(x, "simd_product", file, line), [](T a, T b) { return T(a * b); });
}
template <class T> msl_rt::simd_data<T> simd_max(T x, MSL_CALLER) {
    return msl_rt::fold(msl_rt::exchange(x, "simd_max", file, line), [](T a, T b) { return T(max(a, b)); });
}
template <class T> msl_rt::simd_data<T> simd_min(T x, MSL_CALLER) {
    return msl_rt::fold(msl_rt::exchange(x, "simd_min", file, line), [](T a, T b) { return T(min(a, b)); });
}
template <class T> msl_rt::simd_data<T> simd_and(T x, MSL_CALLER) {
    return msl_rt::fold(msl_rt::exchange(x, "simd_and", file, line), [](T a, T b) { return T(a & b); });
}
template <class T> msl_rt::simd_data<T> simd_or(T x, MSL_CALLER) {
    return msl_rt::fold(msl_rt::exchange(x, "simd_or", file, line), [](T a, T b) { return T(a | b); });
}
template <class T> msl_rt::simd_data<T> simd_xor(T x, MSL_CALLER) {
    return msl_rt::fold(msl_rt::exchange(x, "simd_xor", file, line), [](T a, T b) { return T(a ^ b); });
}

template <class T> msl_rt::simd_data<T> simd_prefix_exclusive_sum(T x, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_prefix_exclusive_sum", file, line);
    return msl_rt::scan(g, msl_rt::below(g.self), T(0), [](T a, T b) { return T(a + b); });
}
template <class T> msl_rt::simd_data<T> simd_prefix_inclusive_sum(T x, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_prefix_inclusive_sum", file, line);
    return T(msl_rt::scan(g, msl_rt::below(g.self), T(0), [](T a, T b) { return T(a + b); }) + x);
}
template <class T> msl_rt::simd_data<T> simd_prefix_exclusive_product(T x, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_prefix_exclusive_product", file, line);
    return msl_rt::scan(g, msl_rt::below(g.self), T(1), [](T a, T b) { return T(a * b); });
}
template <class T> msl_rt::simd_data<T> simd_prefix_inclusive_product(T x, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_prefix_inclusive_product", file, line);
    return T(msl_rt::scan(g, msl_rt::below(g.self), T(1), [](T a, T b) { return T(a * b); }) * x);
}

/* Shuffles: a source lane outside the SIMD-group keeps the caller's value for the _up and _down
 * forms (they do not wrap: MSL spec, table 6.14); any other lane that did not take part yields
 * garbage. */
template <class T> msl_rt::simd_data<T> simd_shuffle(T x, uint16_t lane, MSL_CALLER) {
    return msl_rt::exchange(x, "simd_shuffle", file, line).from(lane);
}
template <class T> msl_rt::simd_data<T> simd_broadcast(T x, uint16_t lane, MSL_CALLER) {
    return msl_rt::exchange(x, "simd_broadcast", file, line).from(lane);
}
template <class T> msl_rt::simd_data<T> simd_shuffle_xor(T x, uint16_t mask, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_shuffle_xor", file, line);
    return g.from(g.self ^ mask);
}
template <class T> msl_rt::simd_data<T> simd_shuffle_down(T x, uint16_t delta, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_shuffle_down", file, line);
    return g.self + delta < MSL_SIMD_WIDTH ? g.from(g.self + delta) : x;
}
template <class T> msl_rt::simd_data<T> simd_shuffle_up(T x, uint16_t delta, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_shuffle_up", file, line);
    return delta <= g.self ? g.from(g.self - delta) : x;
}
template <class T> msl_rt::simd_data<T> simd_shuffle_rotate_down(T x, uint16_t delta, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_shuffle_rotate_down", file, line);
    return g.from((g.self + delta) % MSL_SIMD_WIDTH);
}
template <class T> msl_rt::simd_data<T> simd_shuffle_rotate_up(T x, uint16_t delta, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_shuffle_rotate_up", file, line);
    return g.from((g.self + MSL_SIMD_WIDTH - delta % MSL_SIMD_WIDTH) % MSL_SIMD_WIDTH);
}
/* Lanes of each group of `modulo` (2, 4, ..., 32) shift by delta; the lanes shifted in come from
 * filling_data's other end. */
template <class T>
msl_rt::simd_data<T> simd_shuffle_and_fill_up(T data, T filling_data, uint16_t delta, uint16_t modulo = MSL_SIMD_WIDTH,
                                              MSL_CALLER) {
    struct pair {
        T data, fill;
    };
    auto g = msl_rt::exchange(pair{data, filling_data}, "simd_shuffle_and_fill_up", file, line);
    uint32_t base = g.self / modulo * modulo, i = g.self % modulo;
    return i >= delta ? g.from(base + i - delta).data : g.from(base + i + modulo - delta).fill;
}
template <class T>
msl_rt::simd_data<T> simd_shuffle_and_fill_down(T data, T filling_data, uint16_t delta,
                                                uint16_t modulo = MSL_SIMD_WIDTH, MSL_CALLER) {
    struct pair {
        T data, fill;
    };
    auto g = msl_rt::exchange(pair{data, filling_data}, "simd_shuffle_and_fill_down", file, line);
    uint32_t base = g.self / modulo * modulo, i = g.self % modulo;
    return i + delta < modulo ? g.from(base + i + delta).data : g.from(base + i + delta - modulo).fill;
}
template <class T> msl_rt::simd_data<T> simd_broadcast_first(T x, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "simd_broadcast_first", file, line);
    return g.get(msl_rt::lowest(g.lanes));
}

/* Bit i stands for lane i. */
class simd_vote {
  public:
    typedef uint64_t vote_t;
    explicit constexpr simd_vote(vote_t v = 0) : v(v) {}
    explicit constexpr operator vote_t() const { return v; }
    bool all() const { return v == 0xFFFFFFFFu; } /* every lane of the SIMD-group, active or not */
    bool any() const { return v != 0; }

  private:
    vote_t v;
};

inline simd_vote simd_ballot(bool expr, MSL_CALLER) {
    uint32_t vote = uint32_t(expr) << msl_rt::lane_id();
    auto g = msl_rt::exchange(vote, "simd_ballot", file, line);
    return simd_vote(msl_rt::fold(g, [](uint32_t a, uint32_t b) { return a | b; }));
}
inline bool simd_all(bool expr, MSL_CALLER) {
    auto g = msl_rt::exchange(expr, "simd_all", file, line);
    return msl_rt::fold(g, [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool expr, MSL_CALLER) {
    auto g = msl_rt::exchange(expr, "simd_any", file, line);
    return msl_rt::fold(g, [](bool a, bool b) { return a || b; });
}
inline simd_vote simd_active_threads_mask(MSL_CALLER) {
    uint32_t lanes = msl_rt::simd_sync(MSL_SYNC_SIMD_COLLECTIVE, "simd_active_threads_mask", file, line);
    return simd_vote(lanes);
}
inline bool simd_is_first(MSL_CALLER) {
    uint32_t lanes = msl_rt::simd_sync(MSL_SYNC_SIMD_COLLECTIVE, "simd_is_first", file, line);
    return msl_rt::lane_id() == msl_rt::lowest(lanes);
}

/* ---- quad-group functions: over the 4 lanes 4q..4q+3 of the SIMD-group (one SIMD-group exchange,
 * so every live lane of the SIMD-group must reach them, as it must for SIMD-group functions) ---- */

} // namespace metal
namespace msl_rt {
/* op over the quad's lanes that took part, as a butterfly: (v0 op v2) op (v1 op v3) */
template <class T, class Op> T quad_fold(const gathered<T> &g, Op op) {
    uint32_t base = g.self & ~3u, mine = g.lanes >> base & 0xFu;
    T v[4];
    uint32_t n = 0;
    for (uint32_t i = 0; i < 4; i++)
        if (mine >> i & 1u) v[n++] = g.get(base + i);
    if (n == 4) return op(op(v[0], v[2]), op(v[1], v[3]));
    for (uint32_t i = 1; i < n; i++) v[0] = op(v[0], v[i]);
    return v[0];
}
inline uint32_t quad_below(uint32_t lane) { return below(lane) & ~below(lane & ~3u); }
} // namespace msl_rt
namespace metal {

#define MSL_QUAD_FOLD(name, expr)                                                                                   \
    template <class T> msl_rt::simd_data<T> quad_##name(T x, MSL_CALLER) {                                          \
        return msl_rt::quad_fold(msl_rt::exchange(x, "quad_" #name, file, line), [](T a, T b) { return T(expr); }); \
    }
// clang-format off
MSL_QUAD_FOLD(sum, a + b)
MSL_QUAD_FOLD(product, a * b)
MSL_QUAD_FOLD(max, max(a, b))
MSL_QUAD_FOLD(min, min(a, b))
MSL_QUAD_FOLD(and, a & b)
MSL_QUAD_FOLD(or, a | b)
MSL_QUAD_FOLD(xor, a ^ b)
// clang-format on
#undef MSL_QUAD_FOLD
template <class T> msl_rt::simd_data<T> quad_prefix_exclusive_sum(T x, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_prefix_exclusive_sum", file, line);
    return msl_rt::scan(g, msl_rt::quad_below(g.self), T(0), [](T a, T b) { return T(a + b); });
}
template <class T> msl_rt::simd_data<T> quad_prefix_inclusive_sum(T x, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_prefix_inclusive_sum", file, line);
    return T(msl_rt::scan(g, msl_rt::quad_below(g.self), T(0), [](T a, T b) { return T(a + b); }) + x);
}
/* Shuffles within the quad; the _up and _down forms keep the caller's value past its ends. */
template <class T> msl_rt::simd_data<T> quad_shuffle(T x, uint16_t lane, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_shuffle", file, line);
    return g.from((g.self & ~3u) + lane % 4u);
}
template <class T> msl_rt::simd_data<T> quad_broadcast(T x, uint16_t lane, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_broadcast", file, line);
    return g.from((g.self & ~3u) + lane % 4u);
}
template <class T> msl_rt::simd_data<T> quad_shuffle_xor(T x, uint16_t mask, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_shuffle_xor", file, line);
    return g.from((g.self & ~3u) + ((g.self ^ mask) & 3u));
}
template <class T> msl_rt::simd_data<T> quad_shuffle_down(T x, uint16_t delta, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_shuffle_down", file, line);
    return (g.self & 3u) + delta < 4u ? g.from(g.self + delta) : x;
}
template <class T> msl_rt::simd_data<T> quad_shuffle_up(T x, uint16_t delta, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_shuffle_up", file, line);
    return delta <= (g.self & 3u) ? g.from(g.self - delta) : x;
}
template <class T> msl_rt::simd_data<T> quad_shuffle_rotate_down(T x, uint16_t delta, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_shuffle_rotate_down", file, line);
    return g.from((g.self & ~3u) + (g.self + delta) % 4u);
}
template <class T> msl_rt::simd_data<T> quad_shuffle_rotate_up(T x, uint16_t delta, MSL_CALLER) {
    auto g = msl_rt::exchange(x, "quad_shuffle_rotate_up", file, line);
    return g.from((g.self & ~3u) + (g.self + 4u - delta % 4u) % 4u);
}
inline bool quad_all(bool expr, MSL_CALLER) {
    return msl_rt::quad_fold(msl_rt::exchange(expr, "quad_all", file, line), [](bool a, bool b) { return a && b; });
}
inline bool quad_any(bool expr, MSL_CALLER) {
    return msl_rt::quad_fold(msl_rt::exchange(expr, "quad_any", file, line), [](bool a, bool b) { return a || b; });
}
/* bit i stands for lane i of the quad */
class quad_vote {
  public:
    typedef uint16_t vote_t;
    explicit constexpr quad_vote(vote_t v = 0) : v(v) {}
    explicit constexpr operator vote_t() const { return v; }
    bool all() const { return v == 0xFu; }
    bool any() const { return v != 0; }

  private:
    vote_t v;
};
inline quad_vote quad_ballot(bool expr, MSL_CALLER) {
    auto g = msl_rt::exchange(uint32_t(expr) << (msl_rt::lane_id() & 3u), "quad_ballot", file, line);
    return quad_vote(uint16_t(msl_rt::quad_fold(g, [](uint32_t a, uint32_t b) { return a | b; })));
}
inline bool quad_is_first(MSL_CALLER) {
    uint32_t lanes = msl_rt::simd_sync(MSL_SYNC_SIMD_COLLECTIVE, "quad_is_first", file, line);
    uint32_t lane = msl_rt::lane_id();
    return lane == (lane & ~3u) + msl_rt::lowest(lanes >> (lane & ~3u) & 0xFu);
}

} // namespace metal

/* Apple's internal SIMD-group builtins, which real headers call (MLX's bfloat SIMD functions), global as
 * compiler builtins are. */
#define MSL_SIMD_BUILTIN1(name)                                                                       \
    template <class T> auto __metal_##name(T x, MSL_CALLER)->decltype(::metal::name(x, line, file)) { \
        return ::metal::name(x, line, file);                                                          \
    }
#define MSL_SIMD_BUILTIN2(name)                                                                                      \
    template <class T> auto __metal_##name(T x, uint16_t k, MSL_CALLER)->decltype(::metal::name(x, k, line, file)) { \
        return ::metal::name(x, k, line, file);                                                                      \
    }
#define MSL_SIMD_BUILTIN_FILL(name)                                                  \
    template <class T>                                                               \
    auto __metal_##name(T data, T fill, uint16_t delta, uint16_t modulo, MSL_CALLER) \
        ->decltype(::metal::name(data, fill, delta, modulo, line, file)) {           \
        return ::metal::name(data, fill, delta, modulo, line, file);                 \
    }
/* the bitwise ones also take a float, half or bfloat scalar (as MLX's bfloat simd_xor passes a
 * float), combining its bits */
#define MSL_SIMD_BITS_BUILTIN(name)                                                        \
    template <class T> msl_rt::simd_data<T> __metal_##name(T x, MSL_CALLER) {              \
        if constexpr (std::is_integral<msl_rt::lane_t<T>>::value) {                        \
            return ::metal::name(x, line, file);                                           \
        } else {                                                                           \
            using B = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;              \
            return ::metal::as_type<T>(::metal::name(::metal::as_type<B>(x), line, file)); \
        }                                                                                  \
    }
// clang-format off
MSL_SIMD_BUILTIN1(simd_sum)
MSL_SIMD_BUILTIN1(simd_product)
MSL_SIMD_BUILTIN1(simd_max)
MSL_SIMD_BUILTIN1(simd_min)
MSL_SIMD_BITS_BUILTIN(simd_and)
MSL_SIMD_BITS_BUILTIN(simd_or)
MSL_SIMD_BITS_BUILTIN(simd_xor)
MSL_SIMD_BUILTIN1(simd_prefix_exclusive_sum)
MSL_SIMD_BUILTIN1(simd_prefix_inclusive_sum)
MSL_SIMD_BUILTIN1(simd_prefix_exclusive_product)
MSL_SIMD_BUILTIN1(simd_prefix_inclusive_product)
MSL_SIMD_BUILTIN1(simd_broadcast_first)
MSL_SIMD_BUILTIN2(simd_shuffle)
MSL_SIMD_BUILTIN2(simd_broadcast)
MSL_SIMD_BUILTIN2(simd_shuffle_xor)
MSL_SIMD_BUILTIN2(simd_shuffle_down)
MSL_SIMD_BUILTIN2(simd_shuffle_up)
MSL_SIMD_BUILTIN2(simd_shuffle_rotate_down)
MSL_SIMD_BUILTIN2(simd_shuffle_rotate_up)
MSL_SIMD_BUILTIN_FILL(simd_shuffle_and_fill_up)
MSL_SIMD_BUILTIN_FILL(simd_shuffle_and_fill_down)
// clang-format on
#undef MSL_SIMD_BUILTIN1
#undef MSL_SIMD_BUILTIN2
#undef MSL_SIMD_BUILTIN_FILL
#undef MSL_SIMD_BITS_BUILTIN
/* the SIMD-group's width and the caller's lane, in the argument's type */
template <class T> T __metal_get_simdgroup_size(T) { return T(msl_rt::self()->threads_per_simdgroup); }
template <class T> T __metal_get_thread_index_in_simdgroup(T) { return T(msl_rt::lane_id()); }

namespace metal {

/* ---- simdgroup_matrix ---- */

template <class T, int Cols, int Rows> struct simdgroup_matrix {
    static_assert(Cols == 8 && Rows == 8, "only 8x8 SIMD-group matrices exist");
    simdgroup_matrix() = default;
    simdgroup_matrix(T diagonal) { /* a diagonal matrix */
        uint32_t lane = msl_rt::lane_id(), row = msl_rt::frag_row(lane), col = msl_rt::frag_col(lane);
        elements[0] = row == col ? diagonal : T(0);
        elements[1] = row == col + 1 ? diagonal : T(0);
    }
    vec<T, 2> &thread_elements() { return elements; }
    const vec<T, 2> &thread_elements() const { return elements; }

    vec<T, 2> elements; /* (row, col) and (row, col + 1) of this lane */
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
#ifdef __HAVE_BFLOAT__
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
#endif

template <class T, int Cols, int Rows = Cols> simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, Cols, Rows> m;
    m.elements[0] = m.elements[1] = value;
    return m;
}

/* Element (r, c) of the matrix is src[(origin.y + r) * elements_per_row + origin.x + c], or with
 * transpose_matrix src[(origin.x + c) * elements_per_row + origin.y + r]: the origin is (column,
 * row) of the matrix, as in metal-flash-attention's simdgroup_matrix_storage. Each lane moves its
 * own two elements, so loads and stores need no sync. As in Metal, the memory holds the matrix's
 * own element type, in device or threadgroup memory (strict mode: declarations only). */
#ifdef MSL_STRICT
#define MSL_SIMDGROUP_LOAD_BODY ;
#define MSL_SIMDGROUP_STORE_BODY ;
#else
#define MSL_SIMDGROUP_LOAD_BODY                                                                                    \
    {                                                                                                              \
        for (int j = 0; j < 2; j++)                                                                                \
            d.elements[j] = src[msl_rt::frag_element_index(j, elements_per_row, matrix_origin, transpose_matrix)]; \
    }
#define MSL_SIMDGROUP_STORE_BODY                                                                                   \
    {                                                                                                              \
        for (int j = 0; j < 2; j++)                                                                                \
            dst[msl_rt::frag_element_index(j, elements_per_row, matrix_origin, transpose_matrix)] = a.elements[j]; \
    }
#endif
#define MSL_SIMDGROUP_LOAD_STORE(space)                                                                             \
    template <class T, int Cols, int Rows>                                                                          \
    void simdgroup_load(simdgroup_matrix<T, Cols, Rows> &d, const space T *src, ulong elements_per_row = Cols,      \
                        ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false)                            \
        MSL_SIMDGROUP_LOAD_BODY template <class T, int Cols, int Rows>                                              \
        void simdgroup_store(const simdgroup_matrix<T, Cols, Rows> &a, space T *dst, ulong elements_per_row = Cols, \
                             ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) MSL_SIMDGROUP_STORE_BODY
MSL_SIMDGROUP_LOAD_STORE(device)
MSL_SIMDGROUP_LOAD_STORE(threadgroup)
#undef MSL_SIMDGROUP_LOAD_STORE
#undef MSL_SIMDGROUP_LOAD_BODY
#undef MSL_SIMDGROUP_STORE_BODY

} // namespace metal

namespace msl_rt {

/* d = a * b (+ c): one exchange gathers a's and b's elements (as float: exact for half and bfloat);
 * each lane then computes its own two outputs in float, rounded once to d's type. d may alias. */
template <class TD, class TA, class TB, class TC>
void mma(metal::simdgroup_matrix<TD, 8, 8> &d, const metal::simdgroup_matrix<TA, 8, 8> &a,
         const metal::simdgroup_matrix<TB, 8, 8> &b, const metal::simdgroup_matrix<TC, 8, 8> *c, const char *what,
         const char *file, unsigned line) {
    struct operands {
        float a[2], b[2];
    } mine = {{float(a.elements[0]), float(a.elements[1])}, {float(b.elements[0]), float(b.elements[1])}};
    auto g = exchange(mine, what, file, line);
    if (g.lanes != 0xFFFFFFFFu)
        api->fail(self(), "simdgroup_matrix operation without all 32 lanes of the SIMD-group", file, line);
    uint32_t row = frag_row(g.self), col = frag_col(g.self);
    float acc[2];
    for (uint32_t j = 0; j < 2; j++) {
        acc[j] = c ? float(c->elements[j]) : 0.0f;
        for (uint32_t k = 0; k < 8; k++)
            acc[j] += g.get(frag_lane(row, k)).a[k % 2] * g.get(frag_lane(k, col + j)).b[(col + j) % 2];
    }
    d.elements[0] = TD(acc[0]);
    d.elements[1] = TD(acc[1]);
}

} // namespace msl_rt

namespace metal {

/* As the MSL specification declares them (SIMD-group matrix functions): every operand a non-const
 * `thread` reference, so a const fragment is refused here as it may be by Apple's compiler. */
template <class TD, class TA, class TB, int Cols, int Rows, int K>
void simdgroup_multiply(simdgroup_matrix<TD, Cols, Rows> &d, simdgroup_matrix<TA, K, Rows> &a,
                        simdgroup_matrix<TB, Cols, K> &b, MSL_CALLER) {
    const simdgroup_matrix<TD, Cols, Rows> *no_c = nullptr;
    msl_rt::mma(d, a, b, no_c, "simdgroup_multiply", file, line);
}

template <class TD, class TA, class TB, class TC, int Cols, int Rows, int K>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, Cols, Rows> &d, simdgroup_matrix<TA, K, Rows> &a,
                                   simdgroup_matrix<TB, Cols, K> &b, simdgroup_matrix<TC, Cols, Rows> &c, MSL_CALLER) {
    msl_rt::mma(d, a, b, &c, "simdgroup_multiply_accumulate", file, line);
}

/* a * b and a + b of SIMD-group matrices, as simdgroup_multiply and element by element */
template <class T, int Cols, int Rows, int K>
simdgroup_matrix<T, Cols, Rows> operator*(const simdgroup_matrix<T, K, Rows> &a,
                                          const simdgroup_matrix<T, Cols, K> &b) {
    simdgroup_matrix<T, Cols, Rows> d;
    const simdgroup_matrix<T, Cols, Rows> *no_c = nullptr;
    msl_rt::mma(d, a, b, no_c, "simdgroup_matrix operator*", __FILE__, __LINE__);
    return d;
}
template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> operator+(const simdgroup_matrix<T, Cols, Rows> &a,
                                          const simdgroup_matrix<T, Cols, Rows> &b) {
    simdgroup_matrix<T, Cols, Rows> d;
    d.elements = a.elements + b.elements;
    return d;
}

/* ---- atomics: real atomics, since threadgroups run concurrently on several OS threads ---- */

enum memory_order {
    memory_order_relaxed = __ATOMIC_RELAXED,
    memory_order_acquire = __ATOMIC_ACQUIRE,
    memory_order_release = __ATOMIC_RELEASE,
    memory_order_acq_rel = __ATOMIC_ACQ_REL,
    memory_order_seq_cst = __ATOMIC_SEQ_CST
};

/* Holds the value's 32 bits, so every operation is one on a uint32_t. */
template <class T> struct atomic {
    static_assert(std::is_same<T, int>::value || std::is_same<T, unsigned>::value || std::is_same<T, float>::value,
                  "Metal atomics hold int, uint or float");
    typedef T value_type;
    uint32_t bits;
};
typedef atomic<int> atomic_int;
typedef atomic<unsigned> atomic_uint;
typedef atomic<float> atomic_float;

} // namespace metal

namespace msl_rt {

/* A's value type; A may carry volatile and an address space. */
template <class A> using atomic_value = typename std::remove_cv_t<A>::value_type;

template <class A> uint32_t *atomic_bits(A *object) { return (uint32_t *)&object->bits; }

template <class T> uint32_t to_bits(T v) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    return b;
}
template <class T> T from_bits(uint32_t b) {
    T v;
    std::memcpy(&v, &b, sizeof v);
    return v;
}

/* Read-modify-write by compare-and-swap, for what the builtins lack (float add, min, max). */
template <class A, class F> atomic_value<A> atomic_update(A *object, int order, F f) {
    using V = atomic_value<A>;
    uint32_t *p = atomic_bits(object), old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, to_bits(V(f(from_bits<V>(old)))), true, order, __ATOMIC_RELAXED))
        continue;
    return from_bits<V>(old);
}

} // namespace msl_rt

namespace metal {

template <class A> msl_rt::atomic_value<A> atomic_load_explicit(A *object, memory_order order) {
    return msl_rt::from_bits<msl_rt::atomic_value<A>>(__atomic_load_n(msl_rt::atomic_bits(object), order));
}
template <class A> void atomic_store_explicit(A *object, msl_rt::atomic_value<A> desired, memory_order order) {
    __atomic_store_n(msl_rt::atomic_bits(object), msl_rt::to_bits(desired), order);
}
template <class A>
msl_rt::atomic_value<A> atomic_exchange_explicit(A *object, msl_rt::atomic_value<A> desired, memory_order order) {
    uint32_t old = __atomic_exchange_n(msl_rt::atomic_bits(object), msl_rt::to_bits(desired), order);
    return msl_rt::from_bits<msl_rt::atomic_value<A>>(old);
}
template <class A>
bool atomic_compare_exchange_weak_explicit(A *object, msl_rt::atomic_value<A> *expected,
                                           msl_rt::atomic_value<A> desired, memory_order success,
                                           memory_order failure) {
    uint32_t seen = msl_rt::to_bits(*expected);
    bool ok = __atomic_compare_exchange_n(msl_rt::atomic_bits(object), &seen, msl_rt::to_bits(desired), true, success,
                                          failure);
    if (!ok) *expected = msl_rt::from_bits<msl_rt::atomic_value<A>>(seen);
    return ok;
}

/* int and uint add, subtract and combine bits alike in two's complement: one builtin on the bits. */
#define MSL_ATOMIC_FETCH(name, builtin, op)                                                                      \
    template <class A, class V = msl_rt::atomic_value<A>>                                                        \
    V atomic_fetch_##name##_explicit(A *object, msl_rt::atomic_value<A> operand, memory_order order) {           \
        if constexpr (std::is_floating_point<V>::value)                                                          \
            return msl_rt::atomic_update(object, order, [operand](V v) { return v op operand; });                \
        else return msl_rt::from_bits<V>(builtin(msl_rt::atomic_bits(object), msl_rt::to_bits(operand), order)); \
    }
MSL_ATOMIC_FETCH(add, __atomic_fetch_add, +)
MSL_ATOMIC_FETCH(sub, __atomic_fetch_sub, -)
MSL_ATOMIC_FETCH(and, __atomic_fetch_and, &)
MSL_ATOMIC_FETCH(or, __atomic_fetch_or, |)
MSL_ATOMIC_FETCH(xor, __atomic_fetch_xor, ^)
#undef MSL_ATOMIC_FETCH

template <class A, class V = msl_rt::atomic_value<A>>
V atomic_fetch_min_explicit(A *object, msl_rt::atomic_value<A> operand, memory_order order) {
    return msl_rt::atomic_update(object, order, [operand](V v) { return operand < v ? operand : v; });
}
template <class A, class V = msl_rt::atomic_value<A>>
V atomic_fetch_max_explicit(A *object, msl_rt::atomic_value<A> operand, memory_order order) {
    return msl_rt::atomic_update(object, order, [operand](V v) { return operand > v ? operand : v; });
}

} // namespace metal

#undef MSL_CALLER
#endif
