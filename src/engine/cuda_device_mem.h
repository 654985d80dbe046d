// DeviceMem: one cudaMalloc'd buffer owned by the cuda backend, freed on
// destruction; allocation failures are RESOURCE_EXHAUSTED naming what it was
// for and the device's free memory.
//
// Thread-safety: none (the backend's engine thread).
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstddef>
#include <string_view>

#include "common/status.h"

namespace tandem::engine {

// One device allocation, freed on destruction.
class DeviceMem {
 public:
  DeviceMem() = default;
  ~DeviceMem() { Reset(); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  DeviceMem(DeviceMem&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; o.bytes_ = 0; }

  Status Allocate(size_t bytes, std::string_view what) {
    Reset();
    if (bytes == 0) return Status::Ok();
    const cudaError_t err = cudaMalloc(&p_, bytes);
    if (err != cudaSuccess) {
      p_ = nullptr;
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      return ResourceExhaustedError(fmt::format(
          "backend cuda: {} needs {:.2f} GiB of device memory; {:.2f} GiB of {:.2f} GiB free ({})",
          what, bytes / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0,
          cudaGetErrorString(err)));
    }
    bytes_ = bytes;
    return Status::Ok();
  }
  // Grows (never shrinks) to at least `bytes`; contents are not kept.
  Status Reserve(size_t bytes, std::string_view what) {
    if (bytes <= bytes_) return Status::Ok();
    return Allocate(bytes + bytes / 2, what);
  }
  void Reset() {
    if (p_ != nullptr) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  template <class T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace tandem::engine
