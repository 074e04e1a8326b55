// Handler symbols exported by the FFI extension modules, and the helper both
// nanobind modules use to hand them to jax.ffi.register_ffi_target.
#ifndef MAXATTN_FFI_HANDLERS_H_
#define MAXATTN_FFI_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace maxattn::ffi_glue {
// csrc/ffi/cpu_handlers.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionBwdCpu);
// csrc/ffi/cuda_handlers.cc (only in the CUDA module)
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionBwdCuda);
#ifdef MAXATTN_HAS_SM90
// csrc/ffi/cuda_handlers.cc, with the sm90 kernels
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionFwdSm90);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionBwdSm90);
#endif

// The address that jax.ffi.register_ffi_target expects inside its capsule.
template <typename Fn>
void* HandlerAddress(Fn* fn) {
  return reinterpret_cast<void*>(fn);
}
}  // namespace maxattn::ffi_glue

#endif  // MAXATTN_FFI_HANDLERS_H_
