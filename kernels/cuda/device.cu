#include "kernels/cuda/device.h"

#include <cuda_runtime.h>

#include <cstdio>

#ifndef TANDEM_CUDA_ARCHS
#define TANDEM_CUDA_ARCHS "unknown"
#endif

namespace tandem::kernels::cuda {

int DeviceCount(char* error, int error_size) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (error && error_size > 0) std::snprintf(error, error_size, "%s", cudaGetErrorString(err));
    return 0;
  }
  return n;
}

const char* CompiledArchitectures() { return TANDEM_CUDA_ARCHS; }

}  // namespace tandem::kernels::cuda
