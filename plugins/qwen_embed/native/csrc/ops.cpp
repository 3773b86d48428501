// torch operators over the kernels: qwen_embed::rms_norm, ::rope, ::silu_mul, ::varlen_attention
// (CPU, fp32 and bf16), and qwen_embed::select_isa to choose the instruction set (qwen_embed.native
// names the widest the CPU has; the tests name others).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace qe {
namespace {

const Kernels* active = nullptr;
std::string active_name;

bool cpu_has(const std::string& isa) {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "amx") {
#ifdef QE_NO_AMX
    return false;  // built by a compiler without AMX intrinsics
#endif
    unsigned a, b, c, d;  // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE
    if (!avx512 || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) ||
        !(d & (1u << 24)))
      return false;
    // Linux hands a process the tile registers' state only when asked (ARCH_REQ_XCOMP_PERM).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }
  if (isa == "amx_int8") {  // CPUID leaf 7: EDX bit 25 AMX-INT8, with the rest of "amx"
    unsigned a, b, c, d;
    return cpu_has("amx") && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
  }
  if (isa == "avx512") return avx512;
  if (isa == "avx512bf16") return avx512 && __builtin_cpu_supports("avx512bf16");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "generic";
}

// The instruction set is chosen by the caller (qwen_embed.native.isa_for); one this CPU cannot
// run is an error.
const Kernels* table_for(const std::string& isa) {
#ifndef QE_NO_AMX
  if (isa == "amx") return &amx::kernels;
#endif
  if (isa == "avx512bf16") return &avx512bf16::kernels;
  return isa == "avx512" ? &avx512::kernels : isa == "avx2" ? &avx2::kernels : &generic::kernels;
}

std::string select_isa(std::string requested) {
  TORCH_CHECK(cpu_has(requested), "this CPU (or this build) cannot run the '", requested,
              "' kernels");
  active = table_for(requested);
  active_name = requested;
  return active_name;
}

const Kernels& kernels() {
  TORCH_CHECK(active, "qwen_embed.native chooses the kernels before their first use");
  return *active;
}

// Rows of `n` values: the last dimension contiguous, the others collapsible into one stride.
at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), "qwen_embed native kernels run on CPU tensors");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "qwen_embed native kernels take float32 or bfloat16, not ", t.scalar_type());
  at::Tensor rows = t.dim() == 2 ? t : t.reshape({-1, n});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

void same_dtype(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(b.scalar_type() == a.scalar_type() && b.is_contiguous(), name,
              " must be contiguous and of the input's dtype");
}

// Enough rows per task that a thread's share is worth its start.
int64_t grain(int64_t values_per_row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(values_per_row, 1)); }

// body(0 .. n-1) on torch's threads, each taking the next task when done with one (tasks differ
// in cost: causal blocks late in long segments cost most).
template <typename F>
void in_parallel(int64_t n, const F& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < n; t = next++) body(t);
  });
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1);
  at::Tensor rows = as_rows(x, n);
  same_dtype(x, weight, "weight");
  TORCH_CHECK(weight.numel() == n, "weight has ", weight.numel(), " values for rows of ", n);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t stride = rows.stride(0);
  const auto& k = kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows.size(0), grain(n), [&](int64_t begin, int64_t end) {
    if (bf16)
      k.rms_norm_bf16(ptr<uint16_t>(rows) + begin * stride, stride, ptr<uint16_t>(weight),
                      ptr<uint16_t>(out) + begin * n, end - begin, n, static_cast<float>(eps));
    else
      k.rms_norm_f32(ptr<float>(rows) + begin * stride, stride, ptr<float>(weight),
                     ptr<float>(out) + begin * n, end - begin, n, static_cast<float>(eps));
  });
  return out;
}

// x [T, heads * head_dim] (rows may be strided), cos/sin [T, head_dim / 2] -> [T, heads, head_dim]
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                int64_t head_dim, const std::optional<at::Tensor>& norm_weight, double eps) {
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "head_dim ", head_dim,
              " must be even and at most ", kMaxHeadDim);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % head_dim == 0, "x must be [tokens, heads * head_dim]");
  at::Tensor rows = as_rows(x, x.size(1));
  const int64_t t = rows.size(0), heads = rows.size(1) / head_dim, half = head_dim / 2;
  TORCH_CHECK(heads <= kMaxHeads, "at most ", kMaxHeads, " heads per token, not ", heads);
  same_dtype(x, cos, "cos");
  same_dtype(x, sin, "sin");
  TORCH_CHECK(cos.numel() == t * half && sin.numel() == t * half, "cos/sin must be [", t, ", ",
              half, "]");
  if (norm_weight) {
    same_dtype(x, *norm_weight, "norm_weight");
    TORCH_CHECK(norm_weight->numel() == head_dim, "norm_weight must have head_dim values");
  }
  at::Tensor out = at::empty({t, heads, head_dim}, x.options());
  const int64_t stride = rows.stride(0);
  const auto& k = kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, grain(heads * head_dim), [&](int64_t b, int64_t end) {
    if (bf16)
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
  const int64_t n = rows.size(1) / 2, stride = rows.stride(0);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const auto& k = kernels();
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows.size(0), grain(2 * n), [&](int64_t b, int64_t end) {
    if (bf16)
      k.silu_mul_bf16(ptr<uint16_t>(rows) + b * stride, stride, ptr<uint16_t>(out) + b * n,
                      end - b, n);
    else
      k.silu_mul_f32(ptr<float>(rows) + b * stride, stride, ptr<float>(out) + b * n, end - b, n);
  });
  return out;
}

void check_rotation(int64_t block, int64_t k) {
  TORCH_CHECK(block == 1 || ((block == 16 || block == 32 || block == 64 || block == 128) &&
                             k % block == 0),
              "rotation must be 1 or 16, 32, 64 or 128 dividing ", k, ", got ", block);
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

// oneDNN's int8 micro-kernel through torch: m rows of uint8 codes times n packed int8 channels
// -> int32 sums; false where this torch build lacks it.
bool int8_brgemm(int64_t m, int64_t n, int64_t k, int64_t ld_a, int64_t ld_b, int64_t ld_c,
                 const uint8_t* a, const int8_t* b, int32_t* c) {
#ifdef CPUBLAS_BRGEMM_U8I8I32
  at::native::cpublas::brgemm(m, n, k, ld_a, ld_b, ld_c, false, a, b, c);
  return true;
#else
  return false;
#endif
}

// The same for bf16 rows times one panel of packed bf16 channels -> fp32 sums.
bool bf16_brgemm(int64_t m, int64_t panel, int64_t k, int64_t ld_a, const at::BFloat16* a,
                 const at::BFloat16* b, float* c) {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  at::native::cpublas::brgemm(m, panel, k, ld_a, panel, panel, false, a, b, c);
  return true;
#else
  return false;
#endif
}

// Ends a thread's run of micro-kernel calls (the AMX tile state): the AMX attention kernels
// configure the tiles their own way, and oneDNN reconfigures only after a release.
void brgemm_release() {
#if defined(CPUBLAS_BRGEMM_U8I8I32) || defined(CPUBLAS_BRGEMM_BF16BF16F32)
  at::native::cpublas::brgemm_release();
#endif
}

// Whether a micro-kernel runs here, by a probe call: oneDNN may run below the CPU's instruction
// sets (ONEDNN_MAX_CPU_ISA), and then refuses.
template <typename Call>
bool brgemm_probe(const Call& call) {
  try {
    const bool ran = call();
    brgemm_release();
    return ran;
  } catch (const c10::Error&) {
    return false;
  }
}

// The int8 operator: our row kernels need AVX-512, oneDNN's int8 micro-kernel VNNI (or AMX).
// Asked on every call of the operator: the CPU's part is decided once, oneDNN's switch each time.
bool int8_supported() {
  static const bool runs = [] {
    __builtin_cpu_init();
    uint8_t a[4] = {};
    int8_t b[4 * kPanel] = {};
    int32_t c[kPanel];
    return cpu_has("avx512") && __builtin_cpu_supports("avx512vnni") &&
           brgemm_probe([&] { return int8_brgemm(1, kPanel, 4, 4, kPanel, kPanel, a, b, c); });
  }();
  return runs && at::globalContext().userEnabledMkldnn();
}

// The bf16 operator (batch_invariant): our store needs AVX-512; likewise asked on every call.
bool bf16_supported() {
  static const bool runs = [] {
    at::BFloat16 a[2] = {}, b[2 * kPanel] = {};
    float c[kPanel];
    return cpu_has("avx512") && brgemm_probe([&] { return bf16_brgemm(1, kPanel, 2, 2, a, b, c); });
  }();
  return runs && at::globalContext().userEnabledMkldnn();
}

// How a GEMM is cut into tasks: rows x channels (a multiple of the weights' panel) per task,
// and whether consecutive tasks share their channels (their weights stay in cache while the
// rows change) or their rows. Both operators take it as arguments (perf/bench_*_blocking.py
// try others); their defaults, channels outermost, were the fastest on AMX: int8, 96 rows x
// 1,024 channels (the rows read once per 1,024 channels); bf16, on the tile kernel, 64 rows x
// 512 channels.
struct GemmBlocking {
  int64_t rows, channels;
  bool channels_outer;
};

void check_blocking(int64_t task_rows, int64_t task_channels, int64_t panel) {
  TORCH_CHECK(task_rows > 0 && task_channels > 0 && task_channels % panel == 0,
              "a task takes rows > 0 and a multiple of the panel's ", panel, " channels");
}

// The GEMM of m rows x n channels as tasks of rows [row0, row1) x channels [col0, col1), each
// to the next free thread; `task` ends with brgemm_release.
template <typename Task>
void gemm_tasks(const GemmBlocking& blocking, int64_t m, int64_t n, const Task& task) {
  const int64_t row_tasks = (m + blocking.rows - 1) / blocking.rows;
  const int64_t channel_tasks = (n + blocking.channels - 1) / blocking.channels;
  in_parallel(row_tasks * channel_tasks, [&](int64_t t) {
    const int64_t r = (blocking.channels_outer ? t % row_tasks : t / channel_tasks) * blocking.rows;
    const int64_t c =
        (blocking.channels_outer ? t / row_tasks : t % channel_tasks) * blocking.channels;
    task(r, std::min(m, r + blocking.rows), c, std::min(n, c + blocking.channels));
    brgemm_release();
  });
}

// One int8 GEMM task on oneDNN's brgemm micro-kernel (AVX512_VNNI; int8_tiles decides where
// our AMX kernel runs instead), one call per panel of the task's channels: the call's int32
// sums land in a block in cache, and `finish` rescales and stores them.
template <typename T>
void brgemm_task(const Int8Gemm<T>& g, int64_t row0, int64_t row1, int64_t col0, int64_t col1) {
  const int64_t rows = row1 - row0;
  thread_local std::vector<int32_t> buffer;
  buffer.resize(rows * kPanel);
  int32_t* sums = buffer.data();
  for (int64_t col = col0; col < col1; col += kPanel) {
    const int64_t cols = std::min(kPanel, g.n - col);
    int8_brgemm(rows, kPanel, g.k_pad, g.k_pad, kPanel, kPanel, g.a + row0 * g.k_pad,
                g.packed + col * g.k_pad, sums);
    if constexpr (std::is_same_v<T, float>)
      int8::kernels.finish_f32(g, sums, kPanel, row0, rows, col, cols);
    else
      int8::kernels.finish_bf16(g, sums, kPanel, row0, rows, col, cols);
  }
}

// Whether the int8 GEMM runs on our AMX int8 tile kernel (gemm_amx.cpp) rather than oneDNN's
// micro-kernel: where the CPU and the build have the tiles and the tiles' depth divides k_pad.
// Ours rescales a block's sums while the tiles compute the next (the micro-kernel's call and
// our rescale after it leave each unit idle in turn): docs/tuning.md has the figures.
bool int8_tiles(int64_t k_pad) {
#ifdef QE_NO_AMX
  return false;
#else
  static const bool runs = cpu_has("amx_int8");
  return runs && k_pad % 64 == 0;
#endif
}

// The same for batch_invariant's bf16 GEMM (gemm_amx.cpp): AMX bf16 tiles, 64-channel panels,
// k a multiple of the tiles' 32 values. The same bits as the micro-kernel, which also sums the
// whole width in ascending tile products.
bool bf16_tiles(int64_t k, int64_t panel) {
#ifdef QE_NO_AMX
  return false;
#else
  static const bool runs = cpu_has("amx");
  return runs && panel == kPanel && k % 32 == 0;
#endif
}

// Rows rounded up to the tile kernels' blocks of 32.
int64_t whole_blocks(int64_t rows) { return (rows + 31) / 32 * 32; }

template <typename T>
void int8_gemm(Int8Gemm<T> g, const at::Tensor& rows, int64_t k, int64_t block,
               const GemmBlocking& blocking) {
  const auto& kern = int8::kernels;
  const int64_t m = rows.size(0), stride = rows.stride(0);
  const bool tiles = int8_tiles(g.k_pad);
  // the tile kernel reads whole blocks of 32 rows of codes (the rows past m are never stored)
  at::Tensor codes =
      at::empty({tiles ? whole_blocks(m) : m, g.k_pad}, rows.options().dtype(at::kByte));
  at::Tensor scales = at::empty({m}, rows.options().dtype(at::kFloat));
  at::parallel_for(0, m, grain(k), [&](int64_t b, int64_t e) {
    const T* x = ptr<T>(rows) + b * stride;
    uint8_t* q = ptr<uint8_t>(codes) + b * g.k_pad;
    if constexpr (std::is_same_v<T, float>)
      kern.quantize_f32(x, stride, e - b, k, g.k_pad, block, q, ptr<float>(scales) + b);
    else
      kern.quantize_bf16(x, stride, e - b, k, g.k_pad, block, q, ptr<float>(scales) + b);
  });
  g.a = ptr<uint8_t>(codes);
  g.a_scale = ptr<float>(scales);
#ifndef QE_NO_AMX
  if (tiles) {
    const GemmBlocking in_blocks{whole_blocks(blocking.rows), blocking.channels,
                                 blocking.channels_outer};
    gemm_tasks(in_blocks, m, g.n, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
      if constexpr (std::is_same_v<T, float>)
        int8::tiles.int8_f32(g, r0, r1, c0, c1);
      else
        int8::tiles.int8_bf16(g, r0, r1, c0, c1);
    });
    return;
  }
#endif
  gemm_tasks(blocking, m, g.n, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    brgemm_task(g, r0, r1, c0, c1);
  });
}

// x [..., k] (fp32 or bf16) times int8 weights packed by qwen_embed.int8 (packed int8
// [n_pad / 64, k_pad / 4, 64, 4], offset int32 [n_pad], w_scale fp32 [n_pad]) -> [..., n] in x's
// dtype, plus bias (fp32 [n]) when given. rotation > 1: each row is rotated first by a
// Walsh-Hadamard transform per `rotation` values (16, 32, 64 or 128, dividing k), as the
// weights were before packing. Tasks of task_rows x task_channels: any blocking gives the same
// bits.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offset,
                       const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                       int64_t n, int64_t rotation, int64_t task_rows, int64_t task_channels,
                       bool channels_outer) {
  TORCH_CHECK(int8_supported(), "the int8 operator needs AVX-512 with VNNI and torch's oneDNN");
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(3) == 4 &&
                  packed.size(1) * 4 >= k && packed.size(0) * kPanel >= n,
              "packed must be the int8 [n_pad / 64, k_pad / 4, 64, 4] weights of ", n,
              " channels of ", k, " values");
  const int64_t n_pad = packed.size(0) * kPanel;
  TORCH_CHECK(offset.scalar_type() == at::kInt && offset.is_contiguous() &&
                  offset.numel() == n_pad && w_scale.scalar_type() == at::kFloat &&
                  w_scale.is_contiguous() && w_scale.numel() == n_pad,
              "offset (int32) and w_scale (float32) must have ", n_pad, " values");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be float32 [", n, "]");
  check_rotation(rotation, k);
  check_blocking(task_rows, task_channels, kPanel);
  at::Tensor rows = as_rows(x, k);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  auto operands = [&](auto* out_ptr) {
    return Int8Gemm<std::remove_pointer_t<decltype(out_ptr)>>{
        nullptr, nullptr, ptr<int8_t>(packed), ptr<int32_t>(offset), ptr<float>(w_scale),
        bias ? ptr<float>(*bias) : nullptr, out_ptr, packed.size(1) * 4, n, n};
  };
  const GemmBlocking blocking{task_rows, task_channels, channels_outer};
  if (x.scalar_type() == at::kBFloat16)
    int8_gemm(operands(ptr<uint16_t>(out)), rows, k, rotation, blocking);
  else
    int8_gemm(operands(ptr<float>(out)), rows, k, rotation, blocking);
  return out;
}

// The bf16 GEMM of batch_invariant: on AMX CPUs our tile kernel (gemm_amx.cpp, bf16_tiles),
// elsewhere oneDNN's brgemm micro-kernel; either way the whole K in ascending tile products per
// block of rows, so a row's sums never depend on the rows beside it (oneDNN's own AMX GEMM
// blocks K differently for different row counts).
// x [..., k] bf16 times bf16 weights packed [n_pad / panel, k / 2, panel, 2] (onednn.BrgemmWeight:
// panels of 64) -> [..., n] bf16, plus bias (fp32 [n]) when given, added before rounding.
// Tasks of task_rows x task_channels: any blocking gives the same bits; perf/bench_bf16_blocking.py
// tries others.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t task_rows,
                       int64_t task_channels, bool channels_outer) {
  TORCH_CHECK(bf16_supported(), "the bf16 operator needs AVX-512 and torch's oneDNN");
  const int64_t k = x.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16_linear takes bfloat16 rows");
  const int64_t panel = packed.dim() == 4 ? packed.size(2) : 0;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && panel > 0 && panel % 16 == 0 && packed.size(3) == 2 &&
                  packed.size(1) * 2 == k && packed.size(0) * panel >= n,
              "packed must be the bf16 [n_pad / panel, k / 2, panel, 2] weights of ", n,
              " channels of ", k, " values, panel a multiple of 16");
  check_blocking(task_rows, task_channels, panel);
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be float32 [", n, "]");
  at::Tensor rows = as_rows(x, k);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t m = rows.size(0), lda = rows.stride(0);
  const auto* a = ptr<at::BFloat16>(rows);
  const auto* b = ptr<at::BFloat16>(packed);
  const float* bias_ptr = bias ? ptr<float>(*bias) : nullptr;
  uint16_t* o = ptr<uint16_t>(out);
#ifndef QE_NO_AMX
  if (bf16_tiles(k, panel)) {
    at::Tensor packed_rows = at::empty({whole_blocks(m), k}, rows.options());
    auto* pr = ptr<uint16_t>(packed_rows);
    at::parallel_for(0, whole_blocks(m), 32, [&](int64_t r0, int64_t r1) {
      int8::tiles.pack_rows(reinterpret_cast<const uint16_t*>(a), lda, m, k, r0, r1, pr);
    });
    const Bf16Gemm g{pr, k, reinterpret_cast<const uint16_t*>(b), bias_ptr, o, n, n};
    gemm_tasks({whole_blocks(task_rows), task_channels, channels_outer}, m, n,
               [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
                 int8::tiles.bf16(g, r0, r1, c0, c1);
               });
    return out;
  }
#endif
  gemm_tasks({task_rows, task_channels, channels_outer}, m, n,
             [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
               thread_local std::vector<float> sums;
               sums.resize(task_rows * panel);
               for (int64_t col = c0; col < c1; col += panel) {
                 bf16_brgemm(r1 - r0, panel, k, lda, a + r0 * lda, b + col * k, sums.data());
                 int8::kernels.store_sums(sums.data(), panel, r1 - r0, std::min(panel, n - col),
                                          bias_ptr ? bias_ptr + col : nullptr, o + r0 * n + col,
                                          n);
               }
             });
  return out;
}

// Segments of up to kShortKeys keys: one task per (segment, kv head) packs its keys and values
// into the thread's scratch, still in cache, and attends every query of the heads that share
// them. Longer segments (and batches of too few short ones to keep the threads busy): every
// (segment, kv head) packed into one buffer first, then one task per (segment, block of query
// rows, head). Tasks go to the next free thread, longest first. Either way a query row's
// numbers are the same: each task's arithmetic is its own.
constexpr int64_t kShortKeys = 512;

template <typename T>
void attend_segments(const AttentionKernels<T>& kern, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const int32_t* cq, const int32_t* ck, int64_t segments,
                     bool causal, float scale, at::Tensor& out) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2), group = heads / kv_heads;
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0), v_stride = v.stride(0);
  const int64_t out_stride = heads * d;
  auto packed_bytes = [&](int64_t n_k) {  // of one kv head's keys (or values)
    return (n_k + kern.key_multiple - 1) / kern.key_multiple * kern.key_multiple * d *
           kern.packed_bytes;
  };
  auto pack = [&](int64_t s, int64_t kvh, uint8_t* kp, uint8_t* vp) {
    kern.pack(ptr<T>(k) + ck[s] * k_stride + kvh * d, k_stride,
              ptr<T>(v) + ck[s] * v_stride + kvh * d, v_stride, ck[s + 1] - ck[s], d, kp, vp);
  };
  // rows [first, first + kTaskRows) of the segment's queries, head h, against packed keys/values
  auto attend = [&](int64_t s, int64_t first, int64_t h, const uint8_t* kp, const uint8_t* vp) {
    const int64_t n_q = cq[s + 1] - cq[s], n_k = ck[s + 1] - ck[s], q0 = cq[s] + first;
    kern.attend(ptr<T>(q) + q0 * q_stride + h * d, q_stride, kp, vp,
                ptr<T>(out) + q0 * out_stride + h * d, out_stride,
                std::min(kTaskRows, n_q - first), n_k - n_q + first, n_k, d, causal, scale);
  };
  auto last_block = [&](int64_t s) { return (cq[s + 1] - cq[s] - 1) / kTaskRows * kTaskRows; };

  std::vector<int64_t> short_segments, long_segments;
  for (int64_t s = 0; s < segments; ++s)
    if (cq[s + 1] > cq[s])
      (ck[s + 1] - ck[s] <= kShortKeys ? short_segments : long_segments).push_back(s);
  if (static_cast<int64_t>(short_segments.size()) * kv_heads < 2 * at::get_num_threads()) {
    long_segments.insert(long_segments.end(), short_segments.begin(), short_segments.end());
    short_segments.clear();
  }

  std::vector<int64_t> packed(long_segments.size() + 1, 0);  // where each one's heads start
  for (size_t i = 0; i < long_segments.size(); ++i) {
    const int64_t s = long_segments[i];
    packed[i + 1] = packed[i] + packed_bytes(ck[s + 1] - ck[s]) * kv_heads;
  }
  at::Tensor kp = at::empty({packed.back()}, q.options().dtype(at::kByte));
  at::Tensor vp = at::empty({packed.back()}, q.options().dtype(at::kByte));
  auto packed_at = [&](size_t i, int64_t kvh) {
    return packed[i] + kvh * (packed[i + 1] - packed[i]) / kv_heads;
  };
  in_parallel(static_cast<int64_t>(long_segments.size()) * kv_heads, [&](int64_t task) {
    const int64_t i = task / kv_heads, kvh = task % kv_heads, at = packed_at(i, kvh);
    pack(long_segments[i], kvh, ptr<uint8_t>(kp) + at, ptr<uint8_t>(vp) + at);
  });

  struct Block {
    int64_t index, first;  // long_segments[index], its query rows from `first`
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < long_segments.size(); ++i)
    for (int64_t first = last_block(long_segments[i]); first >= 0; first -= kTaskRows)
      blocks.push_back({static_cast<int64_t>(i), first});
  const int64_t long_tasks = static_cast<int64_t>(blocks.size()) * heads;
  const int64_t short_tasks = static_cast<int64_t>(short_segments.size()) * kv_heads;
  in_parallel(long_tasks + short_tasks, [&](int64_t t) {
    if (t < long_tasks) {
      const Block& b = blocks[t / heads];
      const int64_t h = t % heads, at = packed_at(b.index, h / group);
      attend(long_segments[b.index], b.first, h, ptr<uint8_t>(kp) + at, ptr<uint8_t>(vp) + at);
      return;
    }
    t -= long_tasks;
    const int64_t s = short_segments[t / kv_heads], kvh = t % kv_heads;
    static thread_local std::vector<uint8_t> scratch;
    const int64_t bytes = packed_bytes(ck[s + 1] - ck[s]);
    if (static_cast<int64_t>(scratch.size()) < 2 * bytes + 64) scratch.resize(2 * bytes + 64);
    uint8_t* kb = scratch.data() + (-reinterpret_cast<uintptr_t>(scratch.data()) & 63);
    pack(s, kvh, kb, kb + bytes);
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
      for (int64_t first = last_block(s); first >= 0; first -= kTaskRows)
        attend(s, first, h, kb, kb + bytes);
  });
}

// q [Tq, heads, d], k/v [Tk, kv_heads, d] (rows may be strided), split into segments by the
// host offsets cu_q/cu_k (int32 [s + 1]); a segment's queries sit at its last keys' positions
// (bottom-right causal).
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_q, const at::Tensor& cu_k, bool causal,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, d]");
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TORCH_CHECK(d == 32 || d == 64 || d == 128 || d == 256, "head_dim ", d,
              " is not 32, 64, 128 or 256");
  TORCH_CHECK(k.size(2) == d && v.sizes() == k.sizes() && heads % kv_heads == 0,
              "k and v must be [tokens, kv_heads, ", d, "] with heads a multiple of kv_heads");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "qwen_embed attention takes float32 or bfloat16, not ", q.scalar_type());
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  auto heads_of = [&](const at::Tensor& t) {  // rows of heads, each head's d values contiguous
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == q.scalar_type(),
                "q, k and v must be CPU tensors of one dtype");
    return t.stride(2) == 1 && t.stride(1) == d ? t : t.contiguous();
  };
  TORCH_CHECK(cu_q.device().is_cpu() && cu_k.device().is_cpu() &&
                  cu_q.scalar_type() == at::kInt && cu_k.scalar_type() == at::kInt &&
                  cu_q.is_contiguous() && cu_k.is_contiguous() && cu_q.numel() == cu_k.numel(),
              "cu_q and cu_k must be contiguous int32 CPU offsets of one length");
  const int32_t* cq = cu_q.data_ptr<int32_t>();
  const int32_t* ck = cu_k.data_ptr<int32_t>();
  const int64_t segments = cu_q.numel() - 1;
  TORCH_CHECK(segments >= 0 && cq[0] == 0 && ck[0] == 0 && cq[segments] == q.size(0) &&
                  ck[segments] == k.size(0),
              "cu_q/cu_k must run from 0 to the number of query/key rows");
  for (int64_t s = 0; s < segments; ++s)
    TORCH_CHECK(0 <= cq[s + 1] - cq[s] && cq[s + 1] - cq[s] <= ck[s + 1] - ck[s], "segment ", s,
                " has ", cq[s + 1] - cq[s], " queries for ", ck[s + 1] - ck[s], " keys");
  at::Tensor out = at::empty({q.size(0), heads, d}, q.options());
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    attend_segments(kernels().attention_bf16, heads_of(q), heads_of(k), heads_of(v), cq, ck,
                    segments, causal, sc, out);
  else
    attend_segments(kernels().attention_f32, heads_of(q), heads_of(k), heads_of(v), cq, ck,
                    segments, causal, sc, out);
  return out;
}

}  // namespace
}  // namespace qe

TORCH_LIBRARY(qwen_embed, m) {
  m.def("select_isa(str requested) -> str", &qe::select_isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int head_dim, Tensor? norm_weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("hadamard_rows(Tensor x, int block) -> Tensor");
  m.def("int8_supported() -> bool", &qe::int8_supported);
  m.def("bf16_supported() -> bool", &qe::bf16_supported);
  m.def(
      "bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n, int task_rows=64, "
      "int task_channels=512, bool channels_outer=True) -> Tensor");
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor offset, Tensor w_scale, Tensor? bias, int n, "
      "int rotation=1, int task_rows=96, int task_channels=1024, bool channels_outer=True) -> "
      "Tensor");
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, bool causal, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(qwen_embed, CPU, m) {
  m.impl("rms_norm", &qe::rms_norm);
  m.impl("rope", &qe::rope);
  m.impl("silu_mul", &qe::silu_mul);
  m.impl("hadamard_rows", &qe::hadamard_rows);
  m.impl("int8_linear", &qe::int8_linear);
  m.impl("bf16_linear", &qe::bf16_linear);
  m.impl("varlen_attention", &qe::varlen_attention);
}
