// Numerics shared by the kernels of one instruction set (rows.h, attention.h, gemm/rows.cpp):
// bf16 <-> fp32 as torch converts, a fixed-order lane sum, a vectorisable exp and the int8
// route's rotation. Included into each kernels_<isa>.cpp, whose flags decide the instructions.
#pragma once
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace qe {
namespace QE_ISA {
namespace {

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16);
}

// Round to nearest even, as torch converts fp32 to bf16; NaN stays NaN.
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) {
  uint32_t u = __builtin_bit_cast(uint32_t, v);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  *p = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// The value `store` keeps, as fp32: where transformers rounds an intermediate to the dtype.
template <typename T>
inline float round_to(float v) {
  T t;
  store(&t, v);
  return to_float(t);
}

// 16 values at a time between the model dtype and fp32 as explicit vectors: GCC does not
// vectorise the scalar conversions above well.
typedef float F16 __attribute__((vector_size(64)));
typedef uint32_t U16x32 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));

#if defined(__AVX2__) && !defined(__AVX512F__)
// Where no register holds 16 floats, GCC compiles a comparison or a select of 16-float vectors
// one lane at a time (scalar code) and moves one to unaligned memory piece by piece through
// general registers: on AVX2 those steps take the two 8-float halves, split and joined through
// an aligned copy that stays in registers.
struct Halves {
  __m256 lo, hi;
};
inline Halves halves(F16 v) {
  alignas(64) float lanes[16];
  __builtin_memcpy(lanes, &v, sizeof lanes);
  return {_mm256_load_ps(lanes), _mm256_load_ps(lanes + 8)};
}
inline F16 joined(__m256 lo, __m256 hi) {
  alignas(64) float lanes[16];
  _mm256_store_ps(lanes, lo);
  _mm256_store_ps(lanes + 8, hi);
  F16 v;
  __builtin_memcpy(&v, lanes, sizeof v);
  return v;
}
#endif

inline U16x16 to_bf16(F16 v) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16: round to nearest even, NaN stays NaN (denormal inputs count as zero)
  return reinterpret_cast<U16x16>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  // the generic steps below on each half
  auto rounded = [](__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(_mm256_srli_epi32(biased, 16), _mm256_set1_epi32(0x7fc0), nan);
  };
  const Halves h = halves(v);
  // vpackusdw packs within 128-bit lanes: quarters 0, 2, 1, 3 are memory order
  return reinterpret_cast<U16x16>(
      _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded(h.lo), rounded(h.hi)), 0xD8));
#else
  const U16x32 u = reinterpret_cast<U16x32>(v);
  const U16x32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded, U16x16);
#endif
}
inline F16 from_bf16(U16x16 h) {
#if defined(__AVX512F__)
  // one vpmovzxwd across the register (GCC's generic conversion takes two halves)
  const __m512i wide = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h));
  return reinterpret_cast<F16>(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__)
  const __m256i words = reinterpret_cast<__m256i>(h);
  auto widened = [](__m128i w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
  };
  return joined(widened(_mm256_castsi256_si128(words)),
                widened(_mm256_extracti128_si256(words, 1)));
#else
  return reinterpret_cast<F16>(__builtin_convertvector(h, U16x32) << 16);
#endif
}

#if defined(__AVX512F__)
// The first n of 16 lanes (none for n <= 0): masked loads and stores of a row's tail.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}
#endif

// a > b ? a : b and a < b ? a : b, lane by lane (NaN in a gives b): vmaxps and vminps
inline float greater_of(float a, float b) { return a > b ? a : b; }
inline float lesser_of(float a, float b) { return a < b ? a : b; }
inline F16 greater_of(F16 a, F16 b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const Halves x = halves(a), y = halves(b);
  return joined(_mm256_max_ps(x.lo, y.lo), _mm256_max_ps(x.hi, y.hi));
#else
  return a > b ? a : b;
#endif
}
inline F16 lesser_of(F16 a, F16 b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const Halves x = halves(a), y = halves(b);
  return joined(_mm256_min_ps(x.lo, y.lo), _mm256_min_ps(x.hi, y.hi));
#else
  return a < b ? a : b;
#endif
}

inline F16 load16(const float* p) {
  F16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline F16 load16(const uint16_t* p) {
  U16x16 h;
  __builtin_memcpy(&h, p, sizeof h);
  return from_bf16(h);
}

inline void store16(float* p, F16 v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const Halves h = halves(v);
  _mm256_storeu_ps(p, h.lo);
  _mm256_storeu_ps(p + 8, h.hi);
#else
  __builtin_memcpy(p, &v, sizeof v);
#endif
}
inline void store16(uint16_t* p, F16 v) {
  const U16x16 h = to_bf16(v);
  __builtin_memcpy(p, &h, sizeof h);
}
// round_to for 16 values at once
template <typename T>
inline F16 round16(F16 v) {
  if constexpr (sizeof(T) == sizeof(uint16_t)) return from_bf16(to_bf16(v));
  return v;
}

// 32 values at a time as two vectors, in the lane order that `Rounds` roundings to the model
// dtype left them in. With AVX512_BF16, a bf16 load splits even and odd values with two bit
// operations, and a rounding packs both vectors with one vcvtne2ps2bf16 and splits again: the
// values move between lanes in a fixed way, but no conversion shuffles lanes on its own; the
// store puts them back in memory order with one vpermw. Values that meet (weights, cos/sin) take
// as many roundings, which leaves dtype values unchanged and their lanes matching; the type
// keeps the count, so values in different orders cannot meet. Elsewhere lanes keep memory order.
template <int Rounds>
struct V32 {
  F16 a, b;
};
template <int R>
inline V32<R> operator+(V32<R> x, V32<R> y) { return {x.a + y.a, x.b + y.b}; }
template <int R>
inline V32<R> operator-(V32<R> x, V32<R> y) { return {x.a - y.a, x.b - y.b}; }
template <int R>
inline V32<R> operator*(V32<R> x, V32<R> y) { return {x.a * y.a, x.b * y.b}; }
template <int R>
inline V32<R> operator*(V32<R> x, float s) { return {x.a * s, x.b * s}; }

#if defined(__AVX512BF16__)
// 32 bf16 in one register -> even values (low halves of the 32-bit lanes) and odd ones
inline V32<0> split(__m512i w) {
  const U16x32 u = reinterpret_cast<U16x32>(w);
  return {reinterpret_cast<F16>(u << 16), reinterpret_cast<F16>(u & 0xffff0000u)};
}
inline __m512i pack(F16 a, F16 b) {  // words 0-15: a rounded, 16-31: b rounded
  return reinterpret_cast<__m512i>(
      _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(a)));
}
// Where each position (a's lanes, then b's) holds the value of memory position `element`
// after Rounds + 1 splits, and the store's vpermw index: memory word e <- position index[e].
template <int Rounds>
struct LaneOrder {
  short index[32];
  constexpr LaneOrder() : index() {
    int element[32], next[32];
    for (int p = 0; p < 32; ++p) element[p] = p;
    for (int r = 0; r <= Rounds; ++r) {
      for (int p = 0; p < 32; ++p) next[p] = element[p < 16 ? 2 * p : 2 * (p - 16) + 1];
      for (int p = 0; p < 32; ++p) element[p] = next[p];
    }
    for (int p = 0; p < 32; ++p) index[element[p]] = static_cast<short>(p);
  }
};
template <int Rounds>
constexpr LaneOrder<Rounds> kLaneOrder{};
#endif

inline V32<0> load32(const float* p) { return {load16(p), load16(p + 16)}; }
inline V32<0> load32(const uint16_t* p) {
#if defined(__AVX512BF16__)
  return split(_mm512_loadu_si512(p));
#else
  return {load16(p), load16(p + 16)};
#endif
}

// 32 fp32 values (a rotation's fp32 tables) in the lanes where load32 puts 32 values of T: even
// and odd values apart, as a bf16 load splits them, with AVX512_BF16; memory order elsewhere.
template <typename T>
inline V32<0> load32_in_lanes_of(const float* p) {
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
    const __m512i even = _mm512_slli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 1);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    return {reinterpret_cast<F16>(_mm512_permutex2var_ps(lo, even, hi)),
            reinterpret_cast<F16>(_mm512_permutex2var_ps(lo, odd, hi))};
  }
#endif
  return load32(p);
}

template <typename T, int R>
inline V32<R + 1> round32(V32<R> v) {
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    const V32<0> s = split(pack(v.a, v.b));
    return {s.a, s.b};
  }
#endif
  return {round16<T>(v.a), round16<T>(v.b)};
}

// `Rounds` roundings of values already in the dtype (weights, cos/sin): their lanes, not values
template <typename T, int Rounds>
inline V32<Rounds> load32_as(const T* p) {
  if constexpr (Rounds == 0)
    return load32(p);
  else
    return round32<T>(load32_as<T, Rounds - 1>(p));
}

template <int R>
inline void store32(float* p, V32<R> v) {
  store16(p, v.a);
  store16(p + 16, v.b);
}
template <int R>
inline void store32(uint16_t* p, V32<R> v) {
#if defined(__AVX512BF16__)
  const __m512i index = _mm512_loadu_si512(kLaneOrder<R>.index);
  _mm512_storeu_si512(p, _mm512_permutexvar_epi16(index, pack(v.a, v.b)));
#else
  store16(p, v.a);
  store16(p + 16, v.b);
#endif
}

// Sum of squares in 16 x 4 fixed lanes and a fixed tree: the same order whatever the vector
// width. The lanes are explicit vectors: as an array GCC kept them in memory.
constexpr int kLanes = 16;
typedef int32_t I16 __attribute__((vector_size(64)));

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  // Four vectors of lanes, so that consecutive multiply-adds do not wait for each other.
  F16 lanes[4] = {};
  const int64_t whole = n - n % (4 * kLanes), part = n - n % kLanes;
  for (int64_t j = 0; j < whole; j += 4 * kLanes)
    for (int a = 0; a < 4; ++a) {
      const F16 v = load16(x + j + a * kLanes);
      lanes[a] += v * v;
    }
  for (int64_t j = whole; j < part; j += kLanes) {
    const F16 v = load16(x + j);
    lanes[0] += v * v;
  }
  F16 sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (int64_t l = 0; l < n - part; ++l) {
    float v = to_float(x[part + l]);
    sum[l] += v * v;
  }
  // lane l += lane l + width, for width 8, 4, 2, 1: shuffles in registers
  const I16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma GCC unroll 4
  for (int width = kLanes / 2; width > 0; width /= 2)
    sum += __builtin_shuffle(sum, (lane + width) % kLanes);
  return sum[0];
}

template <typename T>
inline float inverse_rms(const T* x, int64_t n, float eps) {
  return 1.0f / __builtin_sqrtf(sum_squares(x, n) / static_cast<float>(n) + eps);
}

// The int8 route's rotation (int8.py): an unnormalised Walsh-Hadamard transform of each block
// of `block` values (16, 32, 64 or 128, dividing k) of a row into dst, as butterflies (a + b,
// a - b) on pairs h apart for h = 1, 2, 4, ..., the order int8.hadamard_rows takes them, so the
// same floats in every instruction set. A block stays in registers; returns the row's largest
// magnitude.
#if defined(__AVX2__) && !defined(__AVX512F__)
// GCC's generic shuffles of a 16-lane vector are many times slower on AVX2 than these: lanes l
// with l & h set become lo - hi, the others lo + hi, for pairs h = 1, 2 or 4 lanes apart.
template <int h>
inline __m256 butterflies8(__m256 x) {
  const __m256 partner = h == 4   ? _mm256_permute2f128_ps(x, x, 1)
                         : h == 2 ? _mm256_permute_ps(x, 0x4E)
                                  : _mm256_permute_ps(x, 0xB1);
  constexpr int upper = h == 4 ? 0xF0 : h == 2 ? 0xCC : 0xAA;
  return _mm256_blend_ps(_mm256_add_ps(x, partner), _mm256_sub_ps(partner, x), upper);
}
#endif

inline F16 butterflies16(F16 x) {  // pairs 1, 2, 4 and 8 lanes apart
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m256 half[2];
  __builtin_memcpy(half, &x, sizeof x);
  for (__m256& v : half) v = butterflies8<4>(butterflies8<2>(butterflies8<1>(v)));
  const __m256 out[2] = {_mm256_add_ps(half[0], half[1]), _mm256_sub_ps(half[0], half[1])};
  __builtin_memcpy(&x, out, sizeof x);
#else
  const I16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma GCC unroll 4
  for (int h = 1; h < 16; h *= 2) {
    const F16 partner = __builtin_shuffle(x, lane ^ h);
    x = (lane & h) ? partner - x : x + partner;
  }
#endif
  return x;
}

inline F16 abs16(F16 v) {
  return reinterpret_cast<F16>(reinterpret_cast<U16x32>(v) & 0x7fffffffu);
}

// The butterflies across V vectors of a block (pairs of vectors h = 1, 2, ... apart), after
// those within each vector: the rest of the torch order.
template <int V, typename Vec>
inline void butterflies_across(Vec* x) {
#pragma GCC unroll 32
  for (int h = 1; h < V; h *= 2)
#pragma GCC unroll 32
    for (int j = 0; j < V; ++j)
      if (!(j & h)) {
        const Vec a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

template <int V, typename T>
inline F16 hadamard_block(const T* src, float* dst) {
  F16 x[V];
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) x[v] = butterflies16(load16(src + 16 * v));
  butterflies_across<V>(x);
  F16 amax = {};
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    store16(dst + 16 * v, x[v]);
    const F16 m = abs16(x[v]);
    amax = greater_of(m, amax);
  }
  return amax;
}

template <typename T>
inline float hadamard_row(const T* src, int64_t k, int64_t block, float* dst) {
  F16 amax = {};
  for (int64_t j = 0; j < k; j += block) {
    F16 m;
    switch (block) {
      case 16: m = hadamard_block<1>(src + j, dst + j); break;
      case 32: m = hadamard_block<2>(src + j, dst + j); break;
      case 64: m = hadamard_block<4>(src + j, dst + j); break;
      default: m = hadamard_block<8>(src + j, dst + j); break;
    }
    amax = greater_of(m, amax);
  }
  float lanes[kLanes];
  __builtin_memcpy(lanes, &amax, sizeof lanes);
  float most = 0.0f;
  for (float l : lanes) most = l > most ? l : most;
  return most;
}

// exp for silu: Cephes' range reduction and polynomial (about 2 ulp), for one value or 16. The
// clamp stays below the float range's top so that no lane of silu's division makes a denormal
// (a slow microcode path).
inline float floor_of(float x) { return __builtin_floorf(x); }
inline F16 floor_of(F16 x) {
#if defined(__AVX512F__)
  return reinterpret_cast<F16>(
      _mm512_roundscale_ps(reinterpret_cast<__m512>(x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#elif defined(__AVX2__)
  const Halves h = halves(x);
  return joined(_mm256_floor_ps(h.lo), _mm256_floor_ps(h.hi));
#else
  const F16 t = __builtin_convertvector(__builtin_convertvector(x, I16), F16);  // toward zero
  return t > x ? t - 1.0f : t;
#endif
}

// p * 2^k for whole k that keep the result normal
inline float times_pow2(float p, float k) {
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
}
inline F16 times_pow2(F16 p, F16 k) {
#if defined(__AVX512F__)
  return reinterpret_cast<F16>(
      _mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(k)));
#else
  return p * reinterpret_cast<F16>((__builtin_convertvector(k, I16) + 127) << 23);
#endif
}

template <typename V>
inline V exp_approx(V x) {
  x = greater_of(x, V{} - 87.0f);
  x = lesser_of(x, V{} + 80.0f);
  const V k = floor_of(x * 1.44269504088896341f + 0.5f);
  V r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return times_pow2(p, k);
}

template <typename V>
inline V silu(V g) {
  return g / (1.0f + exp_approx(-g));
}

// GELU with tanh's approximation, 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
// as x sigmoid(2u): one exp, and no cancellation where tanh(u) nears -1.
template <typename V>
inline V gelu_tanh(V x) {
  const V two_u = x * (1.5957691216057308f + 0.07135481627260025f * x * x);
  return x / (1.0f + exp_approx(-two_u));
}

}  // namespace
}  // namespace QE_ISA
}  // namespace qe
