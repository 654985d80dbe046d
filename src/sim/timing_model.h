// The roofline timing model of the simulated GPU (docs/sim.md has the
// formulas with a worked example). One engine step over a batch that mixes
// prefill chunks and decode tokens costs
//   FLOPs = 2 * linear_params * new_tokens                       (matmuls)
//         + 4 * layers * heads * head_dim * sum_i (n_i * c_i + n_i (n_i + 1) / 2)
//                                                                 (causal attention over
//                                                                  the cached prefix c_i)
//         + 2 * hidden * vocab * logit_rows                       (LM head)
//   bytes = step_weight_bytes + kv_bytes_per_token * sum_i (c_i + n_i)
//                                                                 (weights once; every
//                                                                  sequence's KV read,
//                                                                  new KV written)
//   seconds = max(FLOPs / (peak_flops * tp * compute_efficiency),
//                 bytes / (memory_bw * tp * memory_efficiency)) + step_overhead
// so a long prefill is compute-bound and a decode step is bandwidth-bound.
// Tensor parallelism (tp devices per worker) scales both roofs perfectly;
// its all-reduce cost is not modelled.
//
// Thread-safety: immutable after construction; any thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"
#include "sim/hardware_profile.h"
#include "sim/model_shape.h"

namespace tandem::sim {

struct TimingParams {
  HardwareProfile hardware;
  ModelShape shape;
  uint32_t tensor_parallel = 1;        // devices per worker
  double compute_efficiency = 0.5;     // achieved / peak FLOP/s (prefill MFU)
  double memory_efficiency = 0.8;      // achieved / peak memory bandwidth (decode)
  double gpu_memory_utilization = 0.9; // share of device memory for weights + KV (vLLM's)
  double step_overhead_s = 0.0;        // fixed cost per step (kernel launches, scheduling)
};

// One sequence's part of a step.
struct SeqWork {
  uint64_t new_tokens = 0;     // n: tokens computed this step
  uint64_t cached_tokens = 0;  // c: tokens already in the KV cache before them
  uint32_t logit_rows = 0;     // rows of the LM head (1 when the step samples)
};

struct StepCost {
  double flops = 0;
  double bytes = 0;
  double compute_seconds = 0;  // FLOPs at the compute roof
  double memory_seconds = 0;   // bytes at the bandwidth roof
  double seconds = 0;          // max of the two + overhead
  bool compute_bound() const { return compute_seconds >= memory_seconds; }
};

// A network link between a prefiller and a decoder.
struct LinkParams {
  double bits_per_s = 100e9;  // 0: infinitely fast
  double latency_s = 10e-6;   // per transfer
};

class TimingModel {
 public:
  // Checks the parameters (efficiencies in (0, 1], tp >= 1, and that the
  // weights fit the devices' memory); errors name the quantity and limit.
  static Result<TimingModel> Create(TimingParams params);

  const TimingParams& params() const { return p_; }

  StepCost Step(std::span<const SeqWork> batch) const;
  // A prompt alone: `prompt_tokens` computed in one step after `cached_tokens`.
  StepCost Prefill(uint64_t prompt_tokens, uint64_t cached_tokens = 0) const;
  // A decode step of `batch` sequences, each with `context_tokens` in its cache.
  StepCost Decode(uint64_t batch, uint64_t context_tokens) const;

  // Device memory left for KV after the weights, in tokens and in blocks.
  uint64_t KvCapacityTokens() const;
  uint64_t KvCapacityBlocks(uint32_t block_size) const { return KvCapacityTokens() / block_size; }
  // Unscaled KV bytes of `tokens` tokens (what a real fleet would move).
  double KvBytes(uint64_t tokens) const {
    return static_cast<double>(tokens) * static_cast<double>(p_.shape.kv_bytes_per_token());
  }
  // Time to move `tokens` tokens' KV over `link` (latency + bytes / bandwidth).
  double TransferSeconds(uint64_t tokens, const LinkParams& link) const;

  // "H100 x1, llama-3-8b (8.0B params), compute eff 0.50, memory eff 0.80"
  std::string Describe() const;

 private:
  explicit TimingModel(TimingParams p) : p_(std::move(p)) {}
  TimingParams p_;
};

}  // namespace tandem::sim
