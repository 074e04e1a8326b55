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
}
