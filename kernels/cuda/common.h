// What every CUDA kernel launcher shares: the status it returns and the
// device view of the paged KV cache.
//
// Conventions of kernels/cuda (FlashInfer-style launchers):
// - Raw device pointers and a cudaStream_t in, a KernelStatus out; a shape
//   comment on every parameter. Nothing here allocates, synchronizes or
//   includes anything from src/.
// - Activations and weights are bf16 (`__nv_bfloat16`); every reduction
//   accumulates in f32 (sampling in 64-bit fixed point). Logits are f32.
// - A launcher checks its arguments on the host (kInvalidArgument /
//   kUnsupported, nothing launched) and returns kCudaError when the launch
//   itself failed. Errors of a kernel still running show up later on the
//   stream, as with any asynchronous CUDA call.
// - Reductions run in an order fixed by the shape of one row (head_dim,
//   hidden size, context length), never by the batch: a row's bits do not
//   depend on which other rows share the launch (docs/cuda.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace tandem::kernels::cuda {

using bf16 = __nv_bfloat16;

enum class KernelCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // a shape or pointer the launcher refuses
  kUnsupported = 2,      // a valid shape this build has no kernel for
  kCudaError = 3,        // the CUDA runtime failed (detail: cudaError_t)
  kCublasError = 4,      // cuBLAS(Lt) failed (detail: cublasStatus_t)
};

struct [[nodiscard]] KernelStatus {
  KernelCode code = KernelCode::kOk;
  int detail = 0;                 // cudaError_t / cublasStatus_t when code says so
  const char* message = "";       // static string: what was wrong and the limit

  bool ok() const { return code == KernelCode::kOk; }
  static KernelStatus Ok() { return {}; }
};

inline KernelStatus InvalidArgument(const char* message) {
  return {KernelCode::kInvalidArgument, 0, message};
}
inline KernelStatus Unsupported(const char* message) {
  return {KernelCode::kUnsupported, 0, message};
}
inline KernelStatus FromCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return KernelStatus::Ok();
  return {KernelCode::kCudaError, static_cast<int>(err), what};
}

// "message (cuda: <runtime's reason>)" into buf; returns buf.
const char* DescribeStatus(const KernelStatus& status, char* buf, int buf_size);

// The paged KV cache in device memory: the block order of
// kernels::KvCacheView ([layer][K,V][kv_head][token][head_dim] per block,
// DESIGN.md section 4) with bf16 elements. A slot is block * block_size +
// offset in block.
struct DeviceKvView {
  bf16* pool = nullptr;     // [num_blocks][block_stride]; borrowed
  size_t block_stride = 0;  // elements between blocks (>= KvBlockFloats(...))
  int num_layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;  // tokens per block

  __host__ __device__ size_t PlaneElems() const {
    return static_cast<size_t>(kv_heads) * static_cast<size_t>(block_size) *
           static_cast<size_t>(head_dim);
  }
  // K row of (block, layer, kv_head, token in block): [head_dim].
  __host__ __device__ bf16* K(int32_t block, int layer, int kv_head, int token) const {
    return pool + static_cast<size_t>(block) * block_stride +
           static_cast<size_t>(layer) * 2 * PlaneElems() +
           (static_cast<size_t>(kv_head) * static_cast<size_t>(block_size) +
            static_cast<size_t>(token)) * static_cast<size_t>(head_dim);
  }
  // V row of the same: [head_dim].
  __host__ __device__ bf16* V(int32_t block, int layer, int kv_head, int token) const {
    return K(block, layer, kv_head, token) + PlaneElems();
  }
};

}  // namespace tandem::kernels::cuda
