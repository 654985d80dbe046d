// GEMMs of the forward pass through cuBLASLt: bf16 inputs, f32 accumulation,
// bf16 or f32 output, in the Hugging Face Linear layout of
// kernels/reference (y = x w^T + bias).
//
// Thread-safety: a GemmContext is used by one thread at a time (the engine
// thread); it caches one algorithm per shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "kernels/cuda/common.h"

struct cublasLtContext;

namespace tandem::kernels::cuda {

enum class GemmOutType { kBf16, kF32 };

class GemmContext {
 public:
  // `workspace`: device memory cuBLASLt may use (32 MiB is plenty on Hopper;
  // borrowed). batch_invariant: every m uses the algorithm chosen for a
  // fixed reference m, without split-K, so a row's bits do not depend on m
  // (docs/cuda.md; checked by the gpu tests).
  static KernelStatus Create(void* workspace, size_t workspace_bytes, bool batch_invariant,
                             std::unique_ptr<GemmContext>* out);
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  // y[i][j] = sum_k x[i][k] * w[j][k] + (bias ? bias[j] : 0)
  KernelStatus Gemm(const bf16* x,     // [m][k]
                    const bf16* w,     // [n][k]
                    const bf16* bias,  // [n] or nullptr (bf16 output only)
                    void* y,           // [m][n], bf16 or f32 as out_type
                    GemmOutType out_type, int m, int n, int k, cudaStream_t stream);

  bool batch_invariant() const { return batch_invariant_; }

 private:
  GemmContext() = default;
  struct Algo;
  cublasLtContext* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  bool batch_invariant_ = false;
  // (m or the reference m, n, k, out type, bias) -> chosen algorithm
  std::map<std::tuple<int, int, int, int, bool>, std::unique_ptr<Algo>> algos_;
};

}  // namespace tandem::kernels::cuda
