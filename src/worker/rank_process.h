// A worker's rank processes (issue 18, docs/parallelism.md "Rank
// processes"): the check of --rank/--group against the layout, the
// follower rank's whole run, and what every rank shares with rank 0 (how
// long they wait for each other, the ready line to the launcher).
#pragma once

#include <cstdint>
#include <string>

#include "common/config.h"
#include "common/status.h"
#include "worker/worker_runtime.h"

namespace tandem::worker {

// How long the ranks of a group wait for each other: followers start first
// and wait for rank 0 to load its model and transport.
inline constexpr int64_t kRankJoinTimeoutMs = 120000;

// The ready line on the launcher's pipe `fd` (none when < 0), then closes it.
void WriteReady(int fd, const std::string& grpc, const std::string& metrics);

// --rank and --group against the layout.
Status CheckRankFlags(const WorkerCommand& cmd, const FleetConfig& fleet, const RoleConfig& rc);

// A follower rank (--rank R > 0) of a worker group: its shard of the model,
// its rank-local KV pool registered with its own transport
// (worker/rank_kv.h), and rank 0's step plans until rank 0 shuts the group
// down (exit 0) or disappears (exit 1). It listens on nothing; its ready
// line (empty addresses) goes out once its pool exists, before it waits
// for rank 0.
int RunFollower(const WorkerCommand& cmd, const FleetConfig& fleet, const RoleConfig& rc,
                const std::string& name);

}  // namespace tandem::worker
