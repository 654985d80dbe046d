// A follower rank of a tensor × pipeline parallel group (issue 18,
// docs/parallelism.md "Pipeline parallel"): rank r > 0 loads the model,
// packs its shard (engine::ShardSpec), allocates its rank-local KV pool
// (engine::ShardKvLayout; the same num_blocks and block ids as rank 0),
// joins the group's communicators (engine::JoinRankComms) and then follows
// rank 0's step plans until a shutdown plan:
//   forward  → engine::StageRunner::Run (its stage of every micro-batch)
//   push_kv  → FollowerOptions::on_push_kv (kv-reshard's transport hook)
//   shutdown → returns OK (the process exits 0)
// Rank 0 gone (its communicators report UNAVAILABLE) → returns that error
// naming the rank (the process exits non-zero within seconds).
//
// Used by `tandem rank` (cli/rank_cmd.cc; `tandem generate` spawns those)
// and by worker follower ranks, which add their transport through the hooks.
//
// Thread-safety: RunFollowerRank runs on the calling thread until the group
// shuts down; the hooks are called on that thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "engine/kv_pool.h"
#include "parallel/communicator.h"
#include "parallel/parallel_layout.h"
#include "parallel/step_plan.h"

namespace tandem::parallel {

struct FollowerOptions {
  std::string model_dir;
  ParallelLayout layout;
  uint32_t rank = 1;                // 1 .. layout.world() - 1
  std::string group;                // the group name rank 0 uses
  int threads = 1;                  // compute threads
  uint32_t num_blocks = 0;          // rank 0's num_blocks (required)
  uint32_t block_size = 16;         // rank 0's block_size
  int64_t join_timeout_ms = 60000;  // waiting for every rank to join
  // The KV pool's memory (borrowed; must outlive the call). Null: plain
  // aligned memory. A worker's follower passes its transport's allocator.
  engine::KvPoolAllocator* allocator = nullptr;
  // Called once the pool exists, before joining the group (a worker's
  // follower registers the pool with its transport here).
  std::function<Status(engine::KvPool&)> on_pool_ready;
  // Called once every communicator has joined, with the world communicator
  // (a worker's follower hands rank 0 its KV transport's descriptor here:
  // kvtransfer::ExchangeRankDescriptors). Non-OK stops the follower.
  std::function<Status(Communicator& world)> on_joined;
  // A push_kv plan: this rank's part of a KV push (kv-reshard), reporting
  // to rank 0 over `world`. Unset: a push_kv plan is an error (the
  // follower stops).
  std::function<Status(const StepPlan& plan, engine::KvPool& pool, Communicator& world)>
      on_push_kv;
};

Status RunFollowerRank(const FollowerOptions& options);

}  // namespace tandem::parallel
