#include "parallel/follower.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <vector>

#include "engine/llama_forward.h"
#include "engine/stage_runner.h"
#include "kernels/cpu/thread_pool.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tandem::parallel {

Status RunFollowerRank(const FollowerOptions& o) {
  const uint32_t world = o.layout.world();
  if (world <= 1) {
    return InvalidArgumentError(fmt::format(
        "--tensor-parallel {} x --pipeline-parallel {}: a group of {} rank(s) has no follower "
        "ranks",
        o.layout.tp, o.layout.pp, world));
  }
  if (o.rank == 0 || o.rank >= world) {
    return InvalidArgumentError(fmt::format(
        "--rank {}: a follower rank is 1 .. {} for {}", o.rank, world - 1, ToString(o.layout)));
  }
  if (o.group.empty()) return InvalidArgumentError("--group: the rank group name is empty");
  if (o.num_blocks == 0 || o.block_size == 0) {
    return InvalidArgumentError(fmt::format("--num-blocks ({}) and --block-size ({}) must be > 0",
                                            o.num_blocks, o.block_size));
  }
  TANDEM_ASSIGN_OR_RETURN(model::ModelConfig config, model::LoadModelConfig(o.model_dir));
  TANDEM_RETURN_IF_ERROR(CheckLayout(o.layout, engine::DimsOf(config)));
  std::unique_ptr<engine::LlamaForward> model;
  {
    TANDEM_ASSIGN_OR_RETURN(model::ModelWeights weights,
                            model::LoadWeights(o.model_dir, config, model::WeightFormat::kF32));
    TANDEM_ASSIGN_OR_RETURN(model, engine::LlamaForward::Create(config, weights, {o.layout, o.rank},
                                                                /*consume=*/&weights));
    model::ReleaseHostWeights(weights);  // the packed shard is all this rank keeps
  }
  const engine::ShardSpec shard{o.layout, o.rank};
  std::unique_ptr<engine::AlignedKvPoolAllocator> own_allocator;
  engine::KvPoolAllocator* allocator = o.allocator;
  if (allocator == nullptr) {
    own_allocator = std::make_unique<engine::AlignedKvPoolAllocator>();
    allocator = own_allocator.get();
  }
  TANDEM_ASSIGN_OR_RETURN(
      auto pool, engine::KvPool::Create(engine::ShardKvLayout(config, shard, o.block_size),
                                        o.num_blocks, *allocator));
  if (o.on_pool_ready) TANDEM_RETURN_IF_ERROR(o.on_pool_ready(*pool));
  kernels::cpu::ThreadPool threads(o.threads < 1 ? 1 : o.threads);
  TANDEM_ASSIGN_OR_RETURN(engine::RankComms comms,
                          engine::JoinRankComms(o.layout, o.rank, o.group, o.join_timeout_ms));
  if (o.on_joined) TANDEM_RETURN_IF_ERROR(o.on_joined(*comms.world));
  spdlog::info("rank {} of {} ({}, stage {}, tensor rank {}): joined group '{}'", o.rank, world,
               ToString(o.layout), o.layout.stage_of(o.rank), o.layout.tp_rank_of(o.rank),
               o.group);
  engine::StageRunner runner(o.layout, o.rank, model.get(), pool.get(), &comms, &threads);
  std::vector<engine::SeqChunk> batch;
  while (true) {
    auto plan = ReceiveStepPlan(*comms.world);
    if (!plan.ok()) {
      return plan.status().WithContext(fmt::format("rank {} waiting for rank 0's step plan", o.rank));
    }
    switch (plan->kind) {
      case StepKind::kShutdown:
        spdlog::info("rank {}: shutdown plan after step {}", o.rank, plan->step);
        return Status::Ok();
      case StepKind::kPushKv:
        if (!o.on_push_kv) {
          return UnimplementedError(fmt::format(
              "rank {}: step {} is a push_kv plan, and this rank has no KV transport", o.rank,
              plan->step));
        }
        TANDEM_RETURN_IF_ERROR(o.on_push_kv(*plan, *pool, *comms.world));
        break;
      case StepKind::kForward: {
        batch.clear();
        for (const PlanChunk& c : plan->chunks) {
          engine::SeqChunk s;
          s.tokens = c.tokens;
          s.start_pos = c.start_pos;
          s.block_table = c.block_table;
          s.num_logits = c.num_logits;
          batch.push_back(s);
        }
        kernels::cpu::ThreadPool::StepScope scope(&threads);
        Status st = runner.Run(batch, plan->micro_batch_ends, {});
        if (!st.ok()) return st.WithContext(fmt::format("rank {} step {}", o.rank, plan->step));
        break;
      }
    }
  }
}

}  // namespace tandem::parallel
