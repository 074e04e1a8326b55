// Hot inner kernels of the CPU backend: a register-blocked GEMM micro-kernel
// and a vectorisable exp. Everything here is always_inline and target-neutral,
// so it is compiled once per ISA inside the target("...") entry points of
// forward.cc / backward.cc (runtime dispatch via DetectIsa): the portable build
// still runs AVX2 / AVX-512 code on machines that have it.
#ifndef MAXATTN_CPU_KERNELS_H_
#define MAXATTN_CPU_KERNELS_H_

#include <bit>
#include <cstdint>

#define MAXATTN_ALWAYS_INLINE inline __attribute__((always_inline))

namespace maxattn::cpu {

// Register blocking per ISA: kMR rows x (16 * kNV) columns of C live in
// registers. AVX-512: 6 x 32 = 12 zmm; AVX2: 6 x 16 = 12 ymm (+2 B + 1 A of
// 16 registers); generic (SSE2): 2 x 16 = 8 xmm.
struct IsaAvx512 { static constexpr int kMR = 6, kNV = 2; };
struct IsaAvx2 { static constexpr int kMR = 6, kNV = 1; };
struct IsaGeneric { static constexpr int kMR = 2, kNV = 1; };

enum class IsaLevel { kGeneric, kAvx2, kAvx512 };
IsaLevel DetectIsa();  // cached; defined in forward.cc

namespace kernels {

// 16 floats; GCC lowers it to one zmm, two ymm or four xmm per target. The
// unaligned, may_alias variant is only used for memory access.
typedef float V16 __attribute__((vector_size(64)));
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));

enum class GemmMode { kOverwrite, kAccumulate, kScaleAccumulate };

// C[r, 0:16*NV] (op)= sum_k A(r, k) * B[k, 0:16*NV] for r < R, where
// A(r, k) = A[r * a_rs + k * a_ks] (any strides: A is read as scalars) and B, C
// are row-major with leading dims ldb, ldc. kScaleAccumulate first multiplies
// row r of C by row_scale[r].
template <int R, int NV>
MAXATTN_ALWAYS_INLINE void MicroKernel(int64_t K, const float* A, int64_t a_rs, int64_t a_ks,
                                       const float* B, int64_t ldb, float* C, int64_t ldc,
                                       GemmMode mode, const float* row_scale) {
  V16 acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if (mode == GemmMode::kOverwrite) {
        acc[r][v] = V16{};
      } else {
        acc[r][v] = *reinterpret_cast<const V16u*>(C + r * ldc + 16 * v);
        if (mode == GemmMode::kScaleAccumulate) acc[r][v] *= row_scale[r];
      }
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    V16 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = *reinterpret_cast<const V16u*>(b + 16 * v);
    const float* a = A + k * a_ks;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float ar = a[r * a_rs];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += ar * bv[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) *reinterpret_cast<V16u*>(C + r * ldc + 16 * v) = acc[r][v];
  }
}

// C[M, N] (op)= A[M, K] * B[K, N] with the addressing of MicroKernel.
// N must be a multiple of 16 (callers pad C and B columns); M is arbitrary.
template <class Isa>
MAXATTN_ALWAYS_INLINE void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs,
                                int64_t a_ks, const float* B, int64_t ldb, float* C, int64_t ldc,
                                GemmMode mode, const float* row_scale) {
  constexpr int MR = Isa::kMR, NV = Isa::kNV;
  int64_t i = 0;
  for (; i + MR <= M; i += MR) {
    const float* a = A + i * a_rs;
    float* c = C + i * ldc;
    const float* rs = row_scale != nullptr ? row_scale + i : nullptr;
    int64_t j = 0;
    for (; j + 16 * NV <= N; j += 16 * NV) {
      MicroKernel<MR, NV>(K, a, a_rs, a_ks, B + j, ldb, c + j, ldc, mode, rs);
    }
    for (; j < N; j += 16) MicroKernel<MR, 1>(K, a, a_rs, a_ks, B + j, ldb, c + j, ldc, mode, rs);
  }
  for (; i < M; ++i) {
    const float* a = A + i * a_rs;
    float* c = C + i * ldc;
    const float* rs = row_scale != nullptr ? row_scale + i : nullptr;
    int64_t j = 0;
    for (; j + 16 * NV <= N; j += 16 * NV) {
      MicroKernel<1, NV>(K, a, a_rs, a_ks, B + j, ldb, c + j, ldc, mode, rs);
    }
    for (; j < N; j += 16) MicroKernel<1, 1>(K, a, a_rs, a_ks, B + j, ldb, c + j, ldc, mode, rs);
  }
}

// exp(x) to ~1 ulp for x in [-87.5, 88]; 0 below (exp(-87.5) ~ 1e-38, below
// that the result would be subnormal and is flushed: irrelevant next to the
// softmax maximum, which contributes exp(0) = 1). -inf -> 0, NaN -> NaN.
// Branch-free so that loops calling it vectorise. Cephes-style: x = n ln2 + r,
// |r| <= ln2/2, degree-6 polynomial, 2^n by building the exponent bits.
MAXATTN_ALWAYS_INLINE float FastExp(float x) {
  const float c = x < -87.5f ? -87.5f : (x > 88.0f ? 88.0f : x);  // NaN stays NaN
  // Round c*log2(e) to an integer by adding 1.5*2^23; the low bits of t hold n.
  const float t = c * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // n in [-126, 127]: (bits(t) << 23) == n << 23 (mod 2^32).
  const uint32_t pow2 = (std::bit_cast<uint32_t>(t) << 23) + (127u << 23);
  const float e = p * std::bit_cast<float>(pow2);
  return x < -87.5f ? 0.0f : e;
}

}  // namespace kernels
}  // namespace maxattn::cpu

#endif  // MAXATTN_CPU_KERNELS_H_
