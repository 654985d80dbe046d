#include "engine/sim_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "common/splitmix.h"

namespace tandem::engine {

namespace {
constexpr auto SplitMix = SplitMix64;
}  // namespace

uint64_t SimHashStep(uint64_t previous, uint32_t token, uint32_t pos) {
  return SplitMix(previous ^ SplitMix((uint64_t{pos} << 32) | token));
}

Result<SimSetup> PrepareSim(const SimConfig& cfg, const model::ModelConfig& tokenizer_model,
                            uint32_t block_size, uint32_t tensor_parallel,
                            uint32_t pipeline_parallel) {
  if (cfg.model_shape.empty()) {
    return InvalidArgumentError("sim.model_shape is required with model.backend 'sim'");
  }
  TANDEM_ASSIGN_OR_RETURN(sim::HardwareProfile hw, sim::FindHardwareProfile(cfg.profile));
  auto shape = sim::LoadModelShape(cfg.model_shape);
  if (!shape.ok()) return shape.status().WithContext("sim.model_shape");
  sim::TimingParams tp;
  tp.hardware = hw;
  tp.shape = *shape;
  if (tensor_parallel > 1 && cfg.tensor_parallel > 1 && tensor_parallel != cfg.tensor_parallel) {
    return InvalidArgumentError(fmt::format(
        "sim.tensor_parallel ({}) and the role's tensor_parallel ({}) disagree: set only the role's",
        cfg.tensor_parallel, tensor_parallel));
  }
  tp.tensor_parallel = tensor_parallel > 1 ? tensor_parallel : cfg.tensor_parallel;
  tp.pipeline_parallel = pipeline_parallel;
  tp.gpus_per_node = cfg.gpus_per_node;
  TANDEM_ASSIGN_OR_RETURN(tp.intra_node_link,
                          sim::ParseLinkClass(cfg.intra_node_link, "sim.intra_node_link"));
  TANDEM_ASSIGN_OR_RETURN(tp.inter_node_link,
                          sim::ParseLinkClass(cfg.inter_node_link, "sim.inter_node_link"));
  tp.compute_efficiency = cfg.compute_efficiency;
  tp.memory_efficiency = cfg.memory_efficiency;
  tp.gpu_memory_utilization = cfg.gpu_memory_utilization;
  tp.step_overhead_s = cfg.step_overhead_us * 1e-6;
  auto timing = sim::TimingModel::Create(tp);
  if (!timing.ok()) return timing.status().WithContext("sim");

  SimSetup s;
  s.timing = std::make_unique<sim::TimingModel>(std::move(timing).value());
  s.real_kv_bytes_per_token = shape->kv_bytes_per_token();
  // K and V of one head: head_dim f32 each, so 8 bytes per head_dim unit;
  // at least 4 floats per K (the running hash, token and position live there).
  const uint64_t scaled = (s.real_kv_bytes_per_token + cfg.kv_scale - 1) / cfg.kv_scale;
  const uint32_t head_dim = static_cast<uint32_t>(std::max<uint64_t>(4, (scaled + 7) / 8));
  s.stored_kv_bytes_per_token = uint64_t{head_dim} * 8;
  s.kv_scale = static_cast<double>(s.real_kv_bytes_per_token) /
               static_cast<double>(s.stored_kv_bytes_per_token);
  model::ModelConfig& mc = s.storage_config;
  mc = tokenizer_model;
  mc.architecture = "sim";
  mc.num_hidden_layers = 1;
  mc.num_attention_heads = 1;
  mc.num_key_value_heads = 1;
  mc.head_dim = head_dim;
  mc.hidden_size = head_dim;
  mc.max_position_embeddings = static_cast<uint32_t>(
      std::min<uint64_t>(shape->max_position_embeddings, 1u << 20));
  mc.sliding_window = 0;
  const uint64_t blocks = s.timing->KvCapacityBlocks(block_size);
  if (blocks == 0) {
    return InvalidArgumentError(fmt::format(
        "sim: {} leaves no device memory for KV after the weights of {}", hw.name, shape->name));
  }
  s.num_blocks = static_cast<uint32_t>(std::min<uint64_t>(blocks, 1u << 24));
  s.summary = fmt::format(
      "SIMULATED GPU: {}; KV {} tokens ({} blocks); KV moved at 1/{:.0f} of its real size ({} of "
      "{} bytes per token)",
      s.timing->Describe(), s.timing->KvCapacityTokens(), s.num_blocks, s.kv_scale,
      s.stored_kv_bytes_per_token, s.real_kv_bytes_per_token);
  return s;
}

SimBackend::SimBackend(const model::ModelConfig& config, const sim::TimingModel& timing,
                       KvPool* pool)
    : config_(config), timing_(timing), pool_(pool) {
  for (uint32_t id : config_.eos_token_ids) {
    if (id < config_.vocab_size) excluded_.push_back(id);
  }
  if (config_.bos_token_id >= 0 && static_cast<uint32_t>(config_.bos_token_id) < config_.vocab_size) {
    excluded_.push_back(static_cast<uint32_t>(config_.bos_token_id));
  }
  std::sort(excluded_.begin(), excluded_.end());
  excluded_.erase(std::unique(excluded_.begin(), excluded_.end()), excluded_.end());
  num_allowed_ = config_.vocab_size - static_cast<uint32_t>(excluded_.size());
}

bool SimBackend::Supports(BackendFeature feature) const {
  switch (feature) {
    case BackendFeature::kRealMath: return false;
    case BackendFeature::kBatchInvariant: return true;
    case BackendFeature::kHostKvPool: return true;
    case BackendFeature::kDeviceKvPool: return false;
  }
  return false;
}

char* SimBackend::Slot(std::span<const uint32_t> block_table, uint32_t pos) const {
  const KvLayout& l = pool_->layout();
  float* block = pool_->block(block_table[pos / l.block_size]);
  // K plane of the only layer and head: [token][head_dim].
  return reinterpret_cast<char*>(block + size_t{pos % l.block_size} * l.head_dim);
}

Status SimBackend::set_eos_probability(double p) {
  if (!(p >= 0 && p <= 1)) {
    return InvalidArgumentError(fmt::format("sim.eos_probability {} is outside [0, 1]", p));
  }
  eos_below_ = 0;
  eos_always_ = p >= 1;
  if (p == 0) return Status::Ok();
  const auto& eos = config_.eos_token_ids;
  const auto it =
      std::find_if(eos.begin(), eos.end(), [&](uint32_t id) { return id < config_.vocab_size; });
  if (it == eos.end()) {
    return InvalidArgumentError(fmt::format(
        "sim.eos_probability {}: the model (fleet.model.path) has no eos token id in its "
        "vocabulary of {}",
        p, config_.vocab_size));
  }
  eos_id_ = *it;
  eos_below_ = static_cast<uint64_t>(std::ldexp(p, 64));  // p < 1: below 2^64
  return Status::Ok();
}

uint32_t SimBackend::TokenFor(uint64_t hash) const {
  if (eos_always_ || (eos_below_ != 0 && SplitMix(hash ^ kSimEosSalt) < eos_below_)) return eos_id_;
  if (num_allowed_ == 0) return 0;  // every id is eos or bos
  // The index-th allowed id: step over the excluded ids at or below it.
  uint32_t id = static_cast<uint32_t>(SplitMix(hash) % num_allowed_);
  for (uint32_t e : excluded_) {
    if (e > id) break;
    ++id;
  }
  return id;
}

Status SimBackend::Forward(std::span<const SeqChunk> batch, std::span<float> logits) {
  const auto start = std::chrono::steady_clock::now();
  const uint32_t vocab = config_.vocab_size;
  work_.clear();
  hot_.clear();
  const bool fill = !logits.empty();
  size_t row = 0;
  double onboard_seconds = 0;
  // The slots this step reads and writes are cold after the last step's
  // sleep (cache and TLB): ask for all of them first, so their misses
  // overlap instead of coming one sequence after another.
  const uint32_t bs = pool_->layout().block_size;
  for (const SeqChunk& c : batch) {
    const size_t end = c.start_pos + c.tokens.size();
    if (c.tokens.empty() || (end + bs - 1) / bs > c.block_table.size()) continue;
    if (c.start_pos > 0) __builtin_prefetch(Slot(c.block_table, c.start_pos - 1), 0);
    __builtin_prefetch(Slot(c.block_table, c.start_pos), 1);
  }
  for (const SeqChunk& c : batch) {
    if (c.tokens.empty()) continue;
    const uint32_t end = c.start_pos + static_cast<uint32_t>(c.tokens.size());
    if (size_t{(end + pool_->layout().block_size - 1) / pool_->layout().block_size} >
        c.block_table.size()) {
      return InternalError(fmt::format("sim: block table covers {} blocks; positions up to {}",
                                       c.block_table.size(), end));
    }
    uint64_t h = kSimHashSeed;
    if (c.start_pos > 0) std::memcpy(&h, Slot(c.block_table, c.start_pos - 1), sizeof(h));
    for (size_t i = 0; i < c.tokens.size(); ++i) {
      const uint32_t pos = c.start_pos + static_cast<uint32_t>(i);
      h = SimHashStep(h, c.tokens[i], pos);
      const uint64_t words[2] = {h, (uint64_t{pos} << 32) | c.tokens[i]};
      std::memcpy(Slot(c.block_table, pos), words, sizeof(words));
    }
    // Only the last position's logits are ever sampled; earlier rows (if
    // asked for) repeat it.
    const uint32_t hot = c.num_logits > 0 ? TokenFor(h) : 0;
    for (uint32_t k = 0; k < c.num_logits; ++k) {
      hot_.push_back(hot);
      if (fill) {
        if ((row + 1) * vocab > logits.size()) return InternalError("sim: logits buffer too small");
        float* r = logits.data() + row * vocab;
        std::fill(r, r + vocab, -1e30f);
        r[hot] = 0.0f;
      }
      ++row;
    }
    work_.push_back(sim::SeqWork{c.tokens.size(), c.start_pos, c.num_logits});
    if (host_bytes_per_s_ > 0) onboard_seconds += c.onboarded_host_blocks * real_block_bytes_ / host_bytes_per_s_;
    if (disk_bytes_per_s_ > 0) onboard_seconds += c.onboarded_disk_blocks * real_block_bytes_ / disk_bytes_per_s_;
  }
  last_step_seconds_ = std::max(timing_.Step(work_).seconds, onboard_seconds);
  if (sleep_) {
    std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                              std::chrono::duration<double>(last_step_seconds_)));
  }
  return Status::Ok();
}

}  // namespace tandem::engine
