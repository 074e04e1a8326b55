// maxattn sm90: forward kernels for head dim 256 with a logit soft cap (own file
// so the instances compile in parallel).
#include "maxattn/sm90/fwd_kernel.h"

MAXATTN_SM90_INSTANTIATE_FORWARD(256, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(256, true), true);
MAXATTN_SM90_INSTANTIATE_FORWARD(256, cutlass::half_t, maxattn::sm90::ForwardVariant(256, true), true);
