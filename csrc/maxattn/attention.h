// maxattn core: the framework-free description of one attention call.
//
// Nothing in this header knows about XLA, JAX or Python. The FFI glue
// (csrc/ffi/) decodes buffers and attributes into these structs and calls a
// backend; tests (tests/cpp/) call the backends directly.
//
// Layouts (all row-major, contiguous):
//   q    [B, T, N, H]     k [B, S, K, H]     v [B, S, K, Hv]
//   out  [B, T, N, Hv]    lse [B, N, T] f32  max_logit [B, N] f32
//   bias [b', n', t', s'] f32, each dim either 1 (broadcast) or B, N, T, S
//   mask [b', n', t', s'] bool (true = attend), same broadcasting as bias
//   q_seq_lengths [B] i32, kv_seq_lengths [B] i32
//   q_segment_ids [B, T] i32, kv_segment_ids [B, S] i32 (0 = padding token)
//
// Semantics (identical to python/maxattn/_src/reference.py):
//   s[b,n,i,j]   = scale * <q[b,i,n,:], k[b,j,n/G,:]> + bias[b,n,i,j]   (G = N/K)
//   logit        = softcap > 0 ? softcap * tanh(s / softcap) : s
//   Let q_valid = q_seq_lengths[b] (or T), kv_valid = kv_seq_lengths[b] (or S),
//   and the diagonal offset d = 0 for top-left alignment,
//   d = kv_valid - q_valid for bottom-right alignment.
//   visible(b,n,i,j) is the AND of
//     i < q_valid and j < kv_valid                          (padding)
//     !causal or j <= i + d                                 (causal)
//     window_left  < 0 or j >= i + d - window_left          (sliding window)
//     window_right < 0 or j <= i + d + window_right
//     no segment ids or (qseg[b,i] == kvseg[b,j] and qseg[b,i] != 0)
//     no mask or mask[b,n,i,j]
//   out[b,i,n,:]   = sum_j softmax_j(logit over visible j) * v[b,j,n/G,:]; 0 if no j visible
//   lse[b,n,i]     = log sum_{visible j} exp(logit);  -inf if no j visible
//   max_logit[b,n] = max over visible (i, j) of s (pre-softcap); -inf if none;
//                    NaN if any visible s is NaN.
//
// Softmax types (inputs.sink_logits, [N] f32; null = vanilla softmax):
//   a sink adds exp(sink[n]) to every row's denominator (the sink logit is not
//   scaled and not soft-capped; off-by-one = a sink of 0 for every head):
//   p[i,j]  = exp(logit[i,j]) / (sum_{visible j'} exp(logit[i,j']) + exp(sink[n]))
//   out     = sum_j p[i,j] v[j]   (0 for a fully masked row)
//   lse     = log(sum_{visible j} exp(logit) + exp(sink[n]))  (includes the sink; a
//             fully masked row has lse = sink[n], finite)
//   max_logit excludes the sink. A sink of -inf is the vanilla softmax.
//   Gradient: dsink[b,n] = -sum_i exp(sink[n] - lse[b,n,i]) * (D_i - dlse_i),
//   D_i = <dout_i, out_i>; the [N] gradient is the sum over b.
//
// Dropout (options.dropout_rate in [0, 1); inputs.dropout_seed, see dropout.h):
//   acts on the normalised probabilities: p' = p * keep(b,n,i,j) / (1 - rate),
//   out = sum_j p'[i,j] v[j]; lse and max_logit are unaffected. keep() is a
//   pure function of (seed, global b, global n, i, j), so forward and backward
//   agree. rate 0 takes the no-dropout path (bit-identical).
#ifndef MAXATTN_ATTENTION_H_
#define MAXATTN_ATTENTION_H_

#include <cstdint>
#include <string>
#include <utility>

namespace maxattn {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

enum class CausalAlignment : int { kTopLeft = 0, kBottomRight = 1 };

// Result of a core call. Never thrown: every public entry point returns one.
class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string message) {
    return Status(Code::kInvalidArgument, std::move(message));
  }
  static Status Internal(std::string message) {
    return Status(Code::kInternal, std::move(message));
  }
  static Status Unimplemented(std::string message) {
    return Status(Code::kUnimplemented, std::move(message));
  }

  enum class Code : int { kOk = 0, kInvalidArgument, kInternal, kUnimplemented };

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

#define MAXATTN_RETURN_IF_ERROR(expr)              \
  do {                                             \
    ::maxattn::Status maxattn_status_ = (expr);    \
    if (!maxattn_status_.ok()) return maxattn_status_; \
  } while (false)

// Sizes of one call.
struct AttentionShape {
  int64_t batch = 0;         // B
  int64_t q_len = 0;         // T
  int64_t kv_len = 0;        // S
  int64_t num_q_heads = 0;   // N
  int64_t num_kv_heads = 0;  // K, N % K == 0
  int64_t head_dim = 0;      // H (q and k)
  int64_t head_dim_v = 0;    // Hv (v and out)
};

// Sizes of a broadcastable [b', n', t', s'] operand (bias or mask).
struct BroadcastDims {
  int64_t b = 1, n = 1, t = 1, s = 1;
};

// Scalar options of one call.
struct AttentionOptions {
  float scale = 1.0f;
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::kTopLeft;
  int64_t window_left = -1;   // < 0: unbounded
  int64_t window_right = -1;  // < 0: unbounded
  float softcap = 0.0f;       // <= 0: no soft cap
  float dropout_rate = 0.0f;  // in [0, 1); > 0 needs inputs.dropout_seed
  // > 0: the caller promises that every row of the segment ids is at most this
  // many contiguous runs, listed in the same order for queries and keys (see
  // python/maxattn/_src/segments.py). A backend may then run the rows as
  // ragged sequences; the result is the dense rule's wherever the promise
  // holds. 0: no promise. At most kMaxSegmentsPerRow; needs segment ids.
  int64_t max_segments = 0;
  // The backward sums every gradient in a fixed order, so two runs on the same
  // inputs give bit-identical dq, dk, dv and dsink (at some cost in time; the
  // forward is deterministic anyway). Backends whose backward always is ignore it.
  bool deterministic = false;
};

inline constexpr int64_t kMaxSegmentsPerRow = 1024;

// Read-only inputs shared by forward and backward. Optional pointers are null
// when the feature is absent.
struct AttentionInputs {
  DType dtype = DType::kFloat32;  // of q, k, v (and out, dout, dq, dk, dv)
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* bias = nullptr;
  BroadcastDims bias_dims;
  const bool* mask = nullptr;
  BroadcastDims mask_dims;
  const int32_t* q_seq_lengths = nullptr;
  const int32_t* kv_seq_lengths = nullptr;
  const int32_t* q_segment_ids = nullptr;   // set together with kv_segment_ids
  const int32_t* kv_segment_ids = nullptr;
  const float* sink_logits = nullptr;      // [N] f32 per-head sink logit, or null (vanilla)
  const uint32_t* dropout_seed = nullptr;  // [4]: key0, key1, batch_offset, head_offset
};

struct ForwardOutputs {
  void* out = nullptr;         // [B, T, N, Hv], dtype
  float* lse = nullptr;        // [B, N, T] or null (not requested)
  float* max_logit = nullptr;  // [B, N], [1, N] (max_logit_over_batch) or null (not requested)
  // max_logit is [1, N]: max_logit[0, n] is the max over every batch row (the sm90 kernels only).
  bool max_logit_over_batch = false;
};

struct BackwardInputs {
  const void* out = nullptr;    // forward output, dtype
  const void* dout = nullptr;   // cotangent of out, dtype
  const float* lse = nullptr;   // forward lse [B, N, T]
  const float* dlse = nullptr;  // cotangent of lse [B, N, T], or null (zero)
};

struct BackwardOutputs {
  void* dq = nullptr;        // like q
  void* dk = nullptr;        // like k
  void* dv = nullptr;        // like v
  float* dbias = nullptr;    // [b', n', t', s'] = bias_dims, reduced over broadcast dims; or null
  float* dsink = nullptr;    // [B, N] per-batch-row gradient of sink_logits, or null
};

// Checks sizes and options (not pointers). Messages name the field and the rule.
Status ValidateShapeAndOptions(const AttentionShape& shape, const AttentionOptions& options,
                               const AttentionInputs& inputs);

// CPU backend (csrc/maxattn/cpu/). Both validate first; both are thread-safe
// and run on the library's shared thread pool.
Status AttentionForwardCpu(const AttentionShape& shape, const AttentionOptions& options,
                           const AttentionInputs& inputs, const ForwardOutputs& outputs);
Status AttentionBackwardCpu(const AttentionShape& shape, const AttentionOptions& options,
                            const AttentionInputs& inputs, const BackwardInputs& saved,
                            const BackwardOutputs& grads);

}  // namespace maxattn

#endif  // MAXATTN_ATTENTION_H_
