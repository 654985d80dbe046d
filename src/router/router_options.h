// Router settings beyond common/config.h's RouterConfig (policy,
// prefill_weight, temperature, local_prefill_threshold_tokens), in the
// units the router computes with. RouterOptionsFromConfig fills them from
// the fleet YAML's `router:` section (docs/configuration.md); the defaults
// below equal the YAML defaults.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

#include "common/config.h"
#include "common/status.h"

namespace tandem::router {

enum class Policy { kKvAware, kLeastLoaded, kRoundRobin, kRandom };
inline constexpr uint32_t kNumPolicies = 4;
std::string_view PolicyName(Policy p);
// "kv_aware" | "least_loaded" | "round_robin" | "random".
Result<Policy> ParsePolicy(std::string_view name);

struct RouterOptions {
  uint32_t block_size_tokens = 16;  // must match the fleet's block_size
  uint64_t seed = 0x7461'6e64'656d'0001;  // temperature sampling and the random policy

  // Hot-prefix guard: when the worker with the longest cached prefix carries
  // more than (1 + threshold) x the mean load of its side (prefill: queued
  // prefill blocks; decode: active blocks), and more than the floor, the
  // cache is ignored on that side and load decides.
  double hot_prefix_threshold = 1.0;
  double hot_prefix_min_load_blocks = 64.0;

  // Topology: KV transfer estimate between a prefiller and a decoder.
  double same_node_bandwidth_bytes_per_s = 13e9;    // shared memory (DESIGN.md section 4)
  double cross_node_bandwidth_bytes_per_s = 1.25e9;  // 10 GbE TCP; set ~12e9 for RDMA
  double cross_zone_bandwidth_bytes_per_s = 0.5e9;
  // Cost units (blocks of prefill work) per millisecond of estimated transfer.
  double transfer_cost_per_ms = 1.0;
  // Block size in bytes when a worker did not say (WorkerInfo.block_bytes 0).
  uint64_t default_block_bytes = 0;

  // KV tiers (docs/router.md, "Tiers"): onboarding one block from a
  // worker's host / disk tier costs this many blocks of prefill work, so a
  // lower-tier hit counts as 1 - cost cached blocks (device > host > disk).
  // Defaults: a Llama-3-8B block (2 MiB) over PCIe 5 (~50 GB/s) or from
  // NVMe (~7 GB/s) against ~0.47 ms of H100 prefill per 16 tokens.
  double host_tier_onboard_cost = 0.1;
  double disk_tier_onboard_cost = 0.6;

  // Load prediction: a routed request's load counts on its workers until a
  // load report that was produced at least this long after the routing
  // arrives (the request had time to reach the worker), or until it is
  // older than max_prediction_age_ns.
  int64_t report_lag_ns = 5'000'000;
  int64_t max_prediction_age_ns = 10'000'000'000;

  // Monotonic clock in ns; empty: std::chrono::steady_clock. Tests inject one.
  std::function<int64_t()> clock;
};

// The options a fleet file asks for: `router:` keys converted to the units
// above (GB/s -> bytes/s, ms/s -> ns) and the fleet's cache.block_size.
// Range checks are config.cc's and Router::Create's.
RouterOptions RouterOptionsFromConfig(const RouterConfig& config, uint32_t block_size_tokens);

}  // namespace tandem::router
