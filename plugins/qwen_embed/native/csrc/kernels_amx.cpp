// Compiled with this instruction set's flags (native/build.py): AVX-512 and AMX bf16 tiles.
#define QE_ISA amx
#define QE_AMX
#include "table.h"
