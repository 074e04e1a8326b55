// XLA FFI handlers of the CPU backend (the template is handler.h).
#include "ffi/handler.h"
#include "ffi/handlers.h"

namespace maxattn::ffi_glue {
namespace {

struct CpuPlatform {
  static constexpr const char* kForwardName = "maxattn_attention_fwd_cpu";
  static constexpr const char* kBackwardName = "maxattn_attention_bwd_cpu";
  static ffi::DataType BiasType(ffi::DataType) { return ffi::DataType::F32; }  // the kernels read f32
  static constexpr bool kMaxLogitOverBatch = false;
  using Context = ContextTypes<>;  // the kernels run on the library's thread pool; no XLA context
  static auto Bind() { return ffi::Ffi::Bind(); }
  static ffi::Error Forward(const DecodedCall& call, const ForwardOutputs& outputs) {
    return ToFfiError(AttentionForwardCpu(call.shape, call.options, call.inputs, outputs));
  }
  static ffi::Error Backward(const DecodedCall& call, const BackwardInputs& saved, const BackwardOutputs& grads) {
    return ToFfiError(AttentionBackwardCpu(call.shape, call.options, call.inputs, saved, grads));
  }
};

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionFwdCpu, (Handler<CpuPlatform, Forward>{}), BindForward<CpuPlatform>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionBwdCpu, (Handler<CpuPlatform, Backward>{}), BindBackward<CpuPlatform>());

}  // namespace maxattn::ffi_glue
