// Test-only fault injection for the CPU backend (used by tests/python/test_failures.py
// through maxattn._maxattn_cpu._fail_next_scratch_allocations, and by tests/cpp).
//
// FailNextScratchAllocations(n) makes the next n scratch allocations of the
// CPU kernels (AlignedBuffer) throw std::bad_alloc, as a real out-of-memory
// would; the public entry points turn that into Status::Internal. Costs one
// relaxed atomic load per allocation when unused.
#ifndef MAXATTN_CPU_FAULT_INJECTION_H_
#define MAXATTN_CPU_FAULT_INJECTION_H_

#include <atomic>

namespace maxattn::cpu::testing {

inline std::atomic<int> g_fail_scratch_allocations{0};

inline void FailNextScratchAllocations(int n) {
  g_fail_scratch_allocations.store(n < 0 ? 0 : n, std::memory_order_relaxed);
}

// True (and consumes one) when an injected failure is pending.
inline bool ConsumeScratchAllocationFailure() {
  int pending = g_fail_scratch_allocations.load(std::memory_order_relaxed);
  while (pending > 0) {
    if (g_fail_scratch_allocations.compare_exchange_weak(pending, pending - 1,
                                                         std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

}  // namespace maxattn::cpu::testing

#endif  // MAXATTN_CPU_FAULT_INJECTION_H_
