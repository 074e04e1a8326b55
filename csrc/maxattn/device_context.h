// Where and how one call of a CUDA backend (cudnn/, sm90/) runs: device,
// stream and a workspace allocator. The FFI glue builds it from XLA's call
// context (csrc/ffi/cuda_handlers.cc); the standalone harnesses from their own
// buffers.
#ifndef MAXATTN_DEVICE_CONTEXT_H_
#define MAXATTN_DEVICE_CONTEXT_H_

#include <cstddef>
#include <functional>

#include <cuda_runtime_api.h>

namespace maxattn {

struct DeviceContext {
  int device = 0;                 // CUDA device ordinal
  cudaStream_t stream = nullptr;  // all work is enqueued here; nothing synchronises
  // Returns `bytes` of device memory (16-byte aligned) valid until the stream
  // reaches the end of this call, or nullptr when out of memory. Called at
  // most a few times per call.
  std::function<void*(size_t bytes)> allocate;
};

}  // namespace maxattn

#endif  // MAXATTN_DEVICE_CONTEXT_H_
