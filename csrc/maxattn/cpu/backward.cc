// CPU backward: dQ, dK, dV, dBias from the saved lse, recomputing the logits
// tile by tile (FlashAttention-2 style).
//
// One task = (batch b, kv head): it exclusively owns dK/dV of that kv head and
// dQ rows of its G query heads, so those need no synchronisation. dQ is
// accumulated in a float scratch [G, T, H] of the task (the one O(T) buffer);
// everything else is O(tile). Tiles are laid out as in the forward
// (transposed [kv, q]), and all five products are the same GEMM kernel:
//   St  = K Qsᵀ          (logits; Qs = scale * Q)
//   dPt = V dOᵀ
//   dV += Pᵀ dO          dK += dSᵀ Qs          dQ += dS K   (times scale at the end)
// with dS = P * (dP - D + dlse) * softcap'(s), D_i = <dout_i, out_i>.
// dBias: when tasks share dbias entries (bias broadcast over b or n across kv
// heads) each participating thread accumulates into its own float buffer and
// the buffers are summed at the end; otherwise tasks write disjoint slices.
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
namespace {

struct BackwardContext {
  AttentionShape shape;
  AttentionOptions options;
  AttentionInputs inputs;
  BackwardInputs saved;
  BackwardOutputs grads;
  BroadcastStrides bias_strides;  // of the dbias layout (= bias_dims)
  bool shared_dbias = false;      // tasks overlap in dbias: use per-slot buffers
  int64_t dbias_size = 0;
  std::vector<AlignedBuffer>* slot_dbias = nullptr;
};

template <class Isa>
MAXATTN_ALWAYS_INLINE void BackwardTask(const BackwardContext& ctx, int64_t task, int slot) {
  using kernels::Gemm;
  using kernels::GemmMode;
  const AttentionShape& sh = ctx.shape;
  const AttentionInputs& in = ctx.inputs;
  const DType dt = in.dtype;
  const int64_t T = sh.q_len, S = sh.kv_len, N = sh.num_q_heads, K = sh.num_kv_heads;
  const int64_t H = sh.head_dim, Hv = sh.head_dim_v;
  const int64_t G = N / K;
  const int64_t kvh = task % K, b = task / K;
  const int64_t Hp = RoundUp(H, 16), Hvp = RoundUp(Hv, 16);
  constexpr int64_t Bq = kBlockQ, Bk = kBlockKv;
  const float scale = ctx.options.scale, softcap = ctx.options.softcap;
  const RowVisibility vis(sh, ctx.options, in, b);
  const int64_t num_q_tiles = CeilDiv(T, Bq);

  float* dbias = nullptr;
  if (ctx.grads.dbias != nullptr) {
    if (ctx.shared_dbias) {
      AlignedBuffer& buf = (*ctx.slot_dbias)[static_cast<size_t>(slot)];
      if (buf.size() == 0) buf.Resize(ctx.dbias_size);  // zeroed; only this slot's thread
      dbias = buf.data();
    } else {
      dbias = ctx.grads.dbias;
    }
  }

  // D[g, i] - dlse[g, i], and the usable lse (+inf for empty rows so that
  // exp(s - lse) is 0 without evaluating -inf - -inf).
  std::vector<float> dd(static_cast<size_t>(G * T)), lse_use(static_cast<size_t>(G * T));
  {
    std::vector<float> o(static_cast<size_t>(Hv)), d_o(static_cast<size_t>(Hv));
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = kvh * G + g;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t e = ((b * T + i) * N + n) * Hv;
        LoadRow(dt, ElemPtr(ctx.saved.out, dt, e), Hv, o.data());
        LoadRow(dt, ElemPtr(ctx.saved.dout, dt, e), Hv, d_o.data());
        float d = 0.0f;
        for (int64_t h = 0; h < Hv; ++h) d += o[static_cast<size_t>(h)] * d_o[static_cast<size_t>(h)];
        const int64_t li = (b * N + n) * T + i;
        if (ctx.saved.dlse != nullptr) d -= ctx.saved.dlse[li];
        const size_t idx = static_cast<size_t>(g * T + i);
        dd[idx] = d;
        const float lse = ctx.saved.lse[li];
        lse_use[idx] = lse == -kInf ? kInf : lse;
      }
      if (ctx.grads.dsink != nullptr) {
        // dsink[b, n] = -sum_i p_sink(i) * (D_i - dlse_i), p_sink(i) = exp(sink - lse_i).
        const float sink = in.sink_logits != nullptr ? in.sink_logits[n] : -kInf;
        float acc = 0.0f;
        if (!(sink == -kInf)) {
          for (int64_t i = 0; i < T; ++i) {
            const size_t idx = static_cast<size_t>(g * T + i);
            acc -= std::exp(sink - lse_use[idx]) * dd[idx];
          }
        }
        ctx.grads.dsink[b * N + n] = acc;
      }
    }
  }
  const bool dropout = ctx.options.dropout_rate > 0.0f;
  const uint32_t drop_threshold = dropout ? DropoutThreshold(ctx.options.dropout_rate) : 0u;
  const float drop_scale = dropout ? 1.0f / (1.0f - ctx.options.dropout_rate) : 1.0f;
  std::vector<unsigned char> keep(dropout ? static_cast<size_t>(Bk * Bq) : 0, 0);
  AlignedBuffer pzt(dropout ? Bk * Bq : 0);  // dropped probabilities P * Z, transposed

  AlignedBuffer dq_acc(G * T * Hp);
  AlignedBuffer k_buf(Bk * Hp), v_buf(Bk * Hvp), dk_acc(Bk * Hp), dv_acc(Bk * Hvp);
  AlignedBuffer q_rows(Bq * Hp), q_t(std::max<int64_t>(H, 1) * Bq);
  AlignedBuffer do_rows(Bq * Hvp), do_t(std::max<int64_t>(Hv, 1) * Bq);
  AlignedBuffer st(Bk * Bq), dpt(Bk * Bq), capgrad(softcap > 0.0f ? Bk * Bq : 0);
  std::vector<unsigned char> visible(static_cast<size_t>(Bk * Bq));
  std::vector<float> out_row(static_cast<size_t>(std::max(Hp, Hvp)));

  for (int64_t j0 = 0; j0 < S; j0 += Bk) {
    const int64_t kc = std::min(Bk, S - j0);
    bool packed = false;
    dk_acc.Zero();
    dv_acc.Zero();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = kvh * G + g;
      for (int64_t qt = 0; qt < num_q_tiles; ++qt) {
        const int64_t i0 = qt * Bq, rows = std::min(Bq, T - i0);
        const TileClass cls = vis.Classify(i0, i0 + rows, j0, j0 + kc);
        if (cls == TileClass::kInvisible) continue;
        if (!packed) {  // K, V rows of this kv tile, zero-padded to Hp / Hvp
          k_buf.Zero();
          v_buf.Zero();
          PackRows(dt, in.k, (b * S + j0) * K * H + kvh * H, K * H, kc, H, 1.0f, k_buf.data(), Hp);
          PackRows(dt, in.v, (b * S + j0) * K * Hv + kvh * Hv, K * Hv, kc, Hv, 1.0f, v_buf.data(),
                   Hvp);
          packed = true;
        }
        // Q (scaled) and dO tiles, as rows and transposed. Padding rows are 0.
        q_rows.Zero();
        do_rows.Zero();
        const int64_t q_first = ((b * T + i0) * N + n) * H;
        const int64_t o_first = ((b * T + i0) * N + n) * Hv;
        PackRows(dt, in.q, q_first, N * H, rows, H, scale, q_rows.data(), Hp);
        PackRows(dt, ctx.saved.dout, o_first, N * Hv, rows, Hv, 1.0f, do_rows.data(), Hvp);
        Transpose(q_rows.data(), Bq, H, Hp, q_t.data(), Bq);
        Transpose(do_rows.data(), Bq, Hv, Hvp, do_t.data(), Bq);

        float* s = st.data();
        float* dp = dpt.data();
        Gemm<Isa>(kc, Bq, H, k_buf.data(), Hp, 1, q_t.data(), Bq, s, Bq, GemmMode::kOverwrite,
                  nullptr);
        if (in.bias != nullptr) {
          const BroadcastStrides& bs = ctx.bias_strides;
          const float* bias = in.bias + bs.Offset(b, n, i0, j0);
          for (int64_t jj = 0; jj < kc; ++jj) {
            for (int64_t r = 0; r < rows; ++r) s[jj * Bq + r] += bias[r * bs.t + jj * bs.s];
          }
        }
        const bool partial = cls == TileClass::kPartial || rows < Bq;
        if (partial) {
          std::fill(visible.begin(), visible.end(), 0);
          bool vis_row[Bk];
          for (int64_t r = 0; r < rows; ++r) {
            vis.RowMask(n, i0 + r, j0, kc, vis_row);
            for (int64_t jj = 0; jj < kc; ++jj) visible[static_cast<size_t>(jj * Bq + r)] = vis_row[jj];
          }
        }
        const int64_t count = kc * Bq;
        if (softcap > 0.0f) {
          const float inv = 1.0f / softcap;
          float* cg = capgrad.data();
          for (int64_t e = 0; e < count; ++e) {
            const float t = std::tanh(s[e] * inv);
            cg[e] = 1.0f - t * t;
            s[e] = softcap * t;
          }
        }
        if (partial) {
          for (int64_t e = 0; e < count; ++e) s[e] = visible[static_cast<size_t>(e)] ? s[e] : -kInf;
        }
        // P[j, i] = exp(logit - lse_i).
        const float* lse_tile = lse_use.data() + g * T + i0;
        const float* dd_tile = dd.data() + g * T + i0;
        float lse_r[Bq], dd_r[Bq];
        for (int64_t r = 0; r < Bq; ++r) {
          lse_r[r] = r < rows ? lse_tile[r] : kInf;
          dd_r[r] = r < rows ? dd_tile[r] : 0.0f;
        }
        for (int64_t jj = 0; jj < kc; ++jj) {
          float* srow = s + jj * Bq;
          for (int64_t r = 0; r < Bq; ++r) srow[r] = kernels::FastExp(srow[r] - lse_r[r]);
        }
        // dPt = V dOᵀ;  dV += Pᵀ dO.
        Gemm<Isa>(kc, Bq, Hv, v_buf.data(), Hvp, 1, do_t.data(), Bq, dp, Bq, GemmMode::kOverwrite,
                  nullptr);
        if (dropout) {
          // Z = keep / (1 - rate): dV += (P Z)ᵀ dO and dP = Z (V dOᵀ).
          std::fill(keep.begin(), keep.end(), 0);
          DropoutKeepTile(in.dropout_seed, drop_threshold, b, n, i0, rows, j0, kc, Bq, keep.data());
          float* pz = pzt.data();
          for (int64_t e = 0; e < count; ++e) {
            const bool kept = keep[static_cast<size_t>(e)] != 0;
            pz[e] = kept ? s[e] * drop_scale : 0.0f;
            dp[e] = kept ? dp[e] * drop_scale : 0.0f;
          }
          Gemm<Isa>(kc, Hvp, rows, pz, Bq, 1, do_rows.data(), Hvp, dv_acc.data(), Hvp,
                    GemmMode::kAccumulate, nullptr);
        } else {
          Gemm<Isa>(kc, Hvp, rows, s, Bq, 1, do_rows.data(), Hvp, dv_acc.data(), Hvp,
                    GemmMode::kAccumulate, nullptr);
        }
        // dS (in place of P).
        for (int64_t jj = 0; jj < kc; ++jj) {
          float* srow = s + jj * Bq;
          const float* dprow = dp + jj * Bq;
          for (int64_t r = 0; r < Bq; ++r) srow[r] = srow[r] * (dprow[r] - dd_r[r]);
        }
        // Entries with P == 0 must stay exactly 0 even if dP is inf/NaN.
        for (int64_t e = 0; e < count; ++e) {
          if (partial && !visible[static_cast<size_t>(e)]) s[e] = 0.0f;
        }
        if (softcap > 0.0f) {
          const float* cg = capgrad.data();
          for (int64_t e = 0; e < count; ++e) s[e] *= cg[e];
        }
        if (dbias != nullptr) {
          const BroadcastStrides& bs = ctx.bias_strides;
          float* db = dbias + bs.Offset(b, n, i0, j0);
          for (int64_t jj = 0; jj < kc; ++jj) {
            for (int64_t r = 0; r < rows; ++r) db[r * bs.t + jj * bs.s] += s[jj * Bq + r];
          }
        }
        // dK += dSᵀ Qs;  dQ += dS K.
        Gemm<Isa>(kc, Hp, rows, s, Bq, 1, q_rows.data(), Hp, dk_acc.data(), Hp,
                  GemmMode::kAccumulate, nullptr);
        Gemm<Isa>(rows, Hp, kc, s, 1, Bq, k_buf.data(), Hp, dq_acc.data() + (g * T + i0) * Hp, Hp,
                  GemmMode::kAccumulate, nullptr);
      }
    }
    for (int64_t jj = 0; jj < kc; ++jj) {
      const int64_t j = j0 + jj;
      StoreRow(dt, dk_acc.data() + jj * Hp, H, ElemPtr(ctx.grads.dk, dt, ((b * S + j) * K + kvh) * H));
      StoreRow(dt, dv_acc.data() + jj * Hvp, Hv,
               ElemPtr(ctx.grads.dv, dt, ((b * S + j) * K + kvh) * Hv));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = kvh * G + g;
    for (int64_t i = 0; i < T; ++i) {
      StoreRowScaled(dt, dq_acc.data() + (g * T + i) * Hp, H, scale, out_row.data(),
                     ElemPtr(ctx.grads.dq, dt, ((b * T + i) * N + n) * H));
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi2"))) void BackwardTaskAvx512(
    const BackwardContext& ctx, int64_t task, int slot) {
  BackwardTask<IsaAvx512>(ctx, task, slot);
}
__attribute__((target("avx2,fma,bmi2"))) void BackwardTaskAvx2(const BackwardContext& ctx,
                                                               int64_t task, int slot) {
  BackwardTask<IsaAvx2>(ctx, task, slot);
}
#endif
void BackwardTaskGeneric(const BackwardContext& ctx, int64_t task, int slot) {
  BackwardTask<IsaGeneric>(ctx, task, slot);
}

Status BackwardImpl(const AttentionShape& shape, const AttentionOptions& options,
                    const AttentionInputs& inputs, const BackwardInputs& saved,
                    const BackwardOutputs& grads) {
  const int64_t B = shape.batch, K = shape.num_kv_heads;
  BackwardContext ctx;
  ctx.shape = shape;
  ctx.options = options;
  ctx.inputs = inputs;
  ctx.saved = saved;
  ctx.grads = grads;
  const BroadcastDims& d = inputs.bias_dims;
  ctx.dbias_size = d.b * d.n * d.t * d.s;
  if (grads.dbias != nullptr) {
    std::fill_n(grads.dbias, ctx.dbias_size, 0.0f);
    ctx.bias_strides = BroadcastStrides(d, shape);
  } else if (inputs.bias != nullptr) {
    ctx.bias_strides = BroadcastStrides(d, shape);
  }
  if (B == 0 || K == 0 || shape.num_q_heads == 0) return Status::Ok();
  // Zero-sized buffers may legitimately be null; anything else must be given.
  if (shape.q_len > 0 && (saved.lse == nullptr || saved.out == nullptr || saved.dout == nullptr)) {
    return Status::InvalidArgument("backward needs the saved out, dout and lse (got null)");
  }
  ctx.shared_dbias =
      grads.dbias != nullptr && ((d.b == 1 && B > 1) || (d.n == 1 && K > 1));
  std::vector<AlignedBuffer> slot_dbias(
      static_cast<size_t>(ctx.shared_dbias ? MaxParallelSlots() : 0));
  ctx.slot_dbias = &slot_dbias;

  void (*fn)(const BackwardContext&, int64_t, int) = BackwardTaskGeneric;
#if defined(__x86_64__) || defined(__i386__)
  switch (DetectIsa()) {
    case IsaLevel::kAvx512: fn = BackwardTaskAvx512; break;
    case IsaLevel::kAvx2: fn = BackwardTaskAvx2; break;
    case IsaLevel::kGeneric: break;
  }
#endif
  ParallelFor(B * K, [&](int64_t task, int slot) { fn(ctx, task, slot); });

  if (ctx.shared_dbias) {
    for (const AlignedBuffer& buf : slot_dbias) {
      if (buf.size() == 0) continue;
      const float* src = buf.data();
      for (int64_t e = 0; e < ctx.dbias_size; ++e) grads.dbias[e] += src[e];
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace cpu

Status AttentionBackwardCpu(const AttentionShape& shape, const AttentionOptions& options,
                            const AttentionInputs& inputs, const BackwardInputs& saved,
                            const BackwardOutputs& grads) {
  return cpu::Guarded("AttentionBackwardCpu", shape, options, inputs,
                      [&] { return cpu::BackwardImpl(shape, options, inputs, saved, grads); });
}

}  // namespace maxattn
