// maxattn sm90: which (query block, head, batch) tile a CTA works on.
//
// Static: one CTA per tile. The grid is (m_blocks, N, B) and the
// hardware dispatches blockIdx.x fastest, so all query blocks of one head run
// side by side: each key/value block is read from DRAM once and served from L2
// to the other query blocks (and, with GQA, to the heads of the same KV head,
// which come next). Ordering the heads fastest instead put B * N different
// K/V working sets in one wave: at (4,2048,32,32,128) that is 128 MiB, more
// than L2, and the kernel ran DRAM-bound (77% of peak, L2 hit rate 5%, ncu on
// the H200). For causal masks the query blocks of a head are handed out in
// decreasing order, so the longest tiles (most key blocks) start first.
#ifndef MAXATTN_SM90_TILE_SCHEDULER_H_
#define MAXATTN_SM90_TILE_SCHEDULER_H_

#include <cuda_runtime.h>

#include "maxattn/sm90/kernel_config.h"

namespace maxattn::sm90 {

// L2 sections (the persistent forward's and the causal backward's orders below):
// a section's rows keep the data their tiles share within this many bytes.
// -DMAXATTN_SM90_L2_SECTION_MIB=n overrides it for experiments.
#ifndef MAXATTN_SM90_L2_SECTION_MIB
#define MAXATTN_SM90_L2_SECTION_MIB 32
#endif
constexpr int64_t kL2SectionBytes = int64_t{MAXATTN_SM90_L2_SECTION_MIB} << 20;

// How many units of unit_bytes each fit in kL2SectionBytes, at least one
// (fallback when unit_bytes is 0).
inline int64_t UnitsPerL2Section(int64_t unit_bytes, int64_t fallback) {
  const int64_t fit = unit_bytes > 0 ? kL2SectionBytes / unit_bytes : fallback;
  return fit < 1 ? 1 : fit;
}

struct StaticLongestFirstScheduler {
  static dim3 Grid(const FwdArgs& args) {
    return dim3(static_cast<unsigned>(args.num_m_blocks), static_cast<unsigned>(args.heads),
                static_cast<unsigned>(args.batch));
  }

  __device__ static Tile Get(const FwdArgs& args) {
    Tile t;
    const int x = static_cast<int>(blockIdx.x);
    t.m_block = args.causal ? args.num_m_blocks - 1 - x : x;
    t.head = static_cast<int>(blockIdx.y);
    t.kv_head = t.head / args.group;
    t.batch = static_cast<int>(blockIdx.z);
    return t;
  }
};

// Persistent: at most one CTA per SM over one tile sequence. CTA c starts with
// tile c; after that each CTA takes the next unclaimed tile from a global
// counter (Next) when its producer has issued the loads of the current one, so,
// as with the hardware's dispatch of a static grid, tiles go to whichever CTA is
// free first: a fixed stride gave causal CTAs unequal shares (tile lengths
// repeat with period num_m_blocks). The CTA keeps its shared-memory pipelines
// across tiles, so the next tile's Q and K/V loads overlap this tile's epilogue.
//
// Order: the (head, batch) rows (head fastest, so a GQA group's heads are
// neighbours) are cut into sections of args.section_heads rows whose K and V
// fit in L2 together (SectionHeads); sections run one after the other. Inside a
// section the query block is the outer index and the row the inner one, so the
// rows' K/V blocks are shared in L2 by every tile of the section. A causal
// section starts with its longest query blocks (most key blocks) and ends with
// its shortest, so the sequence ends on one-block tiles rather than on one
// head's long ones (with one row per section, the order until 2026-12-06, ncu
// counted the busiest SM 6.3% above the mean at (4,2048,32,32,128) causal).
// Without a causal mask every tile has the same length; section_heads = 1 keeps
// the query blocks of one row side by side.
struct PersistentLongestFirstScheduler {
  static dim3 Grid(const FwdArgs& args, int num_sms) {
    return dim3(static_cast<unsigned>(args.num_tiles < num_sms ? args.num_tiles : num_sms));
  }

  // Rows per section: as many whole GQA groups as keep their K and V (kv_len x
  // head_dim elements of element_bytes each, per KV head) within
  // kL2SectionBytes, at least one group; 1 when the tiles are all alike (no
  // causal mask).
  static int SectionHeads(const ProblemArgs& args, int head_dim, int element_bytes) {
    if (!args.causal) return 1;
    const int64_t rows = static_cast<int64_t>(args.heads) * args.batch;
    const int64_t kv_bytes = int64_t{2} * args.kv_len * head_dim * element_bytes;
    const int64_t heads = UnitsPerL2Section(kv_bytes, rows) * args.group;
    return static_cast<int>(heads < rows ? heads : rows);
  }

  // The index of this CTA's next tile (>= num_tiles: none left).
  __device__ static int Next(const FwdArgs& args) {
    return static_cast<int>(gridDim.x) + atomicAdd(args.tile_counter, 1);
  }

  __host__ __device__ static Tile Get(const FwdArgs& args, int index) {
    const int section_tiles = args.section_heads * args.num_m_blocks;
    const int section = index / section_tiles;
    const int first_row = section * args.section_heads;
    const int rows_left = args.heads * args.batch - first_row;
    const int rows = rows_left < args.section_heads ? rows_left : args.section_heads;
    const int within = index - section * section_tiles;
    const int m = within / rows;
    const int head_batch = first_row + within % rows;
    Tile t;
    t.m_block = args.causal ? args.num_m_blocks - 1 - m : m;
    t.head = head_batch % args.heads;
    t.batch = head_batch / args.heads;
    t.kv_head = t.head / args.group;
    return t;
  }
};

// Backward: one CTA per (key block, KV head, batch row), key blocks fastest,
// so the CTAs of one head run side by side and share its Q, dO, lse and D in
// L2. A CTA walks the query blocks that see its keys, for every query head of
// the KV head's group; key block 0 comes first, which for a causal mask
// (top-left) is the one with the most query blocks.
struct BwdTile {
  int n_block;
  int kv_head;
  int batch;
};

// The backward: one CTA per (key block, KV head, batch), grid (num_n_blocks,
// kv_heads, batch), which the hardware dispatches in launch order (x fastest).
// - By default key block n = blockIdx.x, so the CTAs of one (KV head, batch)
//   row run side by side and share its Q and dO in L2.
// - Deterministic mode (bwd_dq_order.h): the same, key blocks launched last
//   first: the order of the dQ adds is the launch order there, and under a
//   causal mask the last key block's CTA (the shortest walk, starting on the
//   diagonal) reaches each query block first.
// - Causal, plain mode at head dim 128 (LongestFirst): longest walks first
//   within L2 sections (section_rows > 0). Key block n walks the query blocks
//   at or after it, so walks shorten with n; row by row, each row's longest
//   walks were launched while its short ones followed, and the grid ended with
//   the last rows' long walks running alone on a few SMs. The launch sequence
//   is cut into sections of section_rows rows whose Q and dO fit in L2
//   together (SectionRows); inside a section the key block is the outer index
//   and the row the inner one, so the grid ends on the last section's shortest
//   walks. (FlashAttention-3 orders its causal backward longest first too.)
struct BwdStaticScheduler {
  static dim3 Grid(const ProblemArgs& args) {
    return dim3(static_cast<unsigned>(args.num_n_blocks), static_cast<unsigned>(args.kv_heads),
                static_cast<unsigned>(args.batch));
  }

  // Rows per L2 section of the causal plain mode: as many (KV head, batch) rows
  // as keep their Q and dO (group x q_len x head_dim elements of element_bytes
  // each, per row) within kL2SectionBytes, at least one; 0 (key blocks fastest
  // per row) without a causal mask.
  static int SectionRows(const ProblemArgs& args, int head_dim, int element_bytes) {
    if (!args.causal) return 0;
    const int64_t rows = static_cast<int64_t>(args.kv_heads) * args.batch;
    const int64_t row_bytes = int64_t{2} * args.group * args.q_len * head_dim * element_bytes;
    const int64_t section = UnitsPerL2Section(row_bytes, rows);
    return static_cast<int>(section < rows ? section : rows);
  }

  // Whether a launch takes the sectioned order: the causal plain mode at head
  // dim 128, where it measured 2.5% (T = 2048) and 4.1% (T = 8192) faster than
  // key blocks fastest per row; at head dim 64 it measured 3.5% slower (H100,
  // ncu, bench/RESULTS.md, fourteenth session); head dim 256 is not measured.
  static bool LongestFirst(const ProblemArgs& args, int head_dim, bool ordered) {
    return args.causal && !ordered && head_dim == 128;
  }

  // The key block of the CTA launched x-th in its (KV head, batch) row.
  __host__ __device__ static int KeyBlock(const ProblemArgs& args, int x, bool reversed) {
    return reversed ? args.num_n_blocks - 1 - x : x;
  }

  // The tile of the CTA launched index-th (index = blockIdx.x + num_n_blocks *
  // (blockIdx.y + kv_heads * blockIdx.z)) in the causal plain mode.
  __host__ __device__ static BwdTile Sectioned(const ProblemArgs& args, int section_rows, int index) {
    const int section_ctas = section_rows * args.num_n_blocks;
    const int section = index / section_ctas;
    const int first_row = section * section_rows;
    const int rows_left = args.kv_heads * args.batch - first_row;
    const int rows = rows_left < section_rows ? rows_left : section_rows;
    const int within = index - section * section_ctas;
    const int row = first_row + within % rows;
    return BwdTile{within / rows, row % args.kv_heads, row / args.kv_heads};
  }

  // section_rows: SectionRows' value where LongestFirst holds, else 0 (key
  // blocks fastest per row); reversed: the deterministic mode (section_rows 0).
  __device__ static BwdTile Get(const ProblemArgs& args, int section_rows, bool reversed) {
    if (section_rows > 0) {
      const int row = static_cast<int>(blockIdx.y) + args.kv_heads * static_cast<int>(blockIdx.z);
      const int index = static_cast<int>(blockIdx.x) + args.num_n_blocks * row;
      return Sectioned(args, section_rows, index);
    }
    return BwdTile{KeyBlock(args, static_cast<int>(blockIdx.x), reversed), static_cast<int>(blockIdx.y),
                   static_cast<int>(blockIdx.z)};
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_TILE_SCHEDULER_H_
