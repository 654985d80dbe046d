// The `cpu` compute backend: LlamaForward over kernels/cpu with a kernel
// ThreadPool of `threads` threads (the engine thread is one of them).
//
// Thread-safety: as ComputeBackend (one driving thread at a time); the
// ThreadPool is created and destroyed by the thread that creates the backend.
#pragma once

#include <memory>

#include "engine/backend.h"
#include "engine/llama_forward.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::engine {

class CpuBackend final : public ComputeBackend {
 public:
  CpuBackend(std::unique_ptr<LlamaForward> model, KvPool* pool, int threads);

  std::string_view name() const override { return "cpu"; }
  bool Supports(BackendFeature feature) const override;
  uint32_t vocab_size() const override { return model_->config().vocab_size; }
  size_t weight_bytes() const override { return model_->weight_bytes(); }
  Status Forward(std::span<const SeqChunk> batch, std::span<float> logits) override;

 private:
  std::unique_ptr<LlamaForward> model_;
  KvPool* pool_;  // borrowed
  std::unique_ptr<kernels::cpu::ThreadPool> threads_;
};

}  // namespace tandem::engine
