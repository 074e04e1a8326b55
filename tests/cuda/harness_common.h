// Shared pieces of the standalone sm90 GPU harnesses (sm90_fwd_harness.cu,
// sm90_bwd_harness.cu): a case description, its visibility rule (the float64
// references' copy of attention.h's), input drawing, device buffers and the
// workspace arena the library allocates from.
#ifndef MAXATTN_TESTS_CUDA_HARNESS_COMMON_H_
#define MAXATTN_TESTS_CUDA_HARNESS_COMMON_H_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "maxattn/attention.h"
#include "maxattn/device_context.h"

namespace harness {

using maxattn::AttentionInputs;
using maxattn::AttentionOptions;
using maxattn::AttentionShape;
using maxattn::CausalAlignment;
using maxattn::DType;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInf32 = std::numeric_limits<float>::infinity();

#define CUDA_OK(expr)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (expr);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__,     \
                   __LINE__, cudaGetErrorString(e_));                                          \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

struct Case {
  Case(std::string name_, int B_, int T_, int S_, int N_, int K_, int H_, DType dtype_ = DType::kBFloat16,
       bool causal_ = false, bool bottom_right_ = false, int wl_ = -1, int wr_ = -1)
      : name(std::move(name_)), B(B_), T(T_), S(S_), N(N_), K(K_), H(H_), dtype(dtype_), causal(causal_),
        bottom_right(bottom_right_), wl(wl_), wr(wr_) {}
  std::string name;
  int B, T, S, N, K, H;
  DType dtype;
  bool causal;
  bool bottom_right;
  int wl, wr;
  std::vector<int> q_lens, kv_lens;  // empty: none
  bool spike = false;                // one large logit in the last batch row
  bool nan = false;                  // one NaN in a query row of batch 0, head N-1
  float softcap = 0.0f;              // > 0: logit soft cap
  float q_gain = 1.0f;               // q drawn from [-q_gain, q_gain] (large logits for the soft cap)
  std::vector<int> q_seg, kv_seg;    // segment ids [B*T], [B*S] (0 = padding); empty: none
  std::vector<float> sink;           // per-head sink logits [N]; empty: vanilla softmax
};

// One batch row of segment ids: runs of the given lengths with ids first, first + 1, ...
// (an id of 0 in `ids` instead marks that run as padding), each row appended to `out`.
inline void AppendRuns(std::vector<int>& out, const std::vector<int>& lengths, const std::vector<int>& ids) {
  for (size_t r = 0; r < lengths.size(); ++r) out.insert(out.end(), lengths[r], ids[r]);
}

inline uint16_t ToBits(float x, DType t) {
  if (t == DType::kBFloat16) {
    const __nv_bfloat16_raw r = __float2bfloat16_rn(x);
    return r.x;
  }
  const __half_raw r = __float2half_rn(x);
  return r.x;
}

inline float FromBits(uint16_t u, DType t) {
  if (t == DType::kBFloat16) {
    __nv_bfloat16_raw r;
    r.x = u;
    return __bfloat162float(__nv_bfloat16(r));
  }
  __half_raw r;
  r.x = u;
  return __half2float(__half(r));
}

struct Visibility {
  int q_valid, kv_valid, d;
  bool causal;
  int wl, wr;
  const int* qs = nullptr;  // this row's segment ids, or null
  const int* ks = nullptr;
  bool operator()(int i, int j) const {
    if (i >= q_valid || j >= kv_valid) return false;
    if (qs != nullptr && (qs[i] == 0 || qs[i] != ks[j])) return false;
    if (causal && j > i + d) return false;
    if (wl >= 0 && j < i + d - wl) return false;
    if (wr >= 0 && j > i + d + wr) return false;
    return true;
  }
};

inline Visibility VisFor(const Case& c, int b) {
  Visibility v;
  v.q_valid = c.q_lens.empty() ? c.T : std::min(std::max(c.q_lens[b], 0), c.T);
  v.kv_valid = c.kv_lens.empty() ? c.S : std::min(std::max(c.kv_lens[b], 0), c.S);
  v.d = c.bottom_right ? v.kv_valid - v.q_valid : 0;
  v.causal = c.causal;
  v.wl = c.wl;
  v.wr = c.wr;
  if (!c.q_seg.empty()) {
    v.qs = c.q_seg.data() + static_cast<size_t>(b) * c.T;
    v.ks = c.kv_seg.data() + static_cast<size_t>(b) * c.S;
  }
  return v;
}

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(n) {
    if (n) CUDA_OK(cudaMalloc(&ptr, n * sizeof(T)));
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  size_t bytes() const { return count * sizeof(T); }
};

// The workspace the library asks for (DeviceContext::allocate): one block, reused by later
// calls on the same stream (they run in order) and grown when a call asks for more. With
// poison, every hand-out is first filled with 0xff bytes (NaN as fp32, -1 as int), so a kernel
// that reads workspace it did not initialise (a dQ accumulator not zeroed, a counter not reset)
// fails the numerics instead of passing on leftovers; the timed runs leave it off.
struct ScratchArena {
  void* block = nullptr;
  size_t size = 0;
  bool poison = false;
  ScratchArena() = default;
  ScratchArena(const ScratchArena&) = delete;
  ScratchArena& operator=(const ScratchArena&) = delete;
  ~ScratchArena() {
    if (block != nullptr) {
      cudaDeviceSynchronize();
      cudaFree(block);
    }
  }
  maxattn::DeviceContext Context() {
    maxattn::DeviceContext ctx;
    ctx.allocate = [this](size_t bytes) -> void* {
      if (bytes > size) {
        if (block != nullptr) {
          cudaDeviceSynchronize();
          cudaFree(block);
        }
        block = nullptr;
        size = 0;
        if (cudaMalloc(&block, bytes) != cudaSuccess) return nullptr;
        size = bytes;
      }
      // The legacy default stream orders this before the library's work on a blocking stream.
      if (poison && bytes > 0 && cudaMemset(block, 0xff, bytes) != cudaSuccess) return nullptr;
      return block;
    };
    return ctx;
  }
};

inline const char* DTypeName(DType t) { return t == DType::kBFloat16 ? "bf16" : "fp16"; }


// Runs work(i) for i in [0, jobs) on every core.
template <class Work>
void ParallelFor(int jobs, Work&& work) {
  const int nthreads = std::max(1u, std::min(std::thread::hardware_concurrency(), 64u));
  std::vector<std::thread> pool;
  for (int t = 0; t < nthreads; ++t) {
    pool.emplace_back([&, t] {
      for (int i = t; i < jobs; i += nthreads) work(i);
    });
  }
  for (auto& th : pool) th.join();
}

// One case's inputs: q, k, v as the element type's bits and as the floats they
// round to (what the references compute with), drawn from [-1, 1] (q times
// q_gain), with the case's spike and NaN planted.
struct HostInputs {
  std::vector<uint16_t> q_bits, k_bits, v_bits;
  std::vector<float> q, k, v;
};

inline HostInputs DrawInputs(const Case& c, std::mt19937_64& rng) {
  const int B = c.B, T = c.T, S = c.S, N = c.N, K = c.K, H = c.H;
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const size_t nq = static_cast<size_t>(B) * T * N * H, nk = static_cast<size_t>(B) * S * K * H;
  HostInputs in;
  auto draw = [&](std::vector<uint16_t>& bits, std::vector<float>& f, size_t n, float gain) {
    bits.resize(n);
    f.resize(n);
    for (size_t i = 0; i < n; ++i) {
      bits[i] = ToBits(uni(rng) * gain, c.dtype);
      f[i] = FromBits(bits[i], c.dtype);
    }
  };
  draw(in.q_bits, in.q, nq, 1.0f);
  if (c.q_gain != 1.0f) {
    for (size_t i = 0; i < nq; ++i) {
      in.q_bits[i] = ToBits(in.q[i] * c.q_gain, c.dtype);
      in.q[i] = FromBits(in.q_bits[i], c.dtype);
    }
  }
  draw(in.k_bits, in.k, nk, 1.0f);
  draw(in.v_bits, in.v, nk, 1.0f);
  const int G = N / K;
  if (c.spike) {  // q row = 3 * a visible k row: a logit far above the rest, in batch row B-1 only
    const int b = B - 1, n = N / 2;
    const Visibility vis = VisFor(c, b);
    for (int i = vis.q_valid - 1; i >= 0; --i) {
      int j0 = -1;
      for (int j = 0; j < S && j0 < 0; ++j) if (vis(i, j)) j0 = j;
      if (j0 < 0) continue;
      for (int h = 0; h < H; ++h) {
        const size_t qi = ((static_cast<size_t>(b) * T + i) * N + n) * H + h;
        const size_t ki = ((static_cast<size_t>(b) * S + j0) * K + n / G) * H + h;
        in.q_bits[qi] = ToBits(3.0f * in.k[ki], c.dtype);
        in.q[qi] = FromBits(in.q_bits[qi], c.dtype);
      }
      break;
    }
  }
  if (c.nan) {
    const int b = 0, n = N - 1;
    const Visibility vis = VisFor(c, b);
    const int i = vis.q_valid / 2;
    const size_t qi = ((static_cast<size_t>(b) * T + i) * N + n) * H + 3;
    in.q_bits[qi] = ToBits(std::nanf(""), c.dtype);
    in.q[qi] = std::nanf("");
  }
  return in;
}

template <class T>
void Upload(DeviceBuffer<T>& dst, const std::vector<T>& src) {
  if (!src.empty()) CUDA_OK(cudaMemcpy(dst.ptr, src.data(), dst.bytes(), cudaMemcpyHostToDevice));
}

template <class T>
std::vector<T> Download(const DeviceBuffer<T>& src) {
  std::vector<T> v(src.count);
  if (!v.empty()) CUDA_OK(cudaMemcpy(v.data(), src.ptr, src.bytes(), cudaMemcpyDeviceToHost));
  return v;
}

// A case on the device: its inputs uploaded and the library's description of the call.
struct DeviceCall {
  DeviceBuffer<uint16_t> q, k, v;
  DeviceBuffer<int32_t> q_lens, kv_lens, q_seg, kv_seg;
  DeviceBuffer<float> sink;
  AttentionShape shape;
  AttentionOptions options;
  AttentionInputs inputs;

  DeviceCall(const Case& c, const HostInputs& h)
      : q(h.q_bits.size()), k(h.k_bits.size()), v(h.v_bits.size()), q_lens(c.q_lens.size()),
        kv_lens(c.kv_lens.size()), q_seg(c.q_seg.size()), kv_seg(c.kv_seg.size()), sink(c.sink.size()) {
    Upload(q, h.q_bits);
    Upload(k, h.k_bits);
    Upload(v, h.v_bits);
    Upload(q_lens, std::vector<int32_t>(c.q_lens.begin(), c.q_lens.end()));
    Upload(kv_lens, std::vector<int32_t>(c.kv_lens.begin(), c.kv_lens.end()));
    Upload(q_seg, std::vector<int32_t>(c.q_seg.begin(), c.q_seg.end()));
    Upload(kv_seg, std::vector<int32_t>(c.kv_seg.begin(), c.kv_seg.end()));
    Upload(sink, c.sink);
    shape.batch = c.B; shape.q_len = c.T; shape.kv_len = c.S; shape.num_q_heads = c.N;
    shape.num_kv_heads = c.K; shape.head_dim = c.H; shape.head_dim_v = c.H;
    options.scale = static_cast<float>(Scale(c));
    options.causal = c.causal;
    options.alignment = c.bottom_right ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
    options.window_left = c.wl;
    options.window_right = c.wr;
    options.softcap = c.softcap;
    inputs.dtype = c.dtype; inputs.q = q.ptr; inputs.k = k.ptr; inputs.v = v.ptr;
    inputs.q_seq_lengths = c.q_lens.empty() ? nullptr : q_lens.ptr;
    inputs.kv_seq_lengths = c.kv_lens.empty() ? nullptr : kv_lens.ptr;
    inputs.q_segment_ids = c.q_seg.empty() ? nullptr : q_seg.ptr;
    inputs.kv_segment_ids = c.kv_seg.empty() ? nullptr : kv_seg.ptr;
    inputs.sink_logits = c.sink.empty() ? nullptr : sink.ptr;
  }

  static double Scale(const Case& c) { return 1.0 / std::sqrt(static_cast<double>(c.H)); }
};

// ||got - ref|| / ||ref|| over the entries where neither is NaN (||got - ref|| when ref is 0),
// and how many entries are NaN in one but not the other.
struct RelError {
  double rel = 0;
  size_t nan_mismatch = 0;
};

// extra_nan_ok: a NaN where the reference is finite is not a mismatch (a NaN
// query row reaches dK of keys it does not see through the tile GEMM).
template <class Got>
RelError RelL2(const std::vector<Got>& got, const std::vector<double>& ref, DType t, bool extra_nan_ok = false) {
  double num = 0, den = 0;
  RelError e;
  if (got.size() != ref.size()) {  // a harness bug, reported as a failure rather than read out of bounds
    e.rel = INFINITY;
    return e;
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    double g;
    if constexpr (std::is_same_v<Got, uint16_t>) g = FromBits(got[i], t);
    else g = got[i];
    const double r = ref[i];
    if (std::isnan(r) || std::isnan(g)) {
      e.nan_mismatch += extra_nan_ok ? std::isnan(r) && !std::isnan(g) : std::isnan(r) != std::isnan(g);
      continue;
    }
    num += (g - r) * (g - r);
    den += r * r;
  }
  e.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

__global__ inline void RandomFill(uint16_t* x, size_t n, uint32_t seed, bool bf16) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    const float f = (h & 0xffffff) * (2.0f / 16777216.0f) - 1.0f;
    if (bf16) {
      const __nv_bfloat16_raw r = __float2bfloat16_rn(f);
      x[i] = r.x;
    } else {
      const __half_raw r = __float2half_rn(f);
      x[i] = r.x;
    }
  }
}


}  // namespace harness

#endif  // MAXATTN_TESTS_CUDA_HARNESS_COMMON_H_
