#include "kernels/cuda/tp_ops.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void ReducedToBf16Kernel(const float* __restrict__ sum, const bf16* __restrict__ bias,
                                    bf16* __restrict__ out, size_t total, int n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v = sum[i];
    if (bias != nullptr) v += __bfloat162float(bias[i % static_cast<size_t>(n)]);
    out[i] = __float2bfloat16(v);
  }
}

}  // namespace

KernelStatus ReducedToBf16(const float* sum, const bf16* bias, bf16* out, int m, int n,
                           cudaStream_t stream) {
  if (m < 0 || n <= 0) return InvalidArgument("ReducedToBf16: m >= 0 and n > 0");
  const size_t total = static_cast<size_t>(m) * static_cast<size_t>(n);
  if (total == 0) return KernelStatus::Ok();
  if (sum == nullptr || out == nullptr) return InvalidArgument("ReducedToBf16: null buffer");
  const size_t blocks = (total + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
  ReducedToBf16Kernel<<<grid, kThreads, 0, stream>>>(sum, bias, out, total, n);
  return FromCuda(cudaGetLastError(), "ReducedToBf16 launch");
}

}  // namespace tandem::kernels::cuda
