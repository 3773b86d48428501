// Compiled with this instruction set's flags (native/build.py): AVX-512 and AVX512_BF16's dot
// products for bf16 attention (CPUs without AMX).
#define QE_ISA avx512bf16
#define QE_BF16DOT
#include "table.h"
