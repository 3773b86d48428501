// The int8 route's GEMM on CPUs with AVX512_VNNI (Zen 4 and later, Cascade Lake and later; AMX
// ones where our tile kernel cannot take the width): panels.h with vpdpbusd, one step 4 uint8
// codes against 4 int8 weights, exact int32 sums. Compiled with AVX-512 and VNNI flags
// (native/build.py), chosen at run time (ops.cpp).
#include "panels.h"

namespace qe {
namespace gemm {
namespace {

// The sums as GCC's own vector of 16 int32: through the intrinsic's __m512i (8 int64) GCC (12)
// copies every sum out and back around each vpdpbusd, or keeps some in memory.
typedef int I32x16 __attribute__((vector_size(64)));

struct Int8Quads {
  static constexpr int kMostRows = 6;
  static I32x16 zero() { return I32x16{}; }
  static I32x16 add(I32x16 sums, __m512i row, __m512i weights) {
    return __builtin_ia32_vpdpbusd_v16si(sums, reinterpret_cast<I32x16>(row),
                                         reinterpret_cast<I32x16>(weights));
  }
  static void store(char* p, I32x16 sums) {
    _mm512_storeu_si512(p, reinterpret_cast<__m512i>(sums));
  }
};

}  // namespace

extern const PanelKernel<uint8_t, int8_t, int32_t> int8_panels = {panel_sums<Int8Quads>};

}  // namespace gemm
}  // namespace qe
