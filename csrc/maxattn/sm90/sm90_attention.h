// maxattn sm90: our own Hopper (sm_90a) attention, forward and backward.
//
// Warp-specialised TMA + WGMMA kernels (csrc/maxattn/sm90/). The forward
// reduces max_logit inside the kernel: one atomic max per (batch, head) per
// consumer warp into outputs.max_logit [B, N] (per head into [1, N] with
// outputs.max_logit_over_batch), which the launcher initialises on the stream. The backward recomputes the probabilities from the forward's
// out and lse (attention.h's BackwardInputs, the residuals every backend
// saves). Segment ids run without a dense bias (segments.h).
// Semantics are exactly those of attention.h; the calls they cannot run are
// named by Sm90UnsupportedReason and Sm90BackwardUnsupportedReason.
#ifndef MAXATTN_SM90_SM90_ATTENTION_H_
#define MAXATTN_SM90_SM90_ATTENTION_H_

#include <cuda_runtime.h>

#include <optional>
#include <string>

#include "maxattn/attention.h"
#include "maxattn/device_context.h"

namespace maxattn {

// nullopt when AttentionForwardSm90 can run this call, else the exact reason
// (one sentence naming the field and the rule). Looks at sizes, options,
// which optional inputs are present and pointer alignment; not at the device.
std::optional<std::string> Sm90UnsupportedReason(const AttentionShape& shape, const AttentionOptions& options,
                                                 const AttentionInputs& inputs);

// Runs the forward on ctx.stream (device pointers; the current device must
// be ctx.device). Validates the call first; returns Unimplemented with the
// reason for a call Sm90UnsupportedReason rejects, or when the device is not
// compute capability 9.0. lse and max_logit are written only when their
// pointers are non-null. ctx.allocate is called at most once per call, for
// one block: Sm90TileCounterBytes(head_dim) bytes of the persistent grid's
// tile counter, then with segment ids their summaries (segments.h: 16 bytes
// per query block and per key block and 4 per key, of each batch row).
// Thread-safe; never throws.
Status AttentionForwardSm90(const AttentionShape& shape, const AttentionOptions& options,
                            const AttentionInputs& inputs, const ForwardOutputs& outputs, const DeviceContext& ctx);

// nullopt when AttentionBackwardSm90 can run this call (a call the forward
// can run, with a head dim the backward has kernels for), else the reason.
std::optional<std::string> Sm90BackwardUnsupportedReason(const AttentionShape& shape,
                                                         const AttentionOptions& options,
                                                         const AttentionInputs& inputs);

// The gradients of a call the forward ran, on ctx.stream: dq, dk, dv like q,
// k, v; dsink [B, N] (per batch row) when the call has sink logits. saved.lse
// is the forward's lse [B, N, T] (natural log; sinks included), saved.dlse its
// cotangent or null. ctx.allocate is called once, for one block: an fp32 dQ
// accumulator [B, N, ceil(T / 64) * 64, H], two fp32 row statistics of the
// same rows, and with segment ids their summaries. dQ tiles are added in arrival
// order (unless options.deterministic), so dQ may differ in the last bits from
// run to run; dK and dV are not.
// Thread-safe; never throws.
Status AttentionBackwardSm90(const AttentionShape& shape, const AttentionOptions& options,
                             const AttentionInputs& inputs, const BackwardInputs& saved,
                             const BackwardOutputs& grads, const DeviceContext& ctx);

// 16 when the kernel for this head dim runs a persistent grid (its workspace
// starts with the tile counter), else 0.
int Sm90TileCounterBytes(int64_t head_dim);

}  // namespace maxattn

#endif  // MAXATTN_SM90_SM90_ATTENTION_H_
