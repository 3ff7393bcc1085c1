/* Metal 4's tensors (<metal_tensor>), MetalPerformancePrimitives' matmul2d with its cooperative
 * tensors, and <metal_logging>'s os_log: included by msl_shim.h for sources compiled as Metal 4
 * (__METAL_VERSION__ >= 400).
 *
 * A tensor's dimension 0 is its innermost (a matrix of M rows and K columns has extents (K, M)).
 * matmul2d<descriptor, scope>::run computes C = A * B (+ C) in float, summed over k in order, and
 * rounds once to C's element type; operands in memory outside their extents read as 0 and such
 * destination elements are not written, as MPP masks them.
 *
 * Cooperative tensors hold a matrix spread over the threads of the operation's scope, some
 * elements per thread. Which thread holds which element is the GPU family's choice, not part of
 * the API: by default (__MSL_CPU_TENSOR_LAYOUT__ 0) the emulated family's, Apple10's (16 x 16
 * tiles, lane L holding rows fm, fm + 8 and columns fn .. fn + 3 of each, tiles in row-major order
 * of the stored matrix, as MLX's and torch's NAX/MPP kernels copy them; Apple9's when asked); with
 * __MSL_CPU_TENSOR_LAYOUT__ 1 by a rule that is nobody's, an affine permutation of the elements
 * drawn per process (FLASHATTN_MPS_CPU_TENSOR_LAYOUT_SEED fixes it) with one slot per thread more
 * than needed, so a kernel that assumes a layout instead of asking get_multidimensional_index and
 * is_valid_element gives wrong results here rather than on another GPU.
 *
 * Exchanges between lanes go through the SIMD-group's exchange (msl_sync.h); cooperative operands
 * and reductions at execution_simdgroups<N> (N > 1) scope are refused at run time (only operands
 * in memory cross SIMD-groups here).
 *
 * What Apple's headers declare (MPPTensorOpsMatMul2d.h and its traits, macOS 26 SDK) is enforced
 * at compile time, on the device and by the strict check, each refusal naming its rule: the
 * scopes (tensor-scope), the element types matmul2d takes (tensor-operand-types), operands that
 * are rank-2 tensors or cooperative tensors (tensor-operand-kind, tensor-rank) bound as lvalues
 * (tensor-operand-lvalue) outside constant memory (tensor-storage), what the cooperative tensors'
 * getters take (tensor-cooperative-getter), cooperative operands of the operation that made them
 * (tensor-cooperative-operand), reductions of one element type (tensor-reduction-types); the
 * descriptor's constructor is Apple's, so strict_check.py names a misbuilt one (tensor-descriptor). */
#ifndef MSL_TENSOR_H
#define MSL_TENSOR_H

#include <cstdlib>
#include <ctime>
#include <utility>

#define MSL_CALLER unsigned line = __builtin_LINE(), const char *file = __builtin_FILE()

#ifndef __MSL_CPU_GPU_FAMILY__
#define __MSL_CPU_GPU_FAMILY__ 10
#endif
#ifndef __MSL_CPU_TENSOR_LAYOUT__
#define __MSL_CPU_TENSOR_LAYOUT__ 0
#endif
static_assert(__MSL_CPU_GPU_FAMILY__ == 10 || __MSL_CPU_GPU_FAMILY__ == 9,
              "the CPU Metal device emulates the Apple9 and Apple10 GPU families");

namespace metal {

constexpr size_t dynamic_extent = size_t(-1);

namespace detail {
template <class I, class Seq> struct dynamic_extents;
}

/* extents<I, E...>: E[r] static, or dynamic_extent and given at construction */
template <class I, size_t... E> struct extents {
    using index_type = I;
    using size_type = std::make_unsigned_t<I>;
    using rank_type = size_t;
    static constexpr size_t rank() { return sizeof...(E); }
    static constexpr size_t rank_dynamic() { return ((E == dynamic_extent) + ... + 0); }
    static constexpr size_t static_extent(size_t r) {
        constexpr size_t e[] = {E..., 0};
        return e[r];
    }
    I values[sizeof...(E) ? sizeof...(E) : 1];

    constexpr extents() : values{} {
        for (size_t r = 0; r < rank(); r++) values[r] = static_extent(r) == dynamic_extent ? 0 : I(static_extent(r));
    }
    /* all extents, or the dynamic ones only */
    template <
        class... J,
        std::enable_if_t<(sizeof...(J) > 0) && (sizeof...(J) == rank() || sizeof...(J) == rank_dynamic()), int> = 0>
    constexpr extents(J... given) : values{} {
        const I v[] = {I(given)...};
        for (size_t r = 0, d = 0; r < rank(); r++)
            values[r] = sizeof...(J) == rank()               ? v[r]
                        : static_extent(r) == dynamic_extent ? v[d++]
                                                             : I(static_extent(r));
    }
    constexpr I extent(size_t r) const { return values[r]; }
};

template <class I, size_t R> using dextents = typename detail::dynamic_extents<I, std::make_index_sequence<R>>::type;
namespace detail {
template <class I, size_t... R> struct dynamic_extents<I, std::index_sequence<R...>> {
    using type = extents<I, ((void)R, dynamic_extent)...>;
};
} // namespace detail

/* how a tensor is bound: all three hold a pointer, extents and strides here */
struct tensor_inline {};
struct tensor_handle {};
struct tensor_offset {};

/* tensor<[address space] T, Extents, Tag>: a view of memory; strides in elements, dimension 0 the
 * innermost (packed: stride 1, then the product of the extents below) */
template <class E, class X, class Tag = tensor_handle> struct tensor {
    using element_type = E;
    using value_type = std::remove_cv_t<metal::remove_addrspace_t<E>>;
    using extents_type = X;
    using index_type = typename X::index_type;
    using data_handle_type = E *;
    using tag_type = Tag;
    static constexpr size_t R = X::rank();

    E *pointer = nullptr;
    X ext;
    index_type stride[R ? R : 1] = {};

    tensor() = default;
    tensor(E *p, X e) : pointer(p), ext(e) {
        index_type s = 1;
        for (size_t r = 0; r < R; r++) stride[r] = s, s *= ext.extent(r);
    }
    template <class S, class = decltype(std::declval<const S &>()[0])>
    tensor(E *p, X e, const S &strides) : pointer(p), ext(e) {
        for (size_t r = 0; r < R; r++) stride[r] = index_type(strides[r]);
    }
    template <class E2, class X2, class T2, std::enable_if_t<std::is_convertible_v<E2 *, E *>, int> = 0>
    tensor(const tensor<E2, X2, T2> &o) : pointer(o.pointer), ext() {
        for (size_t r = 0; r < R; r++) ext.values[r] = o.ext.values[r], stride[r] = o.stride[r];
    }

    static constexpr size_t get_rank() { return R; }
    constexpr index_type get_extent(size_t r) const { return ext.extent(r); }
    constexpr index_type get_stride(size_t r) const { return stride[r]; }
    constexpr X extents() const { return ext; }
    constexpr E *data() const { return pointer; }
    constexpr E *get_data_handle() const { return pointer; }

    /* the element at an index, or 0 (never read) outside the extents */
    value_type get(const index_type (&at)[R ? R : 1], bool *inside = nullptr) const {
        int64_t offset = 0;
        for (size_t r = 0; r < R; r++) {
            if (at[r] < 0 || at[r] >= ext.extent(r)) {
                if (inside) *inside = false;
                return value_type(0);
            }
            offset += int64_t(at[r]) * int64_t(stride[r]);
        }
        if (inside) *inside = true;
        return pointer[offset];
    }
    E &operator[](const array<index_type, R> &at) const {
        int64_t offset = 0;
        for (size_t r = 0; r < R; r++) offset += int64_t(at[r]) * int64_t(stride[r]);
        return pointer[offset];
    }
    template <class... J, std::enable_if_t<sizeof...(J) == R && (std::is_integral_v<J> && ...), int> = 0>
    E &operator()(J... at) const {
        return (*this)[array<index_type, R>{index_type(at)...}];
    }

    /* the view from an offset on: extents SE (dynamic_extent: what remains), all dynamic without them */
    template <size_t... SE, class... O> auto slice(O... offsets) const {
        static_assert(sizeof...(O) == R, "slice: one offset per dimension");
        static_assert(sizeof...(SE) == 0 || sizeof...(SE) == R, "slice: one extent per dimension, or none");
        const index_type off[R] = {index_type(offsets)...};
        int64_t start = 0;
        for (size_t r = 0; r < R; r++) start += int64_t(off[r]) * int64_t(stride[r]);
        using SX = std::conditional_t<sizeof...(SE) == 0, dextents<index_type, R>, metal::extents<index_type, SE...>>;
        SX sx;
        for (size_t r = 0; r < R; r++)
            sx.values[r] = SX::static_extent(r) == dynamic_extent ? index_type(ext.extent(r) - off[r])
                                                                  : index_type(SX::static_extent(r));
        tensor<E, SX, tensor_inline> view(pointer + start, sx);
        for (size_t r = 0; r < R; r++) view.stride[r] = stride[r];
        return view;
    }
};
template <class E, class X> tensor(E *, X) -> tensor<E, X, tensor_inline>;
template <class E, class X, class S> tensor(E *, X, S) -> tensor<E, X, tensor_inline>;

/* The scopes an operation runs at, as Apple declares them: one thread, or N SIMD-groups
 * (execution_simdgroup is N = 1; all of a threadgroup's is N = its SIMD-group count). At
 * execution_thread the CPU device takes operands in memory only. */
template <size_t N> struct execution_threads {
    static_assert(N == 1, "execution_threads<N> exists for N = 1 only (execution_thread) [rule: tensor-scope]");
};
using execution_thread = execution_threads<1>;
template <size_t N> struct execution_simdgroups {
    static_assert(N > 0, "execution_simdgroups<N> needs N > 0 [rule: tensor-scope]");
    static constexpr int simdgroups = int(N);
};
using execution_simdgroup = execution_simdgroups<1>;
/* Not Apple's: named here so that a kernel using it is told why it is refused (tensor-scope). */
struct execution_threadgroup {};

/* <metal_logging>: messages go nowhere on the CPU device (Metal drops them too unless the host
 * enabled logging for the command queue). An aggregate with static members: a logger lives in
 * constant memory, where the strict check's address spaces admit no constructor or member call. */
struct os_log {
    const char *subsystem, *category;
    template <class... A> static void log(A...) {}
    template <class... A> static void log_debug(A...) {}
    template <class... A> static void log_info(A...) {}
    template <class... A> static void log_error(A...) {}
    template <class... A> static void log_fault(A...) {}
};
constexpr constant os_log os_log_default{};

} // namespace metal

namespace msl_rt {
namespace tensor_detail {

/* ---- who runs an operation of a scope ---- */

template <class Scope> struct participants {
    uint32_t rank, count; /* this thread among the scope's threads */
    uint32_t simdgroup, lane;
};
template <class Scope> constexpr bool thread_scope = std::is_same_v<Scope, metal::execution_thread>;

template <class Scope> participants<Scope> who(const char *file, unsigned line) {
    msl_thread *t = self();
    if constexpr (thread_scope<Scope>) { /* the thread alone */
        return {0, 1, t->simdgroup_index_in_threadgroup, t->thread_index_in_simdgroup};
    } else {
        uint32_t groups = uint32_t(Scope::simdgroups);
        if (Scope::simdgroups > 1 && uint32_t(Scope::simdgroups) != t->simdgroups_per_threadgroup)
            api->fail(t, "execution_simdgroups<N>: the threadgroup has another number of SIMD-groups", file, line);
        uint32_t sg = Scope::simdgroups == 1 ? 0 : t->simdgroup_index_in_threadgroup;
        return {sg * MSL_SIMD_WIDTH + t->thread_index_in_simdgroup, groups * MSL_SIMD_WIDTH, sg,
                t->thread_index_in_simdgroup};
    }
}

/* Every participant arrives (a SIMD-group sync, or a threadgroup barrier ordering no memory). */
template <class Scope> void arrive(const char *what, const char *file, unsigned line) {
    if constexpr (thread_scope<Scope>) return;
    else if (Scope::simdgroups == 1) simd_sync(MSL_SYNC_SIMDGROUP_BARRIER, what, file, line);
    else api->sync(self(), MSL_SYNC_THREADGROUP_BARRIER, what, file, line);
}

/* ---- layouts: (thread, slot) -> element of the logical Rows x Cols matrix, or none ---- */

/* per process, unless FLASHATTN_MPS_CPU_TENSOR_LAYOUT_SEED fixes it; set once (a race sets one value) */
inline uint32_t layout_seed() {
    static uint32_t seed; /* 0: not drawn yet */
    uint32_t s = __atomic_load_n(&seed, __ATOMIC_ACQUIRE);
    if (s) return s;
    const char *given = std::getenv("FLASHATTN_MPS_CPU_TENSOR_LAYOUT_SEED");
    uint64_t mix = given && *given
                       ? std::strtoull(given, nullptr, 10)
                       : uint64_t(std::time(nullptr)) * 0x9E3779B97F4A7C15ull ^ __builtin_readcyclecounter();
    mix ^= mix >> 29;
    mix *= 0xBF58476D1CE4E5B9ull;
    uint32_t want = uint32_t(mix >> 32) | 1u;
    uint32_t expected = 0;
    __atomic_compare_exchange_n(&seed, &expected, want, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return expected ? expected : want;
}

constexpr uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }
inline uint32_t gcd(uint32_t a, uint32_t b) { return b ? gcd(b, a % b) : a; }
inline uint32_t inverse_mod(uint32_t a, uint32_t m) { /* a coprime to m */
    int64_t t = 0, nt = 1, r = m, nr = a;
    while (nr) {
        int64_t q = r / nr, x = t - q * nt, y = r - q * nr;
        t = nt, nt = x, r = nr, nr = y;
    }
    return uint32_t(t < 0 ? t + m : t);
}

/* A matrix (Kind 0: Rows x Cols; Transposed: stored as Cols x Rows) or the row reductions of one
 * (Kind 1: one value per row of a Rows x Cols matrix), at Scope. */
template <int Rows, int Cols, bool Transposed, class Scope, int Kind> struct layout {
    static_assert(!thread_scope<Scope>, "the CPU Metal device runs matmul2d at execution_thread scope on tensors in "
                                        "memory only, without cooperative tensors");
    /* Apple10 lays a transposed operand out as stored (MLX and torch load K^T's fragments from K's
     * rows), Apple9 as the logical matrix (torch's a9 kernels load them transposed) */
    static constexpr bool as_stored = Transposed && __MSL_CPU_GPU_FAMILY__ == 10;
    static constexpr uint32_t stored_rows = as_stored ? Cols : Rows, stored_cols = as_stored ? Rows : Cols;
    static constexpr uint32_t tiles = ceil_div(stored_rows, 16) * ceil_div(stored_cols, 16);
    static constexpr uint32_t family_capacity(uint32_t groups) {
        return Kind ? 2 * ceil_div(Rows, 16) : ceil_div(tiles, groups) * 8;
    }
    static constexpr uint32_t scrambled_capacity(uint32_t groups) {
        return Kind ? Rows + 1 : ceil_div(uint32_t(Rows * Cols), groups * MSL_SIMD_WIDTH) + 1;
    }
    static constexpr uint32_t storage = family_capacity(1) > scrambled_capacity(1) ? family_capacity(1)
                                                                                   : scrambled_capacity(1);

    static uint32_t capacity(uint32_t groups) {
        return __MSL_CPU_TENSOR_LAYOUT__ ? scrambled_capacity(groups) : family_capacity(groups);
    }

    /* the element (row, col) slot s of thread (simdgroup g of `groups`, lane) holds; false: none */
    static bool element(uint32_t groups, uint32_t g, uint32_t lane, uint32_t s, int *row, int *col) {
        if (s >= capacity(groups)) return false;
        if (__MSL_CPU_TENSOR_LAYOUT__) return scrambled(groups, g * MSL_SIMD_WIDTH + lane, s, row, col);
        uint32_t fm, fn, dc;
        if (__MSL_CPU_GPU_FAMILY__ == 10) {
            fm = (lane >> 2 & 4) | (lane >> 1 & 3);
            fn = ((lane >> 2 & 2) | (lane & 1)) * 4;
        } else {
            fm = (lane >> 4 & 1) * 4 + (lane >> 1 & 3);
            fn = (lane >> 3 & 1) * 4 + (lane & 1) * 2;
        }
        if (Kind) {
            *row = int(16 * (s / 2) + fm + 8 * (s % 2));
            *col = 0;
            return *row < Rows;
        }
        uint32_t t, j;
        if (__MSL_CPU_GPU_FAMILY__ == 10) { /* 8 slots per tile, tiles in turn */
            t = (s / 8) * groups + g, j = s % 8;
            dc = j & 3;
        } else { /* Apple9: each tile's first row of slots, then their second ones; columns {0, 1, 8, 9} */
            uint32_t across = 4 * ceil_div(stored_cols, 16), band = s / (2 * across), in_band = s % (2 * across);
            t = (band * ceil_div(stored_cols, 16) + in_band % across / 4) * groups + g;
            j = in_band / across * 4 + in_band % 4;
            dc = (j & 1) | (j >> 1 & 1) << 3;
        }
        if (t >= tiles) return false;
        uint32_t sr = 16 * (t / ceil_div(stored_cols, 16)) + fm + (j >> 2) * 8,
                 sc = 16 * (t % ceil_div(stored_cols, 16)) + fn + dc;
        if (sr >= stored_rows || sc >= stored_cols) return false;
        *row = int(as_stored ? sc : sr);
        *col = int(as_stored ? sr : sc);
        return true;
    }

    static bool scrambled(uint32_t groups, uint32_t rank, uint32_t s, int *row, int *col) {
        uint32_t seed = layout_seed();
        if (Kind) {
            uint32_t r = (s + rank * 7u + seed) % uint32_t(Rows + 1);
            *row = int(r), *col = 0;
            return r < uint32_t(Rows);
        }
        uint32_t threads = groups * MSL_SIMD_WIDTH, total = threads * scrambled_capacity(groups);
        uint32_t a = (seed % total) | 1u;
        while (gcd(a, total) != 1) a += 2;
        uint32_t b = (seed >> 7) % total, g = s * threads + rank;
        uint32_t e = uint32_t(uint64_t(inverse_mod(a, total)) * ((g + total - b) % total) % total);
        if (e >= uint32_t(Rows * Cols)) return false;
        *row = int(e / Cols), *col = int(e % Cols);
        return true;
    }
};

} // namespace tensor_detail
} // namespace msl_rt

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
    enum class mode { multiply, multiply_accumulate };
    int m, n, k;
    bool transpose_left, transpose_right, relaxed_precision;
    mode matmul_mode;
    constexpr matmul2d_descriptor(int m_, int n_, int k_ = int(metal::dynamic_extent), bool transpose_left_ = false,
                                  bool transpose_right_ = false, bool relaxed_precision_ = false,
                                  mode matmul_mode_ = mode::multiply)
        : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
          relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
};

enum class reduction_operation { sum, max, min };
template <class T> struct reduction_operation_identity {
    static constexpr T sum_identity = T(0);
    static constexpr T max_identity = metal::numeric_limits<T>::lowest(); /* as Apple's: finite */
    static constexpr T min_identity = metal::numeric_limits<T>::max();
};

namespace detail {
/* Element types by a code (0: none matmul2d takes) */
template <class T> constexpr int type_code() {
    using U = std::remove_cv_t<metal::remove_addrspace_t<T>>;
    if constexpr (!std::is_same_v<U, T>) return 0; /* const or address-space qualified */
    else if constexpr (std::is_same_v<T, half>) return 1;
    else if constexpr (std::is_same_v<T, bfloat>) return 2;
    else if constexpr (std::is_same_v<T, float>) return 3;
    else if constexpr (std::is_same_v<T, int8_t>) return 4;
    else if constexpr (std::is_same_v<T, uint8_t>) return 5;
    else if constexpr (std::is_same_v<T, int32_t>) return 6;
    else return 0;
}
/* The (left, right, destination) element types matmul2d takes, as the macOS 26 SDK's
 * MPPTensorOpsMatMul2d.h lists them (those of MSL's arithmetic types; its 4-bit formats are not
 * emulated). int8_t x int8_t into half, float or bfloat comes with a macOS 27.3 deployment
 * target, beyond the 26.2 the tensor path needs. */
constexpr int declared_triples[][3] = {
    {1, 1, 1}, {1, 4, 1}, {1, 5, 1}, {4, 1, 1}, {5, 1, 1}, {1, 1, 3}, {1, 3, 3}, {1, 4, 3}, {1, 5, 3}, {3, 1, 3},
    {3, 3, 3}, {3, 4, 3}, {3, 5, 3}, {4, 1, 3}, {5, 1, 3}, {4, 3, 3}, {5, 3, 3}, {4, 4, 6}, {5, 5, 6}, {2, 2, 2},
    {2, 2, 3}, {2, 3, 3}, {2, 4, 2}, {2, 4, 3}, {3, 2, 3}, {4, 2, 2}, {4, 2, 3}, {2, 1, 2}, {2, 1, 1}, {2, 1, 3},
    {1, 2, 2}, {1, 2, 1}, {1, 2, 3}, {2, 5, 2}, {2, 5, 3}, {5, 2, 2}, {5, 2, 3}};
template <class L, class R, class D> constexpr bool declared_types() {
    const int l = type_code<L>(), r = type_code<R>(), d = type_code<D>();
    for (const auto &t : declared_triples)
        if (t[0] == l && t[1] == r && t[2] == d) return l != 0;
    return false;
}
} // namespace detail

/* A matrix spread over the threads of a scope: this thread's slots of it. */
template <class T, class Layout> struct cooperative_tensor {
    using element_type = T;
    using value_type = T;
    using layout_type = Layout;
    T elements[Layout::storage];

    static msl_rt::tensor_detail::participants<typename Layout::scope> who(const char *file, unsigned line) {
        return msl_rt::tensor_detail::who<typename Layout::scope>(file, line);
    }
    uint16_t get_capacity(MSL_CALLER) const {
        auto w = who(file, line);
        return uint16_t(Layout::capacity(w.count / MSL_SIMD_WIDTH));
    }
    T &operator[](uint32_t i) { return elements[i]; }
    const T &operator[](uint32_t i) const { return elements[i]; }
    bool is_valid_element(uint32_t i, MSL_CALLER) const {
        int r, c;
        auto w = who(file, line);
        return Layout::element(w.count / MSL_SIMD_WIDTH, w.simdgroup, w.lane, i, &r, &c);
    }
    /* the element's index: [0] its column, [1] its row (row reductions: [0] the row) */
    auto get_multidimensional_index(uint32_t i, MSL_CALLER) const {
        int r = -1, c = -1;
        auto w = who(file, line);
        Layout::element(w.count / MSL_SIMD_WIDTH, w.simdgroup, w.lane, i, &r, &c);
        if constexpr (Layout::kind == 1) return metal::array<int, 1>{r};
        else return metal::array<int, 2>{c, r};
    }
    /* from / into a tensor holding the matrix as stored (transposed operands transposed) */
    /* f(slot, at) for each element this lane holds, `at` its index in a tensor holding the matrix
     * as stored (transposed operands transposed) */
    template <class Index, class F> void each_stored_element(F f, unsigned line, const char *file) const {
        auto w = who(file, line);
        uint32_t groups = w.count / MSL_SIMD_WIDTH;
        for (uint32_t s = 0; s < Layout::capacity(groups); s++) {
            int r, c;
            if (!Layout::element(groups, w.simdgroup, w.lane, s, &r, &c)) continue;
            Index at[2] = {Layout::transposed ? r : c, Layout::transposed ? c : r};
            f(s, at);
        }
    }
    template <class E, class X, class Tag> void load(const metal::tensor<E, X, Tag> &t, MSL_CALLER) {
        using Index = typename metal::tensor<E, X, Tag>::index_type;
        each_stored_element<Index>([&](uint32_t s, Index(&at)[2]) { elements[s] = T(float(t.get(at))); }, line, file);
    }
    template <class E, class X, class Tag> void store(const metal::tensor<E, X, Tag> &t, MSL_CALLER) const {
        using Index = typename metal::tensor<E, X, Tag>::index_type;
        using V = typename metal::tensor<E, X, Tag>::value_type;
        each_stored_element<Index>(
            [&](uint32_t s, Index(&at)[2]) {
                bool inside;
                t.get(at, &inside);
                if (inside) t[{at[0], at[1]}] = V(float(elements[s]));
            },
            line, file);
    }
};

namespace detail {
template <int Rows, int Cols, bool Transposed, class Scope, int Kind>
struct layout : msl_rt::tensor_detail::layout<Rows, Cols, Transposed, Scope, Kind> {
    using scope = Scope;
    static constexpr int rows = Rows, cols = Cols, kind = Kind;
    static constexpr bool transposed = Transposed;
};

template <class X> constexpr bool is_cooperative = false;
template <class T, class L> constexpr bool is_cooperative<cooperative_tensor<T, L>> = true;
template <class X> constexpr bool is_tensor = false;
template <class E, class X, class Tag> constexpr bool is_tensor<metal::tensor<E, X, Tag>> = true;
template <class X> constexpr bool is_operand = is_cooperative<std::remove_cv_t<X>> || is_tensor<std::remove_cv_t<X>>;

/* the scopes MPP takes (MPPTensorOpsTraits.h: execution_thread or execution_simdgroups<N>) */
template <class S> constexpr bool is_scope = std::is_same_v<S, metal::execution_thread>;
template <size_t N> constexpr bool is_scope<metal::execution_simdgroups<N>> = true;

template <class E> constexpr bool in_constant = false;
template <class E> constexpr bool in_constant<MSL_CONSTANT E> = true;

/* an operand's element type: a tensor's element type without its address space (a const one
 * stays const), a cooperative tensor's value type */
template <class X, class = void> struct operand_element {
    using type = void;
};
template <class X> struct operand_element<X, std::enable_if_t<is_tensor<std::remove_cv_t<X>>>> {
    using type = metal::remove_addrspace_t<typename std::remove_cv_t<X>::element_type>;
};
template <class X> struct operand_element<X, std::enable_if_t<is_cooperative<std::remove_cv_t<X>>>> {
    using type = typename std::remove_cv_t<X>::value_type;
};
template <class X> using operand_element_t = std::remove_cv_t<typename operand_element<X>::type>;

/* an operand run() can compute with: a cooperative tensor or a rank-2 tensor */
template <class X> constexpr bool computable() {
    if constexpr (is_tensor<std::remove_cv_t<X>>) return std::remove_cv_t<X>::extents_type::rank() == 2;
    else return is_cooperative<std::remove_cv_t<X>>;
}

/* what run() requires of one operand (Destination: it is written) */
template <class X, bool Destination> constexpr void check_operand() {
    static_assert(is_operand<X>,
                  "matmul2d::run takes metal::tensor or cooperative tensor operands [rule: tensor-operand-kind]");
    if constexpr (is_tensor<std::remove_cv_t<X>>) {
        using T = std::remove_cv_t<X>;
        static_assert(T::extents_type::rank() == 2, "matmul2d's operands are rank-2 tensors [rule: tensor-rank]");
        static_assert(Destination || !in_constant<typename T::element_type>,
                      "matmul2d's inputs in constant memory need a macOS 27.3 deployment target: device, "
                      "threadgroup or thread memory [rule: tensor-storage]");
        static_assert(!Destination || !in_constant<typename T::element_type>,
                      "matmul2d's destination cannot be in constant memory [rule: tensor-storage]");
    }
}

/* All of a cooperative tensor, from every lane of its SIMD-group: matrix[row * cols + col]. */
template <class T, class L>
void gather(const cooperative_tensor<T, L> &ct, float *matrix, const char *file, unsigned line) {
    auto w = msl_rt::tensor_detail::who<typename L::scope>(file, line);
    if (L::scope::simdgroups != 1)
        msl_rt::api->fail(msl_rt::self(),
                          "cooperative operands and reductions beyond one SIMD-group's scope are not supported by "
                          "the CPU Metal device (operands in memory are)",
                          file, line);
    const uint32_t capacity = L::capacity(1);
    struct chunk {
        float v[16];
    };
    for (uint32_t first = 0; first < capacity; first += 16) {
        chunk mine;
        for (uint32_t s = first; s < first + 16; s++) mine.v[s - first] = s < capacity ? float(ct.elements[s]) : 0.0f;
        auto g = msl_rt::exchange(mine, "cooperative tensor exchange", file, line);
        if (g.lanes != 0xFFFFFFFFu)
            msl_rt::api->fail(msl_rt::self(), "a cooperative tensor operation without all 32 lanes of the SIMD-group",
                              file, line);
        for (uint32_t lane = 0; lane < MSL_SIMD_WIDTH; lane++) {
            chunk theirs = g.get(lane);
            for (uint32_t s = first; s < first + 16 && s < capacity; s++) {
                int r, c;
                if (L::element(1, 0, lane, s, &r, &c)) matrix[r * L::cols + c] = theirs.v[s - first];
            }
        }
    }
    (void)w;
}

/* One operand of a product, logical element (row, col): from memory (stored transposed or not) or
 * from the gathered cooperative tensor. */
template <class X, bool Transposed> struct operand {
    const X &x;
    float *matrix; /* cooperative: the gathered values */
    int cols;
    float at(int r, int c) const {
        if constexpr (is_cooperative<X>) {
            return matrix[r * cols + c];
        } else {
            typename X::index_type i[2] = {Transposed ? r : c, Transposed ? c : r};
            return float(x.get(i));
        }
    }
    /* the extent along the product's K: columns of a left operand, rows of a right one */
    template <bool Left> int k_extent() const {
        if constexpr (is_cooperative<X>) return Left ? X::layout_type::cols : X::layout_type::rows;
        else return int(x.get_extent(Left == Transposed ? 1 : 0));
    }
};
} // namespace detail

template <matmul2d_descriptor D, class Scope> struct matmul2d {
    static_assert(detail::is_scope<Scope>, "matmul2d's scope is execution_simdgroups<N> (execution_simdgroup: N = 1) "
                                           "or execution_thread; MPP has no threadgroup scope [rule: tensor-scope]");
    static constexpr bool dynamic_k = D.k == int(metal::dynamic_extent);
    static constexpr int K = dynamic_k ? 0 : D.k;

    /* an operand in memory, or a cooperative tensor of this operation's matrix at its scope */
    template <class X, int Rows, int Cols, bool Transposed> static constexpr bool fits() {
        if constexpr (detail::is_cooperative<X>) {
            using L = typename X::layout_type;
            return L::kind == 0 && L::rows == Rows && L::cols == Cols && L::transposed == Transposed &&
                   std::is_same_v<typename L::scope, Scope>;
        } else {
            return true;
        }
    }

    /* the input getters take element types, unqualified, of a triple matmul2d takes */
    template <class LE, class RE, class E> static constexpr void check_input_getter() {
        static_assert(!detail::is_operand<LE> && !detail::is_operand<RE> && !detail::is_operand<E>,
                      "get_left/right_input_cooperative_tensor<LeftElement, RightElement, Element> take element "
                      "types, not tensors [rule: tensor-cooperative-getter]");
        static_assert(detail::declared_types<LE, RE, E>(),
                      "matmul2d takes no such (left, right, destination) element types [rule: tensor-operand-types]");
    }

    template <class A, class B, class T>
    using destination_t = cooperative_tensor<T, detail::layout<D.m, D.n, false, Scope, 0>>;

    /* operand types (tensors or cooperative tensors) and the destination's element type */
    template <class A, class B, class T> auto get_destination_cooperative_tensor() const {
        static_assert(detail::is_operand<A> && detail::is_operand<B>,
                      "get_destination_cooperative_tensor<LeftOperand, RightOperand, Element> takes the operands' "
                      "types (tensors or cooperative tensors), not element types [rule: tensor-cooperative-getter]");
        static_assert(!(detail::is_operand<A> && detail::is_operand<B>) ||
                          (detail::type_code<typename detail::operand_element<A>::type>() != 0 &&
                           detail::type_code<typename detail::operand_element<B>::type>() != 0),
                      "a cooperative destination's operands hold unqualified element types (not const) "
                      "[rule: tensor-operand-types]");
        static_assert(!(detail::is_operand<A> && detail::is_operand<B>) ||
                          detail::declared_types<detail::operand_element_t<A>, detail::operand_element_t<B>, T>(),
                      "matmul2d takes no such (left, right, destination) element types [rule: tensor-operand-types]");
        return destination_t<A, B, T>{};
    }
    template <class A, class B, class T> auto get_row_reduction_destination_cooperative_tensor() const {
        return cooperative_tensor<T, detail::layout<D.m, D.n, false, Scope, 1>>{};
    }
    template <class A, class B, class T> auto get_left_input_cooperative_tensor() const {
        check_input_getter<A, B, T>();
        static_assert(!dynamic_k, "a cooperative input needs the descriptor's K");
        return cooperative_tensor<A, detail::layout<D.m, K, D.transpose_left, Scope, 0>>{};
    }
    /* the left input holding another operation's destination (as P = softmax(Q K^T) feeds P V) */
    template <class A, class B, class T, class S, class LS>
    auto get_left_input_cooperative_tensor(const cooperative_tensor<S, LS> &source, MSL_CALLER) const {
        auto input = get_left_input_cooperative_tensor<A, B, T>();
        using L = typename decltype(input)::layout_type;
        static_assert(LS::kind == 0 && LS::rows == L::rows && LS::cols == L::cols,
                      "the source's matrix must be this operation's left operand [rule: tensor-cooperative-operand]");
        float matrix[LS::rows * LS::cols];
        detail::gather(source, matrix, file, line);
        auto w = msl_rt::tensor_detail::who<Scope>(file, line);
        for (uint32_t s = 0; s < L::capacity(1); s++) {
            int r, c;
            if (L::element(1, 0, w.lane, s, &r, &c))
                input.elements[s] = typename decltype(input)::value_type(matrix[r * L::cols + c]);
        }
        return input;
    }
    template <class A, class B, class T> auto get_right_input_cooperative_tensor() const {
        check_input_getter<A, B, T>();
        static_assert(!dynamic_k, "a cooperative input needs the descriptor's K");
        return cooperative_tensor<B, detail::layout<K, D.n, D.transpose_right, Scope, 0>>{};
    }

    /* C = A * B, or C += A * B (multiply_accumulate); A and B in memory or cooperative, C either.
     * Apple's run takes thread references: lvalues, const or not. */
    template <class A, class B, class C> void run(A &a, B &b, C &c, MSL_CALLER) const {
        detail::check_operand<A, false>();
        detail::check_operand<B, false>();
        detail::check_operand<C, true>();
        /* past a refused operand, only its own refusal is reported */
        constexpr bool computable = detail::computable<A>() && detail::computable<B>() && detail::computable<C>();
        static_assert(!computable || detail::declared_types<detail::operand_element_t<A>, detail::operand_element_t<B>,
                                                            detail::operand_element_t<C>>(),
                      "matmul2d takes no such (left, right, destination) element types [rule: tensor-operand-types]");
        static_assert(!(detail::is_cooperative<std::remove_cv_t<C>> && std::is_const_v<C>),
                      "a cooperative destination must not be const [rule: tensor-cooperative-operand]");
        static_assert(fits<std::remove_cv_t<A>, D.m, K, D.transpose_left>(),
                      "run: the left cooperative tensor is not this operation's [rule: tensor-cooperative-operand]");
        static_assert(fits<std::remove_cv_t<B>, K, D.n, D.transpose_right>(),
                      "run: the right cooperative tensor is not this operation's [rule: tensor-cooperative-operand]");
        static_assert(
            fits<std::remove_cv_t<C>, D.m, D.n, false>(),
            "run: the destination cooperative tensor is not this operation's [rule: tensor-cooperative-operand]");
        if constexpr (!computable) {
            (void)a, (void)b, (void)c;
        } else if constexpr (detail::is_cooperative<std::remove_cv_t<C>>) {
            execute(a, b, c, file, line);
        } else {
            std::remove_cv_t<C> view = c; /* a view: writing through a const one writes its memory */
            execute(a, b, view, file, line);
        }
    }
    /* a temporary (a slice not bound to a variable) binds to no thread reference */
    template <class A, class B, class C> void run(A &&, B &&, C &&, MSL_CALLER) const {
        static_assert(sizeof(A) == 0, "matmul2d::run takes its operands as lvalues (thread references): bind a "
                                      "slice to a variable first [rule: tensor-operand-lvalue]");
    }

  private:
    template <class A, class B, class C>
    void execute(const A &a, const B &b, C &c, const char *file, unsigned line) const {
        auto w = msl_rt::tensor_detail::who<Scope>(file, line);
        constexpr int ka = detail::is_cooperative<A> ? D.m * (K ? K : 1) : 1;
        constexpr int kb = detail::is_cooperative<B> ? D.n * (K ? K : 1) : 1;
        float left[ka], right[kb];
        if constexpr (detail::is_cooperative<A>) detail::gather(a, left, file, line);
        if constexpr (detail::is_cooperative<B>) detail::gather(b, right, file, line);
        if constexpr (!detail::is_cooperative<A> && !detail::is_cooperative<B>)
            msl_rt::tensor_detail::arrive<Scope>("matmul2d::run", file, line);
        detail::operand<A, D.transpose_left> pa{a, left, dynamic_k ? 0 : K};
        detail::operand<B, D.transpose_right> pb{b, right, D.n};
        int k = dynamic_k ? pa.template k_extent<true>() : K;
        if (dynamic_k && pb.template k_extent<false>() < k) k = pb.template k_extent<false>();
        const bool accumulate = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
        auto product = [&](int r, int col, float acc) {
            for (int i = 0; i < k; i++) acc += pa.at(r, i) * pb.at(i, col);
            return acc;
        };
        if constexpr (detail::is_cooperative<C>) {
            using L = typename C::layout_type;
            uint32_t groups = w.count / MSL_SIMD_WIDTH;
            for (uint32_t s = 0; s < L::capacity(groups); s++) {
                int r, col;
                if (!L::element(groups, w.simdgroup, w.lane, s, &r, &col)) continue;
                c.elements[s] = typename C::value_type(product(r, col, accumulate ? float(c.elements[s]) : 0.0f));
            }
        } else {
            using V = typename C::value_type;
            for (uint32_t e = w.rank; e < uint32_t(D.m * D.n); e += w.count) {
                int r = int(e / D.n), col = int(e % D.n);
                typename C::index_type at[2] = {col, r};
                bool inside;
                float old = float(c.get(at, &inside));
                if (inside) c[{at[0], at[1]}] = V(product(r, col, accumulate ? old : 0.0f));
            }
            msl_rt::tensor_detail::arrive<Scope>("matmul2d::run", file, line);
        }
    }
};

/* dst[row] = op over the row of src, for every row this thread's slots of dst name. Apple's takes
 * both as thread references of one element type, the identity of that type (sum's by default). */
template <class T, class L, class U, class LR, class I = T>
void reduce_rows(cooperative_tensor<T, L> &src, cooperative_tensor<U, LR> &dst,
                 reduction_operation op = reduction_operation::sum, I identity = I(0), MSL_CALLER) {
    static_assert(std::is_same_v<T, U> && std::is_same_v<std::remove_cv_t<metal::remove_addrspace_t<I>>, T>,
                  "reduce_rows takes a source, a destination and an identity of one element type "
                  "[rule: tensor-reduction-types]");
    static_assert(LR::kind == 1 && L::kind == 0 && LR::rows == L::rows,
                  "reduce_rows: a row reduction of src's matrix [rule: tensor-cooperative-operand]");
    float matrix[L::rows * L::cols];
    detail::gather(src, matrix, file, line);
    auto w = msl_rt::tensor_detail::who<typename L::scope>(file, line);
    for (uint32_t s = 0; s < LR::capacity(1); s++) {
        int r, c;
        if (!LR::element(1, 0, w.lane, s, &r, &c)) continue;
        float acc = float(identity);
        for (int j = 0; j < L::cols; j++) {
            float v = matrix[r * L::cols + j];
            acc = op == reduction_operation::sum   ? acc + v
                  : op == reduction_operation::max ? metal::fmax(acc, v)
                                                   : metal::fmin(acc, v);
        }
        dst.elements[s] = U(acc);
    }
}

} // namespace tensor_ops
} // namespace mpp

#undef MSL_CALLER
#endif
