#include "worker/rank_process.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <iostream>

#include "common/logging.h"
#include "engine/engine.h"
#include "kvtransfer/slice_push_ranks.h"
#include "kvtransfer/transport.h"
#include "model/model_config.h"
#include "parallel/follower.h"
#include "parallel/step_plan.h"
#include "worker/kv_transport_setup.h"
#include "worker/rank_kv.h"
#include "worker/rank_layout.h"

namespace tandem::worker {

void WriteReady(int fd, const std::string& grpc, const std::string& metrics) {
  if (fd < 0) return;
  const std::string line = fmt::format("{{\"grpc\":\"{}\",\"metrics\":\"{}\"}}\n",
                                       JsonEscape(grpc), JsonEscape(metrics));
  size_t off = 0;
  while (off < line.size()) {
    const ssize_t n = write(fd, line.data() + off, line.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  close(fd);
}

Status CheckRankFlags(const WorkerCommand& cmd, const FleetConfig& fleet, const RoleConfig& rc) {
  const uint32_t world = fleet.model.backend == "sim" ? 1 : rc.tensor_parallel * rc.pipeline_parallel;
  if (cmd.rank >= world) {
    return InvalidArgumentError(fmt::format(
        "--rank {} is out of range: the worker has {} rank(s) ({}.tensor_parallel {} x "
        "{}.pipeline_parallel {}{})",
        cmd.rank, world, cmd.role, rc.tensor_parallel, cmd.role, rc.pipeline_parallel,
        fleet.model.backend == "sim" ? "; backend sim runs them in one process" : ""));
  }
  if (world > 1 && cmd.group.empty()) {
    return InvalidArgumentError(fmt::format(
        "--group is required for a worker of {} ranks: every rank process joins the group of "
        "that name (tandem launch sets it)",
        world));
  }
  // The layout must split the model (backend sim models it in one process
  // over its own model shape, docs/sim.md; 1 x 1 splits every model).
  if (world > 1) {
    TANDEM_ASSIGN_OR_RETURN(auto model, model::LoadModelConfig(fleet.model.path));
    TANDEM_RETURN_IF_ERROR(CheckRoleLayout(cmd.role, {rc.tensor_parallel, rc.pipeline_parallel},
                                           model, fleet.model.path));
  }
  return Status::Ok();
}

int RunFollower(const WorkerCommand& cmd, const FleetConfig& fleet, const RoleConfig& rc,
                const std::string& name) {
  auto fail = [&](const Status& s) {
    spdlog::error("{} rank {} stopped: {}", name, cmd.rank, s.message());
    std::cerr << fmt::format("tandem {} rank {}: {}\n", cmd.role, cmd.rank, s.message());
    return 1;
  };
  const parallel::ParallelLayout layout{rc.tensor_parallel, rc.pipeline_parallel};
  if (Status s = CheckTransportForLayout(cmd.role, layout, fleet.transport); !s.ok()) return fail(s);
  auto model = model::LoadModelConfig(fleet.model.path);
  if (!model.ok()) return fail(model.status());
  const engine::EngineOptions eo = engine::EngineOptions::FromFleetConfig(fleet);
  const uint32_t num_blocks = rc.num_blocks != 0 ? rc.num_blocks : eo.num_blocks;
  kvtransfer::TransportOptions to;
  to.backend = fleet.transport.backend;
  to.agent_name = name;
  to.num_blocks = num_blocks;
  to.peer_timeout_s = fleet.transport.peer_timeout_seconds;
  auto kv = FollowerRankKv::Create(to, layout, KvDimsOf(*model, eo.block_size), cmd.rank);
  if (!kv.ok()) return fail(kv.status());
  parallel::FollowerOptions fo;
  fo.model_dir = fleet.model.path;
  fo.layout = layout;
  fo.rank = cmd.rank;
  fo.group = cmd.group;
  fo.threads = static_cast<int>(eo.threads);
  fo.num_blocks = num_blocks;
  fo.block_size = eo.block_size;
  fo.join_timeout_ms = kRankJoinTimeoutMs;
  fo.allocator = &(*kv)->allocator();
  fo.on_pool_ready = [&cmd](engine::KvPool&) {
    WriteReady(cmd.ready_fd, "", "");  // started: the launcher starts the next rank
    return Status::Ok();
  };
  FollowerRankKv* rank_kv = kv->get();
  fo.on_joined = [rank_kv](parallel::Communicator& world) { return rank_kv->OnJoined(world); };
  fo.on_push_kv = [rank_kv](const parallel::StepPlan& plan, engine::KvPool&,
                            parallel::Communicator& world) {
    for (const parallel::PlanField& f : plan.extensions) {
      if (f.tag == kvtransfer::kPushKvSpecTag) return rank_kv->OnPushKv(f.bytes, world);
    }
    return rank_kv->OnPushKv({}, world);  // reported to rank 0 as an undecodable spec
  };
  spdlog::info("{} rank {} of {} ({}): joining group {}", name, cmd.rank, layout.world(),
               parallel::ToString(layout), cmd.group);
  if (Status s = parallel::RunFollowerRank(fo); !s.ok()) return fail(s);
  spdlog::info("{} rank {}: rank 0 shut the group down", name, cmd.rank);
  return 0;
}

}  // namespace tandem::worker
