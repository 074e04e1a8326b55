// maxattn sm90: issuing one warpgroup-wide WGMMA GEMM from CuTe fragments,
// shared by the forward and backward consumers.
#ifndef MAXATTN_SM90_GEMM_H_
#define MAXATTN_SM90_GEMM_H_

#include <cute/tensor.hpp>

namespace maxattn::sm90 {

// Issues one warpgroup-wide GEMM over the K mode of the fragments
// (asynchronous: the caller waits with warpgroup_wait<n>() and then fences
// the accumulator before touching it).
template <bool kZeroInit, bool kARegisters, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void IssueGemm(TiledMma& mma, TensorA& a, const TensorB& b, TensorC& c) {
  using namespace cute;
  if constexpr (kARegisters) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_GEMM_H_
