/* MSL's math library (metal::, metal::fast::, metal::precise::) for the CPU Metal device.
 *
 * Every function works on scalars and, lane by lane, on vectors. Arguments of different types meet
 * in one type as in MSL's arithmetic (half and int give half, half and float give float, a scalar
 * with a vector gives the vector), but for min, max and clamp, which take one type as in Metal:
 * max(x, 0.0f), max(h, h), min(i, 3) and max(v, 0.0f) resolve, min(long, int) does not. half and
 * bfloat are computed in float and rounded once. fast:: and precise:: forward to the same
 * functions (see the end): the CPU does not reproduce the GPU's fast-math error.
 * NaN follows the MSL specification: fmax, fmin, max, min return the other argument when exactly
 * one is NaN (NaN when both are); clamp(x, lo, hi) is fmin(fmax(x, lo), hi). */
#ifndef MSL_MATH_H
#define MSL_MATH_H

#include <cmath>
#include <type_traits>

#include "msl_types.h"

/* MSL's constants */
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define FLT_DIG 6
#define FLT_MANT_DIG 24
#define FLT_MAX_10_EXP 38
#define FLT_MAX_EXP 128
#define FLT_MIN_10_EXP (-37)
#define FLT_MIN_EXP (-125)
#define FLT_RADIX 2
#define FLT_MAX 0x1.fffffep127f
#define FLT_MIN 0x1.0p-126f
#define FLT_EPSILON 0x1.0p-23f
#define HALF_DIG 3
#define HALF_MANT_DIG 11
#define HALF_MAX_10_EXP 4
#define HALF_MAX_EXP 16
#define HALF_MIN_10_EXP (-4)
#define HALF_MIN_EXP (-13)
#define HALF_RADIX 2
#define HALF_MAX 65504.0h
#define HALF_MIN 6.103515625e-05h
#define HALF_EPSILON 9.765625e-04h
#define MAXHALF HALF_MAX
#define HUGE_VALH (half(INFINITY))

#ifdef MSL_STRICT

/* Type checking only: loose declarations returning the first argument's type, but for min, max,
 * clamp, fmin and fmax, which exist (as in Metal) for each type but bfloat and its vectors, with
 * every argument of that type (or a scalar bound of a vector's element type): min(long, int) and
 * max(half, float) are ambiguous, as on a Mac. The scalar ones are defined, so that constant
 * expressions such as max(BK, 8) work. */
namespace metal {
/* Lists of declarations and macro bodies, wrapped by hand. */
// clang-format off
#define MSL_DECLARE(name) template <class T, class... U> T name(T, U...);
MSL_DECLARE(exp) MSL_DECLARE(exp2) MSL_DECLARE(exp10) MSL_DECLARE(log) MSL_DECLARE(log2) MSL_DECLARE(log10)
MSL_DECLARE(pow) MSL_DECLARE(powr) MSL_DECLARE(sqrt) MSL_DECLARE(rsqrt) MSL_DECLARE(fma) MSL_DECLARE(mad)
MSL_DECLARE(saturate)
MSL_DECLARE(select) MSL_DECLARE(abs) MSL_DECLARE(fabs) MSL_DECLARE(sign) MSL_DECLARE(floor) MSL_DECLARE(ceil)
MSL_DECLARE(round) MSL_DECLARE(rint) MSL_DECLARE(trunc) MSL_DECLARE(fract) MSL_DECLARE(fmod) MSL_DECLARE(sin)
MSL_DECLARE(cos) MSL_DECLARE(tan) MSL_DECLARE(tanh) MSL_DECLARE(sinh) MSL_DECLARE(cosh) MSL_DECLARE(atan)
MSL_DECLARE(atan2) MSL_DECLARE(asin) MSL_DECLARE(acos) MSL_DECLARE(copysign) MSL_DECLARE(mix) MSL_DECLARE(step)
MSL_DECLARE(normalize) MSL_DECLARE(divide) MSL_DECLARE(popcount) MSL_DECLARE(clz) MSL_DECLARE(ctz)
MSL_DECLARE(mulhi) MSL_DECLARE(acosh) MSL_DECLARE(asinh) MSL_DECLARE(atanh) MSL_DECLARE(cospi) MSL_DECLARE(sinpi)
MSL_DECLARE(tanpi) MSL_DECLARE(ldexp) MSL_DECLARE(frexp) MSL_DECLARE(fmax3) MSL_DECLARE(fmin3) MSL_DECLARE(fmedian3)
MSL_DECLARE(max3) MSL_DECLARE(min3) MSL_DECLARE(median3) MSL_DECLARE(nextafter)
#undef MSL_DECLARE
/* F(S, N) for S's vectors */
#define MSL_VECS(F, S) F(S, 2) F(S, 3) F(S, 4)
#define MSL_PAIR_VEC(S, N, max, min)                                                                              \
    vec<S, N> max(vec<S, N>, vec<S, N>); vec<S, N> max(vec<S, N>, S);                                             \
    vec<S, N> min(vec<S, N>, vec<S, N>); vec<S, N> min(vec<S, N>, S);
#define MSL_MINMAX_VEC(S, N) MSL_PAIR_VEC(S, N, max, min)                                                         \
    vec<S, N> clamp(vec<S, N>, vec<S, N>, vec<S, N>); vec<S, N> clamp(vec<S, N>, S, S);
#define MSL_FMINMAX_VEC(S, N) MSL_PAIR_VEC(S, N, fmax, fmin)
#define MSL_MINMAX(S)                                                                                             \
    constexpr S max(S a, S b) { return a < b ? b : a; }                                                           \
    constexpr S min(S a, S b) { return b < a ? b : a; }                                                           \
    constexpr S clamp(S x, S lo, S hi) { return min(max(x, lo), hi); }                                            \
    MSL_VECS(MSL_MINMAX_VEC, S)
#define MSL_FMINMAX(S) S fmax(S, S); S fmin(S, S); MSL_VECS(MSL_FMINMAX_VEC, S)
MSL_MINMAX(float) MSL_MINMAX(half) MSL_MINMAX(char) MSL_MINMAX(uchar) MSL_MINMAX(short)
MSL_MINMAX(ushort) MSL_MINMAX(int) MSL_MINMAX(uint) MSL_MINMAX(long) MSL_MINMAX(ulong)
MSL_FMINMAX(float) MSL_FMINMAX(half)
#undef MSL_VECS
#undef MSL_PAIR_VEC
#undef MSL_MINMAX_VEC
#undef MSL_FMINMAX_VEC
// clang-format on
#undef MSL_MINMAX
#undef MSL_FMINMAX
                                                                template <class T>
                                                                auto isnan(T x) -> decltype(x != x);
template <class T> auto isinf(T x) -> decltype(x != x);
template <class T> auto isfinite(T x) -> decltype(x != x);
template <class T> auto signbit(T x) -> decltype(x != x);
template <class T> bool isunordered(T x, T y);
template <class T> bool isordered(T x, T y);
template <class T> auto dot(T a, T b) -> decltype(a.x);
template <class T> auto length(T a) -> decltype(a.x);
} // namespace metal

#else /* !MSL_STRICT */

namespace metal {
namespace detail {

/* The type arguments meet in (see arith in msl_types.h); undefined when they do not meet. */
template <class A, class B, class = void> struct common : arith<A, B> {};
template <class T, int N> struct common<vec<T, N>, vec<T, N>> {
    using type = vec<T, N>;
};
template <class T, int N, class S> struct common<vec<T, N>, S, std::enable_if_t<scalar_v<S>>> {
    using type = vec<T, N>;
};
template <class S, class T, int N> struct common<S, vec<T, N>, std::enable_if_t<scalar_v<S>>> {
    using type = vec<T, N>;
};
template <class A, class... B> struct common_of {
    using type = value_t<A>;
};
template <class A, class B, class... C>
struct common_of<A, B, C...> : common_of<typename common<value_t<A>, value_t<B>>::type, C...> {};
template <class... X> using common_t = typename common_of<X...>::type;
/* the same, restricted to floating-point or integer elements */
template <class... X> using floating_t = std::enable_if_t<is_floating_point_v<elem_t<common_t<X...>>>, common_t<X...>>;
template <class... X> using int_t = std::enable_if_t<is_integral_v<elem_t<common_t<X...>>>, common_t<X...>>;
/* min, max and clamp exist per type, as in Metal: every argument of the first one's type, or a
 * scalar of its element type with a vector (a double, which MSL lacks, is a float literal) */
template <class A, class B>
constexpr bool same_kind_v = std::is_same_v<value_t<A>, value_t<B>> ||
                             (info<A>::n > 1 && info<B>::n == 1 && std::is_same_v<elem_t<A>, value_t<B>>);
template <class A, class... B> using matching_t = std::enable_if_t<(same_kind_v<A, B> && ...), common_t<A, B...>>;
template <class X> struct bools {
    using type = bool;
};
template <class T, int N> struct bools<vec<T, N>> {
    using type = vec<bool, N>;
};
template <class X> using bool_t = typename bools<X>::type;

/* R from f applied lane by lane; each x is a scalar (used for every lane) or a vector of R's
 * lanes. f's result is converted to R's element type: the one rounding of half and bfloat. */
template <class T, int N> constexpr const T &lane(const vec<T, N> &v, int i) { return v[i]; }
template <class S> constexpr const S &lane(const S &s, int) { return s; }
template <class R, class F, class... X> constexpr R map(F f, const X &...x) {
    if constexpr (info<R>::n == 1) {
        return R(f(x...));
    } else {
        R r{};
        for (int i = 0; i < info<R>::n; i++) r[i] = elem_t<R>(f(lane(x, i)...));
        return r;
    }
}

/* one lane of max and min (not named max and min: half's operators bring metal::detail into
 * argument-dependent lookup) */
template <class E> constexpr bool lane_isnan(E x) { return is_floating_point_v<E> && !(float(x) == float(x)); }
template <class E> constexpr E lane_max(E x, E y) { return lane_isnan(x) ? y : lane_isnan(y) ? x : x < y ? y : x; }
template <class E> constexpr E lane_min(E x, E y) { return lane_isnan(x) ? y : lane_isnan(y) ? x : y < x ? y : x; }

template <class T, int N> constexpr float sum_of_products(const vec<T, N> &a, const vec<T, N> &b) {
    float s = 0;
    for (int i = 0; i < N; i++) s += float(a[i]) * float(b[i]);
    return s;
}

/* the next E after x towards y; for half and bfloat, one step of their own 16 bits */
template <class E> constexpr E next_after(E x, E y) {
    if constexpr (std::is_same_v<E, float>) {
        return std::nextafter(x, y);
    } else {
        if (lane_isnan(x) || lane_isnan(y)) return E(float(x) + float(y));
        if (float(x) == float(y)) return y;
        if (float(x) == 0.0f) return E::from_bits(float(y) > 0 ? 0x0001u : 0x8001u);
        uint16_t b = __builtin_bit_cast(uint16_t, x);
        return E::from_bits(uint16_t((float(y) > float(x)) == (float(x) > 0) ? b + 1 : b - 1));
    }
}

/* an integer type holding the full product of two E */
template <class E>
using wide_t = std::conditional_t<sizeof(E) <= 4, std::conditional_t<std::is_signed_v<E>, int64_t, uint64_t>,
                                  std::conditional_t<std::is_signed_v<E>, __int128, unsigned __int128>>;

} // namespace detail

/* The lambdas see one lane: x, y, z as float (F1, F2, TEST) or as the element type E. */
#define MSL_F1(name, ...)                                                              \
    template <class A, class R = detail::floating_t<A>> constexpr R name(const A &a) { \
        return detail::map<R>(                                                         \
            [](auto e) {                                                               \
                float x = e;                                                           \
                return __VA_ARGS__;                                                    \
            },                                                                         \
            R(a));                                                                     \
    }
#define MSL_F2(name, ...)                                                                                      \
    template <class A, class B, class R = detail::floating_t<A, B>> constexpr R name(const A &a, const B &b) { \
        return detail::map<R>([](float x, float y) { return __VA_ARGS__; }, R(a), R(b));                       \
    }
#define MSL_F3(name, ...)                                                       \
    template <class A, class B, class C, class R = detail::floating_t<A, B, C>> \
    constexpr R name(const A &a, const B &b, const C &c) {                      \
        auto f = [](auto x, auto y, auto z) {                                   \
            using E [[maybe_unused]] = decltype(x);                             \
            return __VA_ARGS__;                                                 \
        };                                                                      \
        return detail::map<R>(f, R(a), R(b), R(c));                             \
    }
#define MSL_TEST(name, ...)                                                                            \
    template <class A, class R = detail::floating_t<A>> constexpr detail::bool_t<R> name(const A &a) { \
        return detail::map<detail::bool_t<R>>([](float x) { return __VA_ARGS__; }, R(a));              \
    }
#define MSL_ANY(name, T, ...)                                                     \
    template <class A, class R = detail::T##_t<A>> constexpr R name(const A &a) { \
        return detail::map<R>(                                                    \
            [](auto x) {                                                          \
                using E = decltype(x);                                            \
                return __VA_ARGS__;                                               \
            },                                                                    \
            R(a));                                                                \
    }
#define MSL_ANY2(name, T, ...)                                                                            \
    template <class A, class B, class R = detail::T##_t<A, B>> constexpr R name(const A &a, const B &b) { \
        auto f = [](auto x, auto y) {                                                                     \
            using E [[maybe_unused]] = decltype(x);                                                       \
            return __VA_ARGS__;                                                                           \
        };                                                                                                \
        return detail::map<R>(f, R(a), R(b));                                                             \
    }

MSL_F1(exp, std::exp(x))
MSL_F1(exp2, std::exp2(x))
MSL_F1(exp10, std::pow(10.0f, x))
MSL_F1(log, std::log(x))
MSL_F1(log2, std::log2(x))
MSL_F1(log10, std::log10(x))
MSL_F1(sqrt, std::sqrt(x))
MSL_F1(rsqrt, 1.0f / std::sqrt(x))
MSL_F1(fabs, std::fabs(x))
MSL_F1(floor, std::floor(x))
MSL_F1(ceil, std::ceil(x))
MSL_F1(round, std::round(x))
MSL_F1(rint, std::nearbyint(x))
MSL_F1(trunc, std::trunc(x))
MSL_F1(sin, std::sin(x))
MSL_F1(cos, std::cos(x))
MSL_F1(tan, std::tan(x))
MSL_F1(sinh, std::sinh(x))
MSL_F1(cosh, std::cosh(x))
MSL_F1(tanh, std::tanh(x))
MSL_F1(asin, std::asin(x))
MSL_F1(acos, std::acos(x))
MSL_F1(atan, std::atan(x))
MSL_F1(acosh, std::acosh(x))
MSL_F1(asinh, std::asinh(x))
MSL_F1(atanh, std::atanh(x))
MSL_F1(cospi, std::cos(M_PI_F *x))
MSL_F1(sinpi, std::sin(M_PI_F *x))
MSL_F1(tanpi, std::tan(M_PI_F *x))
/* 1.0 if x > 0, -1.0 if x < 0, x itself for +-0, 0 for NaN */
MSL_F1(sign, x > 0 ? 1.0f : x < 0 ? -1.0f : x == x ? x : 0.0f)
/* fmin(x - floor(x), the largest E below 1) */
MSL_F1(fract, std::fmin(x - std::floor(x), 1.0f - float(numeric_limits<decltype(e)>::epsilon()) / 2))
MSL_F1(saturate, detail::lane_min(detail::lane_max(x, 0.0f), 1.0f))

MSL_F2(pow, std::pow(x, y))
MSL_F2(powr, std::pow(x, y))
MSL_F2(fmod, std::fmod(x, y))
MSL_F2(atan2, std::atan2(x, y))
MSL_F2(copysign, std::copysign(x, y))
MSL_F2(fmax, detail::lane_max(x, y))
MSL_F2(fmin, detail::lane_min(x, y))
MSL_F2(step, y < x ? 0.0f : 1.0f) /* step(edge, x) */
MSL_F2(divide, x / y)
MSL_F2(ldexp, std::ldexp(x, int(y))) /* ldexp(x, int k) */

/* half: the product is exact in double and so is its sum with z (within half's range), rounded
 * once; a float sum would round twice. float and bfloat: in float. */
MSL_F3(fma, std::is_same_v<E, half> ? E(std::fma(double(x), double(y), double(z)))
                                    : E(std::fma(float(x), float(y), float(z))))
MSL_F3(mad, fma(x, y, z))
MSL_F3(mix, float(x) + (float(y) - float(x)) * float(z))

MSL_F3(fmax3, E(detail::lane_max(detail::lane_max(float(x), float(y)), float(z))))
MSL_F3(fmin3, E(detail::lane_min(detail::lane_min(float(x), float(y)), float(z))))
MSL_F3(fmedian3, E(detail::lane_max(detail::lane_min(float(x), float(y)),
                                    detail::lane_min(detail::lane_max(float(x), float(y)), float(z)))))

MSL_TEST(isnan, std::isnan(x))
MSL_TEST(isinf, std::isinf(x))
MSL_TEST(isfinite, std::isfinite(x))
MSL_TEST(signbit, std::signbit(x))
/* whether either scalar is NaN (isunordered) or neither (isordered) */
template <class A, class B, std::enable_if_t<detail::scalar_v<A> && detail::scalar_v<B>, int> = 0>
constexpr bool isunordered(A x, B y) {
    return std::isnan(float(x)) || std::isnan(float(y));
}
template <class A, class B, std::enable_if_t<detail::scalar_v<A> && detail::scalar_v<B>, int> = 0>
constexpr bool isordered(A x, B y) {
    return !isunordered(x, y);
}

MSL_ANY(abs, common, is_floating_point_v<E> ? E(std::fabs(float(x))) : x < 0 ? E(-x) : x)
MSL_ANY2(max, matching, detail::lane_max(x, y))
MSL_ANY2(min, matching, detail::lane_min(x, y))
template <class A, class B, class C, class R = detail::matching_t<A, B, C>>
constexpr R clamp(const A &x, const B &lo, const C &hi) {
    auto f = [](auto v, auto l, auto h) { return detail::lane_min(detail::lane_max(v, l), h); };
    return detail::map<R>(f, R(x), R(lo), R(hi));
}

/* of three, as max and min take their types */
template <class A, class B, class C, class R = detail::matching_t<A, B, C>>
constexpr R max3(const A &x, const B &y, const C &z) {
    return max(max(x, y), z);
}
template <class A, class B, class C, class R = detail::matching_t<A, B, C>>
constexpr R min3(const A &x, const B &y, const C &z) {
    return min(min(x, y), z);
}
template <class A, class B, class C, class R = detail::matching_t<A, B, C>>
constexpr R median3(const A &x, const B &y, const C &z) {
    return max(min(x, y), min(max(x, y), z));
}

/* frexp(x, e): the fraction in [0.5, 1) with x = fraction * 2^e, of a float, half or bfloat */
template <class A, std::enable_if_t<is_floating_point_v<A>, int> = 0> A frexp(A x, int &e) {
    return A(std::frexp(float(x), &e));
}

/* select(a, b, c): c ? b : a, with c a bool vector of the operands' lanes, or for scalar operands
 * a scalar (select(T a, T b, bool c): an int converts to bool, as in any call) */
template <class A, class B, class C, class R = detail::common_t<A, B>,
          std::enable_if_t<
              std::is_same_v<detail::elem_t<C>, bool> || (detail::info<C>::n == 1 && detail::info<R>::n == 1), int> = 0>
constexpr R select(const A &a, const B &b, const C &c) {
    return detail::map<R>([](auto x, auto y, bool s) { return s ? y : x; }, R(a), R(b), detail::value_t<C>(c));
}

MSL_ANY(popcount, int, E(__builtin_popcountll(std::make_unsigned_t<E>(x))))
/* clz(0) and ctz(0) are the bit width */
MSL_ANY(clz, int, E(x ? __builtin_clzll(std::make_unsigned_t<E>(x)) - (64 - 8 * int(sizeof(E))) : 8 * int(sizeof(E))))
MSL_ANY(ctz, int, E(x ? __builtin_ctzll(std::make_unsigned_t<E>(x)) : 8 * int(sizeof(E))))
/* the high half of the full product */
MSL_ANY2(mulhi, int, E((detail::wide_t<E>(x) * y) >> (8 * sizeof(E))))
MSL_ANY2(nextafter, floating, detail::next_after(x, E(y)))

#undef MSL_F1
#undef MSL_F2
#undef MSL_F3
#undef MSL_TEST
#undef MSL_ANY
#undef MSL_ANY2

/* Geometric functions of float, half or bfloat vectors, summed in float. */
template <class A, class B, class V = detail::floating_t<A, B>>
constexpr detail::elem_t<V> dot(const A &a, const B &b) {
    return detail::elem_t<V>(detail::sum_of_products(V(a), V(b)));
}
template <class A, class V = detail::floating_t<A>> constexpr detail::elem_t<V> length(const A &a) {
    return detail::elem_t<V>(std::sqrt(detail::sum_of_products(V(a), V(a))));
}
template <class A, class V = detail::floating_t<A>> constexpr V normalize(const A &a) {
    float s = 1.0f / std::sqrt(detail::sum_of_products(V(a), V(a)));
    return detail::map<V>([s](float x) { return x * s; }, V(a));
}

} // namespace metal

#endif /* MSL_STRICT */

/* metal::fast and metal::precise declare their own functions, forwarding to metal's (the CPU does
 * not reproduce the GPU's fast-math error): an overload that user code adds to one of them (a
 * bfloat exp in metal::fast) joins the set instead of hiding every other, as it would behind a
 * using-directive. By value, so that an argument's address space and cv-qualifiers drop. */
// clang-format off
#define MSL_MATH_FUNCTIONS(X) \
    X(exp) X(exp2) X(exp10) X(log) X(log2) X(log10) X(pow) X(powr) X(sqrt) X(rsqrt) X(fabs) X(floor) X(ceil) \
    X(round) X(rint) X(trunc) X(sin) X(cos) X(tan) X(sinh) X(cosh) X(tanh) X(asin) X(acos) X(atan) X(sign) \
    X(fract) X(saturate) X(fmod) X(atan2) X(copysign) X(fmax) X(fmin) X(step) X(divide) X(fma) X(mad) X(mix) \
    X(isnan) X(isinf) X(isfinite) X(signbit) X(abs) X(max) X(min) X(clamp) X(select) X(dot) X(length) \
    X(normalize) X(acosh) X(asinh) X(atanh) X(cospi) X(sinpi) X(tanpi) X(ldexp) X(frexp) X(fmax3) X(fmin3) \
    X(fmedian3) X(max3) X(min3) X(median3) X(nextafter)
// clang-format on
#define MSL_FORWARD(name) \
    template <class... A> constexpr auto name(A... a)->decltype(::metal::name(a...)) { return ::metal::name(a...); }
namespace metal {
namespace fast {
MSL_MATH_FUNCTIONS(MSL_FORWARD)
}
namespace precise {
MSL_MATH_FUNCTIONS(MSL_FORWARD)
}
} // namespace metal

/* Apple's internal math builtins, which real headers call (MLX's bfloat math): __metal_NAME(x...,
 * mode), mode one of the macros below (ignored: fast and precise are the same here), none for fma,
 * a pointer for frexp's exponent. */
#define __METAL_FAST_MATH__ true
#define __METAL_PRECISE_MATH__ false
#define __METAL_MAYBE_FAST_MATH__ __METAL_FAST_MATH__
#define MSL_BUILTIN1(name)                                                                           \
    template <class A> constexpr auto __metal_##name(A a, bool = true)->decltype(::metal::name(a)) { \
        return ::metal::name(a);                                                                     \
    }
#define MSL_BUILTIN2(name)                                                                                            \
    template <class A, class B> constexpr auto __metal_##name(A a, B b, bool = true)->decltype(::metal::name(a, b)) { \
        return ::metal::name(a, b);                                                                                   \
    }
#define MSL_BUILTIN3(name)                                                                        \
    template <class A, class B, class C>                                                          \
    constexpr auto __metal_##name(A a, B b, C c, bool = true)->decltype(::metal::name(a, b, c)) { \
        return ::metal::name(a, b, c);                                                            \
    }
// clang-format off
MSL_BUILTIN1(exp)
MSL_BUILTIN1(exp2)
MSL_BUILTIN1(exp10)
MSL_BUILTIN1(log)
MSL_BUILTIN1(log2)
MSL_BUILTIN1(log10)
MSL_BUILTIN1(sqrt)
MSL_BUILTIN1(rsqrt)
MSL_BUILTIN1(fabs)
MSL_BUILTIN1(floor)
MSL_BUILTIN1(ceil)
MSL_BUILTIN1(round)
MSL_BUILTIN1(rint)
MSL_BUILTIN1(trunc)
MSL_BUILTIN1(sin)
MSL_BUILTIN1(cos)
MSL_BUILTIN1(tan)
MSL_BUILTIN1(sinh)
MSL_BUILTIN1(cosh)
MSL_BUILTIN1(tanh)
MSL_BUILTIN1(asin)
MSL_BUILTIN1(acos)
MSL_BUILTIN1(atan)
MSL_BUILTIN1(acosh)
MSL_BUILTIN1(asinh)
MSL_BUILTIN1(atanh)
MSL_BUILTIN1(cospi)
MSL_BUILTIN1(sinpi)
MSL_BUILTIN1(tanpi)
MSL_BUILTIN1(fract)
MSL_BUILTIN1(saturate)
MSL_BUILTIN2(pow)
MSL_BUILTIN2(powr)
MSL_BUILTIN2(fmod)
MSL_BUILTIN2(atan2)
MSL_BUILTIN2(copysign)
MSL_BUILTIN2(fmax)
MSL_BUILTIN2(fmin)
MSL_BUILTIN2(divide)
MSL_BUILTIN2(ldexp)
MSL_BUILTIN2(nextafter)
MSL_BUILTIN3(fma)
MSL_BUILTIN3(fmax3)
MSL_BUILTIN3(fmin3)
MSL_BUILTIN3(fmedian3)
// clang-format on
template <class A> auto __metal_frexp(A a, int *e) -> decltype(::metal::frexp(a, *e)) { return ::metal::frexp(a, *e); }
#undef MSL_BUILTIN1
#undef MSL_BUILTIN2
#undef MSL_BUILTIN3
#undef MSL_FORWARD

#endif
