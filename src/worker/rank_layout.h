// A worker's rank layout from the fleet file (issue 18, docs/parallelism.md
// "Rank processes"): the role section's `tensor_parallel` and
// `pipeline_parallel`, checked against the model at start-up by the
// launcher (before any process starts) and by the worker itself.
//
// Pure functions, no state.
#pragma once

#include <string_view>

#include "common/config.h"
#include "common/status.h"
#include "model/model_config.h"
#include "parallel/parallel_layout.h"

namespace tandem::worker {

// The role section (prefill | decode | both) of `fleet`.
const RoleConfig& RoleSection(const FleetConfig& fleet, std::string_view role);

// Its layout as configured (backend sim models it inside one process).
parallel::ParallelLayout RoleLayout(const FleetConfig& fleet, std::string_view role);

// parallel::CheckLayout with the key named: INVALID_ARGUMENT e.g.
// "decode.tensor_parallel 3 does not divide num_attention_heads 8 (model
// DIR)".
Status CheckRoleLayout(std::string_view role, const parallel::ParallelLayout& layout,
                       const model::ModelConfig& config, std::string_view model_path);

// How many processes `tandem launch` starts for one worker of `role`: the
// layout's world size, 1 for backend sim.
uint32_t RankProcesses(const FleetConfig& fleet, std::string_view role);

}  // namespace tandem::worker
