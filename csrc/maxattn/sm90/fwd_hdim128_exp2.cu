// maxattn sm90: EXPERIMENT, head dim 128 only: the persistent-CTA variant
// (MAXATTN_SM90_VARIANT=persistent), kept while it is compared on the H200.
#include "maxattn/sm90/fwd_kernel.h"

MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::bfloat16_t, maxattn::sm90::kPersistent);
MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::half_t, maxattn::sm90::kPersistent);
