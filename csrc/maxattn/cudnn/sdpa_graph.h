// cuDNN SDPA graph builders and the process-wide caches of built graphs and
// handles. Internal to csrc/maxattn/cudnn/.
#ifndef MAXATTN_CUDNN_SDPA_GRAPH_H_
#define MAXATTN_CUDNN_SDPA_GRAPH_H_

#include <cstdint>
#include <memory>
#include <optional>

#include <cudnn.h>

#include "maxattn/attention.h"
#include "maxattn/cudnn/cudnn_attention.h"

namespace cudnn_frontend::graph {
class Graph;
}

namespace maxattn::cudnn {

// Named uids of every tensor the graphs exchange with the caller.
enum Uid : int64_t {
  kUidQ = 1,
  kUidK,
  kUidV,
  kUidO,
  kUidStats,
  kUidMax,
  kUidSumExp,
  kUidBias,
  kUidSeqLenQ,
  kUidSeqLenKv,
  kUidDO,
  kUidDQ,
  kUidDK,
  kUidDV,
  kUidDBias,
  kUidSink,
  kUidSeed,
  kUidOffset,
  kUidRaggedQ,  // ragged offsets (ragged.h): of Q and dQ, K and dK, V and dV, O and dO, Stats/Max/Sum_exp
  kUidRaggedK,
  kUidRaggedV,
  kUidRaggedO,
  kUidRaggedStats,
};

// Which softmax statistics the forward graph emits.
enum class StatsMode : int {
  kNone = 0,       // inference, no lse, no max: plain graph
  kStats = 1,      // Stats (= lse) only
  kMaxSumExp = 2,  // Max and Sum_exp (cuDNN < 9.21 cannot emit Stats with Max)
  kStatsMax = 3,   // Stats and Max (cuDNN >= 9.21)
};

// Masking as cuDNN expresses it, derived from the options (see PlanMasks).
struct MaskPlan {
  bool padding = false;       // seq_len_q / seq_len_kv given (always for a ragged call)
  bool bottom_right = false;  // cuDNN BOTTOM_RIGHT alignment (only with padding)
  std::optional<int64_t> left_bound;   // keeps j > i - left_bound (+ alignment shift)
  std::optional<int64_t> right_bound;  // keeps j <= i + right_bound (+ alignment shift)
};

// Translates causal/window/alignment into cuDNN's diagonal band. Returns
// Unimplemented when cuDNN cannot express the combination.
Status PlanMasks(const AttentionShape& shape, const AttentionOptions& options, const CallFeatures& features,
                 MaskPlan* plan);

struct GraphSpec {
  bool backward = false;
  DType dtype = DType::kBFloat16;
  AttentionShape shape;
  float scale = 1.0f;
  MaskPlan masks;
  bool has_bias = false;
  BroadcastDims bias_dims;
  StatsMode stats = StatsMode::kNone;  // forward only
  bool want_dbias = false;             // backward only
  bool deterministic = false;          // backward only: cuDNN's deterministic algorithm
  float dropout = 0.0f;                // probability; > 0 adds the Seed and Offset inputs
  bool sink = false;                   // forward only: cuDNN's sink token (f32 [1, N, 1, 1])
  // > 0: a ragged call (ragged.h): every batch row is this many sequences of
  // the graph (batch B * ragged_segments), each with its own length and
  // ragged offsets; shape.q_len / kv_len bound the sequences' lengths.
  int64_t ragged_segments = 0;
  bool wide_offsets = false;  // int64 ragged offsets (else int32)
};

struct BuiltGraph {
  std::shared_ptr<cudnn_frontend::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

// The cached graph for `spec` on `device`, built on a miss (thread-safe; the
// key includes the device ordinal and the cuDNN version). Concurrent first
// uses of one spec build it once.
Status GetGraph(const GraphSpec& spec, int device, cudnnHandle_t handle, std::shared_ptr<const BuiltGraph>* out);

// Test hooks (maxattn._maxattn_cuda): graphs built so far, and a switch that
// makes the next builds fail as a cuDNN rejection would.
int64_t BuiltGraphCount();
void ArmGraphBuildFaults(int n);

// One cuDNN handle per device, created on first use and kept for the process.
// The returned lock must be held while the handle is bound to a stream and
// used.
class HandleLease {
 public:
  static Status Acquire(int device, cudaStream_t stream, std::unique_ptr<HandleLease>* out);
  virtual ~HandleLease() = default;
  virtual cudnnHandle_t handle() const = 0;
};

}  // namespace maxattn::cudnn

#endif  // MAXATTN_CUDNN_SDPA_GRAPH_H_
