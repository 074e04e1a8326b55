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
// pre-cap). Each entry costs one more MUFU (tanh.approx) and a select that
// keeps masked entries (-inf, whose tanh is -1) at probability 0. The
// epilogue's lse adds back exactly the offset used here (LogitOfMax).
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

template <int kRows, bool kSoftcap = false>
struct OnlineSoftmax {
  float row_max[kRows];  // raw logits (unscaled), quad-uniform
  float row_sum[kRows];  // this thread's partial sum until Finalize()
  SoftmaxScales k;

  __device__ explicit OnlineSoftmax(const SoftmaxScales& scales) : k(scales) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
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

  // s: (rows, cols) raw logits of one tile, replaced by unnormalised
  // probabilities. Returns in `correction` the factor by which the output
  // accumulator must be rescaled for the new row maxima (see Rescale).
  template <class TensorS>
  __device__ void Update(TensorS& s, float (&correction)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) m = fmaxf(m, s(r, c));
      m = QuadMax(m);
      const float offset = m == -INFINITY ? 0.0f : Log2Logit(m);
      correction[r] = Exp2Approx(Log2Logit(row_max[r]) - offset);
      row_max[r] = m;
      float sum = 0.0f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        if constexpr (kSoftcap) {
          const float x = s(r, c);
          const float p = Exp2Approx(fmaf(TanhApprox(x * k.cap_in), k.cap_log2, -offset));
          s(r, c) = x == -INFINITY ? 0.0f : p;
        } else {
          s(r, c) = Exp2Approx(fmaf(s(r, c), k.scale_log2, -offset));
        }
        sum += s(r, c);
      }
      row_sum[r] = fmaf(row_sum[r], correction[r], sum);
    }
  }

  template <class TensorO>
  __device__ static void Rescale(TensorO& o, const float (&correction)[kRows]) {
    using namespace cute;
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

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_SOFTMAX_H_
