#include "engine/parallel_backend.h"

#include <fmt/format.h>

#include <algorithm>

namespace tandem::engine {

ParallelBackend::~ParallelBackend() {
  if (!broken_.ok() || comms_.world == nullptr) return;
  parallel::StepPlan plan;
  plan.kind = parallel::StepKind::kShutdown;
  plan.step = ++step_;
  // Best effort: a follower already gone has nothing left to stop.
  (void)parallel::SendStepPlan(*comms_.world, plan);
}

bool ParallelBackend::Supports(BackendFeature feature) const {
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

Status ParallelBackend::Broken(Status status) {
  broken_ = status;
  std::lock_guard lock(failure_mu_);
  failure_ = status;
  return status;
}

Status ParallelBackend::BroadcastPlan(parallel::StepPlan plan) {
  TANDEM_RETURN_IF_ERROR(broken_);
  plan.step = ++step_;
  Status st = parallel::SendStepPlan(*comms_.world, plan);
  if (!st.ok()) return Broken(st.WithContext("broadcasting the step plan"));
  return Status::Ok();
}

Status ParallelBackend::Forward(std::span<const SeqChunk> batch, std::span<float> logits) {
  TANDEM_RETURN_IF_ERROR(broken_);
  const model::ModelConfig& c = model_->config();
  // Everything a follower would refuse is refused here, before the plan
  // goes out: a follower that fails a step cannot tell rank 0 why.
  TANDEM_RETURN_IF_ERROR(CheckForwardBatch(batch, pool_->layout().block_size,
                                           c.max_position_embeddings, c.vocab_size,
                                           logits.size()));
  size_t total = 0;
  chunk_tokens_.clear();
  for (const SeqChunk& s : batch) {
    for (uint32_t id : s.tokens) {
      if (id >= c.vocab_size) {
        return InvalidArgumentError(
            fmt::format("token id {} is out of range (vocabulary of {})", id, c.vocab_size));
      }
    }
    for (uint32_t b : s.block_table) {
      if (b >= pool_->num_blocks()) {
        return InvalidArgumentError(fmt::format("forward: block id {} out of range (pool has {})",
                                                b, pool_->num_blocks()));
      }
    }
    total += s.tokens.size();
    chunk_tokens_.push_back(static_cast<uint32_t>(s.tokens.size()));
  }
  if (total == 0) return Status::Ok();

  parallel::StepPlan plan;
  plan.kind = parallel::StepKind::kForward;
  plan.chunks.reserve(batch.size());
  for (const SeqChunk& s : batch) {
    parallel::PlanChunk pc;
    pc.tokens.assign(s.tokens.begin(), s.tokens.end());
    pc.start_pos = s.start_pos;
    pc.block_table.assign(s.block_table.begin(), s.block_table.end());
    pc.num_logits = s.num_logits;
    plan.chunks.push_back(std::move(pc));
  }
  if (options_.layout.pp > 1) {
    const uint32_t most = options_.max_micro_batches == 0
                              ? options_.layout.pp
                              : std::min(options_.max_micro_batches, options_.layout.pp);
    plan.micro_batch_ends = parallel::SplitMicroBatches(chunk_tokens_, most);
  }
  TANDEM_RETURN_IF_ERROR(BroadcastPlan(plan));

  kernels::cpu::ThreadPool::StepScope scope(threads_.get());
  std::function<void(uint32_t)> progress;
  if (options_.layout.pp == 1) {
    progress = [this](uint32_t layers_done) { ReportLayersDone(layers_done); };
  }
  Status st = runner_->Run(batch, plan.micro_batch_ends, logits, progress);
  if (!st.ok()) return Broken(st);
  return Status::Ok();
}

Result<std::unique_ptr<ComputeBackend>> CreateParallelBackend(const model::ModelConfig& config,
                                                              const model::ModelWeights& weights,
                                                              KvPool* pool,
                                                              const ParallelBackendOptions& options,
                                                              model::ModelWeights* consume) {
  const parallel::ParallelLayout& layout = options.layout;
  TANDEM_RETURN_IF_ERROR(parallel::CheckLayout(layout, DimsOf(config)));
  if (options.group.empty()) {
    return InvalidArgumentError("parallel backend: the rank group name is empty");
  }
  const ShardSpec shard{layout, 0};
  const KvLayout want = ShardKvLayout(config, shard, pool->layout().block_size);
  const KvLayout& have = pool->layout();
  if (have.num_layers != want.num_layers || have.num_kv_heads != want.num_kv_heads ||
      have.head_dim != want.head_dim) {
    return InvalidArgumentError(fmt::format(
        "KV pool geometry (layers {}, kv heads {}, head_dim {}) does not match rank 0 of {} "
        "({}, {}, {})",
        have.num_layers, have.num_kv_heads, have.head_dim, parallel::ToString(layout),
        want.num_layers, want.num_kv_heads, want.head_dim));
  }
  std::unique_ptr<ParallelBackend> b(new ParallelBackend());
  b->options_ = options;
  b->pool_ = pool;
  TANDEM_ASSIGN_OR_RETURN(b->model_, LlamaForward::Create(config, weights, shard, consume));
  b->threads_ = std::make_unique<kernels::cpu::ThreadPool>(options.threads < 1 ? 1 : options.threads);
  TANDEM_ASSIGN_OR_RETURN(b->comms_,
                          JoinRankComms(layout, 0, options.group, options.join_timeout_ms));
  b->runner_ = std::make_unique<StageRunner>(layout, 0, b->model_.get(), pool, &b->comms_,
                                             b->threads_.get());
  return std::unique_ptr<ComputeBackend>(std::move(b));
}

}  // namespace tandem::engine
