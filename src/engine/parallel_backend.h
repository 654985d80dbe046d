// Rank 0's compute backend of a tensor × pipeline parallel group (issue 18,
// docs/parallelism.md "Pipeline parallel"). The engine, scheduler and prefix
// cache live on rank 0 only; each Forward:
//   1. checks the batch (so followers never receive a plan they must refuse),
//   2. cuts it into micro-batches (pp > 1: up to pp, by sequence, balanced
//      by tokens) and broadcasts the step plan over the world communicator,
//   3. runs rank 0's own shard (stage 0, tensor rank 0) through StageRunner,
//      which also gathers the logits rows from the last stage in batch order.
// The follower ranks (parallel/follower.h) must already run and join the
// same group; creation blocks until they have.
//
// A follower that dies fails the step (and every later one) with UNAVAILABLE
// naming the rank; the backend is then broken for good (the group cannot
// recover a lost shard).
//
// Features: real math, batch-invariant (every rank's forward is, micro-batch
// cuts only regroup whole sequences, and the all-reduce order is fixed), KV
// in host memory (rank 0's pool holds only its stage's layers and its KV
// heads). Layer progress (set_layer_progress) is reported from inside the
// step only when pp == 1; with pp > 1 the engine reports every layer once
// the whole step is done.
//
// Thread-safety: as ComputeBackend (one driving thread: the engine thread).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/llama_forward.h"
#include "engine/stage_runner.h"
#include "kernels/cpu/thread_pool.h"
#include "parallel/parallel_layout.h"
#include "parallel/step_plan.h"

namespace tandem::engine {

struct ParallelBackendOptions {
  parallel::ParallelLayout layout;  // world() > 1
  std::string group;                // the followers' --group
  int threads = 1;                  // compute threads of rank 0
  int64_t join_timeout_ms = 60000;  // waiting for every follower to join
  // Micro-batches per step with pp > 1: at most this many (0: pp, the
  // default; 1 turns the overlap off — bench/bench_pipeline.cc compares).
  uint32_t max_micro_batches = 0;
};

class ParallelBackend final : public ComputeBackend {
 public:
  ~ParallelBackend() override;  // broadcasts the shutdown plan (followers exit 0)

  std::string_view name() const override { return "cpu"; }
  bool Supports(BackendFeature feature) const override;
  uint32_t vocab_size() const override { return model_->config().vocab_size; }
  // Rank 0's shard (each rank reads its own share of the model per step).
  size_t weight_bytes() const override { return model_->weight_bytes(); }
  Status Forward(std::span<const SeqChunk> batch, std::span<float> logits) override;

  const parallel::ParallelLayout& layout() const { return options_.layout; }
  // The group's world communicator, for collectives between steps on the
  // engine thread (or before the engine starts): a worker's KV transport
  // descriptors and KV pushes (issue 18, worker/worker_runtime.cc).
  parallel::Communicator& world() { return *comms_.world; }
  // The sticky failure between ranks (a dead rank, named), OK while the
  // group computes. Any thread: a worker leaves routing when it is set.
  Status failure() const {
    std::lock_guard lock(failure_mu_);
    return failure_;
  }

  // Sends a plan of kind push_kv (kv-reshard fills `plan.extensions`) to the
  // followers; `plan.step` is set here. The caller then does rank 0's part.
  Status BroadcastPlan(parallel::StepPlan plan);

 private:
  friend Result<std::unique_ptr<ComputeBackend>> CreateParallelBackend(
      const model::ModelConfig&, const model::ModelWeights&, KvPool*, const ParallelBackendOptions&,
      model::ModelWeights*);
  ParallelBackend() = default;
  Status Broken(Status status);

  ParallelBackendOptions options_;
  std::unique_ptr<LlamaForward> model_;
  KvPool* pool_ = nullptr;  // borrowed
  std::unique_ptr<kernels::cpu::ThreadPool> threads_;
  RankComms comms_;
  std::unique_ptr<StageRunner> runner_;
  uint64_t step_ = 0;
  Status broken_;  // sticky once a step failed between ranks
  mutable std::mutex failure_mu_;
  Status failure_;  // broken_, readable from any thread; guarded by failure_mu_
  std::vector<uint32_t> chunk_tokens_;  // [num_seqs], scratch
};

// Rank 0 of `options.layout`: `pool` must have ShardKvLayout(config,
// {layout, 0}, block_size) (Engine::Create makes it so). Refuses a layout
// the model cannot be split by (CheckLayout's message) and a cuda/sim build
// path (CPU ranks only). Blocks until every follower joined.
// `consume`: as LlamaForward::Create's.
Result<std::unique_ptr<ComputeBackend>> CreateParallelBackend(
    const model::ModelConfig& config, const model::ModelWeights& weights, KvPool* pool,
    const ParallelBackendOptions& options, model::ModelWeights* consume = nullptr);

}  // namespace tandem::engine
