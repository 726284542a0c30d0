// Python module of the CPU library: FFI handler capsules and a few queries.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "cpu/cpu_isa.h"
#include "cpu/read_probe.h"
#include "cpu/w4a8_linear.h"
#include "cpu/w4a8_moe.h"
#include "xla/ffi/api/c_api.h"
#include "xla_ffi/abi_version.h"

extern "C" XLA_FFI_Error* JaxMoeqW4A8MoeCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4A8MoeCpuInto(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4A8MoeResidualCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4A8MoeResidualCpuInto(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4A8LinearCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeqW4A8LinearCpuInto(XLA_FFI_CallFrame* call_frame);

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
    targets["jax_moeq_w4a8_moe_residual_cpu"] =
        py::capsule(reinterpret_cast<void*>(&JaxMoeqW4A8MoeResidualCpu));
    targets["jax_moeq_w4a8_moe_residual_cpu_into"] =
        py::capsule(reinterpret_cast<void*>(&JaxMoeqW4A8MoeResidualCpuInto));
    targets["jax_moeq_w4a8_linear_cpu"] =
        py::capsule(reinterpret_cast<void*>(&JaxMoeqW4A8LinearCpu));
    targets["jax_moeq_w4a8_linear_cpu_into"] =
        py::capsule(reinterpret_cast<void*>(&JaxMoeqW4A8LinearCpuInto));
    return targets;
  });
  m.def("read_bandwidth_gbps",
        [](int64_t nbytes, int threads, int repeats) {
          if (nbytes < 1 || threads < 1 || threads > 1024 || repeats < 1) {
            throw py::value_error("read_bandwidth_gbps: nbytes, threads and repeats must be >= 1");
          }
          py::gil_scoped_release release;
          return jax_moeq::cpu::MeasureReadBandwidth(nbytes, threads, repeats);
        },
        py::arg("nbytes"), py::arg("threads"), py::arg("repeats") = 5,
        "Sustained read bandwidth (GB/s, median of `repeats` passes) of `threads` threads summing one "
        "`nbytes` buffer: the benchmarks' DRAM figure.");
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
  m.def("w4a8_moe_chunk_tokens",
        [](int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
           int64_t group_size, bool apply_router_weight_on_input) {
          namespace cpu = jax_moeq::cpu;
          if (tokens < 0 || top_k < 0 || top_k > cpu::kW4A8MaxTopK || hidden < 1 ||
              hidden > cpu::kW4A8MaxFeatures || intermediate < 1 ||
              intermediate > cpu::kW4A8MaxFeatures) {
            throw py::value_error("w4a8_moe_chunk_tokens: sizes out of the op's range");
          }
          jax_moeq::cpu::W4A8MoeProblem p{};
          p.tokens = tokens;
          p.top_k = top_k;
          p.hidden = hidden;
          p.intermediate = intermediate;
          p.group_size = group_size;
          p.apply_router_weight_on_input = apply_router_weight_on_input;
          return jax_moeq::cpu::W4A8MoeChunkTokens(p);
        },
        py::arg("tokens"), py::arg("top_k"), py::arg("hidden"), py::arg("intermediate"),
        py::arg("group_size"), py::arg("apply_router_weight_on_input") = false,
        "Tokens the W4A8 MoE op runs per chunk (its scratch is bounded by the chunk).");
  m.def("w4a8_moe_scratch_budget_bytes",
        []() { return jax_moeq::cpu::kW4A8MoeScratchBudgetBytes; });
  m.def("w4a8_moe_scratch_high_water", &jax_moeq::cpu::W4A8MoeScratchHighWater,
        "The most scratch bytes one chunk of a W4A8 MoE call has held in this process.");
  m.def("w4a8_moe_scratch_sets", &jax_moeq::cpu::W4A8MoeScratchSets,
        "Scratch sets the W4A8 MoE op has made in this process (one per concurrent call).");
  m.def("w4a8_moe_profile", &jax_moeq::cpu::W4A8MoeProfileEnable, py::arg("enable"),
        "Turns the W4A8 MoE op's stage timing on or off (process-wide).");
  m.def("w4a8_moe_profile_take", []() {
    namespace cpu = jax_moeq::cpu;
    const cpu::W4A8MoeStageTimes t = cpu::W4A8MoeProfileTake();
    py::dict stages;
    for (int s = 0; s < cpu::kNumStages; ++s) {
      py::dict d;
      d["wall_ns"] = t.wall_ns[s];
      d["dispatch_ns"] = t.dispatch_ns[s];
      d["busy_ns"] = t.busy_ns[s];
      d["join_ns"] = t.join_ns[s];
      d["pieces"] = t.pieces[s];
      d["threads"] = t.threads[s];
      d["late_start_ns"] = t.late_start_ns[s];
      d["idle_tail_ns"] = t.idle_tail_ns[s];
      stages[cpu::W4A8MoeStageName(s)] = d;
    }
    py::dict out;
    out["chunks"] = t.chunks;
    out["stages"] = stages;
    return out;
  }, "Stage times (ns, summed) since the last take, then zeroed: {'chunks', 'stages': {name: "
     "{wall_ns, dispatch_ns, busy_ns, join_ns, pieces, threads, late_start_ns, idle_tail_ns}}}.");
  m.def("w4a8_linear_chunk_rows",
        [](int64_t rows, int64_t in_features, int64_t out_features, int64_t group_size,
           const std::string& dtype) {
          namespace cpu = jax_moeq::cpu;
          cpu::W4A8LinearProblem p{};
          if (dtype == "float32") {
            p.dtype = cpu::ElementType::kF32;
          } else if (dtype == "bfloat16") {
            p.dtype = cpu::ElementType::kBF16;
          } else if (dtype == "float16") {
            p.dtype = cpu::ElementType::kF16;
          } else {
            throw py::value_error("w4a8_linear_chunk_rows: dtype must be float32, bfloat16 or "
                                  "float16, got " + dtype);
          }
          p.rows = rows;
          p.in_features = in_features;
          p.out_features = out_features;
          p.group_size = group_size;
          // The packed size is computed only for sizes where it is defined (g != 0, in range).
          const bool sized = in_features >= 1 && in_features <= cpu::kW4A8MaxFeatures &&
                             out_features >= 1 &&
                             out_features <= cpu::kW4A8LinearMaxOutFeatures &&
                             (group_size == -1 || group_size == 32 || group_size == 64 ||
                              group_size == 128);
          const std::string error = cpu::ValidateW4A8LinearShapes(
              p, sized ? cpu::W4A8PackedBytes(out_features, in_features, group_size) : -1);
          if (!error.empty()) throw py::value_error("w4a8_linear_chunk_rows: " + error);
          return cpu::W4A8LinearChunkRows(p);
        },
        py::arg("rows"), py::arg("in_features"), py::arg("out_features"), py::arg("group_size"),
        py::arg("dtype"),
        "Rows the W4A8 dense linear runs per chunk (its scratch is bounded by the chunk).");
  m.def("w4a8_packed_bytes", &jax_moeq::cpu::W4A8PackedBytes, py::arg("n"), py::arg("k"),
        py::arg("group_size"), "Bytes of one expert's packed weights (N outputs, K inputs).");
}
