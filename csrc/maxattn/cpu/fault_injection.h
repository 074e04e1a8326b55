// Test-only fault injection point of the CPU backend (used by
// tests/python/test_failures.py through
// maxattn._maxattn_cpu._fail_next_scratch_allocations, and by tests/cpp):
// armed, the next scratch allocations of the CPU kernels (AlignedBuffer)
// throw std::bad_alloc, which the public entry points turn into
// Status::Internal.
#ifndef MAXATTN_CPU_FAULT_INJECTION_H_
#define MAXATTN_CPU_FAULT_INJECTION_H_

#include "maxattn/fault_injection.h"

namespace maxattn::cpu::testing {

inline maxattn::testing::FaultSwitch g_scratch_allocation_faults;

inline void FailNextScratchAllocations(int n) { g_scratch_allocation_faults.Arm(n); }

inline bool ConsumeScratchAllocationFailure() { return g_scratch_allocation_faults.Consume(); }

}  // namespace maxattn::cpu::testing

#endif  // MAXATTN_CPU_FAULT_INJECTION_H_
