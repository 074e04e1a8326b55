// CPU forward: tiled flash attention with online softmax.
//
// One task = (batch b, query head n, query tile of kBlockQ rows). The task
// keeps its query tile transposed (QT [H, Bq], pre-scaled) and walks the kv
// tiles that can be visible, computing the logits tile transposed,
// St[j, i] = <k_j, q_i * scale>, so that K rows are read straight from the
// input (no packing for float32) and every per-query-row softmax statistic
// (running max m, sum l) is a vector over i: the softmax updates are plain
// elementwise loops that the compiler vectorises. Extra memory per task is
// O(tile); the T x S matrix never exists.
#include <algorithm>
#include <cmath>
#include <exception>
#include <new>
#include <vector>

#include "maxattn/attention.h"
#include "maxattn/cpu/aligned_buffer.h"
#include "maxattn/cpu/common.h"
#include "maxattn/cpu/kernels.h"
#include "maxattn/cpu/row_store.h"
#include "maxattn/cpu/thread_pool.h"
#include "maxattn/cpu/visibility.h"
#include "maxattn/dropout.h"

namespace maxattn {
namespace cpu {

IsaLevel DetectIsa() {
#if defined(__x86_64__) || defined(__i386__)
  static const IsaLevel level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return IsaLevel::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return IsaLevel::kAvx2;
    return IsaLevel::kGeneric;
  }();
  return level;
#else
  return IsaLevel::kGeneric;
#endif
}

namespace {

struct ForwardContext {
  AttentionShape shape;
  AttentionOptions options;
  AttentionInputs inputs;
  ForwardOutputs outputs;
  int64_t num_q_tiles = 0;
  BroadcastStrides bias_strides;
  // Per task: max of the visible pre-softcap logits, and whether one was NaN.
  std::vector<float>* task_max = nullptr;
  std::vector<unsigned char>* task_nan = nullptr;
};

template <class Isa>
MAXATTN_ALWAYS_INLINE void ForwardTask(const ForwardContext& ctx, int64_t task) {
  using kernels::Gemm;
  using kernels::GemmMode;
  const AttentionShape& sh = ctx.shape;
  const AttentionInputs& in = ctx.inputs;
  const int64_t T = sh.q_len, S = sh.kv_len, N = sh.num_q_heads, K = sh.num_kv_heads;
  const int64_t H = sh.head_dim, Hv = sh.head_dim_v;
  const int64_t G = N / K;
  const int64_t qt = task % ctx.num_q_tiles;
  const int64_t n = (task / ctx.num_q_tiles) % N;
  const int64_t b = task / ctx.num_q_tiles / N;
  const int64_t kvh = n / G;
  const int64_t i0 = qt * kBlockQ;
  const int64_t rows = std::min(kBlockQ, T - i0);
  constexpr int64_t Bq = kBlockQ, Bk = kBlockKv;
  const int64_t Hvp = RoundUp(Hv, 16);
  const float softcap = ctx.options.softcap;
  const bool dropout = ctx.options.dropout_rate > 0.0f;
  const uint32_t drop_threshold = dropout ? DropoutThreshold(ctx.options.dropout_rate) : 0u;

  const RowVisibility vis(sh, ctx.options, in, b);
  int64_t lo, hi;
  vis.RowsRange(i0, i0 + rows, &lo, &hi);

  AlignedBuffer out_acc(Bq * Hvp);  // O [Bq, Hvp]
  float m[Bq], l[Bq], alpha[Bq], msub[Bq], tile_max[Bq];
  unsigned char tile_nan[Bq];
  for (int64_t r = 0; r < Bq; ++r) {
    m[r] = -kInf;
    l[r] = 0.0f;
    tile_max[r] = -kInf;
    tile_nan[r] = 0;
  }

  if (lo < hi) {
    // Q tile, scaled, transposed: QT[h, r]. Padding rows stay 0.
    AlignedBuffer q_rows(Bq * std::max<int64_t>(H, 1));
    AlignedBuffer qt_buf(std::max<int64_t>(H, 1) * Bq);
    PackRows(in.dtype, in.q, ((b * T + i0) * N + n) * H, N * H, rows, H, ctx.options.scale,
             q_rows.data(), H);
    Transpose(q_rows.data(), rows, H, H, qt_buf.data(), Bq);

    AlignedBuffer st(Bk * Bq);  // logits / probabilities, transposed [j, i]
    std::vector<unsigned char> visible;
    const bool direct_k = in.dtype == DType::kFloat32;
    const bool direct_v = in.dtype == DType::kFloat32 && Hv % 16 == 0;
    AlignedBuffer k_buf(direct_k ? 0 : Bk * H);
    AlignedBuffer v_buf(direct_v ? 0 : Bk * Hvp);
    std::vector<unsigned char> keep(dropout ? static_cast<size_t>(Bk * Bq) : 0, 0);

    for (int64_t j0 = lo / Bk * Bk; j0 < hi; j0 += Bk) {
      const int64_t kc = std::min(Bk, S - j0);
      const TileClass cls = vis.Classify(i0, i0 + rows, j0, j0 + kc);
      if (cls == TileClass::kInvisible) continue;

      // St[j, i] = <k_j, scale * q_i>.
      const float* a;
      int64_t a_rs;
      const int64_t k_first = (b * S + j0) * K * H + kvh * H;
      if (direct_k) {
        a = static_cast<const float*>(in.k) + k_first;
        a_rs = K * H;
      } else {
        PackRows(in.dtype, in.k, k_first, K * H, kc, H, 1.0f, k_buf.data(), H);
        a = k_buf.data();
        a_rs = H;
      }
      float* s = st.data();
      Gemm<Isa>(kc, Bq, H, a, a_rs, 1, qt_buf.data(), Bq, s, Bq, GemmMode::kOverwrite, nullptr);

      if (in.bias != nullptr) {
        const BroadcastStrides& bs = ctx.bias_strides;
        const float* bias = in.bias + bs.Offset(b, n, i0, j0);
        for (int64_t jj = 0; jj < kc; ++jj) {
          for (int64_t r = 0; r < rows; ++r) s[jj * Bq + r] += bias[r * bs.t + jj * bs.s];
        }
      }
      const bool partial = cls == TileClass::kPartial || rows < Bq;
      if (partial) {
        visible.assign(static_cast<size_t>(kc * Bq), 0);
        unsigned char row_vis[Bk];
        bool vis_row[Bk];
        for (int64_t r = 0; r < rows; ++r) {
          vis.RowMask(n, i0 + r, j0, kc, vis_row);
          for (int64_t jj = 0; jj < kc; ++jj) row_vis[jj] = vis_row[jj] ? 1 : 0;
          for (int64_t jj = 0; jj < kc; ++jj) visible[jj * Bq + r] = row_vis[jj];
        }
        for (int64_t e = 0; e < kc * Bq; ++e) s[e] = visible[e] ? s[e] : -kInf;
      }
      // max_logit: over visible s before softcap (invisible are -inf now).
      for (int64_t jj = 0; jj < kc; ++jj) {
        const float* srow = s + jj * Bq;
        for (int64_t r = 0; r < Bq; ++r) {
          const float x = srow[r];
          tile_max[r] = x > tile_max[r] ? x : tile_max[r];
          tile_nan[r] |= static_cast<unsigned char>(x != x);
        }
      }
      if (softcap > 0.0f) {
        const float inv = 1.0f / softcap;
        for (int64_t e = 0; e < kc * Bq; ++e) s[e] = softcap * std::tanh(s[e] * inv);
        // tanh maps -inf to -softcap; masked entries must stay -inf.
        if (partial) {
          for (int64_t e = 0; e < kc * Bq; ++e) s[e] = visible[e] ? s[e] : -kInf;
        }
      }
      // Online softmax, vectorised over the query rows i.
      float col_max[Bq];
      for (int64_t r = 0; r < Bq; ++r) col_max[r] = m[r];
      for (int64_t jj = 0; jj < kc; ++jj) {
        const float* srow = s + jj * Bq;
        for (int64_t r = 0; r < Bq; ++r) col_max[r] = srow[r] > col_max[r] ? srow[r] : col_max[r];
      }
      for (int64_t r = 0; r < Bq; ++r) {
        const bool none = col_max[r] == -kInf;  // nothing visible yet: avoid -inf - -inf
        msub[r] = none ? 0.0f : col_max[r];
        alpha[r] = none ? 1.0f : kernels::FastExp(m[r] - col_max[r]);
        m[r] = col_max[r];
      }
      float col_sum[Bq] = {};
      for (int64_t jj = 0; jj < kc; ++jj) {
        float* srow = s + jj * Bq;
        for (int64_t r = 0; r < Bq; ++r) {
          const float p = kernels::FastExp(srow[r] - msub[r]);
          srow[r] = p;
          col_sum[r] += p;
        }
      }
      for (int64_t r = 0; r < Bq; ++r) l[r] = l[r] * alpha[r] + col_sum[r];
      if (dropout) {  // drop after the denominator: dropout acts on normalised probabilities
        DropoutKeepTile(in.dropout_seed, drop_threshold, b, n, i0, rows, j0, kc, Bq, keep.data());
        for (int64_t e = 0; e < kc * Bq; ++e) s[e] = keep[static_cast<size_t>(e)] ? s[e] : 0.0f;
      }

      // O = diag(alpha) O + P V, with P[i, j] = St[j, i].
      const float* v;
      int64_t ldv;
      const int64_t v_first = (b * S + j0) * K * Hv + kvh * Hv;
      if (direct_v) {
        v = static_cast<const float*>(in.v) + v_first;
        ldv = K * Hv;
      } else {
        PackRows(in.dtype, in.v, v_first, K * Hv, kc, Hv, 1.0f, v_buf.data(), Hvp);
        v = v_buf.data();
        ldv = Hvp;
      }
      Gemm<Isa>(rows, Hvp, kc, s, 1, Bq, v, ldv, out_acc.data(), Hvp, GemmMode::kScaleAccumulate,
                alpha);
    }
  }

  // Epilogue: normalise and store rows; lse; this task's max_logit share.
  std::vector<float> row(static_cast<size_t>(std::max<int64_t>(Hv, 1)));
  const float sink = in.sink_logits != nullptr ? in.sink_logits[n] : -kInf;
  const bool has_sink = !(sink == -kInf);  // a NaN sink propagates
  const float drop_scale = dropout ? 1.0f / (1.0f - ctx.options.dropout_rate) : 1.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    // A row with a visible NaN logit is NaN (as in the reference), even when every visible
    // logit is NaN and the running max therefore never left -inf.
    const bool nan_row = tile_nan[r] != 0;
    const bool empty = m[r] == -kInf && !nan_row;
    float inv, lse;
    if (!has_sink) {
      inv = empty ? 0.0f : 1.0f / l[r];
      lse = empty ? -kInf : m[r] + std::log(l[r]);
    } else if (empty) {
      inv = 0.0f;
      lse = sink;
    } else {
      // Denominator l * e^m + e^sink, evaluated relative to M = max(m, sink).
      const float mm = std::max(m[r], sink);
      const float a = std::exp(m[r] - mm);
      const float l2 = l[r] * a + std::exp(sink - mm);
      inv = a / l2;
      lse = mm + std::log(l2);
    }
    if (nan_row) inv = lse = kNaN;
    if (dropout) inv *= drop_scale;
    float* o = out_acc.data() + r * Hvp;
    if (empty) std::fill_n(o, Hv, 0.0f);  // inv is 0, but o may hold 0 * inf = NaN
    StoreRowScaled(in.dtype, o, Hv, inv, row.data(),
                   ElemPtr(ctx.outputs.out, in.dtype, ((b * T + i) * N + n) * Hv));
    if (ctx.outputs.lse != nullptr) ctx.outputs.lse[(b * N + n) * T + i] = lse;
  }
  float tmax = -kInf;
  bool tnan = false;
  for (int64_t r = 0; r < Bq; ++r) {
    tmax = std::max(tmax, tile_max[r]);
    tnan = tnan || tile_nan[r] != 0;
  }
  (*ctx.task_max)[static_cast<size_t>(task)] = tmax;
  (*ctx.task_nan)[static_cast<size_t>(task)] = tnan ? 1 : 0;
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi2"))) void ForwardTaskAvx512(
    const ForwardContext& ctx, int64_t task) {
  ForwardTask<IsaAvx512>(ctx, task);
}
__attribute__((target("avx2,fma,bmi2"))) void ForwardTaskAvx2(const ForwardContext& ctx,
                                                              int64_t task) {
  ForwardTask<IsaAvx2>(ctx, task);
}
#endif
void ForwardTaskGeneric(const ForwardContext& ctx, int64_t task) {
  ForwardTask<IsaGeneric>(ctx, task);
}

Status ForwardImpl(const AttentionShape& shape, const AttentionOptions& options,
                   const AttentionInputs& inputs, const ForwardOutputs& outputs) {
  const int64_t B = shape.batch, T = shape.q_len, N = shape.num_q_heads;
  if (outputs.max_logit != nullptr) std::fill_n(outputs.max_logit, B * N, -kInf);
  if (B == 0 || N == 0 || T == 0) return Status::Ok();

  ForwardContext ctx;
  ctx.shape = shape;
  ctx.options = options;
  ctx.inputs = inputs;
  ctx.outputs = outputs;
  ctx.num_q_tiles = CeilDiv(T, kBlockQ);
  if (inputs.bias != nullptr) ctx.bias_strides = BroadcastStrides(inputs.bias_dims, shape);
  const int64_t num_tasks = B * N * ctx.num_q_tiles;
  std::vector<float> task_max(static_cast<size_t>(num_tasks), -kInf);
  std::vector<unsigned char> task_nan(static_cast<size_t>(num_tasks), 0);
  ctx.task_max = &task_max;
  ctx.task_nan = &task_nan;

  void (*fn)(const ForwardContext&, int64_t) = ForwardTaskGeneric;
#if defined(__x86_64__) || defined(__i386__)
  switch (DetectIsa()) {
    case IsaLevel::kAvx512: fn = ForwardTaskAvx512; break;
    case IsaLevel::kAvx2: fn = ForwardTaskAvx2; break;
    case IsaLevel::kGeneric: break;
  }
#endif
  ParallelFor(num_tasks, [&](int64_t task, int) { fn(ctx, task); });

  if (outputs.max_logit != nullptr) {
    // Deterministic reduction over the query tiles of each (b, n).
    for (int64_t bn = 0; bn < B * N; ++bn) {
      float mx = -kInf;
      bool nan = false;
      for (int64_t t = 0; t < ctx.num_q_tiles; ++t) {
        const size_t idx = static_cast<size_t>(bn * ctx.num_q_tiles + t);
        mx = std::max(mx, task_max[idx]);
        nan = nan || task_nan[idx] != 0;
      }
      outputs.max_logit[bn] = nan ? kNaN : mx;
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace cpu

Status AttentionForwardCpu(const AttentionShape& shape, const AttentionOptions& options,
                           const AttentionInputs& inputs, const ForwardOutputs& outputs) {
  return cpu::Guarded("AttentionForwardCpu", shape, options, inputs,
                      [&] { return cpu::ForwardImpl(shape, options, inputs, outputs); });
}

}  // namespace maxattn
