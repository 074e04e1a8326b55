// maxattn sm90: fp32 online softmax over the rows of one consumer thread.
//
// Each consumer thread holds two query rows of its warpgroup's 64-row slab
// (rows r and r+8 of a 16-row warp slice); the four threads of a quad share a
// row. The running maximum is kept on the raw logits q.k (before the scale),
// which is exactly what max_logit needs; the probabilities are
// exp2(s * scale*log2(e) - max * scale*log2(e)), one FFMA and one MUFU.EX2 per
// entry. A row with no visible entry so far has max -inf and uses 0 as its
// exponent offset, so masked entries (-inf) give 0, never NaN. fmaxf drops a
// NaN logit from the max, but the NaN reaches the row sum through exp2, and
// the epilogue reads it there.
//
// With a logit soft cap (kSoftcap) the logit of raw q.k = x is
// cap * tanh(x * scale / cap); tanh is increasing, so the capped row maximum is
// the cap of the raw one and the running maximum stays raw (max_logit is
// pre-cap). Each entry costs one more MUFU (tanh.approx); in a tile that went
// through the mask also a select that keeps masked entries (-inf, whose tanh
// is -1) at probability 0. Elsewhere no entry is -inf but by an infinite
// input, whose capped logit is -cap, as the reference has it. The epilogue's
// lse adds back exactly the offset used here (LogitOfMax).
#ifndef MAXATTN_SM90_SOFTMAX_H_
#define MAXATTN_SM90_SOFTMAX_H_

#include <cute/tensor.hpp>

namespace maxattn::sm90 {

__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float TanhApprox(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe instead of the MUFU unit, for x < 127 (the softmax
// passes x <= 0, or up to kLazyRescaleLog2 with the lazy rescale): x = n + f with
// n = floor(x) (read from the mantissa of x + 1.5 * 2^23, rounded down), 2^f
// on [0, 1) by a degree-3 polynomial (relative error 8.6e-5, below the
// rounding of P to bf16 or fp16) and 2^n as a float built from its exponent
// bits. The clamp keeps a NaN (max.NaN) and sends x < -126 to exactly 0 (n =
// -127 gives the float 0); a NaN x gives NaN through the polynomial.
__device__ __forceinline__ float Exp2Poly(float x) {
  asm("max.NaN.f32 %0, %0, 0fC2FE0000;" : "+f"(x));  // max(x, -127)
  constexpr float kRound = 12582912.0f;            // 1.5 * 2^23
  const float j = __fadd_rd(x, kRound);
  const float f = x - (j - kRound);
  const float p = fmaf(fmaf(fmaf(0.07706213f, f, 0.22764884f), f, 0.69511681f), f, 1.0f);
  const float two_n = __int_as_float((__float_as_int(j) << 23) + 0x3f800000);
  return p * two_n;
}

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Reorders an SM90 accumulator fragment ((2, 2, V), MMA_M, MMA_N) into
// (rows, cols) = ((2, MMA_M), (2, V, MMA_N)): mode 1 of the value triple is the
// +8 row step, modes 0 and 2 walk the columns.
template <class Layout>
__host__ __device__ constexpr auto RowColLayout(Layout l) {
  using namespace cute;
  auto v = get<0>(l);
  return make_layout(make_layout(get<1>(v), get<1>(l)), make_layout(get<0>(v), get<2>(v), get<2>(l)));
}

// Scale factors of the softmax: scale_log2 = scale * log2(e); with a soft cap
// also cap_in = scale / cap, cap_log2 = cap * log2(e), cap.
struct SoftmaxScales {
  float scale = 1.0f;
  float scale_log2 = 1.0f;
  float cap = 0.0f;
  float cap_in = 0.0f;
  float cap_log2 = 0.0f;
};

// kLazy (kernel_config.h, MAXATTN_SM90_LAZY_RESCALE): the exponent offset of a row stays where
// it is until the row's maximum exceeds it by more than kLazyRescaleLog2 (log2 units), so that
// P <= 2^8 (exact in the element type's range; the row sum and O are fp32) and a key block whose
// maxima grew by less in every row of the warp leaves O and the row sums unscaled: Update sets
// `rescale` false (warp-uniform) and Rescale, a multiply per accumulator element, returns at
// once. The offsets that were used are kept apart from the maxima (max_logit needs those).
inline constexpr float kLazyRescaleLog2 = 8.0f;

// kPoly: how many of every 4 columns of a thread's tile take Exp2Poly instead of the MUFU exp2
// (each instance's count: kernel_config.h, ForwardExp2Poly).
template <int kRows, bool kSoftcap = false, int kPoly = 0, bool kLazy = false>
struct OnlineSoftmax {
  float row_max[kRows];  // raw logits (unscaled), quad-uniform
  float row_sum[kRows];  // this thread's partial sum until Finalize()
  // kLazy: the exponent offset each row uses now (log2 units; meaningless while row_max is -inf),
  // and whether the last Update moved any row's offset in this warp (then O needs Rescale).
  float row_offset[kLazy ? kRows : 1];
  bool rescale = true;
  SoftmaxScales k;

  __device__ explicit OnlineSoftmax(const SoftmaxScales& scales) : k(scales) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
      if constexpr (kLazy) row_offset[r] = 0.0f;
    }
  }

  // The logit of raw q.k = x in log2 units (-inf stays -inf).
  __device__ __forceinline__ float Log2Logit(float x) const {
    if constexpr (kSoftcap) return x == -INFINITY ? -INFINITY : TanhApprox(x * k.cap_in) * k.cap_log2;
    else return x * k.scale_log2;
  }

  // The logit (natural units) of a row's raw maximum m, as the exponents used
  // it: what the epilogue adds to log(sum) for the lse.
  __device__ __forceinline__ float LogitOfMax(float m) const {
    if constexpr (kSoftcap) return TanhApprox(m * k.cap_in) * k.cap;
    else return m * k.scale;
  }

  // The logit (natural units) that row r's exponents are relative to: its
  // maximum's, or with kLazy the offset last set (sum >= 1 either way: the
  // maximum's own term is exp2(>= 0)).
  __device__ __forceinline__ float RowLogit(int r) const {
    if constexpr (kLazy) return row_offset[r] * 0.69314718f;  // ln 2
    else return LogitOfMax(row_max[r]);
  }

  // Row r's running maximum after the tile s: its own and the tile's, across the quad.
  template <class TensorS>
  __device__ __forceinline__ float NewRowMax(const TensorS& s, int r) const {
    float m = row_max[r];
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(s); ++c) m = fmaxf(m, s(r, c));
    return QuadMax(m);
  }

  // s: (rows, cols) raw logits of one tile, replaced by unnormalised
  // probabilities. Returns in `correction` the factor by which the output
  // accumulator must be rescaled for the new row maxima (see Rescale).
  // kMasked: the tile went through the mask (only the soft cap reads it).
  template <bool kMasked, class TensorS>
  __device__ void Update(TensorS& s, float (&correction)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
    if constexpr (kLazy) {
      // New maxima first, then one vote on whether any row of the warp moves its offset: a row
      // that saw nothing so far (no entry is in its sum or O) takes its maximum's as is.
      bool grow = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float m = NewRowMax(s, r);
        const float target = m == -INFINITY ? 0.0f : Log2Logit(m);
        const bool fresh = row_max[r] == -INFINITY;  // nothing in its sum or O yet
        grow = grow | fresh | (target > row_offset[r] + kLazyRescaleLog2);
        if (fresh) row_offset[r] = -INFINITY;  // so its correction is 0 (fresh implies the vote)
        correction[r] = target;  // until the vote
        row_max[r] = m;
      }
      rescale = __any_sync(0xffffffffu, grow);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (rescale) {
          const float target = correction[r];
          correction[r] = Exp2Approx(row_offset[r] - target);  // <= 1; 0 for a fresh row
          row_offset[r] = target;
        }
      }
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float offset;
      if constexpr (kLazy) {
        offset = row_offset[r];
      } else {
        const float m = NewRowMax(s, r);
        offset = m == -INFINITY ? 0.0f : Log2Logit(m);
        correction[r] = Exp2Approx(Log2Logit(row_max[r]) - offset);
        row_max[r] = m;
      }
      float sum = 0.0f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const bool poly = (c % 4) < kPoly;  // compile-time after unrolling
        if constexpr (kSoftcap) {
          const float x = s(r, c);
          const float y = fmaf(TanhApprox(x * k.cap_in), k.cap_log2, -offset);
          const float p = poly ? Exp2Poly(y) : Exp2Approx(y);
          s(r, c) = kMasked && x == -INFINITY ? 0.0f : p;
        } else {
          const float y = fmaf(s(r, c), k.scale_log2, -offset);
          s(r, c) = poly ? Exp2Poly(y) : Exp2Approx(y);
        }
        sum += s(r, c);
      }
      if constexpr (kLazy) row_sum[r] = rescale ? fmaf(row_sum[r], correction[r], sum) : row_sum[r] + sum;
      else row_sum[r] = fmaf(row_sum[r], correction[r], sum);
    }
  }

  // O rescaled by Update's corrections; with kLazy only when that Update moved an offset of
  // the warp (otherwise every correction is 1).
  template <class TensorO>
  __device__ void Rescale(TensorO& o, const float (&correction)[kRows]) const {
    using namespace cute;
    if constexpr (kLazy) {
      if (!rescale) return;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction[r];
    }
  }

  // Completes the row sums across the quad.
  __device__ void Finalize() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) row_sum[r] = QuadSum(row_sum[r]);
  }
};

// The backward's softmax: probabilities recomputed from the forward's lse,
// on S^T (rows = keys, columns = queries: each column has its own statistic).
// With lse2 = lse * log2(e) (+inf for a row past T or with nothing visible,
// which gives 0 everywhere; the mask hides rows past the valid length),
//   P  = exp2(s * scale*log2(e) - lse2)                    (plain)
//   P  = exp2(tanh(s * scale/cap) * cap*log2(e) - lse2)    (soft cap; masked -> 0)
// and the gradient of the logits before the cap, with D = rowsum(dO o O) - dlse,
//   dS = P * (dP - D)             (plain)
//   dS = P * (1 - t^2) * (dP - D) (soft cap, t = tanh(s * scale/cap))
// The scale of the raw scores q.k is applied to dK and dQ at the end.
template <bool kSoftcap>
struct SoftmaxGrad {
  SoftmaxScales k;

  // Without a cap: s (raw scores of a (rows, cols) view) becomes P in place;
  // lse2[c]: the column's lse*log2(e). No mask here: on a boundary tile the
  // caller then sets the hidden entries to 0 (BwdScoreStep), which holds even
  // where the row's lse is NaN (a NaN query row must not reach the dV or dQ of
  // keys it does not see; dK: docs/contract.md) and costs one select per
  // element instead of a -inf before the exponent and a compare and select
  // after it. ToElement then converts P for the dV GEMM.
  template <class TensorS, int kCols>
  __device__ __forceinline__ void Exponentiate(TensorS& s, const float (&lse2)[kCols]) const {
    static_assert(!kSoftcap, "a soft cap needs P and P * (1 - t^2): Probabilities");
    using namespace cute;
    static_assert(decltype(size<1>(s))::value == kCols);
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s); ++r) s(r, c) = Exp2Approx(fmaf(s(r, c), k.scale_log2, -lse2[c]));
    }
  }

  // P for the dV GEMM, converted in the registers' own order: neighbouring elements (two
  // columns of one row) pack into one 32-bit register as the GEMM reads them. Converted in
  // the loops' column-major order, the compiler paired rows r and r + 8 and re-paired them
  // with 16 PRMTs per step.
  template <class TensorS, class TensorP>
  __device__ __forceinline__ static void ToElement(const TensorS& s, TensorP& p) {
    using Element = typename TensorP::value_type;
    CUTE_UNROLL
    for (int i = 0; i < cute::size(s); ++i) p.data()[i] = static_cast<Element>(s.data()[i]);
  }

  // With a cap: s holds raw scores (masked entries -inf); writes P to p (the
  // element type, for the dV GEMM) and leaves P * (1 - t^2) in s for
  // ScoreGrad. kMasked: the tile went through the mask, so a -inf score gives
  // P = 0, also where the row's lse is NaN, and despite tanh(-inf) = -1.
  // Elsewhere a -inf score comes only from an infinite input, whose capped
  // logit is -cap (the forward's choice too).
  template <bool kMasked, class TensorS, class TensorP, int kCols>
  __device__ __forceinline__ void Probabilities(TensorS& s, TensorP& p, const float (&lse2)[kCols]) const {
    static_assert(kSoftcap, "without a cap: Exponentiate, the mask, ToElement");
    using namespace cute;
    using Element = typename TensorP::value_type;
    static_assert(decltype(size<1>(s))::value == kCols);
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        const float x = s(r, c);
        const float t = TanhApprox(x * k.cap_in);
        float prob = Exp2Approx(fmaf(t, k.cap_log2, -lse2[c]));
        if constexpr (kMasked) prob = x == -INFINITY ? 0.0f : prob;
        s(r, c) = prob * fmaf(-t, t, 1.0f);
        p(r, c) = static_cast<Element>(prob);
      }
    }
  }

  // dp: dP of the same view, replaced by dS; s: what Probabilities left;
  // dpsum[c]: the column's D - dlse. kMasked: a masked entry (P = 0) gets dS =
  // 0 even where dP or D is not finite (NaN or inf in a padding row of V or
  // dO must not reach dQ or dK through 0 * NaN).
  template <bool kMasked, class TensorS, class TensorDp, int kCols>
  __device__ __forceinline__ static void ScoreGrad(const TensorS& s, TensorDp& dp, const float (&dpsum)[kCols]) {
    using namespace cute;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        const float ds = s(r, c) * (dp(r, c) - dpsum[c]);
        dp(r, c) = kMasked && s(r, c) == 0.0f ? 0.0f : ds;
      }
    }
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_SOFTMAX_H_
