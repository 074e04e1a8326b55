// XLA FFI handlers of the cuDNN backend (the template is handler.h).
//
// A bias (and dbias) has the input dtype, as cuDNN expects. Every failure
// comes back as an ffi::Error; nothing throws across the FFI boundary.
#include <cuda_runtime_api.h>

#include <exception>
#include <string>
#include <utility>

#include "ffi/handler.h"
#include "ffi/handlers.h"
#include "maxattn/cudnn/cudnn_attention.h"
#include "maxattn/device_scope.h"
#ifdef MAXATTN_HAS_SM90
#include "maxattn/sm90/sm90_attention.h"
#endif

namespace maxattn::ffi_glue {
namespace {

DeviceContext MakeContext(cudaStream_t stream, int32_t device, ffi::ScratchAllocator& scratch) {
  DeviceContext ctx;
  ctx.device = device;
  ctx.stream = stream;
  ctx.allocate = [&scratch](size_t bytes) -> void* {
    // XLA's FFI allocator refuses alignments above 16 bytes (64 was refused on the H200 run).
    auto p = scratch.Allocate(bytes, 16);
    return p.has_value() ? *p : nullptr;
  };
  return ctx;
}

// Runs a core call that may throw (cudnn-frontend) and turns everything into an ffi::Error.
template <typename Fn>
ffi::Error Guarded(const char* op, Fn&& fn) {
  try {
    return ToFfiError(fn());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(op) + ": unknown error");
  }
}

struct CudaPlatform {
  static constexpr const char* kForwardName = "maxattn_attention_fwd_cuda";
  static constexpr const char* kBackwardName = "maxattn_attention_bwd_cuda";
  static ffi::DataType BiasType(ffi::DataType input) { return input; }  // cuDNN reads the bias in the input dtype
  static constexpr bool kMaxLogitOverBatch = false;
  using Context = ContextTypes<cudaStream_t, int32_t, ffi::ScratchAllocator>;
  static auto Bind() {
    return ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // the call's CUDA stream
        .Ctx<ffi::DeviceOrdinal>()                 // the call's device
        .Ctx<ffi::ScratchAllocator>();             // cuDNN workspace and statistics
  }
  static ffi::Error Forward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator& scratch,
                            const DecodedCall& call, const ForwardOutputs& outputs) {
    return Guarded(kForwardName, [&] {
      return cudnn::AttentionForwardCudnn(call.shape, call.options, call.inputs, outputs,
                                          MakeContext(stream, device, scratch));
    });
  }
  static ffi::Error Backward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator& scratch,
                             const DecodedCall& call, const BackwardInputs& saved, const BackwardOutputs& grads) {
    return Guarded(kBackwardName, [&] {
      return cudnn::AttentionBackwardCudnn(call.shape, call.options, call.inputs, saved, grads,
                                           MakeContext(stream, device, scratch));
    });
  }
};

#ifdef MAXATTN_HAS_SM90
// Our Hopper kernels (csrc/maxattn/sm90/). python/maxattn/_src/backends/sm90.py
// sends a backward here only when Sm90BackwardUnsupportedReason accepts the
// call; the others go to the cuDNN target.
struct Sm90Platform {
  static constexpr const char* kForwardName = "maxattn_attention_fwd_sm90";
  static constexpr const char* kBackwardName = "maxattn_attention_bwd_sm90";
  static ffi::DataType BiasType(ffi::DataType input) { return input; }  // no bias is supported
  static constexpr bool kMaxLogitOverBatch = true;  // one atomic max per head (epilogue.h)
  using Context = ContextTypes<cudaStream_t, int32_t, ffi::ScratchAllocator>;
  static auto Bind() {
    return ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // the call's CUDA stream
        .Ctx<ffi::DeviceOrdinal>()                 // the call's device
        .Ctx<ffi::ScratchAllocator>();             // segment summaries, the backward's dQ accumulator
  }
  // Runs `fn` (a core call) on `device`, turning everything into an ffi::Error.
  template <typename Fn>
  static ffi::Error OnDevice(const char* op, int32_t device, Fn&& fn) {
    return Guarded(op, [&] {
      DeviceScope scope(device);
      if (scope.status() != cudaSuccess) {
        return Status::Internal(std::string("cudaSetDevice failed: ") + cudaGetErrorString(scope.status()));
      }
      return fn();
    });
  }
  static ffi::Error Forward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator& scratch,
                            const DecodedCall& call, const ForwardOutputs& outputs) {
    return OnDevice(kForwardName, device, [&] {
      return AttentionForwardSm90(call.shape, call.options, call.inputs, outputs,
                                  MakeContext(stream, device, scratch));
    });
  }
  static ffi::Error Backward(cudaStream_t stream, int32_t device, ffi::ScratchAllocator& scratch,
                             const DecodedCall& call, const BackwardInputs& saved, const BackwardOutputs& grads) {
    return OnDevice(kBackwardName, device, [&] {
      return AttentionBackwardSm90(call.shape, call.options, call.inputs, saved, grads,
                                   MakeContext(stream, device, scratch));
    });
  }
};
#endif

}  // namespace

#ifdef MAXATTN_HAS_SM90
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionFwdSm90, (Handler<Sm90Platform, Forward>{}), BindForward<Sm90Platform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionBwdSm90, (Handler<Sm90Platform, Backward>{}),
                              BindBackward<Sm90Platform>());
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionFwdCuda, (Handler<CudaPlatform, Forward>{}), BindForward<CudaPlatform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionBwdCuda, (Handler<CudaPlatform, Backward>{}),
                              BindBackward<CudaPlatform>());

}  // namespace maxattn::ffi_glue
