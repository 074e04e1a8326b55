// maxattn sm90: forward kernels for head dim 64 (one file per head dim so the
// instances compile in parallel).
#include "maxattn/sm90/fwd_kernel.h"

MAXATTN_SM90_INSTANTIATE_FORWARD(64, cutlass::bfloat16_t, true);
MAXATTN_SM90_INSTANTIATE_FORWARD(64, cutlass::half_t, true);
// Experiment: the plain (non-overlapped) consumer loop, MAXATTN_SM90_VARIANT=plain.
MAXATTN_SM90_INSTANTIATE_FORWARD(64, cutlass::bfloat16_t, false);
MAXATTN_SM90_INSTANTIATE_FORWARD(64, cutlass::half_t, false);
