#include "sim/timing_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace tandem::sim {

Result<TimingModel> TimingModel::Create(TimingParams p) {
  auto in01 = [](double v) { return v > 0.0 && v <= 1.0; };
  if (!in01(p.compute_efficiency)) {
    return InvalidArgumentError(
        fmt::format("compute_efficiency must be in (0, 1], got {}", p.compute_efficiency));
  }
  if (!in01(p.memory_efficiency)) {
    return InvalidArgumentError(
        fmt::format("memory_efficiency must be in (0, 1], got {}", p.memory_efficiency));
  }
  if (!in01(p.gpu_memory_utilization)) {
    return InvalidArgumentError(fmt::format("gpu_memory_utilization must be in (0, 1], got {}",
                                            p.gpu_memory_utilization));
  }
  if (p.tensor_parallel < 1) return InvalidArgumentError("tensor_parallel must be >= 1");
  if (p.step_overhead_s < 0) return InvalidArgumentError("step_overhead must be >= 0");
  if (p.hardware.peak_flops <= 0 || p.hardware.memory_bytes_per_s <= 0 ||
      p.hardware.memory_bytes <= 0) {
    return InvalidArgumentError(fmt::format("hardware profile '{}' is incomplete", p.hardware.name));
  }
  if (p.shape.num_layers == 0 || p.shape.hidden_size == 0) {
    return InvalidArgumentError("the model shape is empty");
  }
  TimingModel m(std::move(p));
  const double usable = m.p_.hardware.memory_bytes * m.p_.tensor_parallel *
                        m.p_.gpu_memory_utilization;
  const double weights = static_cast<double>(m.p_.shape.resident_weight_bytes());
  if (weights >= usable) {
    return InvalidArgumentError(fmt::format(
        "model '{}' needs {:.1f} GB of weights; {} x{} at gpu_memory_utilization {} leaves "
        "{:.1f} GB: raise tensor_parallel", m.p_.shape.name, weights / 1e9,
        m.p_.hardware.name, m.p_.tensor_parallel, m.p_.gpu_memory_utilization, usable / 1e9));
  }
  return m;
}

StepCost TimingModel::Step(std::span<const SeqWork> batch) const {
  const ModelShape& s = p_.shape;
  double new_tokens = 0, attn_pairs = 0, logits = 0, kv_tokens = 0;
  for (const SeqWork& w : batch) {
    const double n = static_cast<double>(w.new_tokens);
    const double c = static_cast<double>(w.cached_tokens);
    new_tokens += n;
    attn_pairs += n * c + n * (n + 1) / 2;
    logits += w.logit_rows;
    kv_tokens += c + n;
  }
  StepCost cost;
  if (batch.empty()) return cost;
  cost.flops = 2.0 * static_cast<double>(s.linear_params()) * new_tokens +
               4.0 * static_cast<double>(s.num_layers * s.num_heads * s.head_dim) * attn_pairs +
               2.0 * static_cast<double>(s.hidden_size * s.vocab_size) * logits;
  cost.bytes = static_cast<double>(s.step_weight_bytes()) +
               static_cast<double>(s.kv_bytes_per_token()) * kv_tokens;
  const double tp = p_.tensor_parallel;
  cost.compute_seconds = cost.flops / (p_.hardware.peak_flops * tp * p_.compute_efficiency);
  cost.memory_seconds = cost.bytes / (p_.hardware.memory_bytes_per_s * tp * p_.memory_efficiency);
  cost.seconds = std::max(cost.compute_seconds, cost.memory_seconds) + p_.step_overhead_s;
  return cost;
}

StepCost TimingModel::Prefill(uint64_t prompt_tokens, uint64_t cached_tokens) const {
  const SeqWork w{prompt_tokens, cached_tokens, 1};
  return Step(std::span<const SeqWork>(&w, 1));
}

StepCost TimingModel::Decode(uint64_t batch, uint64_t context_tokens) const {
  if (batch == 0) return {};
  // Identical sequences: one SeqWork scaled would do, but keep the one path.
  std::vector<SeqWork> works(batch, SeqWork{1, context_tokens, 1});
  return Step(works);
}

uint64_t TimingModel::KvCapacityTokens() const {
  const double usable = p_.hardware.memory_bytes * p_.tensor_parallel * p_.gpu_memory_utilization;
  const double left = usable - static_cast<double>(p_.shape.resident_weight_bytes());
  if (left <= 0) return 0;
  return static_cast<uint64_t>(left / static_cast<double>(p_.shape.kv_bytes_per_token()));
}

double TimingModel::TransferSeconds(uint64_t tokens, const LinkParams& link) const {
  if (tokens == 0) return 0.0;
  const double wire = link.bits_per_s > 0 ? KvBytes(tokens) * 8.0 / link.bits_per_s : 0.0;
  return link.latency_s + wire;
}

std::string TimingModel::Describe() const {
  return fmt::format("{} x{}, {} ({:.1f}B params, {} KiB KV/token), compute eff {:.2f}, "
                     "memory eff {:.2f}",
                     p_.hardware.name, p_.tensor_parallel, p_.shape.name,
                     static_cast<double>(p_.shape.total_params()) / 1e9,
                     p_.shape.kv_bytes_per_token() / 1024.0, p_.compute_efficiency,
                     p_.memory_efficiency);
}

}  // namespace tandem::sim
