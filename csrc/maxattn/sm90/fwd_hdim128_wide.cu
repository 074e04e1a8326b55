// maxattn sm90: forward kernels for head dim 128 with 160-key blocks, for calls
// without a causal mask, window, segment ids or soft cap (kWideKeyBlockSize,
// kernel_config.h; chosen by UsesWideKeyBlocks, sm90_attention.cu).
#include "maxattn/sm90/fwd_kernel.h"

MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(128, false), false,
                                 maxattn::sm90::kWideKeyBlockSize);
MAXATTN_SM90_INSTANTIATE_FORWARD(128, cutlass::half_t, maxattn::sm90::ForwardVariant(128, false), false,
                                 maxattn::sm90::kWideKeyBlockSize);
