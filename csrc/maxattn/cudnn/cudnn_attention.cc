// Forward and backward of the cuDNN backend: graph choice, workspace,
// execution and the epilogue kernels. See cudnn_attention.h.
#include "maxattn/cudnn/cudnn_attention.h"

#include <string>
#include <tuple>
#include <unordered_map>

#include <cudnn.h>
#include <cudnn_frontend.h>

#include "maxattn/device_scope.h"
#include "maxattn/cudnn/kernels.h"
#include "maxattn/cudnn/ragged.h"
#include "maxattn/cudnn/sdpa_graph.h"
#include "maxattn/fault_injection.h"

namespace maxattn::cudnn {
namespace {

constexpr size_t kStatsWithMaxVersion = 92100;
constexpr int64_t kMaxHeadDim = 256;

Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

bool Ragged(const AttentionOptions& options) { return options.max_segments > 0; }

// Buffer-versus-buffer consistency of a call (the support decision is CheckSupported's).
Status CheckConsistent(const AttentionShape& shape, const AttentionOptions& options, const AttentionInputs& inputs) {
  if (Ragged(options) && (!inputs.q_segment_ids || !inputs.kv_segment_ids)) {
    return Status::InvalidArgument("the cudnn backend's ragged path (max_segments > 0) needs segment ids");
  }
  if ((inputs.mask || (inputs.q_segment_ids && !Ragged(options))) && !inputs.bias) {
    return Status::InvalidArgument(
        "the cudnn backend needs a dense mask or segment ids folded into the bias (see cudnn_attention.h)");
  }
  if ((inputs.q_seq_lengths == nullptr) != (inputs.kv_seq_lengths == nullptr)) {
    return Status::InvalidArgument("the cudnn backend needs q_seq_lengths and kv_seq_lengths together");
  }
  if (inputs.bias && (inputs.bias_dims.t != shape.q_len || inputs.bias_dims.s != shape.kv_len)) {
    return Status::InvalidArgument("the cudnn backend needs a bias of shape [b', n', T, S]");
  }
  return Status::Ok();
}

Status CheckCall(const AttentionShape& shape, const AttentionOptions& options, const AttentionInputs& inputs) {
  MAXATTN_RETURN_IF_ERROR(CheckConsistent(shape, options, inputs));
  return CheckSupported(shape, options, FeaturesOf(inputs, options));
}

// Logits of entries a folded-in mask removes are about the dtype's lowest
// value; a row whose statistic is below half of it saw no visible key.
float MaskedRowThreshold(DType dtype) { return dtype == DType::kFloat16 ? -32752.0f : -1.0e38f; }

bool MaskedByBias(const AttentionInputs& inputs, const AttentionOptions& options) {
  return inputs.mask || (inputs.q_segment_ids && !Ragged(options));
}

RowGeometry Geometry(const AttentionShape& s, const AttentionOptions& o, const AttentionInputs& in) {
  RowGeometry g;
  g.batch = static_cast<int32_t>(s.batch);
  g.heads = static_cast<int32_t>(s.num_q_heads);
  g.q_len = static_cast<int32_t>(s.q_len);
  g.kv_len = static_cast<int32_t>(s.kv_len);
  g.q_seq_lengths = in.q_seq_lengths;
  g.kv_seq_lengths = in.kv_seq_lengths;
  g.causal = o.causal;
  g.bottom_right = o.alignment == CausalAlignment::kBottomRight;
  g.window_left = o.window_left;
  g.window_right = o.window_right;
  return g;
}

maxattn::testing::FaultSwitch g_workspace_faults;

// Bump allocator over one scratch allocation (the FFI scratch allocator is
// asked once per call).
class Scratch {
 public:
  void Reserve(int64_t bytes) { total_ += Round(bytes); }
  Status Allocate(const DeviceContext& ctx) {
    if (total_ == 0) return Status::Ok();
    if (g_workspace_faults.Consume()) {
      return Status::Internal("the XLA FFI scratch allocator could not provide " + std::to_string(total_) +
                              " bytes: injected failure (test hook _fail_next_workspace_allocations)");
    }
    base_ = static_cast<char*>(ctx.allocate(static_cast<size_t>(total_)));
    if (!base_) {
      return Status::Internal("the XLA FFI scratch allocator could not provide " + std::to_string(total_) +
                              " bytes (16-byte aligned) for cuDNN workspace and softmax statistics");
    }
    return Status::Ok();
  }
  void* Take(int64_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = base_ + used_;
    used_ += Round(bytes);
    return p;
  }

 private:
  static int64_t Round(int64_t b) { return (b + 255) / 256 * 256; }
  char* base_ = nullptr;
  int64_t total_ = 0, used_ = 0;
};

Status Execute(const BuiltGraph& built, cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
               void* workspace) {
  auto err = built.graph->execute(handle, pack, workspace);
  if (!err.is_good()) return Status::Internal("cuDNN SDPA execution failed: " + err.get_message());
  return Status::Ok();
}

// The graph settings forward and backward share: dtype, sizes, scale, bias,
// dropout and the masks as cuDNN expresses them.
Status BaseSpec(const AttentionShape& shape, const AttentionOptions& options, const AttentionInputs& inputs,
                GraphSpec* spec) {
  spec->dtype = inputs.dtype;
  spec->shape = shape;
  spec->scale = options.scale;
  spec->has_bias = inputs.bias != nullptr;
  spec->bias_dims = inputs.bias_dims;
  spec->dropout = options.dropout_rate;
  spec->ragged_segments = options.max_segments;
  return PlanMasks(shape, options, FeaturesOf(inputs, options), &spec->masks);
}

// The ragged layout of a call with max_segments > 0 (ragged.h).
RaggedProblem RaggedProblemOf(const AttentionShape& s, const AttentionOptions& o, const AttentionInputs& in) {
  RaggedProblem p;
  p.rows = Geometry(s, o, in);
  p.max_segments = static_cast<int32_t>(o.max_segments);
  p.q_segment_ids = in.q_segment_ids;
  p.kv_segment_ids = in.kv_segment_ids;
  p.q_token = s.num_q_heads * s.head_dim;
  p.k_token = s.num_kv_heads * s.head_dim;
  p.v_token = s.num_kv_heads * s.head_dim_v;
  p.o_token = s.num_q_heads * s.head_dim_v;
  p.wide_offsets = NeedsWideOffsets(p);
  return p;
}

// The ragged layout of a call, when it has one: reserved, then built on the stream.
class RaggedPart {
 public:
  RaggedPart(const AttentionShape& s, const AttentionOptions& o, const AttentionInputs& in, GraphSpec* spec)
      : active_(Ragged(o)) {
    if (!active_) return;
    problem_ = RaggedProblemOf(s, o, in);
    spec->wide_offsets = problem_.wide_offsets;
  }
  bool active() const { return active_; }
  void Reserve(Scratch& scratch) const;
  Status Build(Scratch& scratch, cudaStream_t stream);
  const RaggedLayout* layout() const { return active_ ? &layout_ : nullptr; }

 private:
  bool active_;
  RaggedProblem problem_;
  RaggedLayout layout_;
};

void RaggedPart::Reserve(Scratch& scratch) const {
  if (active_) scratch.Reserve(RaggedLayoutBytes(problem_));
}

Status RaggedPart::Build(Scratch& scratch, cudaStream_t stream) {
  if (!active_) return Status::Ok();
  layout_ = CarveRaggedLayout(problem_, scratch.Take(RaggedLayoutBytes(problem_)));
  return CudaStatus(LaunchRaggedLayout(problem_, layout_, stream), "maxattn ragged layout kernel launch");
}

// cuDNN's dropout seed and offset (two int64 in `seed`), derived on the stream
// from inputs.dropout_seed when the graph has dropout.
Status PrepareDropoutSeed(const GraphSpec& spec, const AttentionInputs& inputs, int64_t* seed,
                          cudaStream_t stream) {
  if (spec.dropout <= 0.0f) return Status::Ok();
  return CudaStatus(LaunchDropoutSeed(inputs.dropout_seed, seed, stream), "maxattn dropout seed kernel launch");
}

// Variant-pack entries forward and backward share: q, k, v, bias, sequence
// lengths (a ragged call's per-segment ones) and offsets, and the dropout
// seed/offset.
std::unordered_map<int64_t, void*> CommonPack(const GraphSpec& spec, const AttentionInputs& inputs, int64_t* seed,
                                              const RaggedLayout* ragged) {
  std::unordered_map<int64_t, void*> pack = {
      {kUidQ, const_cast<void*>(inputs.q)},
      {kUidK, const_cast<void*>(inputs.k)},
      {kUidV, const_cast<void*>(inputs.v)},
  };
  if (spec.has_bias) pack[kUidBias] = const_cast<float*>(inputs.bias);
  if (ragged) {
    pack[kUidSeqLenQ] = ragged->seq_len_q;
    pack[kUidSeqLenKv] = ragged->seq_len_kv;
    pack[kUidRaggedQ] = ragged->offset_q;
    pack[kUidRaggedK] = ragged->offset_k;
    pack[kUidRaggedV] = ragged->offset_v;
    pack[kUidRaggedO] = ragged->offset_o;
    pack[kUidRaggedStats] = ragged->offset_stats;
  } else if (spec.masks.padding) {
    pack[kUidSeqLenQ] = const_cast<int32_t*>(inputs.q_seq_lengths);
    pack[kUidSeqLenKv] = const_cast<int32_t*>(inputs.kv_seq_lengths);
  }
  if (spec.dropout > 0.0f) {
    pack[kUidSeed] = seed;
    pack[kUidOffset] = seed + 1;
  }
  return pack;
}

}  // namespace

CallFeatures FeaturesOf(const AttentionInputs& inputs, const AttentionOptions& options) {
  CallFeatures f;
  f.dtype = inputs.dtype;
  f.bias = inputs.bias != nullptr;
  f.masked_by_bias = MaskedByBias(inputs, options);
  f.padding = inputs.q_seq_lengths != nullptr || inputs.kv_seq_lengths != nullptr;
  f.sink = inputs.sink_logits != nullptr;
  return f;
}

Status CheckSupported(const AttentionShape& shape, const AttentionOptions& options, const CallFeatures& features) {
  if (features.dtype != DType::kBFloat16 && features.dtype != DType::kFloat16) {
    return Status::Unimplemented("dtype float32 unsupported: the cudnn backend runs bfloat16 and float16 inputs");
  }
  const bool banded = options.causal || options.window_left >= 0 || options.window_right >= 0;
  if (options.softcap > 0.0f) {
    if (banded || features.masked_by_bias || features.padding) {
      return Status::Unimplemented(
          "logits_soft_cap together with masking (causal, window, sequence lengths, segment ids or mask) is a "
          "known cuDNN gap: cuDNN's score modifier disables its built-in masks");
    }
    return Status::Unimplemented("logits_soft_cap is not supported by the cudnn backend");
  }
  for (const auto& [name, d] : {std::pair{"H", shape.head_dim}, std::pair{"Hv", shape.head_dim_v}}) {
    if (d % 8 != 0 || d > kMaxHeadDim || d == 0) {
      return Status::Unimplemented(std::string("head dim ") + name + "=" + std::to_string(d) +
                                   " unsupported: cuDNN needs a multiple of 8 between 8 and " +
                                   std::to_string(kMaxHeadDim));
    }
  }
  if (shape.batch == 0 || shape.q_len == 0 || shape.kv_len == 0 || shape.num_q_heads == 0) {
    return Status::Unimplemented("an empty batch, sequence or head axis is not supported by the cudnn backend");
  }
  if (Ragged(options) && (features.bias || features.sink || options.dropout_rate > 0.0f)) {
    return Status::Unimplemented(
        "max_segments_per_row (segment ids as cuDNN ragged sequences) runs without a bias, mask, dropout or "
        "sinks");
  }
  if (options.window_left >= 0 && !features.padding && !Ragged(options) && shape.q_len > shape.kv_len) {
    return Status::Unimplemented("cuDNN supports a sliding window only with T <= S (got T=" +
                                 std::to_string(shape.q_len) + ", S=" + std::to_string(shape.kv_len) + ")");
  }
  MaskPlan plan;
  return PlanMasks(shape, options, features, &plan);
}

size_t RuntimeVersion() { return cudnnGetVersion(); }

bool SupportsStatsWithMax() { return RuntimeVersion() >= kStatsWithMaxVersion; }

Status AttentionForwardCudnn(const AttentionShape& shape, const AttentionOptions& options,
                             const AttentionInputs& inputs, const ForwardOutputs& outputs,
                             const DeviceContext& ctx) {
  MAXATTN_RETURN_IF_ERROR(CheckCall(shape, options, inputs));
  DeviceScope scope(ctx.device);
  MAXATTN_RETURN_IF_ERROR(CudaStatus(scope.status(), "cudaSetDevice"));
  if (shape.batch == 0 || shape.q_len == 0 || shape.num_q_heads == 0) return Status::Ok();

  const bool want_lse = outputs.lse != nullptr;
  const bool want_max = outputs.max_logit != nullptr;
  const bool has_sink = inputs.sink_logits != nullptr;
  // cuDNN's Max includes the sink token, max_logit must not: with max_logit
  // the graph runs the vanilla softmax and the sink is applied afterwards
  // (one pass over out); otherwise cuDNN applies it.
  const bool sink_after = has_sink && want_max;
  const bool masked = MaskedByBias(inputs, options);
  GraphSpec spec;
  MAXATTN_RETURN_IF_ERROR(BaseSpec(shape, options, inputs, &spec));
  RaggedPart ragged(shape, options, inputs, &spec);
  spec.sink = has_sink && !sink_after;
  // Rows a folded-in mask empties are found from the statistics (a native
  // sink makes them 0 by itself).
  const bool detect_masked = masked && !spec.sink;
  if (want_max) spec.stats = SupportsStatsWithMax() ? StatsMode::kStatsMax : StatsMode::kMaxSumExp;
  else spec.stats = (want_lse || detect_masked) ? StatsMode::kStats : StatsMode::kNone;

  std::unique_ptr<HandleLease> lease;
  MAXATTN_RETURN_IF_ERROR(HandleLease::Acquire(ctx.device, ctx.stream, &lease));
  std::shared_ptr<const BuiltGraph> built;
  MAXATTN_RETURN_IF_ERROR(GetGraph(spec, ctx.device, lease->handle(), &built));

  const int64_t rows_bytes = shape.batch * shape.num_q_heads * shape.q_len * static_cast<int64_t>(sizeof(float));
  const bool has_stats = spec.stats == StatsMode::kStats || spec.stats == StatsMode::kStatsMax;
  const bool need_max_rows = spec.stats == StatsMode::kMaxSumExp || spec.stats == StatsMode::kStatsMax;
  const bool need_sum_exp = spec.stats == StatsMode::kMaxSumExp;
  // A ragged call's statistics are token-major: the finalize kernel writes the lse.
  const bool need_stats_scratch = has_stats && (!want_lse || ragged.active());
  const bool need_seed = spec.dropout > 0.0f;
  Scratch scratch;
  scratch.Reserve(built->workspace_bytes);
  ragged.Reserve(scratch);
  if (need_max_rows) scratch.Reserve(rows_bytes);
  if (need_sum_exp) scratch.Reserve(rows_bytes);
  if (need_stats_scratch) scratch.Reserve(rows_bytes);
  if (sink_after) scratch.Reserve(rows_bytes);
  if (need_seed) scratch.Reserve(2 * sizeof(int64_t));
  MAXATTN_RETURN_IF_ERROR(scratch.Allocate(ctx));
  void* workspace = scratch.Take(built->workspace_bytes);
  MAXATTN_RETURN_IF_ERROR(ragged.Build(scratch, ctx.stream));
  float* row_max = need_max_rows ? static_cast<float*>(scratch.Take(rows_bytes)) : nullptr;
  float* sum_exp = need_sum_exp ? static_cast<float*>(scratch.Take(rows_bytes)) : nullptr;
  float* stats = need_stats_scratch ? static_cast<float*>(scratch.Take(rows_bytes)) : outputs.lse;
  float* row_scale = sink_after ? static_cast<float*>(scratch.Take(rows_bytes)) : nullptr;
  int64_t* seed = need_seed ? static_cast<int64_t*>(scratch.Take(2 * sizeof(int64_t))) : nullptr;
  MAXATTN_RETURN_IF_ERROR(PrepareDropoutSeed(spec, inputs, seed, ctx.stream));

  std::unordered_map<int64_t, void*> pack = CommonPack(spec, inputs, seed, ragged.layout());
  pack[kUidO] = outputs.out;
  if (spec.sink) pack[kUidSink] = const_cast<float*>(inputs.sink_logits);
  if (has_stats) pack[kUidStats] = stats;
  if (need_max_rows) pack[kUidMax] = row_max;
  if (need_sum_exp) pack[kUidSumExp] = sum_exp;
  MAXATTN_RETURN_IF_ERROR(Execute(*built, lease->handle(), pack, workspace));

  RowGeometry geometry = Geometry(shape, options, inputs);
  if (ragged.active()) geometry.row_code = ragged.layout()->q_rows;
  const bool empty_rows = geometry.MayHaveEmptyRows() || detect_masked;
  if (want_max || empty_rows || sink_after) {
    FinalizeArgs args;
    args.geometry = geometry;
    args.token_major = ragged.active();
    args.row_max = row_max;
    args.sum_exp = (want_lse || sink_after) ? sum_exp : nullptr;  // max_logit alone needs no lse
    if (ragged.active()) {
      args.stats = stats;  // token-major Stats scratch (or null)
      args.lse = outputs.lse;
    } else {
      args.lse = stats;  // the lse output, the Stats scratch, or null
    }
    args.max_logit = outputs.max_logit;
    args.out = empty_rows ? outputs.out : nullptr;
    args.head_dim_v = static_cast<int32_t>(shape.head_dim_v);
    args.masked_below = detect_masked ? MaskedRowThreshold(inputs.dtype) : 0.0f;
    args.sink = inputs.sink_logits;
    args.row_scale = row_scale;
    MAXATTN_RETURN_IF_ERROR(CudaStatus(LaunchFinalizeForward(args, ctx.stream), "maxattn finalize kernel launch"));
  }
  if (sink_after) {
    MAXATTN_RETURN_IF_ERROR(CudaStatus(
        LaunchScaleRows(outputs.out, inputs.dtype == DType::kFloat16, row_scale, static_cast<int32_t>(shape.batch),
                        static_cast<int32_t>(shape.q_len), static_cast<int32_t>(shape.num_q_heads),
                        static_cast<int32_t>(shape.head_dim_v), ctx.stream),
        "maxattn sink rescale kernel launch"));
  }
  return Status::Ok();
}

Status AttentionBackwardCudnn(const AttentionShape& shape, const AttentionOptions& options,
                              const AttentionInputs& inputs, const BackwardInputs& saved,
                              const BackwardOutputs& grads, const DeviceContext& ctx) {
  MAXATTN_RETURN_IF_ERROR(CheckCall(shape, options, inputs));
  if (saved.dlse != nullptr) {
    return Status::InvalidArgument("the cudnn backward takes no dlse (fold it into an extra value column)");
  }
  if (grads.dsink != nullptr && inputs.sink_logits == nullptr) {
    return Status::InvalidArgument("the cudnn backward got a dsink output but no sink_logits");
  }
  DeviceScope scope(ctx.device);
  MAXATTN_RETURN_IF_ERROR(CudaStatus(scope.status(), "cudaSetDevice"));
  const int64_t elem = 2;
  const int64_t dq_bytes = shape.batch * shape.q_len * shape.num_q_heads * shape.head_dim * elem;
  const int64_t dk_bytes = shape.batch * shape.kv_len * shape.num_kv_heads * shape.head_dim * elem;
  const int64_t dv_bytes = shape.batch * shape.kv_len * shape.num_kv_heads * shape.head_dim_v * elem;
  if (shape.batch == 0 || shape.q_len == 0 || shape.kv_len == 0 || shape.num_q_heads == 0) {
    // Nothing attends: every gradient is zero.
    MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(grads.dq, 0, dq_bytes, ctx.stream), "cudaMemsetAsync"));
    MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(grads.dk, 0, dk_bytes, ctx.stream), "cudaMemsetAsync"));
    MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(grads.dv, 0, dv_bytes, ctx.stream), "cudaMemsetAsync"));
    if (grads.dbias && inputs.bias) {
      const BroadcastDims& d = inputs.bias_dims;
      MAXATTN_RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(grads.dbias, 0, d.b * d.n * d.t * d.s * elem, ctx.stream), "cudaMemsetAsync"));
    }
    if (grads.dsink) {
      MAXATTN_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(grads.dsink, 0, shape.batch * shape.num_q_heads * sizeof(float), ctx.stream),
          "cudaMemsetAsync"));
    }
    return Status::Ok();
  }

  // The saved lse includes any sink, so the vanilla backward graph already
  // yields the gradients of q, k, v (and bias) under the sink softmax; the sink
  // gradient comes from its own kernel.
  GraphSpec spec;
  MAXATTN_RETURN_IF_ERROR(BaseSpec(shape, options, inputs, &spec));
  RaggedPart ragged(shape, options, inputs, &spec);
  spec.backward = true;
  spec.want_dbias = spec.has_bias && grads.dbias != nullptr;
  spec.deterministic = options.deterministic;

  std::unique_ptr<HandleLease> lease;
  MAXATTN_RETURN_IF_ERROR(HandleLease::Acquire(ctx.device, ctx.stream, &lease));
  std::shared_ptr<const BuiltGraph> built;
  MAXATTN_RETURN_IF_ERROR(GetGraph(spec, ctx.device, lease->handle(), &built));

  const RowGeometry geometry = Geometry(shape, options, inputs);
  // A ragged call's Stats are token-major: always a fixed copy of the lse.
  const bool fix_lse = geometry.MayHaveEmptyRows() || MaskedByBias(inputs, options) || ragged.active();
  const int64_t rows_bytes = shape.batch * shape.num_q_heads * shape.q_len * static_cast<int64_t>(sizeof(float));
  const bool need_seed = spec.dropout > 0.0f;
  Scratch scratch;
  scratch.Reserve(built->workspace_bytes);
  ragged.Reserve(scratch);
  if (fix_lse) scratch.Reserve(rows_bytes);
  if (grads.dsink) scratch.Reserve(rows_bytes);
  if (need_seed) scratch.Reserve(2 * sizeof(int64_t));
  MAXATTN_RETURN_IF_ERROR(scratch.Allocate(ctx));
  void* workspace = scratch.Take(built->workspace_bytes);
  MAXATTN_RETURN_IF_ERROR(ragged.Build(scratch, ctx.stream));
  float* sink_terms = grads.dsink ? static_cast<float*>(scratch.Take(rows_bytes)) : nullptr;
  const float* lse = saved.lse;
  if (fix_lse) {
    float* fixed = static_cast<float*>(scratch.Take(rows_bytes));
    MAXATTN_RETURN_IF_ERROR(CudaStatus(
        LaunchBackwardLse(saved.lse, fixed, static_cast<int32_t>(shape.batch), static_cast<int32_t>(shape.num_q_heads),
                          static_cast<int32_t>(shape.q_len), ragged.active(), ctx.stream),
        "maxattn lse kernel launch"));
    lse = fixed;
  }
  int64_t* seed = need_seed ? static_cast<int64_t*>(scratch.Take(2 * sizeof(int64_t))) : nullptr;
  MAXATTN_RETURN_IF_ERROR(PrepareDropoutSeed(spec, inputs, seed, ctx.stream));

  std::unordered_map<int64_t, void*> pack = CommonPack(spec, inputs, seed, ragged.layout());
  pack[kUidO] = const_cast<void*>(saved.out);
  pack[kUidDO] = const_cast<void*>(saved.dout);
  pack[kUidStats] = const_cast<float*>(lse);
  pack[kUidDQ] = grads.dq;
  pack[kUidDK] = grads.dk;
  pack[kUidDV] = grads.dv;
  if (spec.want_dbias) pack[kUidDBias] = grads.dbias;
  MAXATTN_RETURN_IF_ERROR(Execute(*built, lease->handle(), pack, workspace));

  if (grads.dsink) {
    MAXATTN_RETURN_IF_ERROR(CudaStatus(
        LaunchSinkGradient(saved.out, saved.dout, inputs.dtype == DType::kFloat16, saved.lse, inputs.sink_logits,
                           sink_terms, grads.dsink, static_cast<int32_t>(shape.batch), static_cast<int32_t>(shape.q_len),
                           static_cast<int32_t>(shape.num_q_heads), static_cast<int32_t>(shape.head_dim_v),
                           ctx.stream),
        "maxattn sink gradient kernel launch"));
  }
  if (ragged.active()) {
    // Tokens outside every running sequence (padding, rows that see no key,
    // poisoned rows) take no part in the result: their gradients are zero.
    const RaggedLayout& l = *ragged.layout();
    const int64_t q_rows = shape.batch * shape.q_len, kv_rows = shape.batch * shape.kv_len;
    for (auto [data, rows, elems, code, keep] :
         {std::tuple{grads.dq, q_rows, shape.num_q_heads * shape.head_dim, l.q_rows, uint8_t{kRowVisible}},
          std::tuple{grads.dk, kv_rows, shape.num_kv_heads * shape.head_dim, l.kv_rows, uint8_t{1}},
          std::tuple{grads.dv, kv_rows, shape.num_kv_heads * shape.head_dim_v, l.kv_rows, uint8_t{1}}}) {
      MAXATTN_RETURN_IF_ERROR(CudaStatus(LaunchZeroRowsExcept(data, rows, elems, code, keep, ctx.stream),
                                         "maxattn zero-rows kernel launch"));
    }
  } else if (spec.masks.padding) {
    // Padded query/key rows take no part in the result: their gradients are zero.
    const int32_t b = static_cast<int32_t>(shape.batch);
    MAXATTN_RETURN_IF_ERROR(CudaStatus(
        LaunchZeroPaddedRows(grads.dq, b, static_cast<int32_t>(shape.q_len), shape.num_q_heads * shape.head_dim,
                             inputs.q_seq_lengths, ctx.stream),
        "maxattn zero-rows kernel launch"));
    MAXATTN_RETURN_IF_ERROR(CudaStatus(
        LaunchZeroPaddedRows(grads.dk, b, static_cast<int32_t>(shape.kv_len), shape.num_kv_heads * shape.head_dim,
                             inputs.kv_seq_lengths, ctx.stream),
        "maxattn zero-rows kernel launch"));
    MAXATTN_RETURN_IF_ERROR(CudaStatus(
        LaunchZeroPaddedRows(grads.dv, b, static_cast<int32_t>(shape.kv_len), shape.num_kv_heads * shape.head_dim_v,
                             inputs.kv_seq_lengths, ctx.stream),
        "maxattn zero-rows kernel launch"));
  }
  return Status::Ok();
}

namespace test_hooks {

int64_t GraphBuilds() { return BuiltGraphCount(); }

void FailNextGraphBuilds(int n) { ArmGraphBuildFaults(n); }

void FailNextWorkspaceAllocations(int n) { g_workspace_faults.Arm(n); }

}  // namespace test_hooks

}  // namespace maxattn::cudnn
