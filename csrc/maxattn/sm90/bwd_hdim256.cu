// maxattn sm90: backward kernels for head dim 256 (one file per head dim and
// soft cap so the instances compile in parallel).
#include "maxattn/sm90/bwd_kernel.h"

MAXATTN_SM90_INSTANTIATE_BACKWARD(256, cutlass::bfloat16_t, false);
MAXATTN_SM90_INSTANTIATE_BACKWARD(256, cutlass::half_t, false);
