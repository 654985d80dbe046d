// Kernels of the cuda backend's tensor parallelism (issue 18,
// docs/parallelism.md "CUDA"): what follows the all-reduce of a
// row-parallel GEMM. Conventions: kernels/cuda/common.h.
//
// Thread-safety: launchers are stateless; any thread may launch on its own
// stream.
#pragma once

#include "kernels/cuda/common.h"

namespace tandem::kernels::cuda {

// out[i][j] = bf16(sum[i][j] + (bias ? bias[j] : 0)) (round to nearest
// even): a row-parallel GEMM's all-reduced f32 partial sums, the bias added
// once after the reduction.
KernelStatus ReducedToBf16(const float* sum,  // [m][n]
                           const bf16* bias,  // [n] or nullptr
                           bf16* out,         // [m][n]
                           int m, int n, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
