// maxattn sm90: the score side of one backward step, shared by both consumer
// main loops (bwd_mainloop_consumer.h, bwd_mainloop_consumer_wide.h). With
// S^T and dP^T issued as the warpgroup's last two WGMMA groups, the step's
// mask is decided while they run (constructor), P^T comes out once S^T
// retires (Probabilities) and dS^T once dP^T does (ScoreGrad), both in the
// element type, in the accumulator layout the next GEMMs read or store.
#ifndef MAXATTN_SM90_BWD_SCORE_STEP_H_
#define MAXATTN_SM90_BWD_SCORE_STEP_H_

#include <cute/tensor.hpp>

#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/mask.h"
#include "maxattn/sm90/softmax.h"

namespace maxattn::sm90 {

// stats[c] = row[query of column c]: a query block's lse*log2(e) or D - dlse
// for the columns (queries) of this thread's S^T tile; cS_rc: its (key, query)
// coordinates as (rows, columns).
template <class TensorC, int kCols>
__device__ __forceinline__ void LoadColumnStats(float (&stats)[kCols], const float* row, const TensorC& cS_rc) {
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) stats[c] = row[cute::get<1>(cS_rc(0, c))];
}

template <class Config>
struct BwdScoreStep {
  BlockMask mask;
  int m0;
  int n0;
  bool need_mask;

  // Query block m of batch row `batch` against the keys from n0. Rebuilt per
  // step from the kernel arguments (constant bank): a row mask kept across the
  // loop would hold eight registers the consumers do not have. With segment
  // ids it reads two summaries.
  __device__ BwdScoreStep(const BwdArgs& a, int batch, int m, int n0_)
      : mask(BlockMask::Make(a, batch, m)), m0(m * Config::kBlockM), n0(n0_) {
    need_mask = mask.template TileNeedsMask<Config::kBlockM, Config::kBlockN>(a, m0, n0) ||
                m0 + Config::kBlockM > mask.q_valid;
  }

  // Waits for S^T (tSrS), writes P^T to rP (the element type, tSrS's layout)
  // with the hidden entries of boundary tiles 0, and leaves in tSrS what
  // ScoreGrad multiplies. Without a cap the mask comes after the exponent
  // (hidden: P = 0, whatever the lse); with one before it (hidden: -inf, which
  // Probabilities turns into 0).
  template <class Grad, class TensorS, class TensorP, class TensorC, int kCols>
  __device__ __forceinline__ void Probabilities(const BwdArgs& a, const Grad& grad, TensorS& tSrS, TensorP& rP,
                                                const TensorC& cS_rc, const float (&lse2)[kCols]) const {
    using namespace cute;
    warpgroup_wait<1>();
    warpgroup_fence_operand(tSrS);
    Tensor s = make_tensor(tSrS.data(), RowColLayout(tSrS.layout()));
    Tensor p = make_tensor(rP.data(), s.layout());
    if constexpr (Config::kSoftcap) {
      if (need_mask) {
        mask.template ApplyTransposed<Config::kBlockM, Config::kBlockN>(a, s, cS_rc, m0, n0, -INFINITY);
        grad.template Probabilities<true>(s, p, lse2);
      } else {
        grad.template Probabilities<false>(s, p, lse2);
      }
    } else {
      grad.Exponentiate(s, lse2);
      if (need_mask) mask.template ApplyTransposed<Config::kBlockM, Config::kBlockN>(a, s, cS_rc, m0, n0, 0.0f);
      Grad::ToElement(s, p);
    }
  }

  // Waits for dP^T (tdPrdP), replaces it by dS^T and writes dS^T to rdS (the element type).
  template <class Grad, class TensorS, class TensorDp, class TensorDs, int kCols>
  __device__ __forceinline__ void ScoreGrad(const Grad& grad, const TensorS& tSrS, TensorDp& tdPrdP, TensorDs& rdS,
                                            const float (&dpsum)[kCols]) const {
    using namespace cute;
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdPrdP);
    Tensor s = make_tensor(tSrS.data(), RowColLayout(tSrS.layout()));
    Tensor dp = make_tensor(tdPrdP.data(), s.layout());
    if (need_mask) grad.template ScoreGrad<true>(s, dp, dpsum);
    else grad.template ScoreGrad<false>(s, dp, dpsum);
    CUTE_UNROLL
    for (int i = 0; i < size(rdS); ++i) rdS(i) = static_cast<typename TensorDs::value_type>(tdPrdP(i));
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_SCORE_STEP_H_
