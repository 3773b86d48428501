// One instruction set's kernel table; kernels_<isa>.cpp defines QE_ISA (and QE_AMX for the
// tile kernels) and includes this.
#include "attention.h"
#include "rows.h"
#ifdef QE_AMX
#include "attention_amx.h"
#endif

namespace qe {
namespace QE_ISA {

extern const Kernels kernels = {
    rms_norm<float>, rms_norm<uint16_t>, rope<float>,   rope<uint16_t>,
    silu_mul<float>, silu_mul<uint16_t>, attend<float>, attend<uint16_t>,
#ifdef QE_AMX
    pack_bf16,       attend_packed_bf16,
#else
    nullptr,         nullptr,
#endif
};

}  // namespace QE_ISA
}  // namespace qe
