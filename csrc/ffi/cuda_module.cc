// Python module `maxattn._maxattn_cuda`: exposes the cuDNN FFI handlers as
// capsules for jax.ffi.register_ffi_target(platform="CUDA"). Imported only
// when JAX has a GPU backend, after JAX has loaded libcudnn.so.9.
#include <cudnn_version.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "maxattn/cudnn/cudnn_attention.h"
#include "ffi/handlers.h"
#ifdef MAXATTN_HAS_SM90
#include "maxattn/sm90/sm90_attention.h"
#endif

namespace nb = nanobind;

namespace {

using Shape = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

// The call described from Python (sizes B, T, S, N, K, H, Hv and the AttentionOptions
// members, as Options.ffi_attributes() names them) in the core's structs.
maxattn::AttentionShape ToShape(const Shape& sizes) {
  const auto [B, T, S, N, K, H, Hv] = sizes;
  return maxattn::AttentionShape{B, T, S, N, K, H, Hv};
}

maxattn::AttentionOptions ToOptions(float scale, bool causal, int alignment, int64_t window_left,
                                    int64_t window_right, float softcap, float dropout_rate,
                                    int64_t max_segments, bool deterministic) {
  maxattn::AttentionOptions options;
  options.scale = scale;
  options.causal = causal;
  options.alignment = static_cast<maxattn::CausalAlignment>(alignment);
  options.window_left = window_left;
  options.window_right = window_right;
  options.softcap = softcap;
  options.dropout_rate = dropout_rate;
  options.max_segments = max_segments;
  options.deterministic = deterministic;
  return options;
}

// cudnn::CheckSupported for a call described from Python: None if the backend
// can run it, else the reason. Arguments: the sizes (B, T, S, N, K, H, Hv), the
// dtype's name, the AttentionOptions members, and the CallFeatures flags.
std::optional<std::string> UnsupportedReason(const Shape& sizes, const std::string& dtype, float scale, bool causal,
                                             int alignment, int64_t window_left, int64_t window_right,
                                             float softcap, float dropout_rate, int64_t max_segments, bool deterministic,
                                             bool bias, bool masked_by_bias, bool padding, bool sink) {
  maxattn::cudnn::CallFeatures features;
  if (dtype == "bfloat16") {
    features.dtype = maxattn::DType::kBFloat16;
  } else if (dtype == "float16") {
    features.dtype = maxattn::DType::kFloat16;
  } else if (dtype == "float32") {
    features.dtype = maxattn::DType::kFloat32;
  } else {
    return "dtype " + dtype + " unsupported: the cudnn backend runs bfloat16 and float16 inputs";
  }
  features.bias = bias;
  features.masked_by_bias = masked_by_bias;
  features.padding = padding;
  features.sink = sink;
  const maxattn::Status status = maxattn::cudnn::CheckSupported(
      ToShape(sizes), ToOptions(scale, causal, alignment, window_left, window_right, softcap, dropout_rate, max_segments,
                deterministic),
      features);
  if (status.ok()) return std::nullopt;
  return status.message();
}

#ifdef MAXATTN_HAS_SM90
// maxattn::Sm90UnsupportedReason (backward=False) or
// Sm90BackwardUnsupportedReason (backward=True) for a call described from
// Python. The kernels also check pointer alignment; XLA's buffers are aligned,
// so the description uses aligned stand-ins for the operands that are present.
std::optional<std::string> Sm90Reason(const Shape& sizes, const std::string& dtype, float scale, bool causal,
                                      int alignment, int64_t window_left, int64_t window_right, float softcap,
                                      float dropout_rate, int64_t max_segments, bool deterministic, bool bias, bool mask,
                                      bool padding, bool segments, bool sink, bool backward) {
  maxattn::AttentionInputs inputs;
  if (dtype == "bfloat16") {
    inputs.dtype = maxattn::DType::kBFloat16;
  } else if (dtype == "float16") {
    inputs.dtype = maxattn::DType::kFloat16;
  } else {
    return "sm90 backend: dtype must be bfloat16 or float16 (got " + dtype + ")";
  }
  alignas(256) static const char kStandIn[256] = {};  // never dereferenced
  const void* p = kStandIn;
  inputs.q = inputs.k = inputs.v = p;
  if (bias) inputs.bias = static_cast<const float*>(p);
  if (mask) inputs.mask = static_cast<const bool*>(p);
  if (padding) {
    inputs.q_seq_lengths = static_cast<const int32_t*>(p);
    inputs.kv_seq_lengths = static_cast<const int32_t*>(p);
  }
  if (segments) {
    inputs.q_segment_ids = static_cast<const int32_t*>(p);
    inputs.kv_segment_ids = static_cast<const int32_t*>(p);
  }
  if (sink) inputs.sink_logits = static_cast<const float*>(p);
  const maxattn::AttentionShape shape = ToShape(sizes);
  const maxattn::AttentionOptions options =
      ToOptions(scale, causal, alignment, window_left, window_right, softcap, dropout_rate, max_segments,
                deterministic);
  return backward ? maxattn::Sm90BackwardUnsupportedReason(shape, options, inputs)
                  : maxattn::Sm90UnsupportedReason(shape, options, inputs);
}
#endif

}  // namespace

using maxattn::ffi_glue::HandlerAddress;

NB_MODULE(_maxattn_cuda, m) {
  m.doc() = "maxattn cuDNN backend: XLA FFI handler capsules";
  m.def("registrations", []() {
    nb::dict targets;
    targets["maxattn_attention_fwd_cuda"] = nb::capsule(HandlerAddress(maxattn::ffi_glue::MaxattnAttentionFwdCuda));
    targets["maxattn_attention_bwd_cuda"] = nb::capsule(HandlerAddress(maxattn::ffi_glue::MaxattnAttentionBwdCuda));
#ifdef MAXATTN_HAS_SM90
    targets["maxattn_attention_fwd_sm90"] = nb::capsule(HandlerAddress(maxattn::ffi_glue::MaxattnAttentionFwdSm90));
    targets["maxattn_attention_bwd_sm90"] = nb::capsule(HandlerAddress(maxattn::ffi_glue::MaxattnAttentionBwdSm90));
#endif
    return targets;
  });
  m.def("unsupported_reason", &UnsupportedReason, nb::arg("sizes"), nb::arg("dtype"), nb::kw_only(),
        nb::arg("scale"), nb::arg("causal"), nb::arg("alignment"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("softcap"), nb::arg("dropout_rate"), nb::arg("max_segments"), nb::arg("deterministic"), nb::arg("bias"), nb::arg("masked_by_bias"),
        nb::arg("padding"), nb::arg("sink"),
        "None if the cudnn backend can run the described call, else the reason (cudnn::CheckSupported).");
#ifdef MAXATTN_HAS_SM90
  m.def("sm90_unsupported_reason", &Sm90Reason, nb::arg("sizes"), nb::arg("dtype"), nb::kw_only(),
        nb::arg("scale"), nb::arg("causal"), nb::arg("alignment"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("softcap"), nb::arg("dropout_rate"), nb::arg("max_segments"), nb::arg("deterministic"), nb::arg("bias"), nb::arg("mask"), nb::arg("padding"),
        nb::arg("segments"), nb::arg("sink"), nb::arg("backward") = false,
        "None if the sm90 forward (backward=True: backward) can run the described call, else the reason "
        "(Sm90UnsupportedReason, Sm90BackwardUnsupportedReason).");
#endif
  m.def("cudnn_version", []() { return maxattn::cudnn::RuntimeVersion(); },
        "The cuDNN version loaded in this process (cudnnGetVersion()).");
  m.def("cudnn_compiled_version", []() { return CUDNN_VERSION; }, "The cuDNN version this module was compiled against.");
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
