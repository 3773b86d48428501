// Row-wise elementwise kernels of a decoder layer, written once and compiled once per
// instruction set (kernels_<isa>.cpp sets QE_ISA and the compiler flags; ops.cpp chooses at run
// time). Plain loops the compiler vectorises; no torch or C++ library headers, so nothing inline
// compiled for a wider instruction set can be shared with code that runs on a narrower one.
//
// Every row is computed alone, in a fixed order of operations, so a text's values never depend
// on the rows computed beside it. Values are rounded to the model dtype where transformers'
// Qwen2/Qwen3 modules round them, except that each rotation and silu(gate) * up is one fp32
// expression rounded once.
#pragma once
#include "numerics.h"

namespace qe {
namespace QE_ISA {
namespace {

// RMSNorm and the rotary kernel run 16 values at a time as explicit vectors (numerics.h), with
// scalar tails where a width is not a multiple of 16; silu_mul is a plain loop GCC vectorises.

template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* weight, T* out, int64_t rows, int64_t n,
              float eps) {
  const int64_t whole = n - n % 16;
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = x + i * x_stride;
    T* dst = out + i * n;
    const float scale = inverse_rms(row, n, eps);
    for (int64_t j = 0; j < whole; j += 16)
      store16(dst + j, round16<T>(load16(row + j) * scale) * load16(weight + j));
    for (int64_t j = whole; j < n; ++j)
      store(dst + j, round_to<T>(to_float(row[j]) * scale) * to_float(weight[j]));
  }
}

// Neox rotation of each head of d values (halves x1, x2): x1 c - x2 s, x2 c + x1 s, with the
// head first RMS-normalised by `norm_weight` when given (Qwen3's q/k norm). D > 0 fixes d at
// compile time (the common head sizes), so the compiler unrolls the short per-head loops.
template <typename T, int64_t D>
void rope_heads(const T* x, int64_t x_stride, const T* cos, const T* sin, const T* norm_weight,
                float eps, T* out, int64_t rows, int64_t heads, int64_t runtime_d) {
  const int64_t d = D > 0 ? D : runtime_d, half = d / 2, whole = half - half % 16;
  float w[kMaxHeadDim];  // the norm's weights, converted once
  for (int64_t j = 0; norm_weight && j < d; ++j) w[j] = to_float(norm_weight[j]);
  auto normed = [&](F16 v, float scale, int64_t j) {
    return round16<T>(round16<T>(v * scale) * load16(w + j));
  };
  auto normed1 = [&](float v, float scale, int64_t j) {
    return round_to<T>(round_to<T>(v * scale) * w[j]);
  };
  float scales[kMaxHeads];
  for (int64_t i = 0; i < rows; ++i) {
    const T* c = cos + i * half;
    const T* s = sin + i * half;
    // The heads' norms first: independent reductions, which the core overlaps.
    for (int64_t h = 0; h < heads && norm_weight; ++h)
      scales[h] = inverse_rms(x + i * x_stride + h * d, d, eps);
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = x + i * x_stride + h * d;
      T* dst = out + (i * heads + h) * d;
      // The next row's head, a stride away (q and k are slices of q|k|v rows): the hardware
      // prefetchers follow contiguous rows, not these.
      for (int64_t j = 0; i + 1 < rows && j < d; j += 64 / static_cast<int64_t>(sizeof(T)))
        __builtin_prefetch(src + x_stride + j);
      const float scale = norm_weight ? scales[h] : 1.0f;
      for (int64_t j = 0; j < whole; j += 16) {
        F16 x1 = load16(src + j), x2 = load16(src + j + half);
        if (norm_weight) {
          x1 = normed(x1, scale, j);
          x2 = normed(x2, scale, j + half);
        }
        const F16 cj = load16(c + j), sj = load16(s + j);
        store16(dst + j, x1 * cj - x2 * sj);
        store16(dst + j + half, x2 * cj + x1 * sj);
      }
      for (int64_t j = whole; j < half; ++j) {
        float x1 = to_float(src[j]), x2 = to_float(src[j + half]);
        if (norm_weight) {
          x1 = normed1(x1, scale, j);
          x2 = normed1(x2, scale, j + half);
        }
        const float cj = to_float(c[j]), sj = to_float(s[j]);
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

// The int8 route's rotation of `rows` rows (hadamard_row) into out [rows, k] in fp32.
template <typename T>
void hadamard_rows(const T* x, int64_t stride, int64_t rows, int64_t k, int64_t block,
                   float* out) {
  for (int64_t i = 0; i < rows; ++i) hadamard_row(x + i * stride, k, block, out + i * k);
}

}  // namespace
}  // namespace QE_ISA
}  // namespace qe
