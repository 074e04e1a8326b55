// maxattn sm90: forward kernels for head dim 128 (one file per head dim so the
// instances compile in parallel).
#include "maxattn/sm90/fwd_kernel.h"

MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(128, false), false);
MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::half_t, maxattn::sm90::ForwardVariant(128, false), false);
