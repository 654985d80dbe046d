// Device helpers shared by the .cu files of kernels/cuda (not a public header).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.h"

namespace tandem::kernels::cuda::detail {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the block in a fixed order (warp butterflies, then warp 0 over the
// per-warp sums); every thread gets the result. `scratch` holds >= 32 floats
// and may be reused right after the call returns on every thread.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = lane < warps ? scratch[lane] : 0.0f;
  total = WarpSum(total);
  return total;
}

inline KernelStatus LaunchStatus(const char* what) {
  return FromCuda(cudaGetLastError(), what);
}

}  // namespace tandem::kernels::cuda::detail
