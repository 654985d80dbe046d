#include "worker/rank_layout.h"

#include <fmt/format.h>

#include "engine/llama_forward.h"

namespace tandem::worker {

const RoleConfig& RoleSection(const FleetConfig& fleet, std::string_view role) {
  return role == "prefill" ? fleet.prefill : role == "decode" ? fleet.decode : fleet.both;
}

parallel::ParallelLayout RoleLayout(const FleetConfig& fleet, std::string_view role) {
  const RoleConfig& rc = RoleSection(fleet, role);
  return {rc.tensor_parallel, rc.pipeline_parallel};
}

Status CheckRoleLayout(std::string_view role, const parallel::ParallelLayout& layout,
                       const model::ModelConfig& config, std::string_view model_path) {
  Status s = parallel::CheckLayout(layout, engine::DimsOf(config));
  if (s.ok()) return s;
  // CheckLayout's message starts with the key ("tensor_parallel 3 ...").
  return InvalidArgumentError(fmt::format("{}.{} (model {})", role, s.message(), model_path));
}

uint32_t RankProcesses(const FleetConfig& fleet, std::string_view role) {
  if (fleet.model.backend == "sim") return 1;
  return RoleLayout(fleet, role).world();
}

}  // namespace tandem::worker
