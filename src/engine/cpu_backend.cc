#include "engine/cpu_backend.h"

#include <fmt/format.h>

namespace tandem::engine {

CpuBackend::CpuBackend(std::unique_ptr<LlamaForward> model, KvPool* pool, int threads)
    : model_(std::move(model)),
      pool_(pool),
      threads_(std::make_unique<kernels::cpu::ThreadPool>(threads < 1 ? 1 : threads)) {}

bool CpuBackend::Supports(BackendFeature feature) const {
  switch (feature) {
    case BackendFeature::kRealMath:
    case BackendFeature::kBatchInvariant:
    case BackendFeature::kHostKvPool:
      return true;
    case BackendFeature::kDeviceKvPool:
      return false;
  }
  return false;
}

std::string_view BackendFeatureName(BackendFeature feature) {
  switch (feature) {
    case BackendFeature::kRealMath: return "real_math";
    case BackendFeature::kBatchInvariant: return "batch_invariant";
    case BackendFeature::kHostKvPool: return "host_kv_pool";
    case BackendFeature::kDeviceKvPool: return "device_kv_pool";
  }
  return "unknown";
}

Status CpuBackend::Forward(std::span<const SeqChunk> batch, std::span<float> logits) {
  // The workers spin for the whole forward pass (a few dozen parallel
  // regions) and go back to sleep after it (kernels/cpu/thread_pool.h).
  kernels::cpu::ThreadPool::StepScope step(threads_.get());
  return model_->Forward(batch, *pool_, logits, threads_.get(),
                         [this](uint32_t layers_done) { ReportLayersDone(layers_done); });
}

Status BackendSupports(std::string_view name, const model::ModelConfig& config) {
  if (name != "cpu") {
    return UnimplementedError(fmt::format(
        "compute backend '{}' is not available in this build (available: cpu)", name));
  }
  static const char* kArchs[] = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"};
  bool known = config.architecture.empty();
  for (const char* a : kArchs) known = known || config.architecture == a;
  if (!known) {
    return UnimplementedError(
        fmt::format("backend cpu: architecture '{}' is not supported", config.architecture));
  }
  if (config.rope.type != "default" && config.rope.type != "linear" &&
      config.rope.type != "llama3" && !config.rope.type.empty()) {
    return UnimplementedError(
        fmt::format("backend cpu: RoPE type '{}' is not supported", config.rope.type));
  }
  return Status::Ok();
}

Result<std::unique_ptr<ComputeBackend>> CreateBackend(std::string_view name,
                                                      const model::ModelConfig& config,
                                                      const model::ModelWeights& weights,
                                                      KvPool* pool, int threads,
                                                      model::ModelWeights* consume) {
  TANDEM_RETURN_IF_ERROR(BackendSupports(name, config));
  const KvLayout& kv = pool->layout();
  if (kv.num_layers != config.num_hidden_layers || kv.num_kv_heads != config.num_key_value_heads ||
      kv.head_dim != config.head_dim) {
    return InvalidArgumentError(fmt::format(
        "KV pool geometry (layers {}, kv heads {}, head_dim {}) does not match the model "
        "({}, {}, {})",
        kv.num_layers, kv.num_kv_heads, kv.head_dim, config.num_hidden_layers,
        config.num_key_value_heads, config.head_dim));
  }
  TANDEM_ASSIGN_OR_RETURN(auto model, LlamaForward::Create(config, weights, {}, consume));
  return std::unique_ptr<ComputeBackend>(new CpuBackend(std::move(model), pool, threads));
}

}  // namespace tandem::engine
