// Small enums shared by the CPU kernels.
#pragma once

#include <cstdint>

namespace jax_moeq::cpu {

enum class ElementType { kF32, kBF16, kF16 };

enum class ActivationKind : int64_t { kSwigluStep = 0, kSwigluOai = 1, kSilu = 2 };

}  // namespace jax_moeq::cpu
