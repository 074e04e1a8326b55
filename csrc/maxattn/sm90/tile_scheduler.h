// maxattn sm90: which (query block, head, batch) tile a CTA works on.
//
// One CTA per tile (not yet persistent). The grid is (N, B, m_blocks) and the
// hardware dispatches blockIdx.x fastest, so every head of a batch row is
// started before the next query block: the heads that share one KV head (GQA)
// run side by side and share K/V in L2. For causal masks the query blocks are
// handed out in decreasing order, so the longest tiles (most key blocks) start
// first and the short ones fill the tail of the last wave.
#ifndef MAXATTN_SM90_TILE_SCHEDULER_H_
#define MAXATTN_SM90_TILE_SCHEDULER_H_

#include <cuda_runtime.h>

#include "maxattn/sm90/kernel_config.h"

namespace maxattn::sm90 {

struct Tile {
  int m_block;
  int head;
  int kv_head;
  int batch;
};

struct StaticLongestFirstScheduler {
  static dim3 Grid(const FwdArgs& args) {
    return dim3(static_cast<unsigned>(args.heads), static_cast<unsigned>(args.batch),
                static_cast<unsigned>(args.num_m_blocks));
  }

  __device__ static Tile Get(const FwdArgs& args) {
    Tile t;
    const int z = static_cast<int>(blockIdx.z);
    t.m_block = args.causal ? args.num_m_blocks - 1 - z : z;
    t.head = static_cast<int>(blockIdx.x);
    t.kv_head = t.head / args.group;
    t.batch = static_cast<int>(blockIdx.y);
    return t;
  }
};

// Persistent: at most one CTA per SM, each walking tiles blockIdx.x,
// blockIdx.x + gridDim.x, ... of one sequence ordered like the static grid
// (query block outermost, longest first for causal; then batch; head fastest).
struct PersistentLongestFirstScheduler {
  static dim3 Grid(const FwdArgs& args, int num_sms) {
    return dim3(static_cast<unsigned>(args.num_tiles < num_sms ? args.num_tiles : num_sms));
  }

  __device__ static Tile Get(const FwdArgs& args, int index) {
    const int per_block = args.heads * args.batch;
    const int z = index / per_block;
    const int rest = index - z * per_block;
    Tile t;
    t.m_block = args.causal ? args.num_m_blocks - 1 - z : z;
    t.batch = rest / args.heads;
    t.head = rest - t.batch * args.heads;
    t.kv_head = t.head / args.group;
    return t;
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_TILE_SCHEDULER_H_
