// Row-wise elementwise kernels of a decoder layer, written once and compiled once per
// instruction set (rows_<isa>.cpp sets QE_ISA and the compiler flags; ops.cpp chooses at run
// time). Plain loops the compiler vectorises; no torch or C++ library headers, so nothing inline
// compiled for a wider instruction set can be shared with code that runs on a narrower one.
//
// Every row is computed alone, in a fixed order of operations, so a text's values never depend
// on the rows computed beside it. Values are rounded to the model dtype where transformers'
// Qwen2/Qwen3 modules round them, except that each rotation and silu(gate) * up is one fp32
// expression rounded once.
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

template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* weight, T* out, int64_t rows, int64_t n,
              float eps) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = x + i * x_stride;
    T* dst = out + i * n;
    float scale = inverse_rms(row, n, eps);
    for (int64_t j = 0; j < n; ++j)
      store(dst + j, round_to<T>(to_float(row[j]) * scale) * to_float(weight[j]));
  }
}

// Neox rotation of each head of d values (halves x1, x2): x1 c - x2 s, x2 c + x1 s, with the
// head first RMS-normalised by `norm_weight` when given (Qwen3's q/k norm). D > 0 fixes d at
// compile time (the common head sizes), so the compiler unrolls the short per-head loops.
template <typename T, int64_t D>
void rope_heads(const T* x, int64_t x_stride, const T* cos, const T* sin, const T* norm_weight,
                float eps, T* out, int64_t rows, int64_t heads, int64_t runtime_d) {
  const int64_t d = D > 0 ? D : runtime_d, half = d / 2;
  float head[kMaxHeadDim];
  for (int64_t i = 0; i < rows; ++i) {
    const T* c = cos + i * half;
    const T* s = sin + i * half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = x + i * x_stride + h * d;
      T* dst = out + (i * heads + h) * d;
      if (norm_weight) {
        float scale = inverse_rms(src, d, eps);
        for (int64_t j = 0; j < d; ++j)
          head[j] = round_to<T>(round_to<T>(to_float(src[j]) * scale) * to_float(norm_weight[j]));
      } else {
        for (int64_t j = 0; j < d; ++j) head[j] = to_float(src[j]);
      }
      for (int64_t j = 0; j < half; ++j) {
        float x1 = head[j], x2 = head[j + half], cj = to_float(c[j]), sj = to_float(s[j]);
        store(dst + j, x1 * cj - x2 * sj);
        store(dst + j + half, x2 * cj + x1 * sj);
      }
    }
  }
}

template <typename T>
void rope(const T* x, int64_t x_stride, const T* cos, const T* sin, const T* norm_weight,
          float eps, T* out, int64_t rows, int64_t heads, int64_t d) {
  auto run = d == 128 ? rope_heads<T, 128> : d == 64 ? rope_heads<T, 64> : rope_heads<T, 0>;
  run(x, x_stride, cos, sin, norm_weight, eps, out, rows, heads, d);
}

template <typename T>
void silu_mul(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t n) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* gate = gate_up + i * stride;
    const T* up = gate + n;
    T* dst = out + i * n;
    for (int64_t j = 0; j < n; ++j) {
      float g = to_float(gate[j]);
      store(dst + j, g / (1.0f + exp_approx(-g)) * to_float(up[j]));
    }
  }
}

}  // namespace

extern const RowKernels kernels = {
    rms_norm<float>, rms_norm<uint16_t>, rope<float>, rope<uint16_t>, silu_mul<float>,
    silu_mul<uint16_t>,
};

}  // namespace QE_ISA
}  // namespace qe
