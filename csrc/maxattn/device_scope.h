// RAII: makes a CUDA device current for the calling thread while in scope.
// Shared by the CUDA backends (cudnn/, sm90) and their FFI glue.
#ifndef MAXATTN_DEVICE_SCOPE_H_
#define MAXATTN_DEVICE_SCOPE_H_

#include <cuda_runtime_api.h>

namespace maxattn {

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      switched_ = status_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  // The result of switching to the device (cudaSuccess when it was already current).
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  bool switched_ = false;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace maxattn

#endif  // MAXATTN_DEVICE_SCOPE_H_
