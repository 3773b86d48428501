// The GEMM operators: the int8 route's (qwen_embed::int8_linear) and batch_invariant's bf16
// one (qwen_embed::bf16_linear), each cut into tasks of rows x channels on torch's threads, on
// our AMX tile kernels (tiles_amx.cpp), our panel kernels (panels.h: VNNI, AVX512_BF16) or, for
// bf16 on AVX-512 CPUs without BF16, oneDNN's brgemm micro-kernel, with the row work of
// rows.cpp around them.
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <mutex>
#include <queue>
#include <type_traits>
#include <vector>

#include "../ops.h"
#include "ahead.h"
#include "gemm.h"

namespace qe {

using gemm::Bf16Gemm;
using gemm::Int8Gemm;
using gemm::kPanel;

namespace {

// oneDNN's bf16 micro-kernel through torch: bf16 rows times one panel of packed bf16 channels
// -> fp32 sums; false where this torch build lacks it.
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
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
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

}  // namespace

// The int8 operator: our kernels only, the row work on AVX-512, the GEMM on VNNI (or AMX).
bool int8_supported() {
  static const bool runs = cpu_has("avx512") && __builtin_cpu_supports("avx512vnni");
  return runs;
}

// The bf16 operator (batch_invariant): our store needs AVX-512, oneDNN's micro-kernel where our
// GEMM kernels do not run. Asked on every call of the operator: the CPU's part is decided once,
// oneDNN's switch each time.
bool bf16_supported() {
  static const bool runs = [] {
    at::BFloat16 a[2] = {}, b[2 * kPanel] = {};
    float c[kPanel];
    return cpu_has("avx512") && brgemm_probe([&] { return bf16_brgemm(1, kPanel, 2, 2, a, b, c); });
  }();
  return runs && at::globalContext().userEnabledMkldnn();
}

namespace {

// How a GEMM is cut into tasks: rows x channels (a multiple of the weights' panel) per task,
// and whether consecutive tasks share their channels (their weights stay in cache while the
// rows change) or their rows. Both operators take it as arguments (perf/bench_kernels.py
// *_blocking try others); their defaults, channels outermost, were the fastest on AMX: int8,
// 96 rows x 1,024 channels (the rows read once per 1,024 channels); bf16, on the tile kernel,
// 64 rows x 512 channels.
struct GemmBlocking {
  int64_t rows, channels;
  bool channels_outer;
};

void check_blocking(int64_t task_rows, int64_t task_channels, int64_t panel) {
  TORCH_CHECK(task_rows > 0 && task_channels > 0 && task_channels % panel == 0,
              "a task takes rows > 0 and a multiple of the panel's ", panel, " channels");
}

// A GEMM's bias: fp32, one value per channel, or none.
const float* bias_values(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              "bias must be float32 [", n, "]");
  return ptr<float>(*bias);
}

// A GEMM's output: x's leading dimensions, n channels each.
at::Tensor output_for(const at::Tensor& x, int64_t n, at::ScalarType dtype) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return at::empty(sizes, x.options().dtype(dtype));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// An m x n GEMM cut by a blocking: its tasks in the operators' order, task t's rows
// [row0, row1) and channels [col0, col1).
struct TaskGrid {
  int64_t m, n;
  GemmBlocking b;
  int64_t row_tasks = ceil_div(m, b.rows), channel_tasks = ceil_div(n, b.channels);

  int64_t count() const { return row_tasks * channel_tasks; }
  std::array<int64_t, 4> task(int64_t t) const {
    const int64_t r = (b.channels_outer ? t % row_tasks : t / channel_tasks) * b.rows;
    const int64_t c = (b.channels_outer ? t / row_tasks : t % channel_tasks) * b.channels;
    return {r, std::min(m, r + b.rows), c, std::min(n, c + b.channels)};
  }
};

// When the last of a grid's tasks ends, each taken by the next free thread in order and
// costing its rows x channels: in_parallel's schedule.
int64_t tasks_span(const TaskGrid& grid, int64_t threads) {
  std::priority_queue<int64_t, std::vector<int64_t>, std::greater<int64_t>> free_at;
  for (int64_t t = 0; t < threads; ++t) free_at.push(0);
  int64_t span = 0;
  for (int64_t t = 0; t < grid.count(); ++t) {
    const auto [row0, row1, col0, col1] = grid.task(t);
    const int64_t end = free_at.top() + (row1 - row0) * (col1 - col0);
    free_at.pop();
    free_at.push(end);
    span = std::max(span, end);
  }
  return span;
}

// Beyond this many tasks per thread a GEMM's blocking stays: its tasks keep every thread busy
// but for the last round, and finer ones would read its rows more often.
constexpr int64_t kFewTasks = 4;

}  // namespace

// Channels per task of an m x n GEMM: the blocking's where it has many tasks, else the most
// channels, in whole panels and at most the blocking's, whose tasks end soonest on `threads`
// threads (tasks_span): a short query's narrow layers would otherwise be one task, or 3 on 2
// threads (one of them idle a third of the time). Every operator gives a row the same bits
// under any blocking.
int64_t gemm_task_channels(int64_t m, int64_t n, int64_t task_rows, int64_t task_channels,
                           int64_t panel, int64_t threads, bool channels_outer) {
  const int64_t row_tasks = ceil_div(m, task_rows);
  if (m <= 0 || threads <= 1 || row_tasks * ceil_div(n, task_channels) > kFewTasks * threads)
    return task_channels;
  // The choice per shape, kept: a forward's layers ask the same few (row counts vary per
  // forward: at most kKeptShapes kept).
  constexpr size_t kKeptShapes = 4096;
  static std::mutex mutex;
  static std::map<std::array<int64_t, 7>, int64_t> chosen;
  const std::array<int64_t, 7> shape{m, n, task_rows, task_channels, panel, threads,
                                     channels_outer};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = chosen.find(shape); it != chosen.end()) return it->second;
  auto span = [&](int64_t channels) {
    return tasks_span({m, n, {task_rows, channels, channels_outer}}, threads);
  };
  int64_t best = task_channels, shortest = span(task_channels);
  for (int64_t channels = task_channels - panel;
       channels >= panel && row_tasks * ceil_div(n, channels) <= kFewTasks * threads;
       channels -= panel)
    if (const int64_t s = span(channels); s < shortest) best = channels, shortest = s;
  if (chosen.size() >= kKeptShapes) chosen.clear();
  return chosen[shape] = best;
}

namespace {

// The GEMM of m rows x n channels as tasks of rows [row0, row1) x channels [col0, col1), each
// to the next free thread, the channels per task in whole panels of `panel` channels
// (gemm_task_channels); `task` ends with brgemm_release.
template <typename Task>
void gemm_tasks(const GemmBlocking& blocking, int64_t m, int64_t n, int64_t panel,
                const Task& task) {
  const int64_t channels = gemm_task_channels(m, n, blocking.rows, blocking.channels, panel,
                                              at::get_num_threads(), blocking.channels_outer);
  const TaskGrid grid{m, n, {blocking.rows, channels, blocking.channels_outer}};
  in_parallel(grid.count(), [&](int64_t t) {
    const auto [row0, row1, col0, col1] = grid.task(t);
    task(row0, row1, col0, col1);
    brgemm_release();
  });
}

// The panels a panel kernel's task reads for its output channels [col, ...) of n_out: the
// panel at col, and for a gate|up projection (up > 0) up's panel `up` channels further, its
// sums after gate's. `next` names the panel read after `index` (-1: none), which `once` (the
// GEMM reads each panel once: gemm::reads_panels_once) fetches meanwhile.
struct PanelReads {
  int64_t up, panel;
  bool once;

  int64_t count() const { return up ? 2 : 1; }
  int64_t channel(int64_t col, int64_t index) const { return col + index * up; }
  int64_t next(int64_t col, int64_t index, int64_t col1) const {
    if (!once) return -1;
    if (index + 1 < count()) return channel(col, index + 1);
    return col + panel < col1 ? col + panel : -1;
  }
};

// One int8 GEMM task on our VNNI panel kernel (panels_vnni.cpp; int8_tiles decides where our
// AMX kernel runs instead), one call per panel of the task's channels (PanelReads): the call's
// int32 sums land in a block in cache, and `finish` rescales and stores them.
template <typename T>
void panel_task(const Int8Gemm<T>& g, bool once, int64_t row0, int64_t row1, int64_t col0,
                int64_t col1) {
  const int64_t rows = row1 - row0;
  const PanelReads reads{g.up, kPanel, once};
  thread_local std::vector<int32_t> buffer;
  buffer.resize(reads.count() * rows * kPanel);
  int32_t* sums = buffer.data();
  for (int64_t col = col0; col < col1; col += kPanel) {
    for (int64_t i = 0; i < reads.count(); ++i) {
      const int64_t next = reads.next(col, i, col1);
      gemm::int8_panels.sums(g.a + row0 * g.k_pad, g.k_pad, rows,
                             g.packed + reads.channel(col, i) * g.k_pad, g.k_pad,
                             next < 0 ? nullptr : g.packed + next * g.k_pad,
                             sums + i * rows * kPanel);
    }
    const int64_t cols = std::min(kPanel, g.ldo - col);
    if constexpr (std::is_same_v<T, float>)
      gemm::rows.finish_int8_f32(g, sums, kPanel, row0, rows, col, cols);
    else
      gemm::rows.finish_int8_bf16(g, sums, kPanel, row0, rows, col, cols);
  }
}

// Whether the int8 GEMM runs on our AMX int8 tile kernel (tiles_amx.cpp) rather than the VNNI
// panel kernel: where the CPU and the build have the tiles and the tiles' depth divides k_pad
// (every Qwen width). It rescales a block's sums while the tiles compute the next (oneDNN's
// AMX micro-kernel's call and our rescale after it left each unit idle in turn): docs/tuning.md
// has the figures.
// (cpu_has: false in a build without the tiles)
bool int8_tiles_run() {
  static const bool runs = cpu_has("amx_int8");
  return runs;
}

bool int8_tiles(int64_t k_pad) { return int8_tiles_run() && k_pad % 64 == 0; }

// The same for batch_invariant's bf16 GEMM (tiles_amx.cpp): AMX bf16 tiles, weights in panels of
// kTilePanel channels (bf16_panel: the faster) or kPanel, k a multiple of the tiles' 32 values.
// The same bits as the micro-kernel, which also sums the whole width in ascending tile products.
bool bf16_tiles_run() {
  static const bool runs = cpu_has("amx");
  return runs;
}

bool bf16_tiles(int64_t k, int64_t panel) {
  return bf16_tiles_run() && (panel == gemm::kTilePanel || panel == kPanel) && k % 32 == 0;
}

// Rows rounded up to the tile kernels' blocks of 32.
int64_t whole_blocks(int64_t rows) { return (rows + 31) / 32 * 32; }

// The channels a tile kernel's tasks are cut in: whole panels, and whole blocks of 32 channels.
int64_t tile_task_panel(int64_t panel) { return std::max<int64_t>(panel, 32); }

// A gated GEMM (`gated`: n channels of a gate|up projection -> silu(gate) * up, n / 2 of them):
// on the tile kernels each block is 16 gate and 16 up channels, on the panel kernels each
// output panel reads gate's panel and up's (PanelReads), so n / 2 comes in whole blocks of
// `whole` channels (16, or the weights' panel). The gate half's size for the kernels (0: not
// gated).
int64_t gated_up(bool gated, int64_t whole, int64_t n, bool bias) {
  if (!gated) return 0;
  TORCH_CHECK(n % (2 * whole) == 0 && !bias, "gated needs n a multiple of ", 2 * whole,
              " (each half in whole blocks of ", whole, " channels) and no bias; got n ", n);
  return n / 2;
}

// A gated GEMM's blocking: its tasks cover n / 2 output channels with half the channels of the
// plain GEMM's, in whole blocks of `whole`, so a task reads as many weights.
GemmBlocking gated_blocking(GemmBlocking blocking, bool gated, int64_t whole) {
  if (gated) blocking.channels = std::max(whole, blocking.channels / 2 / whole * whole);
  return blocking;
}

// The tile kernels' tasks over the n_out output channels, rows in whole blocks.
template <typename Task>
void tile_tasks(GemmBlocking blocking, int64_t m, int64_t n_out, int64_t panel, bool gated,
                const Task& task) {
  blocking.rows = whole_blocks(blocking.rows);
  const int64_t whole = gated ? gemm::kGatedChannels : tile_task_panel(panel);
  gemm_tasks(gated_blocking(blocking, gated, whole), m, n_out, whole, task);
}

template <typename T>
void int8_gemm(Int8Gemm<T> g, const at::Tensor& rows, int64_t k, int64_t block,
               const GemmBlocking& blocking) {
  const auto& kern = gemm::rows;
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
    tile_tasks(blocking, m, g.ldo, g.panel, g.up > 0,  // rows of ldo: the output's channels
               [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
                 if constexpr (std::is_same_v<T, float>)
                   gemm::tiles.int8_f32(g, r0, r1, c0, c1);
                 else
                   gemm::tiles.int8_bf16(g, r0, r1, c0, c1);
               });
    return;
  }
#endif
  const bool once = gemm::reads_panels_once(m, blocking.rows);
  gemm_tasks(gated_blocking(blocking, g.up > 0, kPanel), m, g.ldo, kPanel,
             [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
               panel_task(g, once, r0, r1, c0, c1);
             });
}

}  // namespace

int64_t bf16_panel(int64_t k) {
  return bf16_tiles(k, gemm::kTilePanel) ? gemm::kTilePanel : kPanel;
}

int64_t int8_panel() { return int8_tiles_run() ? gemm::kTilePanel : kPanel; }

// x [..., k] (fp32 or bf16) times int8 weights packed by qwen_embed.int8 (packed int8
// [n_pad / panel, k_pad / 4, panel, 4], panel 64 or, for the AMX tile kernel (k_pad a multiple
// of 64), 16: int8_panel; offset int32 [n_pad], w_scale fp32 [n_pad]) -> [..., n] in x's
// dtype, plus bias (fp32 [n]) when given. rotation > 1: each row is rotated first by a
// Walsh-Hadamard transform per `rotation` values (16, 32, 64 or 128, dividing k), as the
// weights were before packing. Tasks of task_rows x task_channels: any blocking gives the same
// bits. gated: silu(gate) * up of a gate|up projection, [..., n / 2] (gated_up).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offset,
                       const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                       int64_t n, int64_t rotation, int64_t task_rows, int64_t task_channels,
                       bool channels_outer, bool gated) {
  TORCH_CHECK(int8_supported(), "the int8 operator needs AVX-512 with VNNI");
  const int64_t k = x.size(-1);
  const int64_t panel = packed.dim() == 4 ? packed.size(2) : 0;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  (panel == kPanel || panel == gemm::kTilePanel) && packed.size(3) == 4 &&
                  packed.size(1) * 4 >= k && packed.size(0) * panel >= n,
              "packed must be the int8 [n_pad / panel, k_pad / 4, panel, 4] weights of ", n,
              " channels of ", k, " values, panel 64 or 16");
  TORCH_CHECK(panel == kPanel || int8_tiles(packed.size(1) * 4),
              "int8 weights in 16-channel panels need the AMX tile kernel and k_pad a multiple "
              "of 64 (int8_panel)");
  const int64_t n_pad = packed.size(0) * panel;
  TORCH_CHECK(offset.scalar_type() == at::kInt && offset.is_contiguous() &&
                  offset.numel() == n_pad && w_scale.scalar_type() == at::kFloat &&
                  w_scale.is_contiguous() && w_scale.numel() == n_pad,
              "offset (int32) and w_scale (float32) must have ", n_pad, " values");
  const float* bias_ptr = bias_values(bias, n);
  check_rotation(rotation, k);
  check_blocking(task_rows, task_channels, tile_task_panel(panel));  // 16 only on the tiles
  const bool tiles = int8_tiles(packed.size(1) * 4);
  const int64_t up = gated_up(gated, tiles ? gemm::kGatedChannels : panel, n, bias_ptr);
  at::Tensor rows = as_rows(x, k);
  const int64_t n_out = up ? up : n;
  at::Tensor out = output_for(x, n_out, x.scalar_type());
  auto operands = [&](auto* out_ptr) {
    return Int8Gemm<std::remove_pointer_t<decltype(out_ptr)>>{
        nullptr, nullptr, ptr<int8_t>(packed), ptr<int32_t>(offset), ptr<float>(w_scale),
        bias_ptr, out_ptr, packed.size(1) * 4, n, n_out, panel, up};
  };
  const GemmBlocking blocking{task_rows, task_channels, channels_outer};
  if (x.scalar_type() == at::kBFloat16)
    int8_gemm(operands(ptr<uint16_t>(out)), rows, k, rotation, blocking);
  else
    int8_gemm(operands(ptr<float>(out)), rows, k, rotation, blocking);
  return out;
}

// bf16_linear's packed weights [panels, steps, panel, 2] plus the product of a low-rank pair,
// b [n, r] times a [r, 2 * steps], fp32 (lora.py: an adapter merged for one forward): each
// weight float(w) + the pair's sum, rounded once (as a fine-tune merged at load), in the same
// layout; channels past n (the panels' padding) unchanged.
at::Tensor bf16_merge_pair(const at::Tensor& packed, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(bf16_supported(), "bf16_merge_pair needs the bf16 operator's CPU (AVX-512)");
  const int64_t panel = packed.dim() == 4 ? packed.size(2) : 0;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && panel > 0 && panel % 16 == 0 && packed.size(3) == 2,
              "packed must be bf16_linear's bf16 [panels, steps, panel, 2] weights");
  const int64_t panels = packed.size(0), steps = packed.size(1);
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat && a.size(1) == 2 * steps &&
                  b.dim() == 2 && b.scalar_type() == at::kFloat && b.size(1) == a.size(0) &&
                  b.size(0) <= panels * panel,
              "a must be float32 [r, ", 2 * steps, "] and b float32 [n <= ", panels * panel,
              ", r]");
  const at::Tensor a_rows = a.contiguous(), bt = b.t().contiguous();
  at::Tensor out = at::empty_like(packed);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    gemm::rows.merge_pair_bf16(ptr<uint16_t>(packed), steps, panel, ptr<float>(bt),
                               ptr<float>(a_rows), b.size(0), a.size(0), p0, p1,
                               ptr<uint16_t>(out));
  });
  return out;
}

// The AVX2 GEMM operators run here: the int8 route's where the CPU has no VNNI (int8.py runs
// int8_linear where it has VNNI) and the fp32 one of CPUs without AVX-512 (route.py).
bool avx2_supported() {
  static const bool runs = cpu_has("avx2");
  return runs;
}

// x [..., k] (fp32 or bf16) times int8 weights packed by qwen_embed.int8 in vpmaddwd's pairs
// ([n_pad / 16, k_pad / 2, 16, 2], k_pad = k rounded up to even; w_scale fp32 [n_pad]) ->
// fp32 [..., n]: each row rotated (rotation > 1) and quantised as int8.Int8Weight does in torch,
// the exact integer sums, each times its row's scale, then its channel's: the torch route's
// bits before its cast to the input's dtype and its bias. Tasks of task_rows x task_channels:
// any blocking gives the same bits.
at::Tensor int8_linear_avx2(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& w_scale, int64_t n, int64_t rotation,
                            int64_t task_rows, int64_t task_channels, bool channels_outer) {
  TORCH_CHECK(avx2_supported(), "the int8 AVX2 operator needs a CPU with AVX2 and FMA");
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == gemm::kPairsPanel && packed.size(3) == 2 &&
                  packed.size(1) == (k + 1) / 2 && packed.size(0) * gemm::kPairsPanel >= n,
              "packed must be the int8 [n_pad / 16, k_pad / 2, 16, 2] weights of ", n,
              " channels of ", k, " values");
  const int64_t n_pad = packed.size(0) * gemm::kPairsPanel, k_pad = packed.size(1) * 2;
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.numel() == n_pad,
              "w_scale must be float32 with ", n_pad, " values");
  check_rotation(rotation, k);
  check_blocking(task_rows, task_channels, gemm::kPairsPanel);
  at::Tensor rows = as_rows(x, k);
  const int64_t m = rows.size(0), stride = rows.stride(0);
  at::Tensor codes = at::empty({m, k_pad}, rows.options().dtype(at::kShort));
  at::Tensor scales = at::empty({m}, rows.options().dtype(at::kFloat));
  const auto& kern = gemm::pairs_avx2;
  at::parallel_for(0, m, grain(k), [&](int64_t b, int64_t e) {
    int16_t* q = ptr<int16_t>(codes) + b * k_pad;
    float* s = ptr<float>(scales) + b;
    if (rows.scalar_type() == at::kBFloat16)
      kern.quantize_bf16(ptr<uint16_t>(rows) + b * stride, stride, e - b, k, k_pad, rotation, q, s);
    else
      kern.quantize_f32(ptr<float>(rows) + b * stride, stride, e - b, k, k_pad, rotation, q, s);
  });
  at::Tensor out = output_for(x, n, at::kFloat);
  const gemm::PairsGemm g{ptr<int16_t>(codes), ptr<float>(scales), ptr<int8_t>(packed),
                          ptr<float>(w_scale), ptr<float>(out), k_pad, n};
  gemm_tasks({task_rows, task_channels, channels_outer}, m, n, gemm::kPairsPanel,
             [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) { kern.gemm(g, r0, r1, c0, c1); });
  return out;
}

// The fp32 GEMM of CPUs with AVX2 and no AVX-512 (route.py chooses it there):
// x [..., k] fp32 times weights packed [n_pad / 16, k, 16] (avx2_gemm.Avx2F32Weight: fp32, or
// bf16 in gemm.h's order) -> [..., n] fp32, plus bias (fp32 [n]) when given. Each output is one
// chain of multiply-adds in input order, so a row's result is the same at any row count and
// under any blocking of task_rows x task_channels.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t n, int64_t task_rows,
                      int64_t task_channels, bool channels_outer) {
  TORCH_CHECK(avx2_supported(), "the fp32 AVX2 operator needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "f32_linear takes float32 rows");
  const int64_t k = x.size(-1);
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && (bf16 || packed.scalar_type() == at::kFloat) &&
                  packed.is_contiguous() && packed.size(2) == gemm::kFloatPanel &&
                  packed.size(1) == k && packed.size(0) * gemm::kFloatPanel >= n,
              "packed must be the float32 or bfloat16 [n_pad / 16, k, 16] weights of ", n,
              " channels of ", k, " values");
  check_blocking(task_rows, task_channels, gemm::kFloatPanel);
  const float* bias_ptr = bias_values(bias, n);
  at::Tensor rows = as_rows(x, k);
  at::Tensor out = output_for(x, n, at::kFloat);
  const gemm::FloatGemm g{ptr<float>(rows), rows.stride(0),
                          bf16 ? nullptr : ptr<float>(packed),
                          bf16 ? ptr<uint16_t>(packed) : nullptr,
                          bias_ptr, ptr<float>(out), n, k, n};
  gemm_tasks({task_rows, task_channels, channels_outer}, rows.size(0), n, gemm::kFloatPanel,
             [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
               gemm::floats_avx2.gemm(g, r0, r1, c0, c1);
             });
  return out;
}

// The bf16 GEMM of batch_invariant: on AMX CPUs our tile kernel (tiles_amx.cpp, bf16_tiles), on
// AVX512_BF16 ones our panel kernel (panels_avx512bf16.cpp), elsewhere oneDNN's brgemm
// micro-kernel; each the whole K in ascending tile products or pairs per block of rows, so a
// row's sums never depend on the rows beside it (oneDNN's own AMX GEMM blocks K differently for
// different row counts), and all three give the same bits.
// x [..., k] bf16 times bf16 weights packed [n_pad / panel, k / 2, panel, 2]
// (onednn.NativeBf16Weight: bf16_panel's) -> [..., n] bf16, plus bias (fp32 [n]) when given,
// added before rounding.
// Tasks of task_rows x task_channels: any blocking gives the same bits; perf/bench_kernels.py
// bf16_blocking tries others. gated: silu(gate) * up of a gate|up projection, [..., n / 2]
// (gated_up).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t n, int64_t task_rows,
                       int64_t task_channels, bool channels_outer, bool gated) {
  TORCH_CHECK(bf16_supported(), "the bf16 operator needs AVX-512 and torch's oneDNN");
  const int64_t k = x.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16_linear takes bfloat16 rows");
  const int64_t panel = packed.dim() == 4 ? packed.size(2) : 0;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && panel > 0 && panel % 16 == 0 && packed.size(3) == 2 &&
                  packed.size(1) * 2 == k && packed.size(0) * panel >= n,
              "packed must be the bf16 [n_pad / panel, k / 2, panel, 2] weights of ", n,
              " channels of ", k, " values, panel a multiple of 16");
  const bool tiles = bf16_tiles(k, panel);
  const int64_t task_panel = tiles ? tile_task_panel(panel) : panel;
  check_blocking(task_rows, task_channels, task_panel);
  const float* bias_ptr = bias_values(bias, n);
  const int64_t whole = tiles ? gemm::kGatedChannels : panel;
  const int64_t up = gated_up(gated, whole, n, bias_ptr), n_out = up ? up : n;
  at::Tensor rows = as_rows(x, k);
  at::Tensor out = output_for(x, n_out, at::kBFloat16);
  const int64_t m = rows.size(0), lda = rows.stride(0);
  const auto* a = ptr<at::BFloat16>(rows);
  const auto* b = ptr<at::BFloat16>(packed);
  uint16_t* o = ptr<uint16_t>(out);
#ifndef QE_NO_AMX
  if (tiles) {
    at::Tensor packed_rows = at::empty({whole_blocks(m), k}, rows.options());
    auto* pr = ptr<uint16_t>(packed_rows);
    at::parallel_for(0, whole_blocks(m), 32, [&](int64_t r0, int64_t r1) {
      gemm::tiles.pack_rows(reinterpret_cast<const uint16_t*>(a), lda, m, k, r0, r1, pr);
    });
    const Bf16Gemm g{pr, k, reinterpret_cast<const uint16_t*>(b), bias_ptr, o, n_out, n, panel, up};
    tile_tasks({task_rows, task_channels, channels_outer}, m, n_out, panel, gated,
               [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
                 gemm::tiles.bf16(g, r0, r1, c0, c1);
               });
    return out;
  }
#endif
  // our panel kernel where the CPU has AVX512_BF16 and no AMX: the micro-kernel's bits there,
  // and faster on the few rows whose weights stream from memory (panels_avx512bf16.cpp); on AMX
  // CPUs the micro-kernel sums on tiles, whose bits vdpbf16ps does not always give (widths the
  // tile kernel does not take)
  static const bool panels_run = cpu_has("avx512bf16") && !bf16_tiles_run();
  const bool ours = panels_run && panel == kPanel;
  const PanelReads reads{up, panel, gemm::reads_panels_once(m, task_rows)};
  const auto* weights = reinterpret_cast<const uint16_t*>(b);
  const GemmBlocking blocking{task_rows, task_channels, channels_outer};
  gemm_tasks(gated_blocking(blocking, up > 0, panel), m, n_out, panel,
             [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
               const int64_t rows = r1 - r0;
               thread_local std::vector<float> buffer;
               buffer.resize(reads.count() * rows * panel);
               float* sums = buffer.data();
               for (int64_t col = c0; col < c1; col += panel) {
                 for (int64_t i = 0; i < reads.count(); ++i) {
                   const int64_t from = reads.channel(col, i), next = reads.next(col, i, c1);
                   if (ours)
                     gemm::bf16_panels.sums(reinterpret_cast<const uint16_t*>(a + r0 * lda), lda,
                                            rows, weights + from * k, k,
                                            next < 0 ? nullptr : weights + next * k,
                                            sums + i * rows * panel);
                   else
                     bf16_brgemm(rows, panel, k, lda, a + r0 * lda, b + from * k,
                                 sums + i * rows * panel);
                 }
                 const int64_t cols = std::min(panel, n_out - col);
                 if (up)
                   gemm::rows.store_gated_bf16(sums, panel, rows, cols, o + r0 * n_out + col,
                                               n_out);
                 else
                   gemm::rows.store_bf16(sums, panel, rows, cols,
                                         bias_ptr ? bias_ptr + col : nullptr, o + r0 * n + col,
                                         n);
               }
             });
  return out;
}

}  // namespace qe
