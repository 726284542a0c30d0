// Run-time choice of the SIMD path for the CPU kernels: one dispatch point.
#pragma once

#include <string>
#include <vector>

namespace jax_moeq::cpu {

// x86-64: kAmxInt8 (AMX tiles, with the VNNI code for few rows), kAvx512Vnni, kAvx2
// (JAX_MOEQ_X86). AArch64: kNeonI8mm (SMMLA), kNeonDotprod (SDOT)
// (JAX_MOEQ_AARCH64). kPortable everywhere.
enum class Isa {
  kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2, kNeonDotprod = 3, kNeonI8mm = 4, kAmxInt8 = 5
};

const char* IsaName(Isa isa);
// Paths this machine can run, best first. Always contains kPortable. Detected on
// the first call (thread-safe), the same list after.
const std::vector<Isa>& AvailableIsas();
// The best available path, unless JAX_MOEQ_CPU_ISA names another
// ("amx_int8", "avx512_vnni", "avx2", "neon_i8mm", "neon_dotprod", "portable"). Sets *error
// for an unknown or unavailable name and then returns kPortable. Reads the
// variable on every call (tests switch paths within a process); no state of its own.
Isa SelectIsa(std::string* error);
// Parses an ISA name; returns false when unknown.
bool ParseIsa(const std::string& name, Isa* isa);

// The CPU's maker, where a kernel's tuning differs by it (x86: CPUID's vendor string; Hygon's
// cores are AMD's). Detected once.
enum class CpuVendor { kOther = 0, kIntel = 1, kAmd = 2 };
CpuVendor DetectedCpuVendor();
// CPUID's display family (base family, plus the extended family when the base is 0xF; AMD:
// 0x17 Zen to Zen 2, Hygon 0x18, 0x19 Zen 3 and 4, 0x1A Zen 5); 0 off x86. Detected once.
int DetectedCpuFamily();

}  // namespace jax_moeq::cpu
