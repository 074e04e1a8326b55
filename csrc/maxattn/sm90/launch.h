// maxattn sm90: the per-instance launchers (defined in fwd_kernel.h and
// bwd_kernel.h, instantiated in fwd_hdim*.cu and bwd_hdim*.cu, bf16 and fp16
// each).
#ifndef MAXATTN_SM90_LAUNCH_H_
#define MAXATTN_SM90_LAUNCH_H_

#include <cuda_runtime.h>

#include "maxattn/attention.h"
#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/kernel_config.h"

namespace maxattn::sm90 {

template <int kHeadDim, class Element, int kVariant, bool kSoftcap>
Status LaunchForward(const FwdArgs& args, const void* q, const void* k, const void* v, cudaStream_t stream);

// The main backward kernel (the pre- and post-passes are bwd_prepost.h's).
template <int kHeadDim, class Element, bool kSoftcap>
Status LaunchBackward(const BwdArgs& args, const void* q, const void* k, const void* v, const void* dout,
                      cudaStream_t stream);

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_LAUNCH_H_
