// Row-wise elementwise kernels of a decoder layer (and the vision tower's GELU), written once
// and compiled once per instruction set (kernels_<isa>.cpp sets QE_ISA and the compiler flags;
// cpu_features.cpp chooses at run time). GCC vector types, 32 values at a time (numerics.h's
// V32), with scalar tails where a width is not a multiple of 32; no torch or C++ library
// headers, so nothing inline compiled for a wider instruction set can be shared with code that
// runs on a narrower one.
//
// Every row is computed alone, in a fixed order of operations, so a text's values never depend
// on the rows computed beside it. Values are rounded to the model dtype where transformers'
// Qwen2/Qwen3 modules round them, except that each rotation, silu(gate) * up and GELU is one
// fp32 expression rounded once.
#pragma once
#include "numerics.h"

namespace qe {
namespace QE_ISA {
namespace {

// A weight of the rows' dtype scales the normalised value rounded to it (transformers' Qwen2/3
// RMSNorm); an fp32 weight with bf16 rows scales it in fp32, rounded once (Qwen3.5's, whose
// 1 + weight is kept in fp32).
template <typename T, typename W = T>
void rms_norm(const T* x, int64_t x_stride, const W* weight, T* out, int64_t rows, int64_t n,
              float eps) {
  constexpr bool wide = sizeof(W) > sizeof(T);
  const int64_t whole = n - n % 32;
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = x + i * x_stride;
    T* dst = out + i * n;
    const float scale = inverse_rms(row, n, eps);
    for (int64_t j = 0; j < whole; j += 32)
      if constexpr (wide)
        store32(dst + j, load32(row + j) * scale * load32_in_lanes_of<T>(weight + j));
      else
        store32(dst + j, round32<T>(load32(row + j) * scale) * load32_as<T, 1>(weight + j));
    for (int64_t j = whole; j < n; ++j)
      if constexpr (wide)
        store(dst + j, to_float(row[j]) * scale * weight[j]);
      else
        store(dst + j, round_to<T>(to_float(row[j]) * scale) * to_float(weight[j]));
  }
}

// The residual add (x + residual rounded to the dtype, as transformers' add rounds it) written
// over x, then the sum's RMSNorm into out, a row at a time: the sum is read back from L1.
template <typename T, typename W = T>
void add_rms_norm(T* x, const T* residual, const W* weight, T* out, int64_t rows, int64_t n,
                  float eps) {
  const int64_t whole = n - n % 32;
  for (int64_t i = 0; i < rows; ++i) {
    T* row = x + i * n;
    const T* add = residual + i * n;
    for (int64_t j = 0; j < whole; j += 32)
      store32(row + j, round32<T>(load32(row + j) + load32(add + j)));
    for (int64_t j = whole; j < n; ++j)
      store(row + j, round_to<T>(to_float(row[j]) + to_float(add[j])));
    rms_norm(row, n, weight, out + i * n, 1, n, eps);
  }
}

// Neox rotation of each head of d values (halves x1, x2): x1 c - x2 s, x2 c + x1 s, with the
// head first RMS-normalised by `norm_weight` when Normed (Qwen3's q/k norm), which rounds twice.
// The tables (C) are in the rows' dtype, or fp32 for 16-bit rows without a norm (the vision
// tower's rotation, in fp32). D > 0 fixes d at compile time (the common head sizes), so the
// compiler unrolls the short per-head loops.
template <typename T, typename C, int64_t D, bool Normed>
void rope_heads(const T* x, int64_t x_stride, const C* cos, const C* sin, const T* norm_weight,
                float eps, T* out, int64_t rows, int64_t heads, int64_t runtime_d) {
  static_assert(sizeof(C) == sizeof(T) || !Normed, "fp32 tables rotate rows without a norm");
  constexpr int R = Normed ? 2 : 0;  // roundings of a rotated value
  const int64_t d = D > 0 ? D : runtime_d, half = d / 2, whole = half - half % 32;
  V32<1> w1[kMaxHeadDim / 64], w2[kMaxHeadDim / 64];  // the norm's weights, in the lanes they meet
  for (int64_t j = 0; Normed && j < whole; j += 32) {
    w1[j / 32] = load32_as<T, 1>(norm_weight + j);
    w2[j / 32] = load32_as<T, 1>(norm_weight + half + j);
  }
  auto normed1 = [&](float v, float scale, int64_t j) {
    return Normed ? round_to<T>(round_to<T>(v * scale) * to_float(norm_weight[j])) : v;
  };
  float scales[kMaxHeads];
  V32<R> c[kMaxHeadDim / 64], s[kMaxHeadDim / 64];
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < whole; j += 32) {
      if constexpr (sizeof(C) == sizeof(T)) {
        c[j / 32] = load32_as<T, R>(cos + i * half + j);
        s[j / 32] = load32_as<T, R>(sin + i * half + j);
      } else {
        c[j / 32] = load32_in_lanes_of<T>(cos + i * half + j);
        s[j / 32] = load32_in_lanes_of<T>(sin + i * half + j);
      }
    }
    // The heads' norms first: independent reductions, which the core overlaps.
    for (int64_t h = 0; h < heads && Normed; ++h)
      scales[h] = inverse_rms(x + i * x_stride + h * d, d, eps);
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = x + i * x_stride + h * d;
      T* dst = out + (i * heads + h) * d;
      // The next row's head, a stride away (q and k are slices of q|k|v rows): the hardware
      // prefetchers follow contiguous rows, not these.
      for (int64_t j = 0; i + 1 < rows && j < d; j += 64 / static_cast<int64_t>(sizeof(T)))
        __builtin_prefetch(src + x_stride + j);
      const float scale = Normed ? scales[h] : 1.0f;
      auto load = [&](const T* p, V32<1> weight) {
        if constexpr (Normed)
          return round32<T>(round32<T>(load32(p) * scale) * weight);
        else
          return load32(p);
      };
      for (int64_t j = 0; j < whole; j += 32) {
        const V32<R> x1 = load(src + j, w1[j / 32]), x2 = load(src + j + half, w2[j / 32]);
        const V32<R> cj = c[j / 32], sj = s[j / 32];
        store32(dst + j, x1 * cj - x2 * sj);
        store32(dst + j + half, x2 * cj + x1 * sj);
      }
      for (int64_t j = whole; j < half; ++j) {
        const float x1 = normed1(to_float(src[j]), scale, j);
        const float x2 = normed1(to_float(src[j + half]), scale, j + half);
        const float cj = to_float(cos[i * half + j]), sj = to_float(sin[i * half + j]);
        store(dst + j, x1 * cj - x2 * sj);
        store(dst + j + half, x2 * cj + x1 * sj);
      }
    }
  }
}

template <typename T, typename C = T>
void rope(const T* x, int64_t x_stride, const C* cos, const C* sin, const T* norm_weight,
          float eps, T* out, int64_t rows, int64_t heads, int64_t d) {
  auto run = d == 128 ? rope_heads<T, C, 128, false>
             : d == 64 ? rope_heads<T, C, 64, false>
                       : rope_heads<T, C, 0, false>;
  if constexpr (sizeof(C) == sizeof(T))
    if (norm_weight)
      run = d == 128 ? rope_heads<T, C, 128, true>
            : d == 64 ? rope_heads<T, C, 64, true>
                      : rope_heads<T, C, 0, true>;
  run(x, x_stride, cos, sin, norm_weight, eps, out, rows, heads, d);
}

template <typename T>
void silu_mul(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t n) {
  const int64_t whole = n - n % 32;
  for (int64_t i = 0; i < rows; ++i) {
    const T* gate = gate_up + i * stride;
    const T* up = gate + n;
    T* dst = out + i * n;
    for (int64_t j = 0; j < whole; j += 32) {
      const V32<0> g = load32(gate + j), u = load32(up + j);
      store32(dst + j, V32<0>{silu(g.a), silu(g.b)} * u);
    }
    for (int64_t j = whole; j < n; ++j) store(dst + j, silu(to_float(gate[j])) * to_float(up[j]));
  }
}

template <typename T>
void gelu_tanh(const T* x, int64_t stride, T* out, int64_t rows, int64_t n) {
  const int64_t whole = n - n % 32;
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = x + i * stride;
    T* dst = out + i * n;
    for (int64_t j = 0; j < whole; j += 32) {
      const V32<0> v = load32(row + j);
      store32(dst + j, V32<0>{gelu_tanh(v.a), gelu_tanh(v.b)});
    }
    for (int64_t j = whole; j < n; ++j) store(dst + j, gelu_tanh(to_float(row[j])));
  }
}

// The int8 route's rotation of `rows` rows (hadamard_row) into out [rows, k] in fp32.
template <typename T>
void hadamard_rows(const T* x, int64_t stride, int64_t rows, int64_t k, int64_t block,
                   float* out) {
  for (int64_t i = 0; i < rows; ++i) hadamard_row(x + i * stride, k, block, out + i * k);
}

// float64 vectors of the widest registers the instruction set has (GCC's generic shuffles of
// a vector wider than them are many times slower)
#ifdef __AVX512F__
constexpr int kDoubles = 8;
#else
constexpr int kDoubles = 4;
#endif
typedef double DV __attribute__((vector_size(8 * kDoubles)));
typedef int64_t LV __attribute__((vector_size(8 * kDoubles)));

// One block of V x kDoubles float64 values of `wide`, in registers: hadamard_block's
// butterflies (pairs 1, 2, ... apart within a vector, then across vectors); returns its
// lanes' largest magnitudes.
template <int V>
inline DV hadamard_block_f64(double* wide) {
  LV lane;
  for (int l = 0; l < kDoubles; ++l) lane[l] = l;
  DV x[V];
  __builtin_memcpy(x, wide, sizeof x);
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v)
#pragma GCC unroll 3
    for (int h = 1; h < kDoubles; h *= 2) {
      const DV partner = __builtin_shuffle(x[v], lane ^ h);
      x[v] = (lane & h) ? partner - x[v] : x[v] + partner;
    }
  butterflies_across<V>(x);
  __builtin_memcpy(wide, x, sizeof x);
  DV most = {};
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) {
    const DV m = x[v] < 0 ? -x[v] : x[v];
    most = m > most ? m : most;
  }
  return most;
}

// The int8 route's weights at load, int8.torch_weight_codes' arithmetic: each of `rows` rows of
// w (k values, `stride` apart) widened to float64 in `wide` (k values), rotated per `block`
// values (block > 1) by hadamard_block_f64, then quantised as int8.quantize_rows: scale =
// float(max |x|), at least float(1e-12), / 127; code = round-half-even(float(x) * (1 / scale)),
// within +-127; scales[i] = scale / block; sums[i] the row's codes added up.
template <typename T>
void weight_codes(const T* w, int64_t stride, int64_t rows, int64_t k, int64_t block,
                  double* wide, int8_t* codes, float* scales, int32_t* sums) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = w + i * stride;
    for (int64_t j = 0; j < k; ++j) wide[j] = static_cast<double>(to_float(row[j]));
    double most = 0.0;
    if (block > 1) {
      DV lanes = {};
      for (int64_t j = 0; j < k; j += block) {
        DV m;
        switch (block) {
          case 16: m = hadamard_block_f64<16 / kDoubles>(wide + j); break;
          case 32: m = hadamard_block_f64<32 / kDoubles>(wide + j); break;
          case 64: m = hadamard_block_f64<64 / kDoubles>(wide + j); break;
          default: m = hadamard_block_f64<128 / kDoubles>(wide + j); break;
        }
        lanes = m > lanes ? m : lanes;
      }
      for (int l = 0; l < kDoubles; ++l) most = lanes[l] > most ? lanes[l] : most;
    } else {
      for (int64_t j = 0; j < k; ++j) {
        const double m = __builtin_fabs(wide[j]);
        most = m > most ? m : most;
      }
    }
    const float floor = static_cast<float>(1e-12), largest = static_cast<float>(most);
    const float scale = (largest > floor ? largest : floor) / 127.0f;
    const float inverse = 1.0f / scale;
    int8_t* code = codes + i * k;
    int32_t sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      const float v = __builtin_rintf(static_cast<float>(wide[j]) * inverse);
      code[j] = static_cast<int8_t>(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v);
      sum += code[j];
    }
    scales[i] = scale / static_cast<float>(block);
    sums[i] = sum;
  }
}

// Qwen3.5's causal depthwise convolution and its SiLU for rows [first, first + rows) of x (rows of
// n channels, `stride` apart): row i sums x[i - s] * taps[kernel - 1 - s] (taps [kernel][n], fp32)
// over the s <= position[i] (a sequence starts from zeros), in fp32 in order of s, rounded to the
// dtype, then silu rounded once: gated_delta.causal_conv_silu's arithmetic.
template <typename T>
void conv_silu(const T* x, int64_t stride, const float* taps, int64_t kernel,
               const int64_t* position, T* out, int64_t first, int64_t rows, int64_t n) {
  const int64_t whole = n - n % 16;
  for (int64_t i = first; i < first + rows; ++i) {
    const int64_t reach = position[i] + 1 < kernel ? position[i] + 1 : kernel;
    const T* row = x + i * stride;
    const float* last = taps + (kernel - 1) * n;
    T* dst = out + i * n;
    for (int64_t j = 0; j < whole; j += 16) {
      F16 sum = load16(row + j) * load16(last + j);
      for (int64_t s = 1; s < reach; ++s)
        sum += load16(row - s * stride + j) * load16(last - s * n + j);
      store16(dst + j, silu(round16<T>(sum)));
    }
    for (int64_t j = whole; j < n; ++j) {
      float sum = to_float(row[j]) * last[j];
      for (int64_t s = 1; s < reach; ++s) sum += to_float(row[j - s * stride]) * last[j - s * n];
      store(dst + j, silu(round_to<T>(sum)));
    }
  }
}

}  // namespace
}  // namespace QE_ISA
}  // namespace qe
