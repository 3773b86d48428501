// The row-wise operators over the kernel table (rows.h): RMSNorm (its weight in the rows' dtype
// or fp32), q/k norm + rotary, SiLU gating, GELU (tanh), and the int8 route's Walsh-Hadamard
// rotation of rows; fp32 and bf16 CPU tensors; Qwen3.5's causal convolution.
#include "ops.h"

namespace qe {
namespace {

// Each row of `rows` (fp32 or bf16, strided) through the kernel of its dtype, `f32` or `bf16`
// (src, stride, dst, rows, width), into out's contiguous rows of `width` values.
void each_row(const at::Tensor& rows, const at::Tensor& out, int64_t width,
              void (*f32)(const float*, int64_t, float*, int64_t, int64_t),
              void (*bf16)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t)) {
  const int64_t stride = rows.stride(0);
  const bool is_bf16 = rows.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows.size(0), grain(rows.size(1)), [&](int64_t b, int64_t end) {
    if (is_bf16)
      bf16(ptr<uint16_t>(rows) + b * stride, stride, ptr<uint16_t>(out) + b * width, end - b,
           width);
    else
      f32(ptr<float>(rows) + b * stride, stride, ptr<float>(out) + b * width, end - b, width);
  });
}

}  // namespace

namespace {

// The norm's weight: of x's dtype, or fp32 with bf16 x (scaled in fp32, rounded once); true
// for the latter.
bool fp32_weight(const at::Tensor& x, const at::Tensor& weight, int64_t n) {
  const bool wide = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kFloat;
  if (wide) {
    TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  } else {
    same_dtype(x, weight, "weight");
  }
  TORCH_CHECK(weight.numel() == n, "weight has ", weight.numel(), " values for rows of ", n);
  return wide;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1);
  at::Tensor rows = as_rows(x, n);
  const bool wide = fp32_weight(x, weight, n);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t stride = rows.stride(0);
  const auto& k = kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows.size(0), grain(n), [&](int64_t begin, int64_t end) {
    const uint16_t* src = bf16 ? ptr<uint16_t>(rows) + begin * stride : nullptr;
    if (wide)
      k.rms_norm_bf16_f32(src, stride, ptr<float>(weight), ptr<uint16_t>(out) + begin * n,
                          end - begin, n, static_cast<float>(eps));
    else if (bf16)
      k.rms_norm_bf16(src, stride, ptr<uint16_t>(weight), ptr<uint16_t>(out) + begin * n,
                      end - begin, n, static_cast<float>(eps));
    else
      k.rms_norm_f32(ptr<float>(rows) + begin * stride, stride, ptr<float>(weight),
                     ptr<float>(out) + begin * n, end - begin, n, static_cast<float>(eps));
  });
  return out;
}

// rms_norm(x + residual), the sum written over x (contiguous rows; residual of x's shape)
at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes(),
              "x and residual must be contiguous and of one shape");
  same_dtype(x, residual, "residual");
  const bool wide = fp32_weight(x, weight, n);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const auto& k = kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n ? x.numel() / n : 0, grain(n), [&](int64_t b, int64_t end) {
    if (wide)
      k.add_rms_norm_bf16_f32(ptr<uint16_t>(x) + b * n, ptr<uint16_t>(residual) + b * n,
                              ptr<float>(weight), ptr<uint16_t>(out) + b * n, end - b, n, e);
    else if (bf16)
      k.add_rms_norm_bf16(ptr<uint16_t>(x) + b * n, ptr<uint16_t>(residual) + b * n,
                          ptr<uint16_t>(weight), ptr<uint16_t>(out) + b * n, end - b, n, e);
    else
      k.add_rms_norm_f32(ptr<float>(x) + b * n, ptr<float>(residual) + b * n, ptr<float>(weight),
                         ptr<float>(out) + b * n, end - b, n, e);
  });
  return out;
}

// x [T, heads * head_dim] (rows may be strided), cos/sin [T, head_dim / 2] -> [T, heads, head_dim];
// the tables in x's dtype, or fp32 with bf16 rows and no norm (the rotation in fp32, rounded
// once: the vision tower's)
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                int64_t head_dim, const std::optional<at::Tensor>& norm_weight, double eps) {
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "head_dim ", head_dim,
              " must be even and at most ", kMaxHeadDim);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % head_dim == 0, "x must be [tokens, heads * head_dim]");
  at::Tensor rows = as_rows(x, x.size(1));
  const int64_t t = rows.size(0), heads = rows.size(1) / head_dim, half = head_dim / 2;
  TORCH_CHECK(heads <= kMaxHeads, "at most ", kMaxHeads, " heads per token, not ", heads);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool f32_tables = bf16 && cos.scalar_type() == at::kFloat;
  if (f32_tables) {
    TORCH_CHECK(sin.scalar_type() == at::kFloat, "sin must be fp32, as cos is");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos/sin must be contiguous");
    TORCH_CHECK(!norm_weight, "fp32 cos/sin rotate bf16 rows without a norm_weight");
  } else {
    same_dtype(x, cos, "cos");
    same_dtype(x, sin, "sin");
  }
  TORCH_CHECK(cos.numel() == t * half && sin.numel() == t * half, "cos/sin must be [", t, ", ",
              half, "]");
  if (norm_weight) {
    same_dtype(x, *norm_weight, "norm_weight");
    TORCH_CHECK(norm_weight->numel() == head_dim, "norm_weight must have head_dim values");
  }
  at::Tensor out = at::empty({t, heads, head_dim}, x.options());
  const int64_t stride = rows.stride(0);
  const auto& k = kernels();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, grain(heads * head_dim), [&](int64_t b, int64_t end) {
    if (f32_tables)
      k.rope_bf16_f32(ptr<uint16_t>(rows) + b * stride, stride, ptr<float>(cos) + b * half,
                      ptr<float>(sin) + b * half, nullptr, 0.0f,
                      ptr<uint16_t>(out) + b * heads * head_dim, end - b, heads, head_dim);
    else if (bf16)
      k.rope_bf16(ptr<uint16_t>(rows) + b * stride, stride, ptr<uint16_t>(cos) + b * half,
                  ptr<uint16_t>(sin) + b * half,
                  norm_weight ? ptr<uint16_t>(*norm_weight) : nullptr, e,
                  ptr<uint16_t>(out) + b * heads * head_dim, end - b, heads, head_dim);
    else
      k.rope_f32(ptr<float>(rows) + b * stride, stride, ptr<float>(cos) + b * half,
                 ptr<float>(sin) + b * half, norm_weight ? ptr<float>(*norm_weight) : nullptr, e,
                 ptr<float>(out) + b * heads * head_dim, end - b, heads, head_dim);
  });
  return out;
}

// gate_up [T, 2n] -> silu(gate) * up [T, n]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate_up's last dimension must be even");
  at::Tensor rows = as_rows(gate_up, gate_up.size(-1));
  const int64_t n = rows.size(1) / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, gate_up.options());
  each_row(rows, out, n, kernels().silu_mul_f32, kernels().silu_mul_bf16);
  return out;
}

// x [..., n] (rows may be strided) -> GELU(x) with tanh's approximation, contiguous
at::Tensor gelu_tanh(const at::Tensor& x) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  each_row(as_rows(x, x.size(-1)), out, x.size(-1), kernels().gelu_tanh_f32,
           kernels().gelu_tanh_bf16);
  return out;
}

// x [..., k] (fp32 or bf16) -> fp32 [..., k]: each row's blocks of `block` values rotated by an
// unnormalised Walsh-Hadamard transform (the int8 route's rotation, int8.py).
at::Tensor hadamard_rows(const at::Tensor& x, int64_t block) {
  const int64_t k = x.size(-1);
  check_rotation(block, k);
  TORCH_CHECK(block > 1, "rotation block must be from 16");
  at::Tensor rows = as_rows(x, k);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t stride = rows.stride(0);
  const auto& kern = kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows.size(0), grain(k), [&](int64_t b, int64_t end) {
    if (bf16)
      kern.hadamard_bf16(ptr<uint16_t>(rows) + b * stride, stride, end - b, k, block,
                         ptr<float>(out) + b * k);
    else
      kern.hadamard_f32(ptr<float>(rows) + b * stride, stride, end - b, k, block,
                        ptr<float>(out) + b * k);
  });
  return out;
}

// w [n, k] (fp32 or bf16) -> (int8 codes [n, k], fp32 scales [n, 1], int32 sums of each row's
// codes [n]): the int8 route's weights, rotated per `block` values in float64 and quantised per
// row (int8.weight_codes); one parallel region for the whole weight (two encoders loading at
// once share the cores).
std::tuple<at::Tensor, at::Tensor, at::Tensor> weight_codes(const at::Tensor& w, int64_t block) {
  TORCH_CHECK(w.dim() == 2, "w must be [out, in]");
  const int64_t n = w.size(0), k = w.size(1);
  check_rotation(block, k);
  at::Tensor rows = as_rows(w, k);
  at::Tensor codes = at::empty({n, k}, w.options().dtype(at::kChar));
  at::Tensor scales = at::empty({n, 1}, w.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({n}, w.options().dtype(at::kInt));
  const int64_t stride = rows.stride(0);
  const auto& kern = kernels();
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  at::parallel_for(0, n, grain(k), [&](int64_t b, int64_t end) {
    std::vector<double> wide(k);
    int8_t* out = ptr<int8_t>(codes) + b * k;
    if (bf16)
      kern.weight_codes_bf16(ptr<uint16_t>(rows) + b * stride, stride, end - b, k, block,
                             wide.data(), out, ptr<float>(scales) + b, ptr<int32_t>(sums) + b);
    else
      kern.weight_codes_f32(ptr<float>(rows) + b * stride, stride, end - b, k, block,
                            wide.data(), out, ptr<float>(scales) + b, ptr<int32_t>(sums) + b);
  });
  return {codes, scales, sums};
}

// x [T, n] (rows may be strided), weight [n, kernel] (taken in fp32), position [T] (int64:
// each row's place in its sequence) -> silu(causal depthwise convolution within each sequence)
at::Tensor causal_conv_silu(const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& position) {
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, channels]");
  const int64_t t = x.size(0), n = x.size(1);
  at::Tensor rows = as_rows(x, n);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == n, "weight must be [", n, ", kernel]");
  TORCH_CHECK(position.scalar_type() == at::kLong && position.is_contiguous() &&
                  position.numel() == t,
              "position must be int64 [", t, "]");
  const int64_t kernel = weight.size(1);
  const int64_t* pos = ptr<int64_t>(position);
  for (int64_t i = 0; i < t; ++i)  // a row reaches back only into rows of this batch
    TORCH_CHECK(pos[i] >= 0 && pos[i] <= i, "position[", i, "] = ", pos[i], " is outside x");
  at::Tensor taps = weight.to(at::kFloat).t().contiguous();  // [kernel, n]: a tap's channels
  at::Tensor out = at::empty({t, n}, x.options());
  const int64_t stride = rows.stride(0);
  const auto& k = kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, t, grain(n), [&](int64_t b, int64_t end) {
    if (bf16)
      k.conv_silu_bf16(ptr<uint16_t>(rows), stride, ptr<float>(taps), kernel, pos,
                       ptr<uint16_t>(out), b, end - b, n);
    else
      k.conv_silu_f32(ptr<float>(rows), stride, ptr<float>(taps), kernel, pos, ptr<float>(out), b,
                      end - b, n);
  });
  return out;
}

}  // namespace qe
