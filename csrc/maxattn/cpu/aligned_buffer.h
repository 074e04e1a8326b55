// RAII float buffer with 64-byte alignment (one cache line / one AVX-512 vector).
#ifndef MAXATTN_CPU_ALIGNED_BUFFER_H_
#define MAXATTN_CPU_ALIGNED_BUFFER_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>

#include "maxattn/cpu/fault_injection.h"

namespace maxattn::cpu {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Zero-initialised: padding lanes of packed tiles must be 0, never garbage.
  explicit AlignedBuffer(int64_t n) { Resize(n); }

  void Resize(int64_t n) {
    data_.reset();
    size_ = 0;
    if (n <= 0) return;
    if (testing::ConsumeScratchAllocationFailure()) throw std::bad_alloc();
    data_.reset(static_cast<float*>(
        ::operator new(static_cast<size_t>(n) * sizeof(float), std::align_val_t{kAlign})));
    size_ = n;
    Zero();
  }
  void Zero() {
    if (size_ > 0) std::memset(data_.get(), 0, static_cast<size_t>(size_) * sizeof(float));
  }
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  int64_t size() const { return size_; }

 private:
  static constexpr size_t kAlign = 64;
  struct Deleter {
    void operator()(float* p) const { ::operator delete(p, std::align_val_t{kAlign}); }
  };
  std::unique_ptr<float, Deleter> data_;
  int64_t size_ = 0;
};

}  // namespace maxattn::cpu

#endif  // MAXATTN_CPU_ALIGNED_BUFFER_H_
