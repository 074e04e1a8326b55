// maxattn sm90: named barriers among a CTA's warpgroups (bar.sync /
// bar.arrive with an id and a thread count; id 0 is __syncthreads). The
// forward's ping-pong turns use ids 2 and 3 (mainloop_consumer.h) and its out
// staging ids 4 and 5 (epilogue.h), the backward's dS hand-over ids 1 to 3 and
// its dQ hand-over to the writer warps 4 to 7 (bwd_config.h; at head dim 256, which has no writer
// warps, ids 4 and 5 are the consumers' turns of the deterministic mode: bwd_config_wide.h). Also the global-memory turn counters of the backward's
// deterministic mode (bwd_dq_order.h): an acquire spin and a release add.
#ifndef MAXATTN_SM90_BARRIER_H_
#define MAXATTN_SM90_BARRIER_H_

namespace maxattn::sm90 {

__device__ __forceinline__ void NamedBarrierSync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ void NamedBarrierArrive(int id, int num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// Spins until *counter == value (acquire: what was written before the matching
// release is visible afterwards).
__device__ __forceinline__ void WaitForCount(const int* counter, int value) {
  int seen;
  while (true) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    if (seen == value) return;
  }
}

// *counter += 1 with release semantics (at GPU scope).
__device__ __forceinline__ void ReleaseCount(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BARRIER_H_
