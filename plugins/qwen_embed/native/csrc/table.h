// One instruction set's kernel table; kernels_<isa>.cpp defines QE_ISA (and QE_AMX for the
// tile kernels, QE_BF16DOT for the AVX512_BF16 ones) and includes this.
#include "attention.h"
#include "delta_rule.h"
#include "rows.h"
#ifdef QE_AMX
#include "attention_amx.h"
#endif
#ifdef QE_BF16DOT
#include "attention_bf16.h"
#endif

namespace qe {
namespace QE_ISA {

extern const Kernels kernels = {
    rms_norm<float>,
    rms_norm<uint16_t>,
    add_rms_norm<float>,
    add_rms_norm<uint16_t>,
    rms_norm<uint16_t, float>,
    add_rms_norm<uint16_t, float>,
    rope<float>,
    rope<uint16_t>,
    rope<uint16_t, float>,
    silu_mul<float>,
    silu_mul<uint16_t>,
    gelu_tanh<float>,
    gelu_tanh<uint16_t>,
    hadamard_rows<float>,
    hadamard_rows<uint16_t>,
    weight_codes<float>,
    weight_codes<uint16_t>,
    conv_silu<float>,
    conv_silu<uint16_t>,
    delta_rule<float>,
    delta_rule<uint16_t>,
    l2_heads<float>,
    l2_heads<uint16_t>,
    {pack<float>, attend<float>, kChunk, sizeof(float)},
#if defined(QE_AMX)
    {pack_tiles, attend_tiles, kTileKeys, sizeof(uint16_t)},
#elif defined(QE_BF16DOT)
    {pack_pairs, attend_pairs, kChunk, sizeof(uint16_t)},
#else
    {pack<uint16_t>, attend<uint16_t>, kChunk, sizeof(float)},
#endif
};

}  // namespace QE_ISA
}  // namespace qe
