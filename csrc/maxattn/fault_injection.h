// Test-only fault injection: a FaultSwitch armed with n makes the next n
// checks at its injection point report a failure, as the real fault (an
// out-of-memory, a rejected cuDNN graph) would. Tests arm them through the
// extension modules' `_fail_next_*` functions. Costs one relaxed atomic load
// per check when unarmed.
#ifndef MAXATTN_FAULT_INJECTION_H_
#define MAXATTN_FAULT_INJECTION_H_

#include <atomic>

namespace maxattn::testing {

class FaultSwitch {
 public:
  void Arm(int n) { pending_.store(n < 0 ? 0 : n, std::memory_order_relaxed); }

  // True (and consumes one) when an injected failure is pending.
  bool Consume() {
    int pending = pending_.load(std::memory_order_relaxed);
    while (pending > 0) {
      if (pending_.compare_exchange_weak(pending, pending - 1, std::memory_order_relaxed)) return true;
    }
    return false;
  }

 private:
  std::atomic<int> pending_{0};
};

}  // namespace maxattn::testing

#endif  // MAXATTN_FAULT_INJECTION_H_
