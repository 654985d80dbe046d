#include "router/router_options.h"

#include <cmath>

namespace tandem::router {

RouterOptions RouterOptionsFromConfig(const RouterConfig& config, uint32_t block_size_tokens) {
  RouterOptions o;
  o.block_size_tokens = block_size_tokens;
  o.seed = config.seed;
  o.hot_prefix_threshold = config.hot_prefix_threshold;
  o.hot_prefix_min_load_blocks = config.hot_prefix_min_load_blocks;
  o.same_node_bandwidth_bytes_per_s = config.same_node_bandwidth_gbps * 1e9;
  o.cross_node_bandwidth_bytes_per_s = config.cross_node_bandwidth_gbps * 1e9;
  o.cross_zone_bandwidth_bytes_per_s = config.cross_zone_bandwidth_gbps * 1e9;
  o.transfer_cost_per_ms = config.transfer_cost_per_ms;
  o.report_lag_ns = std::llround(config.load_report_lag_ms * 1e6);
  o.max_prediction_age_ns = std::llround(config.max_prediction_age_s * 1e9);
  return o;
}

}  // namespace tandem::router
