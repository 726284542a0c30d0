// Validation helpers shared by the CUDA FFI handlers: errors prefixed with the target's name,
// shape / dtype / scratch-size checks of buffers, the int range check of attributes that the
// launchers narrow to int, the MoE's token rows and router outputs, and csrc/cuda's error strings
// as FFI errors. Handlers only (XLA types); csrc/ never sees them.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_moeq::ffi_cuda {

namespace ffi = xla::ffi;

// "[d0, d1, ...]"
inline std::string Dims(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline std::string Dims(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  size_t i = 0;
  for (int64_t v : dims) s += (i++ ? ", " : "") + std::to_string(v);
  return s + "]";
}

inline bool HasShape(ffi::AnyBuffer::Dimensions dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

inline bool FitsInt(int64_t v) {
  return v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max();
}

// The checks of one target: every error names it ("<target>: <message>").
class TargetChecks {
 public:
  explicit TargetChecks(const char* target) : target_(target) {}

  ffi::Error Invalid(const std::string& message) const {
    return ffi::Error::InvalidArgument(std::string(target_) + ": " + message);
  }
  ffi::Error Internal(const std::string& message) const {
    return ffi::Error::Internal(std::string(target_) + ": " + message);
  }

  // An error string of csrc/cuda's validators and launchers (empty: none) as an FFI error.
  ffi::Error InvalidUnlessEmpty(const std::string& error) const {
    return error.empty() ? ffi::Error::Success() : Invalid(error);
  }
  ffi::Error InternalUnlessEmpty(const std::string& error) const {
    return error.empty() ? ffi::Error::Success() : Internal(error);
  }

  // `name` has exactly the shape `want`.
  ffi::Error Shape(const char* name, const ffi::AnyBuffer& buffer,
                   std::initializer_list<int64_t> want) const {
    if (HasShape(buffer.dimensions(), want)) return ffi::Error::Success();
    return Invalid(std::string(name) + " has shape " + Dims(buffer.dimensions()) +
                   ", expected " + Dims(want));
  }

  // `name` has the shape `want` and the element type `dtype` (called `dtype_name` in messages).
  ffi::Error Buffer(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType dtype,
                    const char* dtype_name, std::initializer_list<int64_t> want) const {
    if (ffi::Error e = Shape(name, buffer, want); e.failure()) return e;
    if (buffer.element_type() != dtype) {
      return Invalid(std::string(name) + " must be " + dtype_name);
    }
    return ffi::Error::Success();
  }

  // A scratch buffer of element type `dtype` holding at least `count` elements.
  ffi::Error Scratch(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType dtype,
                     int64_t count) const {
    if (buffer.element_type() != dtype || static_cast<int64_t>(buffer.element_count()) < count) {
      return Invalid(std::string(name) + " scratch must hold " + std::to_string(count) +
                     " elements of its dtype");
    }
    return ffi::Error::Success();
  }

  // An attribute that the launchers narrow to int: out of int32 it is refused, not wrapped.
  ffi::Error IntAttr(const char* name, int64_t value) const {
    if (FitsInt(value)) return ffi::Error::Success();
    return Invalid(std::string(name) + " " + std::to_string(value) + " is out of range");
  }

  // IntAttr of each (name, value), in order: the first out of range is reported.
  ffi::Error IntAttrs(std::initializer_list<std::pair<const char*, int64_t>> attrs) const {
    for (const auto& [name, value] : attrs) {
      if (ffi::Error e = IntAttr(name, value); e.failure()) return e;
    }
    return ffi::Error::Success();
  }

  // x is [tokens, hidden]; sets *tokens.
  ffi::Error TokenRows(const ffi::AnyBuffer& x, int64_t hidden, int64_t* tokens) const {
    const auto xd = x.dimensions();
    if (xd.size() != 2 || xd[1] != hidden) {
      return Invalid("x must be [tokens, hidden], got " + Dims(xd));
    }
    *tokens = xd[0];
    return ffi::Error::Success();
  }

  // The router's outputs: topk_ids int32 [tokens, top_k], topk_weights float32 of that shape;
  // sets *top_k.
  ffi::Error TopK(const ffi::AnyBuffer& topk_ids, const ffi::AnyBuffer& topk_weights,
                  int64_t tokens, int64_t* top_k) const {
    if (topk_ids.element_type() != ffi::S32) return Invalid("topk_ids must be int32");
    if (topk_weights.element_type() != ffi::F32) return Invalid("topk_weights must be float32");
    const auto id = topk_ids.dimensions();
    if (id.size() != 2 || id[0] != tokens) {
      return Invalid("topk_ids must be [tokens, top_k], got " + Dims(id));
    }
    *top_k = id[1];
    return Shape("topk_weights", topk_weights, {tokens, *top_k});
  }

 private:
  const char* target_;
};

}  // namespace jax_moeq::ffi_cuda

#define JAX_MOEQ_RETURN_IF_ERROR(expr) \
  do {                                 \
    ::xla::ffi::Error _e = (expr);     \
    if (_e.failure()) return _e;       \
  } while (0)
