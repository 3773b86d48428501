// Which instruction set's kernels this CPU (and this build) runs, and the table of the one
// qwen_embed.native chose (qwen_embed::select_isa; the tests name others).
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ops.h"

namespace qe {
namespace {

const Kernels* active = nullptr;
std::string active_name;

}  // namespace

bool cpu_has(const std::string& isa) {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "amx") {
#ifdef QE_NO_AMX
    return false;  // built by a compiler without AMX intrinsics
#endif
    unsigned a, b, c, d;  // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE
    if (!avx512 || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) ||
        !(d & (1u << 24)))
      return false;
    // Linux hands a process the tile registers' state only when asked (ARCH_REQ_XCOMP_PERM).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }
  if (isa == "amx_int8") {  // CPUID leaf 7: EDX bit 25 AMX-INT8, with the rest of "amx"
    unsigned a, b, c, d;
    return cpu_has("amx") && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
  }
  if (isa == "avx512") return avx512;
  if (isa == "avx512bf16") return avx512 && __builtin_cpu_supports("avx512bf16");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "generic";
}

// The instruction set is chosen by the caller (qwen_embed.native.isa_for); one this CPU cannot
// run is an error.
static const Kernels* table_for(const std::string& isa) {
#ifndef QE_NO_AMX
  if (isa == "amx") return &amx::kernels;
#endif
  if (isa == "avx512bf16") return &avx512bf16::kernels;
  return isa == "avx512" ? &avx512::kernels : isa == "avx2" ? &avx2::kernels : &generic::kernels;
}

std::string select_isa(std::string requested) {
  TORCH_CHECK(cpu_has(requested), "this CPU (or this build) cannot run the '", requested,
              "' kernels");
  active = table_for(requested);
  active_name = requested;
  return active_name;
}

const Kernels& kernels() {
  TORCH_CHECK(active, "qwen_embed.native chooses the kernels before their first use");
  return *active;
}

}  // namespace qe
