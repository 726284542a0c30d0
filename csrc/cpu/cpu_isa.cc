#include "cpu/cpu_isa.h"

#include <cstdlib>

namespace jax_moeq::cpu {

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx2: return "avx2";
    case Isa::kPortable: return "portable";
  }
  return "unknown";
}

bool ParseIsa(const std::string& name, Isa* isa) {
  for (Isa candidate : {Isa::kAvx512Vnni, Isa::kAvx2, Isa::kPortable}) {
    if (name == IsaName(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

namespace {

// CPU feature detection, run once per process: __builtin_cpu_init writes libgcc's global
// feature table, so calls from the handler's concurrent first uses would race on it (and cost
// a few cpuid instructions on every call). A function-local static is initialized exactly once,
// other threads waiting for it (C++11 [stmt.dcl]).
std::vector<Isa> DetectIsas() {
  std::vector<Isa> isas;
#if defined(JAX_MOEQ_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni")) {
    isas.push_back(Isa::kAvx512Vnni);
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    isas.push_back(Isa::kAvx2);
  }
#endif
  isas.push_back(Isa::kPortable);
  return isas;
}

}  // namespace

const std::vector<Isa>& AvailableIsas() {
  static const std::vector<Isa> isas = DetectIsas();
  return isas;
}

Isa SelectIsa(std::string* error) {
  const std::vector<Isa>& available = AvailableIsas();
  const char* forced = std::getenv("JAX_MOEQ_CPU_ISA");
  if (forced == nullptr || *forced == '\0') return available.front();
  Isa isa;
  if (!ParseIsa(forced, &isa)) {
    *error = std::string("JAX_MOEQ_CPU_ISA='") + forced +
             "' is not one of avx512_vnni, avx2, portable";
    return Isa::kPortable;
  }
  for (Isa candidate : available) {
    if (candidate == isa) return isa;
  }
  *error = std::string("JAX_MOEQ_CPU_ISA='") + forced + "' is not supported by this CPU";
  return Isa::kPortable;
}

}  // namespace jax_moeq::cpu
