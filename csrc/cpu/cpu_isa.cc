#include "cpu/cpu_isa.h"

#include <cstdlib>
#include <cstring>

#if defined(JAX_MOEQ_X86)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

// Linux reports AArch64 features in the auxiliary vector; elsewhere the NEON
// paths are built but not chosen.
#if defined(JAX_MOEQ_AARCH64) && defined(__linux__)
#define JAX_MOEQ_AARCH64_HWCAP 1
#include <sys/auxv.h>
// Linux's bit numbers (asm/hwcap.h), for C libraries whose headers predate them.
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

namespace jax_moeq::cpu {
namespace {

// Every path of any build, in the order JAX_MOEQ_CPU_ISA's error message lists them.
constexpr Isa kAllIsas[] = {Isa::kAmxInt8,   Isa::kAvx512Vnni,   Isa::kAvx2,
                            Isa::kNeonI8mm,  Isa::kNeonDotprod, Isa::kPortable};

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAmxInt8: return "amx_int8";
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx2: return "avx2";
    case Isa::kNeonI8mm: return "neon_i8mm";
    case Isa::kNeonDotprod: return "neon_dotprod";
    case Isa::kPortable: return "portable";
  }
  return "unknown";
}

bool ParseIsa(const std::string& name, Isa* isa) {
  for (Isa candidate : kAllIsas) {
    if (name == IsaName(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

namespace {

#if defined(JAX_MOEQ_X86)
// AMX-INT8 is usable when CPUID reports AMX-TILE and AMX-INT8, the OS saves the tile state
// (XCR0 bits 17 and 18), and Linux grants this process the tile data state: it is off until
// asked for (arch_prctl ARCH_REQ_XCOMP_PERM), and a tile instruction without it is SIGILL.
// The grant is process-wide, so once (DetectIsas runs once) covers every thread.
bool AmxInt8Usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_tile = (edx >> 24) & 1, amx_int8 = (edx >> 25) & 1;
  const bool osxsave = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 27) & 1);
  if (!amx_tile || !amx_int8 || !osxsave) return false;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if (((xcr0_lo >> 17) & 3) != 3) return false;
#if defined(__linux__)
  constexpr int kArchReqXcompPerm = 0x1023;  // asm/prctl.h
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

std::string AllIsaNames() {
  std::string names;
  for (Isa isa : kAllIsas) names += std::string(names.empty() ? "" : ", ") + IsaName(isa);
  return names;
}

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
    // The AMX path runs GEMMs of few rows on the VNNI code: it needs both.
    if (AmxInt8Usable()) isas.push_back(Isa::kAmxInt8);
    isas.push_back(Isa::kAvx512Vnni);
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    isas.push_back(Isa::kAvx2);
  }
#endif
#if defined(JAX_MOEQ_AARCH64_HWCAP)
  // The kernel reports what user space may execute; the i8mm path also runs the dotprod
  // code (an odd last token), so it needs both.
  const bool dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  const bool i8mm = (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
  if (dotprod && i8mm) isas.push_back(Isa::kNeonI8mm);
  if (dotprod) isas.push_back(Isa::kNeonDotprod);
#endif
  isas.push_back(Isa::kPortable);
  return isas;
}

CpuVendor ReadCpuVendor() {
#if defined(JAX_MOEQ_X86)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return CpuVendor::kOther;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  if (std::strcmp(vendor, "GenuineIntel") == 0) return CpuVendor::kIntel;
  if (std::strcmp(vendor, "AuthenticAMD") == 0 || std::strcmp(vendor, "HygonGenuine") == 0) {
    return CpuVendor::kAmd;
  }
#endif
  return CpuVendor::kOther;
}

int ReadCpuFamily() {
#if defined(JAX_MOEQ_X86)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  const int base = (eax >> 8) & 0xF;
  return base == 0xF ? base + static_cast<int>((eax >> 20) & 0xFF) : base;
#else
  return 0;
#endif
}

}  // namespace

int DetectedCpuFamily() {
  static const int family = ReadCpuFamily();
  return family;
}

CpuVendor DetectedCpuVendor() {
  static const CpuVendor vendor = ReadCpuVendor();
  return vendor;
}

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
    *error = std::string("JAX_MOEQ_CPU_ISA='") + forced + "' is not one of " + AllIsaNames();
    return Isa::kPortable;
  }
  for (Isa candidate : available) {
    if (candidate == isa) return isa;
  }
  *error = std::string("JAX_MOEQ_CPU_ISA='") + forced + "' is not supported by this CPU";
  return Isa::kPortable;
}

}  // namespace jax_moeq::cpu
