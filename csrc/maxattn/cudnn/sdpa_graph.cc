#include "maxattn/cudnn/sdpa_graph.h"

#include "maxattn/device_scope.h"

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <cudnn_frontend.h>

#include "maxattn/fault_injection.h"

namespace maxattn::cudnn {
namespace fe = cudnn_frontend;

namespace {

Status FromFe(fe::error_t err, const char* what) {
  if (err.is_good()) return Status::Ok();
  std::string message = std::string("cuDNN ") + what + " failed: " + err.get_message();
  if (err.get_code() == fe::error_code_t::GRAPH_NOT_SUPPORTED) return Status::Unimplemented(message);
  return Status::Internal(message);
}

#define MAXATTN_FE_RETURN_IF_ERROR(expr, what) MAXATTN_RETURN_IF_ERROR(FromFe((expr), what))

fe::DataType_t IoType(DType dtype) {
  return dtype == DType::kFloat16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

// [B, L, heads, dim] row-major buffer seen as cuDNN's [B, heads, L, dim].
std::shared_ptr<fe::graph::Tensor_attributes> BthdTensor(fe::graph::Graph& g, const char* name, int64_t uid,
                                                         int64_t b, int64_t l, int64_t heads, int64_t dim) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({b, heads, l, dim})
                      .set_stride({l * heads * dim, dim, heads * dim, 1}));
}

void SetBthd(const std::shared_ptr<fe::graph::Tensor_attributes>& t, const char* name, int64_t uid, int64_t b,
             int64_t l, int64_t heads, int64_t dim) {
  t->set_output(true).set_name(name).set_uid(uid).set_dim({b, heads, l, dim}).set_stride(
      {l * heads * dim, dim, heads * dim, 1});
}

// Sequences of the graph: the batch, or B * M for a ragged call.
int64_t GraphBatch(const GraphSpec& spec) {
  return spec.ragged_segments > 0 ? spec.shape.batch * spec.ragged_segments : spec.shape.batch;
}

// The [B', N, T, 1] float32 layout of row statistics: the lse layout [B, N, T],
// or token-major [B, T, N] for a ragged call (ragged.h: each sequence's rows
// start at its first token, so its statistics are contiguous over tokens, as
// cuDNN sizes its ragged workspaces).
void SetStatsLayout(const GraphSpec& spec, fe::graph::Tensor_attributes& t) {
  const AttentionShape& s = spec.shape;
  const int64_t n = s.num_q_heads, l = s.q_len;
  t.set_dim({GraphBatch(spec), n, l, 1}).set_data_type(fe::DataType_t::FLOAT);
  if (spec.ragged_segments > 0) t.set_stride({l * n, 1, n, 1});
  else t.set_stride({n * l, l, 1, 1});
}

// The ragged offsets of one tensor family: [B' + 1] int32 or int64 element offsets.
std::shared_ptr<fe::graph::Tensor_attributes> RaggedOffset(fe::graph::Graph& g, const GraphSpec& spec,
                                                           const char* name, int64_t uid) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({GraphBatch(spec) + 1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(spec.wide_offsets ? fe::DataType_t::INT64 : fe::DataType_t::INT32));
}

// The ragged offset tensors of a call (all null for a dense call).
struct RaggedOffsets {
  std::shared_ptr<fe::graph::Tensor_attributes> q, k, v, o, stats;
};

RaggedOffsets DeclareRaggedOffsets(fe::graph::Graph& g, const GraphSpec& spec) {
  if (spec.ragged_segments <= 0) return {};
  return {RaggedOffset(g, spec, "RaggedQ", kUidRaggedQ), RaggedOffset(g, spec, "RaggedK", kUidRaggedK),
          RaggedOffset(g, spec, "RaggedV", kUidRaggedV), RaggedOffset(g, spec, "RaggedO", kUidRaggedO),
          RaggedOffset(g, spec, "RaggedStats", kUidRaggedStats)};
}

void SetRagged(const std::shared_ptr<fe::graph::Tensor_attributes>& t,
               const std::shared_ptr<fe::graph::Tensor_attributes>& offset) {
  if (offset) t->set_ragged_offset(offset);
}

std::shared_ptr<fe::graph::Tensor_attributes> RowStats(fe::graph::Graph& g, const char* name, int64_t uid,
                                                       const GraphSpec& spec, const RaggedOffsets& ragged) {
  auto t = g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid));
  SetStatsLayout(spec, *t);
  SetRagged(t, ragged.stats);
  return t;
}

std::shared_ptr<fe::graph::Tensor_attributes> BiasLike(fe::graph::Graph& g, const char* name, int64_t uid,
                                                       const BroadcastDims& d) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({d.b, d.n, d.t, d.s})
                      .set_stride({d.n * d.t * d.s, d.t * d.s, d.s, 1}));
}

// A per-head float32 [1, N, 1, 1] tensor (the sink logits).
std::shared_ptr<fe::graph::Tensor_attributes> PerHead(fe::graph::Graph& g, const char* name, int64_t uid,
                                                      int64_t heads) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({1, heads, 1, 1})
                      .set_stride({heads, 1, 1, 1})
                      .set_data_type(fe::DataType_t::FLOAT));
}

// An int64 scalar in device memory (dropout seed / offset).
std::shared_ptr<fe::graph::Tensor_attributes> Scalar64(fe::graph::Graph& g, const char* name, int64_t uid) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT64));
}

std::shared_ptr<fe::graph::Tensor_attributes> SeqLen(fe::graph::Graph& g, const char* name, int64_t uid,
                                                     int64_t batch) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({batch, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

template <typename Attributes>
void ApplyMasks(const MaskPlan& m, Attributes& a) {
  if (m.bottom_right) a.set_diagonal_alignment(fe::DiagonalAlignment_t::BOTTOM_RIGHT);
  else a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT);
  if (m.left_bound) a.set_diagonal_band_left_bound(static_cast<int>(*m.left_bound));
  if (m.right_bound) a.set_diagonal_band_right_bound(static_cast<int>(*m.right_bound));
}

// The attributes forward and backward share: padding, diagonal band, dropout.
template <typename Attributes>
void ApplyCommon(fe::graph::Graph& g, const GraphSpec& spec, Attributes& a) {
  if (spec.masks.padding) {
    a.set_padding_mask(true)
        .set_seq_len_q(SeqLen(g, "SeqLenQ", kUidSeqLenQ, GraphBatch(spec)))
        .set_seq_len_kv(SeqLen(g, "SeqLenKV", kUidSeqLenKv, GraphBatch(spec)));
  }
  if (spec.ragged_segments > 0) {
    // Tokens in all: bounds cuDNN's ragged workspaces (softmax sums, dQ accumulator).
    a.set_max_total_seq_len_q(spec.shape.batch * spec.shape.q_len)
        .set_max_total_seq_len_kv(spec.shape.batch * spec.shape.kv_len);
  }
  ApplyMasks(spec.masks, a);
  if (spec.dropout > 0.0f) {
    a.set_dropout(spec.dropout, Scalar64(g, "Seed", kUidSeed), Scalar64(g, "Offset", kUidOffset));
  }
}

std::shared_ptr<fe::graph::Graph> NewGraph(DType dtype) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(IoType(dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Graph> DefineForward(const GraphSpec& spec) {
  const AttentionShape& s = spec.shape;
  const int64_t b = GraphBatch(spec);
  auto g = NewGraph(spec.dtype);
  const RaggedOffsets ragged = DeclareRaggedOffsets(*g, spec);
  auto q = BthdTensor(*g, "Q", kUidQ, b, s.q_len, s.num_q_heads, s.head_dim);
  auto k = BthdTensor(*g, "K", kUidK, b, s.kv_len, s.num_kv_heads, s.head_dim);
  auto v = BthdTensor(*g, "V", kUidV, b, s.kv_len, s.num_kv_heads, s.head_dim_v);
  SetRagged(q, ragged.q);
  SetRagged(k, ragged.k);
  SetRagged(v, ragged.v);
  const bool stats = spec.stats == StatsMode::kStats || spec.stats == StatsMode::kStatsMax;
  auto attrs = fe::graph::SDPA_attributes().set_name("maxattn_sdpa_fwd").set_attn_scale(spec.scale).set_generate_stats(stats);
  if (spec.has_bias) attrs.set_bias(BiasLike(*g, "Bias", kUidBias, spec.bias_dims));
  if (spec.sink) attrs.set_sink_token(PerHead(*g, "Sink", kUidSink, s.num_q_heads));
  ApplyCommon(*g, spec, attrs);
  if (spec.stats == StatsMode::kMaxSumExp || spec.stats == StatsMode::kStatsMax) {
    auto max = RowStats(*g, "Max", kUidMax, spec, ragged);
    max->set_output(true);
    attrs.set_logit_max(max);
  }
  if (spec.stats == StatsMode::kMaxSumExp) {
    auto sum_exp = RowStats(*g, "Sum_exp", kUidSumExp, spec, ragged);
    sum_exp->set_output(true);
    attrs.set_score_sum_exp(sum_exp);
  }
  auto [o, lse] = g->sdpa(q, k, v, std::move(attrs));
  SetBthd(o, "O", kUidO, b, s.q_len, s.num_q_heads, s.head_dim_v);
  SetRagged(o, ragged.o);
  if (stats && lse) {
    lse->set_output(true).set_name("Stats").set_uid(kUidStats);
    SetStatsLayout(spec, *lse);
    SetRagged(lse, ragged.stats);
  }
  return g;
}

std::shared_ptr<fe::graph::Graph> DefineBackward(const GraphSpec& spec) {
  const AttentionShape& s = spec.shape;
  const int64_t b = GraphBatch(spec);
  auto g = NewGraph(spec.dtype);
  const RaggedOffsets ragged = DeclareRaggedOffsets(*g, spec);
  auto q = BthdTensor(*g, "Q", kUidQ, b, s.q_len, s.num_q_heads, s.head_dim);
  auto k = BthdTensor(*g, "K", kUidK, b, s.kv_len, s.num_kv_heads, s.head_dim);
  auto v = BthdTensor(*g, "V", kUidV, b, s.kv_len, s.num_kv_heads, s.head_dim_v);
  auto o = BthdTensor(*g, "O", kUidO, b, s.q_len, s.num_q_heads, s.head_dim_v);
  auto dout = BthdTensor(*g, "dO", kUidDO, b, s.q_len, s.num_q_heads, s.head_dim_v);
  for (auto& [t, offset] : {std::pair{q, ragged.q}, std::pair{k, ragged.k}, std::pair{v, ragged.v},
                            std::pair{o, ragged.o}, std::pair{dout, ragged.o}}) {
    SetRagged(t, offset);
  }
  auto stats = RowStats(*g, "Stats", kUidStats, spec, ragged);
  auto attrs = fe::graph::SDPA_backward_attributes()
                   .set_name("maxattn_sdpa_bwd")
                   .set_attn_scale(spec.scale)
                   .set_deterministic_algorithm(spec.deterministic);
  if (spec.has_bias) {
    attrs.set_bias(BiasLike(*g, "Bias", kUidBias, spec.bias_dims));
    if (spec.want_dbias) {
      auto dbias = BiasLike(*g, "dBias", kUidDBias, spec.bias_dims);
      dbias->set_output(true);
      attrs.set_dbias(dbias);
    }
  }
  ApplyCommon(*g, spec, attrs);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, std::move(attrs));
  SetBthd(dq, "dQ", kUidDQ, b, s.q_len, s.num_q_heads, s.head_dim);
  SetBthd(dk, "dK", kUidDK, b, s.kv_len, s.num_kv_heads, s.head_dim);
  SetBthd(dv, "dV", kUidDV, b, s.kv_len, s.num_kv_heads, s.head_dim_v);
  SetRagged(dq, ragged.q);
  SetRagged(dk, ragged.k);
  SetRagged(dv, ragged.v);
  return g;
}

std::atomic<int64_t> g_graph_builds{0};
maxattn::testing::FaultSwitch g_graph_build_faults;

// validate -> operation graph -> heuristics -> support -> plans.
Status Build(const GraphSpec& spec, cudnnHandle_t handle, BuiltGraph* out) {
  if (g_graph_build_faults.Consume()) {
    return Status::Unimplemented("cuDNN graph build failed: injected failure (test hook _fail_next_graph_builds)");
  }
  std::shared_ptr<fe::graph::Graph> g;
  try {
    g = spec.backward ? DefineBackward(spec) : DefineForward(spec);
  } catch (const std::exception& e) {
    return Status::Internal(std::string("cuDNN graph definition threw: ") + e.what());
  }
  MAXATTN_FE_RETURN_IF_ERROR(g->validate(), "graph validation");
  MAXATTN_FE_RETURN_IF_ERROR(g->build_operation_graph(handle), "build_operation_graph");
  MAXATTN_FE_RETURN_IF_ERROR(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                             "create_execution_plans");
  MAXATTN_FE_RETURN_IF_ERROR(g->check_support(), "check_support");
  MAXATTN_FE_RETURN_IF_ERROR(g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  int64_t workspace = 0;
  MAXATTN_FE_RETURN_IF_ERROR(g->get_workspace_size(workspace), "get_workspace_size");
  out->graph = std::move(g);
  out->workspace_bytes = workspace;
  return Status::Ok();
}

std::vector<int64_t> Key(const GraphSpec& spec, int device) {
  const AttentionShape& s = spec.shape;
  int32_t scale_bits = 0, dropout_bits = 0;
  std::memcpy(&scale_bits, &spec.scale, sizeof scale_bits);
  std::memcpy(&dropout_bits, &spec.dropout, sizeof dropout_bits);
  const MaskPlan& m = spec.masks;
  return {spec.backward, device, static_cast<int64_t>(cudnnGetVersion()), static_cast<int64_t>(spec.dtype),
          s.batch, s.q_len, s.kv_len, s.num_q_heads, s.num_kv_heads, s.head_dim, s.head_dim_v, scale_bits,
          m.padding, m.bottom_right, m.left_bound.has_value(), m.left_bound.value_or(0),
          m.right_bound.has_value(), m.right_bound.value_or(0), spec.has_bias, spec.bias_dims.b,
          spec.bias_dims.n, spec.bias_dims.t, spec.bias_dims.s, static_cast<int64_t>(spec.stats),
          spec.want_dbias, dropout_bits, spec.sink, spec.ragged_segments, spec.wide_offsets, spec.deterministic};
}

struct HandleDeleter {
  void operator()(cudnnContext* h) const {
    if (h) cudnnDestroy(h);
  }
};
using UniqueHandle = std::unique_ptr<cudnnContext, HandleDeleter>;

struct DeviceHandle {
  UniqueHandle handle;
  std::mutex mutex;  // held while the handle is bound to a stream
};

class HandleLeaseImpl final : public HandleLease {
 public:
  HandleLeaseImpl(DeviceHandle* h) : lock_(h->mutex), handle_(h->handle.get()) {}
  cudnnHandle_t handle() const override { return handle_; }

 private:
  std::unique_lock<std::mutex> lock_;
  cudnnHandle_t handle_;
};

}  // namespace

Status PlanMasks(const AttentionShape& shape, const AttentionOptions& options, const CallFeatures& features,
                 MaskPlan* plan) {
  // A ragged call (ragged.h) always passes sequence lengths; its sequences are
  // the rows' segments, each on its own top-left diagonal.
  const bool ragged = options.max_segments > 0;
  const bool padding = features.padding || ragged;
  MaskPlan m;
  m.padding = padding;
  if (options.causal) m.right_bound = 0;
  if (options.window_right >= 0) {
    m.right_bound = m.right_bound ? std::min<int64_t>(*m.right_bound, options.window_right) : options.window_right;
  }
  if (options.window_left >= 0) m.left_bound = options.window_left + 1;
  const bool banded = m.left_bound || m.right_bound;
  if (banded && options.alignment == CausalAlignment::kBottomRight && !ragged) {
    if (padding) {
      if (features.bias || options.dropout_rate > 0.0f) {
        return Status::Unimplemented(
            "cuDNN does not support a bias, mask, segment ids or dropout together with bottom-right causal "
            "alignment and sequence lengths");
      }
      m.bottom_right = true;
    } else {
      // Full lengths: the bottom-right diagonal is the top-left one shifted by S - T.
      const int64_t shift = shape.kv_len - shape.q_len;
      if (m.right_bound) *m.right_bound += shift;
      if (m.left_bound) *m.left_bound -= shift;
    }
  }
  if (m.right_bound && *m.right_bound < 0) {
    return Status::Unimplemented(
        "bottom-right causal alignment with T=" + std::to_string(shape.q_len) + " > S=" +
        std::to_string(shape.kv_len) + " leaves the first rows empty, which cuDNN cannot express without "
        "sequence lengths (its causal/window right edge must be on or above the main diagonal)");
  }
  *plan = m;
  return Status::Ok();
}

Status GetGraph(const GraphSpec& spec, int device, cudnnHandle_t handle, std::shared_ptr<const BuiltGraph>* out) {
  // Leaked on purpose: graphs must outlive every static destructor that may still run a call.
  static auto* mutex = new std::mutex;
  static auto* cache = new std::map<std::vector<int64_t>, std::shared_ptr<const BuiltGraph>>;
  const std::vector<int64_t> key = Key(spec, device);
  std::lock_guard<std::mutex> lock(*mutex);
  auto it = cache->find(key);
  if (it != cache->end()) {
    *out = it->second;
    return Status::Ok();
  }
  auto built = std::make_shared<BuiltGraph>();
  MAXATTN_RETURN_IF_ERROR(Build(spec, handle, built.get()));
  (*cache)[key] = built;
  g_graph_builds.fetch_add(1, std::memory_order_relaxed);
  *out = std::move(built);
  return Status::Ok();
}

int64_t BuiltGraphCount() { return g_graph_builds.load(std::memory_order_relaxed); }

void ArmGraphBuildFaults(int n) { g_graph_build_faults.Arm(n); }

Status HandleLease::Acquire(int device, cudaStream_t stream, std::unique_ptr<HandleLease>* out) {
  static auto* mutex = new std::mutex;
  static auto* handles = new std::map<int, std::unique_ptr<DeviceHandle>>;
  DeviceHandle* h = nullptr;
  {
    std::lock_guard<std::mutex> lock(*mutex);
    auto& slot = (*handles)[device];
    if (!slot) {
      DeviceScope scope(device);
      cudnnHandle_t raw = nullptr;
      const cudnnStatus_t st = cudnnCreate(&raw);
      if (st != CUDNN_STATUS_SUCCESS) {
        handles->erase(device);
        return Status::Internal(std::string("cudnnCreate failed on device ") + std::to_string(device) + ": " +
                                cudnnGetErrorString(st));
      }
      slot = std::make_unique<DeviceHandle>();
      slot->handle.reset(raw);
    }
    h = slot.get();
  }
  auto lease = std::make_unique<HandleLeaseImpl>(h);
  const cudnnStatus_t st = cudnnSetStream(lease->handle(), stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    return Status::Internal(std::string("cudnnSetStream failed: ") + cudnnGetErrorString(st));
  }
  *out = std::move(lease);
  return Status::Ok();
}

}  // namespace maxattn::cudnn
