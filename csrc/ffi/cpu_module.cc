// Python module `maxattn._maxattn_cpu`: exposes the CPU FFI handlers as
// capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "ffi/handlers.h"
#include "maxattn/cpu/fault_injection.h"

namespace nb = nanobind;

using maxattn::ffi_glue::HandlerAddress;

NB_MODULE(_maxattn_cpu, m) {
  m.doc() = "maxattn CPU backend: XLA FFI handler capsules";
  m.def("registrations", []() {
    nb::dict targets;
    targets["maxattn_attention_fwd_cpu"] = nb::capsule(HandlerAddress(maxattn::ffi_glue::MaxattnAttentionFwdCpu));
    targets["maxattn_attention_bwd_cpu"] = nb::capsule(HandlerAddress(maxattn::ffi_glue::MaxattnAttentionBwdCpu));
    return targets;
  });
  // Test-only: the next n scratch allocations of the CPU kernels fail (std::bad_alloc).
  m.def("_fail_next_scratch_allocations",
        [](int n) { maxattn::cpu::testing::FailNextScratchAllocations(n); }, nb::arg("n"));
}
