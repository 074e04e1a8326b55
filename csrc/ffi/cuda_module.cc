// Python module `maxattn._maxattn_cuda`: exposes the cuDNN FFI handlers as
// capsules for jax.ffi.register_ffi_target(platform="CUDA"). Imported only
// when JAX has a GPU backend, after JAX has loaded libcudnn.so.9.
#include <nanobind/nanobind.h>

#include "maxattn/cudnn/cudnn_attention.h"
#include "xla/ffi/api/ffi.h"

namespace maxattn::ffi_glue {
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionBwdCuda);
}  // namespace maxattn::ffi_glue

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule EncapsulateFfiHandler(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_maxattn_cuda, m) {
  m.doc() = "maxattn cuDNN backend: XLA FFI handler capsules";
  m.def("registrations", []() {
    nb::dict targets;
    targets["maxattn_attention_fwd_cuda"] = EncapsulateFfiHandler(maxattn::ffi_glue::MaxattnAttentionFwdCuda);
    targets["maxattn_attention_bwd_cuda"] = EncapsulateFfiHandler(maxattn::ffi_glue::MaxattnAttentionBwdCuda);
    return targets;
  });
  m.def("cudnn_version", []() { return maxattn::cudnn::RuntimeVersion(); },
        "The cuDNN version loaded in this process (cudnnGetVersion()).");
  m.def("supports_stats_with_max", []() { return maxattn::cudnn::SupportsStatsWithMax(); },
        "True when cuDNN (>= 9.21) can emit Stats and Max together.");
}
