// The fleet YAML's router keys and worker labels: parsed, converted to
// RouterOptions units, range-checked with messages naming the key and the
// limit, and effective in a decision (topology from the role labels).
#include <gtest/gtest.h>

#include <string>

#include "common/config.h"
#include "router/router.h"
#include "router/router_options.h"

namespace tandem::router {
namespace {

constexpr const char* kBase =
    "model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 1\n";

Result<FleetConfig> Parse(const std::string& extra) {
  return ParseFleetConfig(std::string(kBase) + extra, "fleet.yaml", "/tmp");
}

TEST(RouterConfig, DefaultsEqualRouterOptionsDefaults) {
  auto c = Parse("");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const RouterOptions got = RouterOptionsFromConfig(c->router, 16);
  const RouterOptions want;
  EXPECT_EQ(got.seed, want.seed);
  EXPECT_DOUBLE_EQ(got.hot_prefix_threshold, want.hot_prefix_threshold);
  EXPECT_DOUBLE_EQ(got.hot_prefix_min_load_blocks, want.hot_prefix_min_load_blocks);
  EXPECT_DOUBLE_EQ(got.same_node_bandwidth_bytes_per_s, want.same_node_bandwidth_bytes_per_s);
  EXPECT_DOUBLE_EQ(got.cross_node_bandwidth_bytes_per_s, want.cross_node_bandwidth_bytes_per_s);
  EXPECT_DOUBLE_EQ(got.cross_zone_bandwidth_bytes_per_s, want.cross_zone_bandwidth_bytes_per_s);
  EXPECT_DOUBLE_EQ(got.transfer_cost_per_ms, want.transfer_cost_per_ms);
  EXPECT_EQ(got.report_lag_ns, want.report_lag_ns);
  EXPECT_EQ(got.max_prediction_age_ns, want.max_prediction_age_ns);
  EXPECT_EQ(c->prefill.node, "");
  EXPECT_EQ(c->decode.zone, "");
}

TEST(RouterConfig, EveryKeyIsReadAndConverted) {
  auto c = Parse(
      "router:\n"
      "  policy: least_loaded\n"
      "  seed: 42\n"
      "  hot_prefix_threshold: 0.5\n"
      "  hot_prefix_min_load_blocks: 8\n"
      "  transfer_cost_per_ms: 2.5\n"
      "  load_report_lag_ms: 20\n"
      "  max_prediction_age_s: 1.5\n"
      "  topology:\n"
      "    same_node_bandwidth_gbps: 40\n"
      "    cross_node_bandwidth_gbps: 12\n"
      "    cross_zone_bandwidth_gbps: 0.1\n"
      "both:\n  node: host-a\n  zone: us-east-1a\n");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->router.policy, "least_loaded");
  const RouterOptions o = RouterOptionsFromConfig(c->router, 32);
  EXPECT_EQ(o.block_size_tokens, 32u);
  EXPECT_EQ(o.seed, 42u);
  EXPECT_DOUBLE_EQ(o.hot_prefix_threshold, 0.5);
  EXPECT_DOUBLE_EQ(o.hot_prefix_min_load_blocks, 8);
  EXPECT_DOUBLE_EQ(o.transfer_cost_per_ms, 2.5);
  EXPECT_EQ(o.report_lag_ns, 20'000'000);
  EXPECT_EQ(o.max_prediction_age_ns, 1'500'000'000);
  EXPECT_DOUBLE_EQ(o.same_node_bandwidth_bytes_per_s, 40e9);
  EXPECT_DOUBLE_EQ(o.cross_node_bandwidth_bytes_per_s, 12e9);
  EXPECT_DOUBLE_EQ(o.cross_zone_bandwidth_bytes_per_s, 0.1e9);
  EXPECT_EQ(c->both.node, "host-a");
  EXPECT_EQ(c->both.zone, "us-east-1a");
  EXPECT_TRUE(Router::Create(c->router, o).ok());
}

struct BadKey {
  const char* yaml;
  const char* key;    // the message names it
  const char* limit;  // ... and the limit
};

class RouterConfigBad : public ::testing::TestWithParam<BadKey> {};

TEST_P(RouterConfigBad, ErrorNamesKeyAndLimit) {
  auto c = Parse(GetParam().yaml);
  ASSERT_FALSE(c.ok());
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find(GetParam().key), std::string::npos) << msg;
  EXPECT_NE(msg.find(GetParam().limit), std::string::npos) << msg;
}

INSTANTIATE_TEST_SUITE_P(
    Keys, RouterConfigBad,
    ::testing::Values(
        BadKey{"router:\n  hot_prefix_threshold: -1\n", "router.hot_prefix_threshold", "[0"},
        BadKey{"router:\n  max_prediction_age_s: 0\n", "router.max_prediction_age_s", "0.001"},
        BadKey{"router:\n  load_report_lag_ms: 1e9\n", "router.load_report_lag_ms", "60000"},
        BadKey{"router:\n  topology:\n    cross_node_bandwidth_gbps: 0\n",
               "router.topology.cross_node_bandwidth_gbps", "0.001"},
        BadKey{"router:\n  topology:\n    cross_node_bandwidth: 10\n",
               "cross_node_bandwidth", "unknown key"},
        BadKey{"both:\n  nodes: a\n", "nodes", "unknown key"}));

// The labels of the fleet file reach the cost: with a slow link between
// nodes, the decoder on the prefiller's node wins although it is busier.
TEST(RouterConfig, TopologyFromYamlDecidesThePair) {
  auto c = Parse(
      "router:\n  transfer_cost_per_ms: 1\n  topology:\n    cross_node_bandwidth_gbps: 0.001\n");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto router = Router::Create(c->router, RouterOptionsFromConfig(c->router, 16)).value();
  auto add = [&](const char* name, WorkerRole role, const char* node) {
    WorkerInfo info;
    info.name = name;
    info.role = role;
    info.node = node;
    info.block_bytes = 1 << 20;
    return router->AddWorker(info).value();
  };
  const WorkerId p = add("p", WorkerRole::kPrefill, "a");
  const WorkerId d_near = add("d-near", WorkerRole::kDecode, "a");
  const WorkerId d_far = add("d-far", WorkerRole::kDecode, "b");
  LoadReport busy;
  busy.active_decode_blocks = 50;
  busy.free_blocks = 1000;
  ASSERT_TRUE(router->ApplyLoadReport(d_near, busy).ok());
  LoadReport idle;
  idle.free_blocks = 1000;
  ASSERT_TRUE(router->ApplyLoadReport(d_far, idle).ok());
  auto d = router->Route(RouteRequest{{}, 64});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->prefill, p);
  EXPECT_EQ(d->decode, d_near) << d->DebugString();

  // With the default (fast) cross-node link the idle far decoder wins.
  auto c2 = Parse("");
  auto fast = Router::Create(c2->router, RouterOptionsFromConfig(c2->router, 16)).value();
  router = std::move(fast);
  add("p", WorkerRole::kPrefill, "a");
  const WorkerId near2 = add("d-near", WorkerRole::kDecode, "a");
  const WorkerId far2 = add("d-far", WorkerRole::kDecode, "b");
  ASSERT_TRUE(router->ApplyLoadReport(near2, busy).ok());
  ASSERT_TRUE(router->ApplyLoadReport(far2, idle).ok());
  auto d2 = router->Route(RouteRequest{{}, 64});
  ASSERT_TRUE(d2.ok());
  EXPECT_EQ(d2->decode, far2) << d2->DebugString();
}

}  // namespace
}  // namespace tandem::router
