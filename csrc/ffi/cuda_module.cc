// Python module `maxattn._maxattn_cuda`: exposes the cuDNN FFI handlers as
// capsules for jax.ffi.register_ffi_target(platform="CUDA"). Imported only
// when JAX has a GPU backend, after JAX has loaded libcudnn.so.9.
#include <nanobind/nanobind.h>

#include "maxattn/cudnn/cudnn_attention.h"
#include "ffi/handlers.h"

namespace nb = nanobind;

using maxattn::ffi_glue::HandlerAddress;

NB_MODULE(_maxattn_cuda, m) {
  m.doc() = "maxattn cuDNN backend: XLA FFI handler capsules";
  m.def("registrations", []() {
    nb::dict targets;
    targets["maxattn_attention_fwd_cuda"] = nb::capsule(HandlerAddress(maxattn::ffi_glue::MaxattnAttentionFwdCuda));
    targets["maxattn_attention_bwd_cuda"] = nb::capsule(HandlerAddress(maxattn::ffi_glue::MaxattnAttentionBwdCuda));
    return targets;
  });
  m.def("cudnn_version", []() { return maxattn::cudnn::RuntimeVersion(); },
        "The cuDNN version loaded in this process (cudnnGetVersion()).");
  m.def("supports_stats_with_max", []() { return maxattn::cudnn::SupportsStatsWithMax(); },
        "True when cuDNN (>= 9.21) can emit Stats and Max together.");
  // Test-only hooks (tests/python/test_cudnn_hardening.py).
  m.def("_graph_builds", []() { return maxattn::cudnn::test_hooks::GraphBuilds(); },
        "Number of cuDNN graphs built and cached in this process.");
  m.def("_fail_next_graph_builds", [](int n) { maxattn::cudnn::test_hooks::FailNextGraphBuilds(n); },
        nb::arg("n"), "The next n graph builds fail as a cuDNN rejection would.");
  m.def("_fail_next_workspace_allocations",
        [](int n) { maxattn::cudnn::test_hooks::FailNextWorkspaceAllocations(n); }, nb::arg("n"),
        "The next n scratch allocations of the cudnn backend fail.");
}
