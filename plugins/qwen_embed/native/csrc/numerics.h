// Numerics shared by the kernels of one instruction set (rows.h, attention.h): bf16 <-> fp32 as
// torch converts, a fixed-order lane sum, and a vectorisable exp. Included into each
// kernels_<isa>.cpp, whose flags decide the instructions.
#pragma once
#include <stdint.h>

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

// Sum of squares in 16 fixed lanes and a fixed tree: the same order whatever the vector width.
constexpr int kLanes = 16;
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float lanes[kLanes] = {};
  const int64_t whole = n - n % kLanes;
  for (int64_t j = 0; j < whole; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      float v = to_float(x[j + l]);
      lanes[l] += v * v;
    }
  for (int64_t l = 0; l < n - whole; ++l) {
    float v = to_float(x[whole + l]);
    lanes[l] += v * v;
  }
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

template <typename T>
inline float inverse_rms(const T* x, int64_t n, float eps) {
  return 1.0f / __builtin_sqrtf(sum_squares(x, n) / static_cast<float>(n) + eps);
}

// exp for silu: Cephes' range reduction and polynomial (about 2 ulp), vectorisable. The clamp
// stays below the float range's top so that no lane of silu's division makes a denormal (a
// slow microcode path).
inline float exp_approx(float x) {
  x = x > -87.0f ? x : -87.0f;
  x = x < 80.0f ? x : 80.0f;
  float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
}

}  // namespace
}  // namespace QE_ISA
}  // namespace qe
