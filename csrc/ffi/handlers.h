// Handler symbols exported by the FFI extension modules.
#ifndef MAXATTN_FFI_HANDLERS_H_
#define MAXATTN_FFI_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace maxattn::ffi_glue {
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MaxattnAttentionBwdCpu);
}  // namespace maxattn::ffi_glue

#endif  // MAXATTN_FFI_HANDLERS_H_
