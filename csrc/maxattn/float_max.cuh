// NaN-propagating float max for CUDA kernels, and its atomic form for
// reducing max_logit over many blocks into one fp32 buffer.
//
// The atomic orders floats through their bit patterns: non-negative values
// by signed-int atomicMax, negative ones by unsigned atomicMin. NaN is stored
// as 0x7fffffff, the largest signed int, so it wins against every value and
// stays. The buffer must first have every byte set to kAtomicMaxEmptyByte
// (0xff): -1 as an int (below every non-negative float) and the largest
// unsigned (above every negative float), so the first value, -inf included,
// always replaces it. Every block that owns a slot must issue its atomic
// (-inf when it saw nothing), so the sentinel never survives a launch.
#ifndef MAXATTN_FLOAT_MAX_CUH_
#define MAXATTN_FLOAT_MAX_CUH_

namespace maxattn {

// The byte a max_logit buffer is filled with before the first AtomicMaxFloat.
inline constexpr int kAtomicMaxEmptyByte = 0xff;

// max(a, b), NaN when either is NaN.
__device__ __forceinline__ float NanMax(float a, float b) {
  return (a != a || b != b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
}

// *address = NanMax(*address, value), atomically (see the header comment):
// one reduction that returns nothing (NaN becomes 0x7fffffff, so it takes the
// signed max with the non-negative values).
__device__ __forceinline__ void AtomicMaxFloat(float* address, float value) {
  const int bits = value != value ? 0x7fffffff : __float_as_int(value);
  if (bits >= 0) {
    asm volatile("red.relaxed.gpu.global.max.s32 [%0], %1;" ::"l"(address), "r"(bits) : "memory");
  } else {
    asm volatile("red.relaxed.gpu.global.min.u32 [%0], %1;" ::"l"(address), "r"(bits) : "memory");
  }
}

}  // namespace maxattn

#endif  // MAXATTN_FLOAT_MAX_CUH_
