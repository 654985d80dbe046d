#include "worker/rank_layout.h"

#include <fmt/format.h>

namespace tandem::worker {

const RoleConfig& RoleSection(const FleetConfig& fleet, std::string_view role) {
  return role == "prefill" ? fleet.prefill : role == "decode" ? fleet.decode : fleet.both;
}

parallel::ParallelLayout RoleLayout(const FleetConfig& fleet, std::string_view role) {
  const RoleConfig& rc = RoleSection(fleet, role);
  return {rc.tensor_parallel, rc.pipeline_parallel};
}

parallel::ModelDims ModelDimsOf(const model::ModelConfig& c) {
  return {.num_layers = c.num_hidden_layers,
          .num_heads = c.num_attention_heads,
          .num_kv_heads = c.num_key_value_heads,
          .intermediate = c.intermediate_size,
          .vocab = c.vocab_size};
}

Status CheckRoleLayout(std::string_view role, const parallel::ParallelLayout& layout,
                       const model::ModelConfig& config, std::string_view model_path) {
  Status s = parallel::CheckLayout(layout, ModelDimsOf(config));
  if (s.ok()) return s;
  // CheckLayout's message starts with the key ("tensor_parallel 3 ...").
  return InvalidArgumentError(fmt::format("{}.{} (model {})", role, s.message(), model_path));
}

uint32_t RankProcesses(const FleetConfig& fleet, std::string_view role) {
  if (fleet.model.backend == "sim") return 1;
  return RoleLayout(fleet, role).world();
}

}  // namespace tandem::worker
