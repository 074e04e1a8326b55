// maxattn sm90: our own Hopper (sm_90a) attention forward.
//
// Warp-specialised TMA + WGMMA kernel (csrc/maxattn/sm90/) with max_logit
// reduced inside the kernel: one atomic max per (batch, head) per consumer warp
// into outputs.max_logit [B, N], which the launcher initialises on the stream.
// Semantics are exactly those of attention.h; the calls it cannot run are
// named by Sm90UnsupportedReason.
#ifndef MAXATTN_SM90_SM90_ATTENTION_H_
#define MAXATTN_SM90_SM90_ATTENTION_H_

#include <cuda_runtime.h>

#include <optional>
#include <string>

#include "maxattn/attention.h"

namespace maxattn {

// nullopt when AttentionForwardSm90 can run this call, else the exact reason
// (one sentence naming the field and the rule). Looks at sizes, options,
// which optional inputs are present and pointer alignment; not at the device.
std::optional<std::string> Sm90UnsupportedReason(const AttentionShape& shape, const AttentionOptions& options,
                                                 const AttentionInputs& inputs);

// Runs the forward on `stream` (device pointers). Validates the call first;
// returns Unimplemented with the reason for a call Sm90UnsupportedReason
// rejects, or when the current device is not compute capability 9.0. lse and
// max_logit are written only when their pointers are non-null. Thread-safe;
// never throws.
Status AttentionForwardSm90(const AttentionShape& shape, const AttentionOptions& options,
                            const AttentionInputs& inputs, const ForwardOutputs& outputs, cudaStream_t stream);

}  // namespace maxattn

#endif  // MAXATTN_SM90_SM90_ATTENTION_H_
