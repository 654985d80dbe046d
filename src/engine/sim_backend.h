// The `sim` compute backend (DESIGN.md section 6, docs/sim.md): no math. A
// step sleeps for the time the roofline TimingModel gives for its batch on
// the simulated GPU, so scheduling, batching and queueing behave as on that
// device, and the KV pool holds the simulated model's per-token KV size
// divided by `kv_scale` (the bytes the transport really moves).
//
// Outputs are deterministic: every token's KV slot stores a 64-bit running
// hash of the sequence up to it (tokens and positions), and the next token
// is a function of the last hash, so the same prompt gives the same tokens
// whatever the batch, the chunking, prefix-cache hits or the topology — and
// a decoder only continues correctly if the prefiller's KV bytes arrived.
// Token ids are drawn from the engine's vocabulary (the tokenizer model's)
// minus its bos/eos ids, so a sim sequence runs to max_tokens, unless
// sim.eos_probability makes a share of them the model's eos. Logits are
// one-hot (one_hot_logits()), so every sampling setting that cannot pick a
// -1e30 logit picks that token; the engine then takes it from hot_tokens()
// and asks for no logits (an empty span: no row is filled).
//
// Thread-safety: as ComputeBackend (one driving thread); the setup
// functions are pure.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "engine/backend.h"
#include "sim/timing_model.h"

namespace tandem::engine {

// What a worker (or `tandem generate`) needs to run a simulated GPU.
struct SimSetup {
  std::unique_ptr<sim::TimingModel> timing;
  // The engine's model: the tokenizer model's vocabulary and special ids,
  // the simulated shape's context length, and a KV geometry of one layer,
  // one head and `head_dim` floats per K (and V) holding the scaled size.
  model::ModelConfig storage_config;
  uint32_t num_blocks = 0;         // KV capacity of the simulated device(s)
  uint64_t real_kv_bytes_per_token = 0;
  uint64_t stored_kv_bytes_per_token = 0;
  double kv_scale = 1;             // real / stored bytes
  std::string summary;             // one line for logs: "SIMULATED H100 x1 ..."
};

// `tokenizer_model`: the config of fleet.model.path (the tokenizer's
// model). `block_size`: tokens per block. `tensor_parallel` /
// `pipeline_parallel`: the worker's role keys (issue 18); the simulated
// worker is tp x pp GPUs in this one process (sim.tensor_parallel, the
// older fleet-wide key, applies when the role's tensor_parallel is 1).
Result<SimSetup> PrepareSim(const SimConfig& sim, const model::ModelConfig& tokenizer_model,
                            uint32_t block_size, uint32_t tensor_parallel = 1,
                            uint32_t pipeline_parallel = 1);

class SimBackend final : public ComputeBackend {
 public:
  // `timing` and `pool` are borrowed.
  SimBackend(const model::ModelConfig& config, const sim::TimingModel& timing, KvPool* pool);

  std::string_view name() const override { return "sim"; }
  bool Supports(BackendFeature feature) const override;
  uint32_t vocab_size() const override { return config_.vocab_size; }
  size_t weight_bytes() const override { return timing_.params().shape.step_weight_bytes(); }
  Status Forward(std::span<const SeqChunk> batch, std::span<float> logits) override;
  bool one_hot_logits() const override { return true; }
  std::span<const uint32_t> hot_tokens() const override { return hot_; }

  // The modelled seconds of the last Forward (for tests).
  double last_step_seconds() const { return last_step_seconds_; }
  // Off: Forward returns at once (tests of outputs and of the timing alone).
  void set_sleep(bool sleep) { sleep_ = sleep; }
  // Each output token is the model's first eos id with probability `p`
  // (when SplitMix64(hash ^ kSimEosSalt) < p x 2^64; otherwise the token as
  // without it). p in [0, 1]; p > 0 needs an eos id in the vocabulary.
  Status set_eos_probability(double p);
  // Onboarding from the lower KV tiers: a step that onboarded blocks lasts
  // max(compute, Σ real block bytes / link bandwidth) — the copies overlap
  // the compute (layer by layer on a GPU). Bytes per second; 0: free.
  void set_tier_links(double host_bytes_per_s, double disk_bytes_per_s, double real_block_bytes) {
    host_bytes_per_s_ = host_bytes_per_s;
    disk_bytes_per_s_ = disk_bytes_per_s;
    real_block_bytes_ = real_block_bytes;
  }

 private:
  // Where position `pos` keeps its two words (its hash, then pos and token)
  // in the K plane: head_dim f32 (at least 4). Only 4-byte aligned when
  // head_dim is odd, so the words are copied in and out (memcpy), never
  // dereferenced as uint64_t.
  char* Slot(std::span<const uint32_t> block_table, uint32_t pos) const;
  uint32_t TokenFor(uint64_t hash) const;

  model::ModelConfig config_;
  const sim::TimingModel& timing_;
  KvPool* pool_;
  // The ids the backend may emit are [0, vocab) but these (eos, bos),
  // ascending: TokenFor maps an index among the allowed ids to its id with
  // no vocabulary-sized table (a cache miss per token after a step's sleep).
  std::vector<uint32_t> excluded_;
  uint32_t num_allowed_ = 0;
  uint32_t eos_id_ = 0;
  uint64_t eos_below_ = 0;   // SplitMix64(hash ^ kSimEosSalt) under it: eos (0: never)
  bool eos_always_ = false;  // p = 1
  std::vector<sim::SeqWork> work_;
  std::vector<uint32_t> hot_;  // the last Forward's hot token per logits row
  double last_step_seconds_ = 0;
  bool sleep_ = true;
  double host_bytes_per_s_ = 0;
  double disk_bytes_per_s_ = 0;
  double real_block_bytes_ = 0;
};

// Running hash of a sequence: h(pos) = Mix(h(pos - 1), token, pos), h(-1) = kSeed.
uint64_t SimHashStep(uint64_t previous, uint32_t token, uint32_t pos);
// sim.eos_probability's draw is SplitMix64 of the running hash xor this.
inline constexpr uint64_t kSimEosSalt = 0x656F732D73696D31ull;   // "eos-sim1"
inline constexpr uint64_t kSimHashSeed = 0x73696d2d74616e64ull;  // "sim-tand"

}  // namespace tandem::engine
