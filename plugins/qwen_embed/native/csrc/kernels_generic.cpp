// Compiled with this instruction set's flags (native/build.py).
#define QE_ISA generic
#include "table.h"
