// Host-only checks of CuTe layout facts the sm90 backward relies on (no GPU
// needed; CI runs it after the CUDA compile-and-link check).
//
// The backward's consumers take the shared-memory operand partitions of their
// GEMMs (the WGMMA descriptors) from the thread slice of their warpgroup's
// first thread, so the descriptors are warp-uniform and live in uniform
// registers (bwd_mainloop_consumer.h). That is only right if every thread of a
// warpgroup gets the same partition as its first thread -- checked here for
// each operand and head dim, together with the converse for S^T's A operand
// (the two warpgroups own different keys, so theirs must differ).
// The head-dim-256 backward (bwd_config_wide.h, bwd_mainloop_consumer_wide.h):
// the same uniformity (with its P^T / dS^T operand), the two warpgroups'
// split (queries of S^T, columns of dK, dV and dQ), and that its dQ GEMMs,
// one per 128-column half, land where the post-pass reads them: element i of
// a thread's 64 is (row, column) of the whole-H partition, and the first 8192
// elements of K's tile are its first 128 columns.
// Also: the persistent forward's tile sequence is a bijection onto the tiles,
// longest first within each L2 section (tile_scheduler.h), and its out tile
// (epilogue.h) and the backward's dK and dV (bwd_epilogue.h) are staged by
// stmatrix at the accumulator's coordinates, the forward's P V reads P from the S accumulator's
// registers in their order (at every key block width), and the forward's per-query-block mask
// decision (BlockMask::UnmaskedKeyBlocks) agrees with the per-tile one (TileNeedsMask).
// Exit code 1 on any mismatch.
#include <cstdio>
#include <vector>

#include <cute/tensor.hpp>

#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/bwd_config_wide.h"
#include "maxattn/sm90/kernel_config.h"
#include "maxattn/sm90/mask.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace {

using namespace cute;

// Layout algebra only: a made-up shared-memory address, never dereferenced.
template <class Element>
Element* FakeSmemBase() {
  return reinterpret_cast<Element*>(uintptr_t{1} << 16);
}

// Counts (and prints the first eight of) the threads whose operand partition differs from their
// warpgroup's first thread's.
struct UniformityCheck {
  const char* what;  // "backward H=128", ...
  int mismatches = 0;

  template <class Partition>
  void ExpectSame(const Partition& mine, const Partition& first, const char* operand, int t) {
    if (mine.layout() == first.layout() && mine.data() == first.data()) return;
    if (mismatches++ < 8) std::printf("  %s %s: thread %d differs from its warpgroup's first thread\n", what, operand, t);
  }
};

template <class Config>
int CheckWarpgroupUniformOperands() {
  auto* base = FakeSmemBase<typename Config::Element>();
  Tensor sQ = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutK{});
  Tensor sQt = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutQt{});
  typename Config::TiledMmaSdP mma_sdp;
  typename Config::TiledMmadKV mma_dkv;
  typename Config::TiledMmadQ mma_dq;
  char what[32];
  std::snprintf(what, sizeof(what), "backward H=%d", Config::kHeadDim);
  UniformityCheck check{what};
  for (int t = 0; t < Config::kConsumerThreads; ++t) {
    const int first = t / 128 * 128;
    auto sdp = mma_sdp.get_thread_slice(t), sdp0 = mma_sdp.get_thread_slice(first);
    check.ExpectSame(sdp.partition_A(sK), sdp0.partition_A(sK), "S^T/dP^T A (K, V)", t);
    check.ExpectSame(sdp.partition_B(sQ), sdp0.partition_B(sQ), "S^T/dP^T B (Q, dO)", t);
    auto dkv = mma_dkv.get_thread_slice(t), dkv0 = mma_dkv.get_thread_slice(first);
    check.ExpectSame(dkv.partition_B(sQt), dkv0.partition_B(sQt), "dK/dV B (Q^T, dO^T)", t);
    if constexpr (Config::kDqFromRegisters) {  // H = 256: P^T and dS^T from shared memory, dQ by column halves
      Tensor sPt = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutPt{});
      check.ExpectSame(dkv.partition_A(sPt), dkv0.partition_A(sPt), "dK/dV A (P^T, dS^T)", t);
      Tensor sdS = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutdS{});
      Tensor sKt = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutKtHalfH{});
      auto dq = mma_dq.get_thread_slice(t), dq0 = mma_dq.get_thread_slice(first);
      check.ExpectSame(dq.partition_A(sdS), dq0.partition_A(sdS), "dQ A (dS)", t);
      check.ExpectSame(dq.partition_B(sKt), dq0.partition_B(sKt), "dQ B (K^T half)", t);
    } else if constexpr (Config::kDqSplitKeys) {  // one warpgroup's tiled MMA over its own keys
      Tensor sdS = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutdSHalf{});
      Tensor sKt = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutKtHalf{});
      auto dq = mma_dq.get_thread_slice(t % 128), dq0 = mma_dq.get_thread_slice(0);
      check.ExpectSame(dq.partition_A(sdS), dq0.partition_A(sdS), "dQ A (dS half)", t);
      check.ExpectSame(dq.partition_B(sKt), dq0.partition_B(sKt), "dQ B (K^T half)", t);
    } else {
      Tensor sdS = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutdS{});
      Tensor sKt = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutKt{});
      auto dq = mma_dq.get_thread_slice(t), dq0 = mma_dq.get_thread_slice(first);
      check.ExpectSame(dq.partition_A(sdS), dq0.partition_A(sdS), "dQ A (dS)", t);
      check.ExpectSame(dq.partition_B(sKt), dq0.partition_B(sKt), "dQ B (K^T)", t);
    }
  }
  // Each warpgroup owns its keys (at H = 256 they share them: CheckWideBackward).
  if (!Config::kDqFromRegisters &&
      mma_sdp.get_thread_slice(0).partition_A(sK).data() == mma_sdp.get_thread_slice(128).partition_A(sK).data()) {
    std::printf("  H=%d S^T A: both warpgroups got the same keys\n", Config::kHeadDim);
    ++check.mismatches;
  }
  std::printf("backward H=%d%s: operand partitions warpgroup-uniform: %s\n", Config::kHeadDim,
              Config::kSoftcap ? " (fp16, soft cap)" : "", check.mismatches == 0 ? "ok" : "FAILED");
  return check.mismatches;
}

// The head-dim-256 backward's own facts (its operands' uniformity: CheckWarpgroupUniformOperands).
template <class Config>
int CheckWideBackward() {
  auto* base = FakeSmemBase<typename Config::Element>();
  Tensor sQ = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutKtHalfH{});
  typename Config::TiledMmaSdP mma_sdp;
  typename Config::TiledMmadKV mma_dkv;
  typename Config::TiledMmadQ mma_dq;
  int split = 0;  // the warpgroups share the keys and split queries (S^T) and columns (dK, dV, dQ)
  auto wg0 = [](auto& mma) { return mma.get_thread_slice(0); };
  auto wg1 = [](auto& mma) { return mma.get_thread_slice(128); };
  split += wg0(mma_sdp).partition_A(sK).data() != wg1(mma_sdp).partition_A(sK).data();
  split += wg0(mma_sdp).partition_B(sQ).data() == wg1(mma_sdp).partition_B(sQ).data();
  split += wg0(mma_dkv).partition_B(sQt).data() == wg1(mma_dkv).partition_B(sQt).data();
  split += wg0(mma_dq).partition_B(sKt).data() == wg1(mma_dq).partition_B(sKt).data();
  if (split) std::printf("  H=256: %d operand(s) not split between the warpgroups as planned\n", split);

  // dQ: the consumer's GEMM of column half h gives a thread the coordinates of its 128-column
  // partition shifted by 128 h; the post-pass maps element 32 h + i with the whole-H partition.
  int dq_map = 0;
  constexpr int kBlockM = Config::kBlockM, kHalf = Config::kHeadDim / 2;
  for (int t = 0; t < Config::kConsumerThreads; ++t) {
    auto thr = mma_dq.get_thread_slice(t);
    Tensor whole = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<Config::kHeadDim>>{}));
    Tensor half = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHalf>>{}));
    static_assert(decltype(size(whole))::value == 2 * decltype(size(half))::value);
    for (int i = 0; i < size(whole); ++i) {
      const int h = i / size(half), j = i % size(half);
      if (get<0>(whole(i)) != get<0>(half(j)) || get<1>(whole(i)) != get<1>(half(j)) + kHalf * h) ++dq_map;
    }
  }
  if (dq_map) std::printf("  H=256: %d dQ elements where the post-pass reads another column\n", dq_map);

  // K's tile: columns [128 h, 128 h + 128) of every key are the half tile at element 8192 h
  // (offsets before the swizzle, which 16 KB steps keep).
  int k_half = 0;
  const auto k_layout = typename Config::SmemLayoutK{};
  const auto half_layout = typename Config::SmemLayoutKtHalfH{};  // (column, key) of one half
  for (int key = 0; key < Config::kBlockN; ++key) {
    for (int col = 0; col < Config::kHeadDim; ++col) {
      const int h = col / kHalf;
      if (k_layout(key, col) != h * Config::kBlockN * kHalf + half_layout(col % kHalf, key)) ++k_half;
    }
  }
  if (k_half) std::printf("  H=256: %d elements of K outside their column half's tile\n", k_half);
  const int failures = split + dq_map + k_half;
  std::printf("backward H=256%s: warpgroup split, dQ halves, K halves: %s\n",
              Config::kSoftcap ? " (fp16, soft cap)" : "", failures == 0 ? "ok" : "FAILED");
  return failures;
}

// The forward's consumers do the same for S = Q K^T (A: their 64 query rows, B: the key block)
// and O += P V (B: V^T).
template <class Config>
int CheckForwardOperands() {
  auto* base = FakeSmemBase<typename Config::Element>();
  Tensor sQ = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(base), typename Config::SmemLayoutVt{});
  typename Config::TiledMmaS mma_s;
  typename Config::TiledMmaO mma_o;
  char what[48];
  std::snprintf(what, sizeof(what), "forward H=%d%s N=%d loop %d", Config::kHeadDim, Config::kSoftcap ? " soft cap" : "",
                Config::kBlockN, Config::kVariant);
  UniformityCheck check{what};
  for (int t = 0; t < Config::kConsumerThreads; ++t) {
    const int first = t / 128 * 128;
    auto s = mma_s.get_thread_slice(t), s0 = mma_s.get_thread_slice(first);
    check.ExpectSame(s.partition_A(sQ), s0.partition_A(sQ), "S A (Q)", t);
    check.ExpectSame(s.partition_B(sK), s0.partition_B(sK), "S B (K)", t);
    auto o = mma_o.get_thread_slice(t), o0 = mma_o.get_thread_slice(first);
    check.ExpectSame(o.partition_B(sVt), o0.partition_B(sVt), "O B (V^T)", t);
  }
  if (Config::kConsumerWarpgroups > 1 &&
      mma_s.get_thread_slice(0).partition_A(sQ).data() == mma_s.get_thread_slice(128).partition_A(sQ).data()) {
    std::printf("  forward H=%d S A: both warpgroups got the same query rows\n", Config::kHeadDim);
    ++check.mismatches;
  }
  std::printf("%s: operand partitions warpgroup-uniform: %s\n", what,
              check.mismatches == 0 ? "ok" : "FAILED");
  return check.mismatches;
}

// P V takes P from registers: ConvertFragment (gemm.h) copies the S accumulator into P V's A
// operand element by element, so element i of a thread's two fragments must be the same (query,
// key). Checked per key block width, the head-dim-256 instance's named 64 x 80 atom included.
template <class Config>
int CheckForwardPRegisters() {
  typename Config::TiledMmaS mma_s;
  typename Config::TiledMmaO mma_o;
  Tensor id = make_identity_tensor(Shape<typename Config::BlockM, typename Config::BlockN>{});
  int mismatches = 0;
  for (int t = 0; t < Config::kConsumerThreads; ++t) {
    Tensor c = mma_s.get_thread_slice(t).partition_C(id);
    Tensor a = mma_o.get_thread_slice(t).partition_A(id);
    if (size(c) != size(a)) {
      ++mismatches;
      continue;
    }
    for (int i = 0; i < size(c); ++i) mismatches += c(i) == a(i) ? 0 : 1;
  }
  std::printf("forward H=%d, %d-key blocks: S accumulator = P V's A registers: %s\n", Config::kHeadDim,
              Config::kBlockN, mismatches == 0 ? "ok" : "FAILED");
  return mismatches;
}

// Accumulators staged by stmatrix (the persistent forward's out tile, epilogue.h; the backward's dK
// and dV, bwd_epilogue.h): the copy is built on one warpgroup's TiledMma and fed the fragment of
// the two-warpgroup TiledMma. Checked: (a) thread t of warpgroup w holds in the whole TiledMma the
// elements that thread t holds in the warpgroup's, kRows w rows further down; (b) emulating
// stmatrix.x4 (.b16, not transposed) on CuTe's per-thread views -- lane 8 j + r gives the address of
// row r of matrix j, lane 4 r + q holds its columns 2 q and 2 q + 1 in register j -- every element
// lands at its accumulator coordinate.
template <class TiledMma, class TiledMmaWarpgroup, class CopyAtom, int kRows, int kH>
int CheckStmatrixStaging(const char* what) {
  constexpr int kWarpgroups = 2;
  TiledMma mma;
  TiledMmaWarpgroup mma_wg;
  auto copy_c = make_tiled_copy_C(CopyAtom{}, mma_wg);
  auto coords = [&](int t) {
    return mma_wg.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kH>>{}));
  };
  int rows = 0, moved = 0;
  for (int t = 0; t < 128; ++t) {
    for (int w = 0; w < kWarpgroups; ++w) {
      Tensor c = mma.get_thread_slice(w * 128 + t)
                     .partition_C(make_identity_tensor(Shape<Int<kWarpgroups * kRows>, Int<kH>>{}));
      Tensor c_wg = coords(t);
      for (int k = 0; k < size(c_wg); ++k) {
        rows += get<0>(c(k)) != get<0>(c_wg(k)) + w * kRows || get<1>(c(k)) != get<1>(c_wg(k));
      }
    }
  }
  auto src = [&](int t) { return copy_c.get_thread_slice(t).retile_S(coords(t)); };
  auto dst = [&](int t) {
    return copy_c.get_thread_slice(t).partition_D(make_identity_tensor(Shape<Int<kRows>, Int<kH>>{}));
  };
  // Mode 0 of both views is the atom's 8 values, repeated: one stmatrix per repetition.
  constexpr int kValues = decltype(size<0>(dst(0)))::value;
  static_assert(kValues % 8 == 0 && decltype(size<0>(src(0)))::value == kValues);
  for (int warp = 0; warp < 4; ++warp) {
    for (int call = 0; call < kValues / 8; ++call) {
      for (int m = 0; m < size<1>(dst(0)); ++m) {
        for (int n = 0; n < size<2>(dst(0)); ++n) {
          for (int j = 0; j < 4; ++j) {
            for (int r = 0; r < 8; ++r) {
              Tensor row = dst(32 * warp + 8 * j + r);  // this lane's 16 bytes: 8 consecutive columns
              const auto target = row(8 * call, m, n);
              for (int e = 0; e < 8; ++e) {
                const auto value = src(32 * warp + 4 * r + e / 2)(8 * call + 2 * j + e % 2, m, n);
                const auto slot = row(8 * call + e, m, n);
                moved += get<0>(value) != get<0>(target) || get<1>(value) != get<1>(target) + e ||
                         get<0>(slot) != get<0>(target) || get<1>(slot) != get<1>(target) + e;
              }
            }
          }
        }
      }
    }
  }
  if (rows) std::printf("  %s: %d elements where the warpgroup's MMA has another row\n", what, rows);
  if (moved) std::printf("  %s: %d elements staged at another coordinate\n", what, moved);
  std::printf("%s: staged by stmatrix at the accumulator's coordinates: %s\n", what,
              rows + moved == 0 ? "ok" : "FAILED");
  return rows + moved;
}

template <class Config>
int CheckForwardOutStaging() {
  char what[32];
  std::snprintf(what, sizeof(what), "forward H=%d out tile", Config::kHeadDim);
  return CheckStmatrixStaging<typename Config::TiledMmaO, typename Config::TiledMmaOWarpgroup,
                              typename Config::CopyAtomOStaging, Config::WarpgroupRows::value, Config::kHeadDim>(what);
}

template <class Config>
int CheckBackwardDkDvStaging() {
  static_assert(Config::kConsumerWarpgroups == 2);
  char what[32];
  std::snprintf(what, sizeof(what), "backward H=%d dK/dV", Config::kHeadDim);
  return CheckStmatrixStaging<typename Config::TiledMmadKV, typename Config::TiledMmadKVWarpgroup,
                              typename Config::CopyAtomdKVStaging, Config::kBlockN / 2, Config::kHeadDim>(what);
}

// A problem's sizes in FwdArgs or BwdArgs (the schedulers read only these).
template <class Args>
Args ProblemSizes(int batch, int heads, int kv_heads, int q_len, int kv_len, bool causal) {
  Args a;
  a.batch = batch;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.group = heads / kv_heads;
  a.q_len = q_len;
  a.kv_len = kv_len;
  a.causal = causal;
  return a;
}

// The persistent forward's tile sequence (tile_scheduler.h) visits every (query block, head,
// batch) exactly once, and a causal section hands out its query blocks longest first.
int CheckForwardTileOrder() {
  using maxattn::sm90::FwdArgs;
  using maxattn::sm90::PersistentLongestFirstScheduler;
  struct Case {
    int batch, heads, kv_heads, q_len, kv_len;
    bool causal;
  };
  const Case cases[] = {{4, 32, 32, 2048, 2048, true},   {4, 32, 8, 4096, 4096, true},
                        {2, 16, 16, 8192, 8192, true},   {3, 5, 1, 1000, 1500, true},
                        {1, 7, 7, 300, 131072, true},    {4, 32, 32, 2048, 2048, false},
                        {2, 6, 3, 129, 129, true},     {5, 12, 12, 4096, 4096, true}};
  int failures = 0;
  for (const Case& c : cases) {
    FwdArgs a = ProblemSizes<FwdArgs>(c.batch, c.heads, c.kv_heads, c.q_len, c.kv_len, c.causal);
    a.num_m_blocks = (c.q_len + 127) / 128;
    a.num_tiles = a.num_m_blocks * c.heads * c.batch;
    a.section_heads = PersistentLongestFirstScheduler::SectionHeads(a, 128, 2);
    std::vector<int> seen(static_cast<size_t>(a.num_tiles), 0);
    int bad = 0, prev_section = -1, prev_m = 0;
    for (int i = 0; i < a.num_tiles; ++i) {
      const auto t = PersistentLongestFirstScheduler::Get(a, i);
      const bool in_range = t.m_block >= 0 && t.m_block < a.num_m_blocks && t.head >= 0 && t.head < a.heads &&
                            t.batch >= 0 && t.batch < a.batch && t.kv_head == t.head / a.group;
      if (!in_range || seen[(static_cast<size_t>(t.batch) * a.heads + t.head) * a.num_m_blocks + t.m_block]++) {
        ++bad;
        continue;
      }
      const int section = (t.batch * a.heads + t.head) / a.section_heads;
      if (c.causal && section == prev_section && t.m_block > prev_m) ++bad;  // longest first within a section
      prev_section = section;
      prev_m = t.m_block;
    }
    const bool ok = bad == 0 && a.section_heads % a.group == 0 && (c.causal || a.section_heads == 1);
    if (!ok) {
      std::printf("  forward tile order (%d,%d,%d,%d,%d,%s): %d bad tiles, section_heads %d\n", c.batch, c.q_len,
                  c.heads, c.kv_heads, c.kv_len, c.causal ? "causal" : "none", bad, a.section_heads);
      ++failures;
    }
  }
  std::printf("forward tile order: every tile once, longest first per section: %s\n", failures == 0 ? "ok" : "FAILED");
  return failures;
}

// The causal backward's launch order (BwdStaticScheduler::Sectioned, tile_scheduler.h) maps the
// launch indices onto every (key block, KV head, batch) exactly once, and within a section hands
// out the key blocks in increasing order: longest walks first.
int CheckBackwardTileOrder() {
  using maxattn::sm90::BwdArgs;
  using maxattn::sm90::BwdStaticScheduler;
  struct Case {
    int batch, heads, kv_heads, q_len, kv_len, head_dim;
  };
  const Case cases[] = {{4, 32, 32, 2048, 2048, 128}, {4, 32, 8, 4096, 4096, 128}, {2, 16, 16, 8192, 8192, 128},
                        {3, 5, 1, 1000, 1500, 64},    {1, 7, 7, 300, 131072, 128}, {2, 6, 3, 129, 129, 256},
                        {5, 12, 12, 4096, 4096, 64},  {1, 1, 1, 65536, 65536, 128}};
  int failures = 0;
  for (const Case& c : cases) {
    BwdArgs a = ProblemSizes<BwdArgs>(c.batch, c.heads, c.kv_heads, c.q_len, c.kv_len, true);
    const int block_n = maxattn::sm90::BwdBlockN(c.head_dim);
    a.num_n_blocks = (c.kv_len + block_n - 1) / block_n;
    const int section_rows = BwdStaticScheduler::SectionRows(a, c.head_dim, 2);
    const int ctas = a.num_n_blocks * c.kv_heads * c.batch;
    std::vector<int> seen(static_cast<size_t>(ctas), 0);
    int bad = 0, prev_section = -1, prev_n = 0;
    for (int i = 0; i < ctas; ++i) {
      const auto t = BwdStaticScheduler::Sectioned(a, section_rows, i);
      const bool in_range = t.n_block >= 0 && t.n_block < a.num_n_blocks && t.kv_head >= 0 &&
                            t.kv_head < a.kv_heads && t.batch >= 0 && t.batch < a.batch;
      if (!in_range || seen[(static_cast<size_t>(t.batch) * a.kv_heads + t.kv_head) * a.num_n_blocks + t.n_block]++) {
        ++bad;
        continue;
      }
      const int section = (t.batch * a.kv_heads + t.kv_head) / section_rows;
      if (section == prev_section && t.n_block < prev_n) ++bad;  // longest walks first within a section
      prev_section = section;
      prev_n = t.n_block;
    }
    a.causal = false;
    const bool ok = bad == 0 && section_rows >= 1 && BwdStaticScheduler::SectionRows(a, c.head_dim, 2) == 0;
    if (!ok) {
      std::printf("  backward tile order (%d,%d,%d,%d,%d,H=%d): %d bad tiles, section_rows %d\n", c.batch, c.q_len,
                  c.heads, c.kv_heads, c.kv_len, c.head_dim, bad, section_rows);
      ++failures;
    }
  }
  std::printf("backward tile order: every tile once, longest first per section: %s\n", failures == 0 ? "ok" : "FAILED");
  return failures;
}

// The forward decides per key block whether to mask by the range UnmaskedKeyBlocks solves once per
// query block; the backward by TileNeedsMask per tile (mask.h). Without segment ids the two must
// agree on every tile: checked over lengths, both causal alignments and windows.
template <int kBlockM, int kBlockN>
int CheckUnmaskedKeyBlocks() {
  const maxattn::sm90::ProblemArgs args{};
  int mismatches = 0, cases = 0;
  const int lengths[] = {1, 63, 128, 129, 300, 512};
  const int windows[] = {-1, 0, 5, 100, 257};
  for (int q : lengths) {
    for (int kv : lengths) {
      for (int mode = 0; mode < 3; ++mode) {  // no causal mask, causal top-left, causal bottom-right
        for (int wl : windows) {
          for (int wr : windows) {
            maxattn::sm90::BlockMask m;
            m.q_valid = q;
            m.kv_valid = kv;
            m.causal = mode > 0;
            m.diag = mode == 2 ? kv - q : 0;
            m.window_left = wl;
            m.window_right = wr;
            for (int m0 = 0; m0 < q; m0 += kBlockM) {
              int lo = 0, hi = 0;
              m.UnmaskedKeyBlocks<kBlockM, kBlockN>(m0, &lo, &hi);
              for (int nb = 0; nb * kBlockN < kv; ++nb) {
                ++cases;
                const bool clear = nb >= lo && nb < hi;
                if (clear != m.TileNeedsMask<kBlockM, kBlockN>(args, m0, nb * kBlockN)) continue;
                if (mismatches++ < 5) {
                  std::printf("  q %d kv %d mode %d wl %d wr %d m0 %d nb %d: range [%d, %d)\n", q, kv, mode, wl, wr,
                              m0, nb, lo, hi);
                }
              }
            }
          }
        }
      }
    }
  }
  std::printf("mask decision, %d x %d tiles: UnmaskedKeyBlocks = TileNeedsMask on %d tiles: %s\n", kBlockM,
              kBlockN, cases, mismatches == 0 ? "ok" : "FAILED");
  return mismatches;
}

}  // namespace

int main() {
  using maxattn::sm90::BwdConfig;
  int failures = 0;
  failures += CheckWarpgroupUniformOperands<BwdConfig<128, cutlass::bfloat16_t>>();
  failures += CheckWarpgroupUniformOperands<BwdConfig<64, cutlass::bfloat16_t>>();
  failures += CheckWarpgroupUniformOperands<BwdConfig<128, cutlass::half_t, true>>();
  using maxattn::sm90::BwdWideConfig;
  failures += CheckWarpgroupUniformOperands<BwdWideConfig<cutlass::bfloat16_t>>();
  failures += CheckWarpgroupUniformOperands<BwdWideConfig<cutlass::half_t, true>>();
  failures += CheckWideBackward<BwdWideConfig<cutlass::bfloat16_t>>();
  failures += CheckWideBackward<BwdWideConfig<cutlass::half_t, true>>();
  using maxattn::sm90::FwdConfig;
  failures += CheckForwardOperands<FwdConfig<64, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(64, false), false>>();
  failures += CheckForwardOperands<FwdConfig<128, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(128, false), false>>();
  failures += CheckForwardOperands<FwdConfig<256, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(256, false), false>>();
  failures += CheckForwardOperands<FwdConfig<256, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(256, true), true>>();
  failures += CheckForwardPRegisters<FwdConfig<64, cutlass::half_t, maxattn::sm90::ForwardVariant(64, false), false>>();
  failures += CheckForwardPRegisters<FwdConfig<128, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(128, false), false>>();
  failures += CheckForwardPRegisters<FwdConfig<256, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(256, true), true>>();
  failures += CheckForwardOutStaging<FwdConfig<64, cutlass::bfloat16_t, maxattn::sm90::ForwardVariant(64, false), false>>();
  failures += CheckForwardOutStaging<FwdConfig<128, cutlass::half_t, maxattn::sm90::ForwardVariant(128, true), true>>();
  failures += CheckBackwardDkDvStaging<BwdConfig<128, cutlass::bfloat16_t>>();
  failures += CheckBackwardDkDvStaging<BwdConfig<64, cutlass::half_t, true>>();
  failures += CheckForwardTileOrder();
  failures += CheckBackwardTileOrder();
  failures += CheckUnmaskedKeyBlocks<128, 128>();
  failures += CheckUnmaskedKeyBlocks<128, 160>();
  failures += CheckUnmaskedKeyBlocks<128, 64>();
  failures += CheckUnmaskedKeyBlocks<128, 80>();
  return failures == 0 ? 0 : 1;
}
