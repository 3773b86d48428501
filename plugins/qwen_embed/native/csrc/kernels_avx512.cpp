// Compiled with this instruction set's flags (native/build.py).
#define QE_ISA avx512
#include "table.h"
