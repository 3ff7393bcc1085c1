/* MSL's builtin types for kernels compiled as C++ by the CPU Metal device: the scalar names,
 * half and bfloat (rounded after every operation, as Apple GPUs do), vec<T, N> with swizzles,
 * packed vectors, as_type, numeric_limits and the metal type traits.
 *
 * With MSL_STRICT defined (the strict check: clang -fsyntax-only with real address spaces) the
 * types are clang's own instead, because a class object in device, constant or threadgroup memory
 * cannot be assigned to nor call member functions. That mode only type-checks: functions may be
 * declarations, arithmetic need not be exact. */
#ifndef MSL_TYPES_H
#define MSL_TYPES_H

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
static_assert(sizeof(long) == 8, "MSL's long is 64-bit: an LP64 host is needed");

#ifdef MSL_STRICT
/* bfloat: char16_t is the one builtin type that is distinct from every MSL type, can be a
 * parameter, has arithmetic in any address space and can be a vector element. */
typedef _Float16 half;
typedef char16_t bfloat;
#else
namespace metal::detail {
struct half_format;
struct bfloat_format;
template <class F> struct fp16;
} // namespace metal::detail
typedef metal::detail::fp16<metal::detail::half_format> half;
typedef metal::detail::fp16<metal::detail::bfloat_format> bfloat;
#endif

/* ---- type traits: std's, with half and bfloat counted as floating point ---- */

namespace metal {
namespace detail {
template <class T>
constexpr bool fp16_v = std::is_same_v<std::remove_cv_t<T>, half> || std::is_same_v<std::remove_cv_t<T>, bfloat>;
}

using std::bool_constant;
using std::conditional;
using std::conditional_t;
using std::decay;
using std::decay_t;
using std::declval;
using std::enable_if;
using std::enable_if_t;
using std::false_type;
using std::integral_constant;
using std::is_const;
using std::is_const_v;
using std::is_convertible;
using std::is_convertible_v;
using std::is_pointer;
using std::is_pointer_v;
using std::is_same;
using std::is_same_v;
using std::is_void;
using std::is_void_v;
using std::make_signed;
using std::make_signed_t;
using std::make_unsigned;
using std::make_unsigned_t;
using std::remove_const;
using std::remove_const_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_pointer;
using std::remove_pointer_t;
using std::remove_reference;
using std::remove_reference_t;
using std::true_type;

/* T without its address space (Metal's remove_addrspace) */
template <class T> struct remove_addrspace {
    using type = T;
};
template <class T> struct remove_addrspace<MSL_DEVICE T> {
    using type = T;
};
template <class T> struct remove_addrspace<MSL_CONSTANT T> {
    using type = T;
};
template <class T> struct remove_addrspace<MSL_THREADGROUP T> {
    using type = T;
};
template <class T> using remove_addrspace_t = typename remove_addrspace<T>::type;

/* Apple's internal traits that real headers use (under `#pragma METAL internals : enable`) */
template <class... B> struct _disjunction : std::disjunction<B...> {};
template <class... B> struct _conjunction : std::conjunction<B...> {};

#define MSL_TRAIT(name, expr)                                  \
    template <class T> struct name : bool_constant<(expr)> {}; \
    template <class T> constexpr bool name##_v = name<T>::value;
MSL_TRAIT(is_floating_point, std::is_floating_point_v<T> || detail::fp16_v<T>)
MSL_TRAIT(is_integral, std::is_integral_v<T> && !detail::fp16_v<T>)
MSL_TRAIT(is_arithmetic, is_floating_point_v<T> || is_integral_v<T>)
MSL_TRAIT(is_scalar, std::is_scalar_v<T> || detail::fp16_v<T>)
MSL_TRAIT(is_signed, std::is_signed_v<T> || detail::fp16_v<T>)
MSL_TRAIT(is_unsigned, std::is_unsigned_v<T> && !detail::fp16_v<T>)
#undef MSL_TRAIT
} // namespace metal

#ifdef MSL_STRICT

/* ext_vector_type gives every swizzle and works in any address space, but C++ has no
 * float4(a, b, ...) for a non-class type: a function-like macro per vector name turns those
 * constructions into calls (a macro only expands when the name is followed by '('). */
namespace metal {
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
namespace detail {
template <class V> using packed_vec = V; /* sizeof(packed_float3) is 16 here */
template <class V, class... A> V make(A...);
} // namespace detail
template <class T> bool all(T);
template <class T> bool any(T);
template <class T, class U> T as_type(U);
} // namespace metal

#define MSL_MAKE(V) ::metal::detail::make<::V>
#define float2(...) MSL_MAKE(float2)(__VA_ARGS__)
#define float3(...) MSL_MAKE(float3)(__VA_ARGS__)
#define float4(...) MSL_MAKE(float4)(__VA_ARGS__)
#define half2(...) MSL_MAKE(half2)(__VA_ARGS__)
#define half3(...) MSL_MAKE(half3)(__VA_ARGS__)
#define half4(...) MSL_MAKE(half4)(__VA_ARGS__)
#define bfloat2(...) MSL_MAKE(bfloat2)(__VA_ARGS__)
#define bfloat3(...) MSL_MAKE(bfloat3)(__VA_ARGS__)
#define bfloat4(...) MSL_MAKE(bfloat4)(__VA_ARGS__)
#define int2(...) MSL_MAKE(int2)(__VA_ARGS__)
#define int3(...) MSL_MAKE(int3)(__VA_ARGS__)
#define int4(...) MSL_MAKE(int4)(__VA_ARGS__)
#define uint2(...) MSL_MAKE(uint2)(__VA_ARGS__)
#define uint3(...) MSL_MAKE(uint3)(__VA_ARGS__)
#define uint4(...) MSL_MAKE(uint4)(__VA_ARGS__)
#define short2(...) MSL_MAKE(short2)(__VA_ARGS__)
#define short3(...) MSL_MAKE(short3)(__VA_ARGS__)
#define short4(...) MSL_MAKE(short4)(__VA_ARGS__)
#define ushort2(...) MSL_MAKE(ushort2)(__VA_ARGS__)
#define ushort3(...) MSL_MAKE(ushort3)(__VA_ARGS__)
#define ushort4(...) MSL_MAKE(ushort4)(__VA_ARGS__)
#define char2(...) MSL_MAKE(char2)(__VA_ARGS__)
#define char3(...) MSL_MAKE(char3)(__VA_ARGS__)
#define char4(...) MSL_MAKE(char4)(__VA_ARGS__)
#define uchar2(...) MSL_MAKE(uchar2)(__VA_ARGS__)
#define uchar3(...) MSL_MAKE(uchar3)(__VA_ARGS__)
#define uchar4(...) MSL_MAKE(uchar4)(__VA_ARGS__)
#define long2(...) MSL_MAKE(long2)(__VA_ARGS__)
#define long3(...) MSL_MAKE(long3)(__VA_ARGS__)
#define long4(...) MSL_MAKE(long4)(__VA_ARGS__)
#define ulong2(...) MSL_MAKE(ulong2)(__VA_ARGS__)
#define ulong3(...) MSL_MAKE(ulong3)(__VA_ARGS__)
#define ulong4(...) MSL_MAKE(ulong4)(__VA_ARGS__)
#define bool2(...) MSL_MAKE(bool2)(__VA_ARGS__)
#define bool3(...) MSL_MAKE(bool3)(__VA_ARGS__)
#define bool4(...) MSL_MAKE(bool4)(__VA_ARGS__)

#else /* !MSL_STRICT */

/* ---- half and bfloat ---- */

namespace metal {
template <class T, int N> struct vec;

namespace detail {

template <class T> constexpr bool scalar_v = std::is_arithmetic_v<T> || fp16_v<T>;

/* Round to nearest even; NaN stays NaN (made quiet). */
constexpr uint16_t float_to_bf16(float f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(u >> 16 | 0x40u);
    return uint16_t((u + 0x7fffu + (u >> 16 & 1u)) >> 16);
}

struct bfloat_format {
    using storage = uint16_t;
    static constexpr uint16_t max = 0x7f7f, min = 0x0080, epsilon = 0x3c00, infinity = 0x7f80, nan = 0x7fc0;
    static constexpr int digits = 8;
    template <class T> static constexpr storage from(T x) { return float_to_bf16(float(x)); }
    static constexpr float to_float(storage b) { return __builtin_bit_cast(float, uint32_t(b) << 16); }
};

struct half_format {
    static constexpr uint16_t max = 0x7bff, min = 0x0400, epsilon = 0x1400, infinity = 0x7c00, nan = 0x7e00;
    static constexpr int digits = 11;
#if defined(__FLT16_MAX__) && !defined(MSL_SOFT_HALF)
    /* The compiler's conversions are correctly rounded, from any type. Arithmetic is never done on
     * _Float16 itself: compilers keep its intermediate results in float (excess precision). */
    using storage = _Float16;
    template <class T> static constexpr storage from(T x) { return storage(x); }
    static constexpr float to_float(storage h) { return float(h); }
#else
    /* Conversions in software (after F. Giesen's float_to_half_fast3_rtne), from double so that
     * a fused multiply-add computed in double rounds once. */
    using storage = uint16_t;
    template <class T> static constexpr storage from(T x) {
        uint64_t u = __builtin_bit_cast(uint64_t, double(x)), sign = u >> 48 & 0x8000u;
        u &= 0x7fffffffffffffffu;
        if (u >= 0x40f0000000000000u) /* >= 65536: inf, or NaN kept quiet with its top payload bits */
            return storage(sign | (u > 0x7ff0000000000000u ? 0x7e00u | (u >> 42 & 0x3ffu) : 0x7c00u));
        if (u < 0x3f10000000000000u) /* below 2^-14: adding 2^28 rounds to a multiple of 2^-24 */
            return storage(
                sign | (__builtin_bit_cast(uint64_t, __builtin_bit_cast(double, u) + 0x1p28) - 0x41b0000000000000u));
        /* rebias the exponent (15 - 1023), round the 42 dropped bits to nearest even */
        return storage(sign | (u + 0xc100000000000000u + 0x1ffffffffffu + (u >> 42 & 1u)) >> 42);
    }
    static constexpr float to_float(storage h) {
        uint32_t u = uint32_t(h & 0x7fffu) << 13, e = u & 0x0f800000u;
        if (e == 0x0f800000u) u += 0x70000000u; /* inf, NaN */
        else if (e == 0) u = __builtin_bit_cast(uint32_t, __builtin_bit_cast(float, u + 0x38800000u) - 0x1p-14f);
        else u += 0x38000000u;
        return __builtin_bit_cast(float, u | uint32_t(h & 0x8000u) << 16);
    }
#endif
};

/* MSL 3.1: bfloat converts implicitly only to float (and from integers here); float and half never
 * convert to bfloat implicitly, nor bfloat to half. */
template <class F, class T>
constexpr bool implicit_from = std::is_same_v<T, fp16<F>> || std::is_integral_v<T> ||
                               (std::is_same_v<F, half_format> && !std::is_same_v<T, fp16<bfloat_format>>);

/* half and bfloat: stored in 16 bits, every operation computed in float and rounded back. For
 * + - * / and sqrt that is the correctly rounded result, float having >= 2p + 2 bits. */
template <class F> struct fp16 {
    typename F::storage v;

    fp16() = default;
    template <class T, std::enable_if_t<scalar_v<T> && implicit_from<F, T>, int> = 0>
    constexpr fp16(T x) : v(F::from(x)) {}
    template <class T, std::enable_if_t<scalar_v<T> && !implicit_from<F, T>, int> = 0>
    explicit constexpr fp16(T x) : v(F::from(x)) {}
    /* a class converting to float (a user's bfloat16_t): float to half is a standard conversion
     * in MSL, so this one is implicit for half, explicit for bfloat (static_cast<bfloat>(x)); a
     * half or bfloat in device, constant or threadgroup memory is no such class */
    template <class T, class P = remove_addrspace_t<T>,
              std::enable_if_t<!fp16_v<P> && !scalar_v<T> && std::is_class_v<T> &&
                                   std::is_convertible_v<const T &, float> && implicit_from<F, float>,
                               int> = 0>
    constexpr fp16(const T &x) : v(F::from(float(x))) {}
    template <class T, class P = remove_addrspace_t<T>,
              std::enable_if_t<!fp16_v<P> && !scalar_v<T> && std::is_class_v<T> &&
                                   std::is_convertible_v<const T &, float> && !implicit_from<F, float>,
                               int> = 0>
    explicit constexpr fp16(const T &x) : v(F::from(float(x))) {}
    constexpr operator float() const { return F::to_float(v); }
    static constexpr fp16 from_bits(uint16_t b) {
        fp16 r{};
        r.v = __builtin_bit_cast(typename F::storage, b);
        return r;
    }

    constexpr fp16 operator+() const { return *this; }
    constexpr fp16 operator-() const { return fp16(-float(*this)); }
    template <class T> constexpr fp16 &operator+=(T x) { return *this = fp16(*this + x); }
    template <class T> constexpr fp16 &operator-=(T x) { return *this = fp16(*this - x); }
    template <class T> constexpr fp16 &operator*=(T x) { return *this = fp16(*this * x); }
    template <class T> constexpr fp16 &operator/=(T x) { return *this = fp16(*this / x); }
    constexpr fp16 &operator++() { return *this += 1; }
    constexpr fp16 &operator--() { return *this -= 1; }
    constexpr fp16 operator++(int) {
        fp16 old = *this;
        *this += 1;
        return old;
    }
    constexpr fp16 operator--(int) {
        fp16 old = *this;
        *this -= 1;
        return old;
    }
};

/* MSL's usual arithmetic conversions: half with half or an integer gives half, with float gives
 * float; half with bfloat gives float; MSL has no double, a double (a literal such as 1.0) acts
 * as float. */
template <class A, class B, class = void> struct arith {};
template <class A, class B> struct arith<A, B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>> {
    using type = std::conditional_t<std::is_same_v<std::common_type_t<A, B>, double>, float, std::common_type_t<A, B>>;
};
template <class S, class T> struct arith<S, T, std::enable_if_t<fp16_v<S> && fp16_v<T>>> {
    using type = std::conditional_t<std::is_same_v<S, T>, S, float>;
};
template <class S, class A> struct arith<S, A, std::enable_if_t<fp16_v<S> && std::is_arithmetic_v<A>>> {
    using type = std::conditional_t<std::is_floating_point_v<A>, float, S>;
};
template <class A, class S> struct arith<A, S, std::enable_if_t<std::is_arithmetic_v<A> && fp16_v<S>>> : arith<S, A> {};
template <class A, class B> using arith_t = typename arith<A, B>::type;

/* Operators of half and bfloat (found by argument-dependent lookup): both operands converted to
 * the result type, computed in float, rounded to the result type. */
template <class A, class B> using fp16_op_t = std::enable_if_t<fp16_v<A> || fp16_v<B>, arith_t<A, B>>;
#define MSL_FP16_OP(op)                                                                        \
    template <class A, class B, class R = fp16_op_t<A, B>> constexpr R operator op(A a, B b) { \
        return R(float(R(a)) op float(R(b)));                                                  \
    }
#define MSL_FP16_CMP(op)                                                                          \
    template <class A, class B, class R = fp16_op_t<A, B>> constexpr bool operator op(A a, B b) { \
        return float(R(a)) op float(R(b));                                                        \
    }
// clang-format off
MSL_FP16_OP(+)
MSL_FP16_OP(-)
MSL_FP16_OP(*)
MSL_FP16_OP(/)
MSL_FP16_CMP(==)
MSL_FP16_CMP(!=)
MSL_FP16_CMP(<)
MSL_FP16_CMP(<=)
MSL_FP16_CMP(>)
MSL_FP16_CMP(>=)
// clang-format on
#undef MSL_FP16_OP
#undef MSL_FP16_CMP

/* ---- vectors ---- */

template <class V> struct packed_vec;
template <class T, int N, int A> struct vec_storage;

/* What a value is as a vector operand: its lane count (0: not a scalar nor a vector), the plain
 * type it converts to, its element type. */
template <class X, class = void> struct info {
    static constexpr int n = 0;
};
template <class X> struct info<X, std::enable_if_t<scalar_v<X>>> {
    static constexpr int n = 1;
    using type = std::conditional_t<std::is_same_v<X, double>, float, X>;
    using elem = type;
};
template <class T, int N> struct info<vec<T, N>> {
    static constexpr int n = N;
    using type = vec<T, N>;
    using elem = T;
};
template <class V> struct info<packed_vec<V>> : info<V> {};
/* an operand in device, constant or threadgroup memory (a `const A &` deduced from it) */
template <class X> struct info<MSL_DEVICE X> : info<X> {};
template <class X> struct info<MSL_CONSTANT X> : info<X> {};
template <class X> struct info<MSL_THREADGROUP X> : info<X> {};
template <class X> using value_t = typename info<X>::type;
template <class X> using elem_t = typename info<X>::elem;

template <int... I> constexpr bool distinct() {
    int idx[] = {I...};
    for (int i = 0; i < int(sizeof...(I)); i++)
        for (int j = 0; j < i; j++)
            if (idx[i] == idx[j]) return false;
    return true;
}

/* A swizzle of N-lane storage: a union member overlaying the vector's elements. It carries V,
 * the vector it reads as, so that argument-dependent lookup finds V's operators. */
template <class T, int N, class V, int... I> struct swizzle {
    T e[N];

    swizzle() = default;
    swizzle(const swizzle &) = default;
    constexpr operator V() const { return V(e[I]...); }
    constexpr swizzle &operator=(V v) { /* by value: v may overlap *this (v.yx = v) */
        static_assert(distinct<I...>(), "a swizzle that repeats a component cannot be assigned to");
        int k = 0;
        ((e[I] = v[k++]), ...);
        return *this;
    }
    template <class U, std::enable_if_t<std::is_same_v<U, swizzle>, int> = 0> constexpr swizzle &operator=(U &o) {
        return *this = V(o);
    }

  private:
    /* Trivial, so that vectors stay trivially copyable, and private because copying the whole
     * overlay would also copy the components the swizzle does not name: a.xy = b.xy with b
     * const or a temporary does not compile; write a.xy = float2(b.xy). */
    template <class, int, int> friend struct vec_storage;
    swizzle &operator=(const swizzle &) = default;
    swizzle &operator=(swizzle &&) = default;
};
template <class T, int N, class V, int... I> struct info<swizzle<T, N, V, I...>> : info<V> {};

struct no_such_component {}; /* the type of the swizzles naming a component beyond the vector */
template <class T, int N, int... I>
using swz = std::conditional_t<((I < N) && ...), swizzle<T, N, vec<T, int(sizeof...(I))>, I...>, no_such_component>;

/* F(name, indices...) for every swizzle of length 2 to 4 over the names a, b, c, d: SWZ0 has one
 * letter n and its index i, SWZ1 emits the two-letter names, SWZ2 three, SWZ3 four. */
#define MSL_SWIZZLES(F, a, b, c, d) \
    MSL_SWZ0(F, a, b, c, d, a, 0)   \
    MSL_SWZ0(F, a, b, c, d, b, 1) MSL_SWZ0(F, a, b, c, d, c, 2) MSL_SWZ0(F, a, b, c, d, d, 3)
#define MSL_SWZ0(F, a, b, c, d, n, i)   \
    MSL_SWZ1(F, a, b, c, d, n##a, i, 0) \
    MSL_SWZ1(F, a, b, c, d, n##b, i, 1) MSL_SWZ1(F, a, b, c, d, n##c, i, 2) MSL_SWZ1(F, a, b, c, d, n##d, i, 3)
#define MSL_SWZ1(F, a, b, c, d, n, ...)           \
    F(n, __VA_ARGS__)                             \
    MSL_SWZ2(F, a, b, c, d, n##a, __VA_ARGS__, 0) \
    MSL_SWZ2(F, a, b, c, d, n##b, __VA_ARGS__, 1) \
    MSL_SWZ2(F, a, b, c, d, n##c, __VA_ARGS__, 2) MSL_SWZ2(F, a, b, c, d, n##d, __VA_ARGS__, 3)
#define MSL_SWZ2(F, a, b, c, d, n, ...) \
    F(n, __VA_ARGS__)                   \
    MSL_SWZ3(F, n##a, __VA_ARGS__, 0)   \
    MSL_SWZ3(F, n##b, __VA_ARGS__, 1) MSL_SWZ3(F, n##c, __VA_ARGS__, 2) MSL_SWZ3(F, n##d, __VA_ARGS__, 3)
#define MSL_SWZ3(F, n, ...) F(n, __VA_ARGS__)
#define MSL_SWIZZLE_MEMBER(name, ...) swz<T, N, __VA_ARGS__> name;
#define MSL_ID(...) __VA_ARGS__
/* N lanes aligned to A: the elements, the one-letter names, every swizzle. */
#define MSL_VEC_STORAGE(n, xyzw, rgba)                                 \
    template <class T, int A> struct alignas(A) vec_storage<T, n, A> { \
        static constexpr int N = n;                                    \
        union {                                                        \
            T e[n];                                                    \
            struct {                                                   \
                T MSL_ID xyzw;                                         \
            };                                                         \
            struct {                                                   \
                T MSL_ID rgba;                                         \
            };                                                         \
            MSL_SWIZZLES(MSL_SWIZZLE_MEMBER, x, y, z, w)               \
            MSL_SWIZZLES(MSL_SWIZZLE_MEMBER, r, g, b, a)               \
        };                                                             \
    };
MSL_VEC_STORAGE(2, (x, y), (r, g))
MSL_VEC_STORAGE(3, (x, y, z), (r, g, b))
MSL_VEC_STORAGE(4, (x, y, z, w), (r, g, b, a))
#undef MSL_VEC_STORAGE
/* Metal 4's 8- and 16-lane vectors (vec<T, 8>, as MPP fragments use them): elements, no names. */
#define MSL_WIDE_VEC_STORAGE(n)                                        \
    template <class T, int A> struct alignas(A) vec_storage<T, n, A> { \
        static constexpr int N = n;                                    \
        T e[n];                                                        \
    };
MSL_WIDE_VEC_STORAGE(8)
MSL_WIDE_VEC_STORAGE(16)
#undef MSL_WIDE_VEC_STORAGE
#undef MSL_ID
#undef MSL_SWIZZLE_MEMBER
#undef MSL_SWIZZLES
#undef MSL_SWZ0
#undef MSL_SWZ1
#undef MSL_SWZ2
#undef MSL_SWZ3

/* MSL's alignment: a 3-lane vector is aligned (and sized) like the 4-lane one. */
template <class T, int N> constexpr int vec_align = int(sizeof(T)) * (N == 3 ? 4 : N);

/* A packed vector: T's alignment, no padding; converts to and from V. */
template <class V> struct packed_vec : vec_storage<elem_t<V>, info<V>::n, alignof(elem_t<V>)> {
    packed_vec() = default;
    template <class... A, std::enable_if_t<(sizeof...(A) > 0) && std::is_constructible_v<V, const A &...>, int> = 0>
    constexpr packed_vec(const A &...a) : packed_vec::vec_storage{} {
        V v(a...);
        for (int i = 0; i < info<V>::n; i++) this->e[i] = v[i];
    }
    constexpr operator V() const {
        V v{};
        for (int i = 0; i < info<V>::n; i++) v[i] = this->e[i];
        return v;
    }
    constexpr elem_t<V> &operator[](int i) { return this->e[i]; }
    constexpr const elem_t<V> &operator[](int i) const { return this->e[i]; }
};

/* Compound assignment to a swizzle or a packed vector: through the plain vector. */
template <class X> constexpr bool proxy_v = false;
template <class T, int N, class V, int... I> constexpr bool proxy_v<swizzle<T, N, V, I...>> = true;
template <class V> constexpr bool proxy_v<packed_vec<V>> = true;
#define MSL_COMPOUND(op)                                                                                               \
    template <class X, class R, std::enable_if_t<proxy_v<X>, int> = 0> constexpr X &operator op##=(X &x, const R &r) { \
        return x = value_t<X>(x) op r;                                                                                 \
    }
// clang-format off
MSL_COMPOUND(+)
MSL_COMPOUND(-)
MSL_COMPOUND(*)
MSL_COMPOUND(/)
MSL_COMPOUND(%)
MSL_COMPOUND(&)
MSL_COMPOUND(|)
MSL_COMPOUND(^)
MSL_COMPOUND(<<)
MSL_COMPOUND(>>)
// clang-format on
#undef MSL_COMPOUND

} // namespace detail

/* MSL's vec<T, N>: element-wise operators (half and bfloat lanes round per operation through
 * T's own operators), a scalar operand is broadcast, comparisons give vec<bool, N>. */
template <class T, int N> struct vec : detail::vec_storage<T, N, detail::vec_align<T, N>> {
    using bools = vec<bool, N>;
    vec() = default;
    /* broadcast */
    template <class S, std::enable_if_t<detail::scalar_v<S>, int> = 0> constexpr vec(S s) : vec::vec_storage{} {
        for (int i = 0; i < N; i++) this->e[i] = T(s);
    }
    /* another element type (a vector, swizzle or packed vector of N lanes): explicit, as in MSL */
    template <class X, std::enable_if_t<detail::info<X>::n == N, int> = 0>
    explicit constexpr vec(const X &x) : vec::vec_storage{} {
        detail::value_t<X> v = x;
        for (int i = 0; i < N; i++) this->e[i] = T(v[i]);
    }
    /* concatenation of scalars and vectors: float4(xy, z, w), float4(float3, 1.0f), ...; lanes
     * beyond the operands are 0, for a brace-initialiser with fewer (float4 v = {xy, 1.0f}) */
    template <class... X,
              std::enable_if_t<
                  (sizeof...(X) > 1) && ((detail::info<X>::n > 0) && ...) && (detail::info<X>::n + ...) <= N, int> = 0>
    constexpr vec(const X &...x) : vec::vec_storage{} {
        int k = 0;
        (put(k, x), ...);
    }
    /* a brace-initialiser of scalars: lanes beyond them are 0 (float4 v = {1.0f} is 1, 0, 0, 0,
     * where float4(1.0f) broadcasts) */
    template <class S, std::enable_if_t<detail::scalar_v<S>, int> = 0>
    constexpr vec(std::initializer_list<S> s) : vec::vec_storage{} {
        int k = 0;
        for (const S &x : s)
            if (k < N) this->e[k++] = T(x);
    }

    constexpr T &operator[](int i) { return this->e[i]; }
    constexpr const T &operator[](int i) const { return this->e[i]; }

#define MSL_LANES(R, expr)                   \
    R r{};                                   \
    for (int i = 0; i < N; i++) r[i] = expr; \
    return r;
#define MSL_VEC_OP(op)                                                                            \
    friend constexpr vec operator op(const vec &a, const vec &b) { MSL_LANES(vec, a[i] op b[i]) } \
    friend constexpr vec &operator op##=(vec &a, const vec &b) { return a = a op b; }
#define MSL_VEC_CMP(op) \
    friend constexpr bools operator op(const vec &a, const vec &b) { MSL_LANES(bools, a[i] op b[i]) }
    // clang-format off
    MSL_VEC_OP(+)
    MSL_VEC_OP(-)
    MSL_VEC_OP(*)
    MSL_VEC_OP(/)
    MSL_VEC_OP(%)
    MSL_VEC_OP(&)
    MSL_VEC_OP(|)
    MSL_VEC_OP(^)
    MSL_VEC_OP(<<)
    MSL_VEC_OP(>>)
    MSL_VEC_CMP(==)
    MSL_VEC_CMP(!=)
    MSL_VEC_CMP(<)
    MSL_VEC_CMP(<=)
    MSL_VEC_CMP(>)
    MSL_VEC_CMP(>=)
    MSL_VEC_CMP(&&)
    MSL_VEC_CMP(||)
    // clang-format on
    friend constexpr vec operator+(const vec &a) { return a; }
    friend constexpr vec operator-(const vec &a) { MSL_LANES(vec, -a[i]) }
    friend constexpr vec operator~(const vec &a) { MSL_LANES(vec, ~a[i]) }
    friend constexpr bools operator!(const vec &a) { MSL_LANES(bools, !a[i]) }
#undef MSL_VEC_OP
#undef MSL_VEC_CMP
#undef MSL_LANES

  private:
    template <class X> constexpr void put(int &k, const X &x) {
        if constexpr (detail::info<X>::n == 1) {
            this->e[k++] = T(x);
        } else {
            detail::value_t<X> v = x;
            for (int i = 0; i < detail::info<X>::n; i++) this->e[k++] = T(v[i]);
        }
    }
};

/* all() / any() of a bool vector (or a swizzle of one, or a bool) */
namespace detail {
template <class X> constexpr int count_true(const X &x) {
    value_t<X> v = x;
    if constexpr (info<X>::n == 1) {
        return v;
    } else {
        int k = 0;
        for (int i = 0; i < info<X>::n; i++) k += v[i];
        return k;
    }
}
} // namespace detail
template <class X, enable_if_t<is_same_v<detail::elem_t<X>, bool>, int> = 0> constexpr bool all(const X &x) {
    return detail::count_true(x) == detail::info<X>::n;
}
template <class X, enable_if_t<is_same_v<detail::elem_t<X>, bool>, int> = 0> constexpr bool any(const X &x) {
    return detail::count_true(x) > 0;
}

/* Reinterprets the bits (of the plain vector, for a swizzle or packed vector); constexpr, as
 * libraries' own 16-bit float types use it in constexpr conversions. */
template <class T, class U> constexpr T as_type(const U &x) {
    if constexpr (detail::proxy_v<U>) {
        return as_type<T>(detail::value_t<U>(x));
    } else {
        static_assert(sizeof(T) == sizeof(U), "as_type needs types of the same size");
        return __builtin_bit_cast(T, x);
    }
}

} // namespace metal

#endif /* MSL_STRICT */

/* ---- both modes ---- */

#define MSL_VECTOR_TYPES(T, name)                                \
    typedef metal::vec<T, 2> name##2;                            \
    typedef metal::vec<T, 3> name##3;                            \
    typedef metal::vec<T, 4> name##4;                            \
    typedef metal::detail::packed_vec<name##2> packed_##name##2; \
    typedef metal::detail::packed_vec<name##3> packed_##name##3; \
    typedef metal::detail::packed_vec<name##4> packed_##name##4;
MSL_VECTOR_TYPES(float, float)
MSL_VECTOR_TYPES(half, half)
MSL_VECTOR_TYPES(bfloat, bfloat)
MSL_VECTOR_TYPES(int, int)
MSL_VECTOR_TYPES(uint, uint)
MSL_VECTOR_TYPES(short, short)
MSL_VECTOR_TYPES(ushort, ushort)
MSL_VECTOR_TYPES(char, char)
MSL_VECTOR_TYPES(uchar, uchar)
MSL_VECTOR_TYPES(long, long)
MSL_VECTOR_TYPES(ulong, ulong)
MSL_VECTOR_TYPES(bool, bool)
#undef MSL_VECTOR_TYPES

namespace metal {
template <class T, int Cols, int Rows> struct matrix;
}
#define MSL_MATRIX_TYPES(T)                \
    typedef metal::matrix<T, 2, 2> T##2x2; \
    typedef metal::matrix<T, 2, 3> T##2x3; \
    typedef metal::matrix<T, 2, 4> T##2x4; \
    typedef metal::matrix<T, 3, 2> T##3x2; \
    typedef metal::matrix<T, 3, 3> T##3x3; \
    typedef metal::matrix<T, 3, 4> T##3x4; \
    typedef metal::matrix<T, 4, 2> T##4x2; \
    typedef metal::matrix<T, 4, 3> T##4x3; \
    typedef metal::matrix<T, 4, 4> T##4x4;
MSL_MATRIX_TYPES(float)
MSL_MATRIX_TYPES(half)
#undef MSL_MATRIX_TYPES

/* MSL's half literals, 1.0h and 1h: a suffix without '_' is reserved in C++, hence the pragma
 * (the shim is compiled by clang only, build.c). */
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wuser-defined-literals"
constexpr half operator""h(long double x) { return half(x); }
constexpr half operator""h(unsigned long long x) { return half(x); }
#pragma clang diagnostic pop

namespace metal {

/* metal::array<T, N>: an aggregate, as std::array */
template <class T, size_t N> struct array {
    T elems[N];
    constexpr T &operator[](size_t i) { return elems[i]; }
    constexpr const T &operator[](size_t i) const { return elems[i]; }
    static constexpr size_t size() { return N; }
    constexpr T *begin() { return elems; }
    constexpr T *end() { return elems + N; }
    constexpr const T *begin() const { return elems; }
    constexpr const T *end() const { return elems + N; }
};

/* uniform<T>: a value the same in every thread, which all of them are here anyway */
template <class T> using uniform = T;
template <class T> constexpr T make_uniform(T x) { return x; }

/* matrix<T, Cols, Rows>: Cols column vectors of Rows lanes; m[c] is column c, m * v and v * m
 * are the linear maps, m * n the product, summed in T (as MSL does). */
template <class T, int Cols, int Rows> struct matrix {
    vec<T, Rows> columns[Cols];

    matrix() = default;
    /* d on the diagonal, 0 elsewhere */
    constexpr explicit matrix(T d) : columns{} {
        for (int c = 0; c < Cols && c < Rows; c++) columns[c][c] = d;
    }
    /* from the columns */
    template <class... V, std::enable_if_t<sizeof...(V) == Cols && (Cols > 1) &&
                                               ((sizeof(V) == sizeof(vec<T, Rows>) && !std::is_arithmetic_v<V>)&&...),
                                           int> = 0>
    constexpr matrix(const V &...v) : columns{vec<T, Rows>(v)...} {}
    /* from Cols * Rows scalars, column by column */
    template <class... S, std::enable_if_t<sizeof...(S) == Cols * Rows && (Cols * Rows > 4 || Rows == 2) &&
                                               (std::is_arithmetic_v<S> && ...),
                                           int> = 0>
    constexpr matrix(S... s) : columns{} {
        T v[] = {T(s)...};
        for (int i = 0; i < Cols * Rows; i++) columns[i / Rows][i % Rows] = v[i];
    }

    /* from another element type: explicit, as in MSL (`(float4x4)h` of a half4x4) */
    template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
    explicit constexpr matrix(const matrix<U, Cols, Rows> &m) : columns{} {
        for (int c = 0; c < Cols; c++) columns[c] = vec<T, Rows>(m.columns[c]);
    }

    constexpr vec<T, Rows> &operator[](int c) { return columns[c]; }
    constexpr const vec<T, Rows> &operator[](int c) const { return columns[c]; }

    friend constexpr vec<T, Rows> operator*(const matrix &m, const vec<T, Cols> &v) {
        vec<T, Rows> r = m.columns[0] * v[0];
        for (int c = 1; c < Cols; c++) r = r + m.columns[c] * v[c];
        return r;
    }
    friend constexpr vec<T, Cols> operator*(const vec<T, Rows> &v, const matrix &m) {
        vec<T, Cols> r;
        for (int c = 0; c < Cols; c++) {
            T s = v[0] * m.columns[c][0];
            for (int k = 1; k < Rows; k++) s = s + v[k] * m.columns[c][k];
            r[c] = s;
        }
        return r;
    }
    template <int K> friend constexpr matrix<T, K, Rows> operator*(const matrix &a, const matrix<T, K, Cols> &b) {
        matrix<T, K, Rows> r;
        for (int k = 0; k < K; k++) r.columns[k] = a * b.columns[k];
        return r;
    }
    friend constexpr matrix operator*(const matrix &a, T s) {
        matrix r;
        for (int c = 0; c < Cols; c++) r.columns[c] = a.columns[c] * s;
        return r;
    }
    friend constexpr matrix operator*(T s, const matrix &a) { return a * s; }
    friend constexpr matrix operator+(const matrix &a, const matrix &b) {
        matrix r;
        for (int c = 0; c < Cols; c++) r.columns[c] = a.columns[c] + b.columns[c];
        return r;
    }
    friend constexpr matrix operator-(const matrix &a, const matrix &b) {
        matrix r;
        for (int c = 0; c < Cols; c++) r.columns[c] = a.columns[c] - b.columns[c];
        return r;
    }
};

template <class T, int Cols, int Rows> constexpr matrix<T, Rows, Cols> transpose(const matrix<T, Cols, Rows> &m) {
    matrix<T, Rows, Cols> r;
    for (int c = 0; c < Cols; c++)
        for (int k = 0; k < Rows; k++) r.columns[k][c] = m.columns[c][k];
    return r;
}

template <class T> struct numeric_limits : std::numeric_limits<T> {};
#ifndef MSL_STRICT
template <class F> struct numeric_limits<detail::fp16<F>> {
    using T = detail::fp16<F>;
    static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false;
    static constexpr bool has_infinity = true, has_quiet_NaN = true;
    static constexpr int digits = F::digits;
    static constexpr T min() { return T::from_bits(F::min); }
    static constexpr T max() { return T::from_bits(F::max); }
    static constexpr T lowest() { return T::from_bits(F::max | 0x8000u); }
    static constexpr T epsilon() { return T::from_bits(F::epsilon); }
    static constexpr T infinity() { return T::from_bits(F::infinity); }
    static constexpr T quiet_NaN() { return T::from_bits(F::nan); }
    static constexpr T denorm_min() { return T::from_bits(1); }
};
#endif

} // namespace metal

#endif
