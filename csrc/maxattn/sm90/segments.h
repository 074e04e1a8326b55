// maxattn sm90: segment ids as per-block summaries, so that the forward skips
// the tile pairs whose segments cannot meet and compares ids only in the tiles
// where they may differ. O(B * (T + S)) memory; no dense bias.
//
// A pre-pass (segments.cu, two small kernels on the call's stream) writes
//   key blocks   [B, ceil(S / kBlockN)]: the smallest and largest non-zero id
//                among the block's valid keys (j < kv_valid), and `uniform`:
//                that id when every key of the block is valid and has it,
//                else 0;
//   run ends     [B, S]: for each valid key j, one past the last key of the
//                run of equal ids that holds j, cut at the end of j's key
//                block (and at kv_valid);
//   query blocks [B, ceil(T / block_m)]: `uniform` likewise for the block's
//                rows, and the key blocks [n_lo, n_hi) whose id range meets
//                the block's (empty when none does, or when every row is
//                padding);
//   and, when asked for (the backward, which walks the query blocks of one
//   key block), key-block queries [B, ceil(S / block_n)]: the query blocks
//   [m_lo, m_hi) whose key range [n_lo, n_hi) holds the key block (a hull,
//   so a superset of the blocks whose ids meet it: exact after the mask).
// The kernel intersects its causal / window key range with [n_lo, n_hi), and
// in every tile that is not uniform with the same id on both sides it walks
// the key block's runs and masks those whose id is not the row's (mask.h).
// That is exact for any ids; for packed rows (contiguous runs of ids) the
// range is tight and only the tiles that straddle a document boundary walk
// runs (two, typically).
#ifndef MAXATTN_SM90_SEGMENTS_H_
#define MAXATTN_SM90_SEGMENTS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "maxattn/attention.h"

namespace maxattn::sm90 {

struct alignas(16) KeyBlockIds {
  int32_t lo;       // > hi when the block has no valid non-padding key
  int32_t hi;
  int32_t uniform;  // the id of every key, or 0
  int32_t unused;
};

struct alignas(16) QueryBlockKeys {
  int32_t n_lo;     // key blocks [n_lo, n_hi) that may hold a visible key
  int32_t n_hi;
  int32_t uniform;  // the id of every row, or 0
  int32_t unused;
};

struct alignas(8) KeyBlockQueries {
  int32_t m_lo;     // query blocks [m_lo, m_hi) that may see the key block
  int32_t m_hi;
};

struct SegmentSummaryArgs {
  const int32_t* q_ids = nullptr;   // [B, T]
  const int32_t* kv_ids = nullptr;  // [B, S]
  const int32_t* q_lens = nullptr;  // [B] or null
  const int32_t* kv_lens = nullptr;
  int batch = 0, q_len = 0, kv_len = 0;
  int block_m = 0, block_n = 0;     // the kernel's tile sizes
  KeyBlockIds* key_blocks = nullptr;        // [B, ceil(S / block_n)]
  int32_t* kv_run_end = nullptr;            // [B, S]
  QueryBlockKeys* query_blocks = nullptr;   // [B, ceil(T / block_m)]
  KeyBlockQueries* key_block_queries = nullptr;  // [B, ceil(S / block_n)], or null (not wanted)
};

// Enqueues the summary kernels on `stream` (two, three with key_block_queries).
Status SummarizeSegments(const SegmentSummaryArgs& args, cudaStream_t stream);

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_SEGMENTS_H_
