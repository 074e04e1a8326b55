// maxattn sm90: EXPERIMENT, head dim 128 only: the other consumer-loop
// variants (MAXATTN_SM90_VARIANT=plain|pingpong), kept while they are compared
// on the H200 and removed once one is chosen.
#include "maxattn/sm90/fwd_kernel.h"

MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::bfloat16_t, maxattn::sm90::kPlain);
MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::half_t, maxattn::sm90::kPlain);
MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::bfloat16_t, maxattn::sm90::kPingPong);
MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::half_t, maxattn::sm90::kPingPong);
