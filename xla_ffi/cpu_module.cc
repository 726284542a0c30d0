// Python module of the CPU library: FFI handler capsules and a few queries.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "cpu/cpu_isa.h"
#include "cpu/w4a8_moe.h"
#include "xla/ffi/api/c_api.h"
#include "xla_ffi/abi_version.h"

extern "C" XLA_FFI_Error* JaxMoeqW4A8MoeCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4A8MoeCpuInto(XLA_FFI_CallFrame* call_frame);

namespace py = pybind11;

PYBIND11_MODULE(_cpu_ffi, m) {
  m.doc() = "jax_moeq CPU kernels (XLA FFI handlers)";
  // Checked by jax_moeq/_ffi.py before it registers any handler (xla_ffi/abi_version.h).
  m.attr("ABI_VERSION") = JAX_MOEQ_FFI_ABI_VERSION;
  m.def("registrations", []() {
    py::dict targets;
    targets["jax_moeq_w4a8_moe_cpu"] =
        py::capsule(reinterpret_cast<void*>(&JaxMoeqW4A8MoeCpu));
    targets["jax_moeq_w4a8_moe_cpu_into"] =
        py::capsule(reinterpret_cast<void*>(&JaxMoeqW4A8MoeCpuInto));
    return targets;
  });
  m.def("available_isas", []() {
    std::vector<std::string> names;
    for (auto isa : jax_moeq::cpu::AvailableIsas()) names.push_back(jax_moeq::cpu::IsaName(isa));
    return names;
  }, "SIMD paths this CPU can run, best first.");
  m.def("selected_isa", []() {
    std::string error;
    auto isa = jax_moeq::cpu::SelectIsa(&error);
    if (!error.empty()) throw py::value_error(error);
    return std::string(jax_moeq::cpu::IsaName(isa));
  }, "The SIMD path the kernels will use now (honours JAX_MOEQ_CPU_ISA).");
  m.def("w4a8_packed_bytes", &jax_moeq::cpu::W4A8PackedBytes, py::arg("n"), py::arg("k"),
        py::arg("group_size"), "Bytes of one expert's packed weights (N outputs, K inputs).");
}
