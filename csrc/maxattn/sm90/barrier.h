// maxattn sm90: named barriers among a CTA's warpgroups (bar.sync /
// bar.arrive with an id and a thread count; id 0 is __syncthreads). The
// forward's ping-pong turns use ids 2 and 3 (mainloop_consumer.h), the
// backward's dS hand-over ids 1 to 3 (bwd_config.h).
#ifndef MAXATTN_SM90_BARRIER_H_
#define MAXATTN_SM90_BARRIER_H_

namespace maxattn::sm90 {

__device__ __forceinline__ void NamedBarrierSync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ void NamedBarrierArrive(int id, int num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BARRIER_H_
