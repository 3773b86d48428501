// batch_invariant's bf16 GEMM on CPUs with AVX512_BF16 (Zen 4 and later, Cooper Lake; AMX ones
// where our tile kernel cannot take the width): panels.h with vdpbf16ps, one step a pair of
// bf16 values. Compiled with AVX-512 and AVX512_BF16 flags (native/build.py), chosen at run time
// (ops.cpp).
#include "panels.h"

namespace qe {
namespace gemm {
namespace {

struct Bf16Pairs {
  static constexpr int kMostRows = 6;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static __m512 add(__m512 sums, __m512i row, __m512i weights) {
    return _mm512_dpbf16_ps(sums, reinterpret_cast<__m512bh>(row),
                            reinterpret_cast<__m512bh>(weights));
  }
  static void store(char* p, __m512 sums) { _mm512_storeu_ps(p, sums); }
};

}  // namespace

extern const PanelKernel<uint16_t, uint16_t, float> bf16_panels = {panel_sums<Bf16Pairs>};

}  // namespace gemm
}  // namespace qe
