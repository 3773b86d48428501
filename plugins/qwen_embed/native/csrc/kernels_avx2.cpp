// Compiled with this instruction set's flags (native/build.py).
#define QE_ISA avx2
#include "table.h"
