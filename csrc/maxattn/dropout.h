// Counter-based dropout mask shared by every backend and by the pure-JAX
// reference (python/maxattn/_src/reference.py implements the same function
// in uint32 jnp arithmetic; the two must stay bit-identical).
//
//   keep(b, n, i, j) = Philox4x32-10(counter = (j >> 2, i, n + head_offset, b + batch_offset),
//                                    key = (seed0, seed1))[j & 3] >= threshold
//   threshold        = DropoutThreshold(rate) = min(floor(double(rate) * 2^32), 2^32 - 1)
//
// seed = {seed0, seed1, batch_offset, head_offset}: the first two words come
// from the JAX PRNG key (jax.random.bits(key, (2,), uint32)); the offsets
// give the global (batch, head) index of a shard's block so that a sharded
// call draws the same mask as the unsharded one.
#ifndef MAXATTN_DROPOUT_H_
#define MAXATTN_DROPOUT_H_

#include <cstdint>

namespace maxattn {

struct Philox4x32 {
  uint32_t v[4];
};

inline Philox4x32 Philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

inline uint32_t DropoutThreshold(float rate) {
  const double t = static_cast<double>(rate) * 4294967296.0;
  if (!(t > 0.0)) return 0u;
  if (t >= 4294967295.0) return 0xFFFFFFFFu;
  return static_cast<uint32_t>(t);
}

// The 32 random bits of element (b, n, i, j) (local indices; the offsets of
// `seed` are added here).
inline uint32_t DropoutBits(const uint32_t* seed, int64_t b, int64_t n, int64_t i, int64_t j) {
  const Philox4x32 r = Philox4x32_10(static_cast<uint32_t>(j >> 2), static_cast<uint32_t>(i),
                                     static_cast<uint32_t>(n) + seed[3],
                                     static_cast<uint32_t>(b) + seed[2], seed[0], seed[1]);
  return r.v[j & 3];
}

// keep[jj * ld + r] = 1 if element (b, n, i0 + r, j0 + jj) is kept, for
// r < rows, jj < cols (the transposed [kv, q] tile layout of the CPU kernels).
inline void DropoutKeepTile(const uint32_t* seed, uint32_t threshold, int64_t b, int64_t n, int64_t i0,
                            int64_t rows, int64_t j0, int64_t cols, int64_t ld, unsigned char* keep) {
  const uint32_t cn = static_cast<uint32_t>(n) + seed[3], cb = static_cast<uint32_t>(b) + seed[2];
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t ci = static_cast<uint32_t>(i0 + r);
    int64_t jj = 0;
    while (jj < cols) {
      const int64_t j = j0 + jj;
      const Philox4x32 x = Philox4x32_10(static_cast<uint32_t>(j >> 2), ci, cn, cb, seed[0], seed[1]);
      for (int64_t w = j & 3; w < 4 && jj < cols; ++w, ++jj) {
        keep[jj * ld + r] = x.v[w] >= threshold ? 1 : 0;
      }
    }
  }
}

}  // namespace maxattn

#endif  // MAXATTN_DROPOUT_H_
