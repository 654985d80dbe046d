// Autoscaling with real processes (issue 22; docs/scheduling.md,
// "Autoscaling"): a sim 1P1D fleet launched with autoscale.enabled. A small
// bounded ramp of requests raises the proxy's
// tandem_planner_desired_workers to the bounds' max; the launcher follows by
// starting a prefiller and a decoder (the state file lists them, the proxy
// registers them); once the load stops the planner lowers its counts after
// the cooldown and the launcher drains the newest workers (SIGTERM, their
// graceful drain), back to 1P1D. No request fails at any point.
// Targets are set far below what any request takes, so that the direction
// of every decision does not depend on the machine's speed or load.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <future>
#include <sstream>
#include <thread>

#include "../fleet/fleet_harness.h"

namespace tandem::testing {
namespace {

using namespace std::chrono_literals;

// The value of `name{... LABEL="VALUE" ...}` in Prometheus text; -1 if absent.
double LabelValue(const std::string& text, const std::string& name, const std::string& label,
                  const std::string& value) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + "{", 0) != 0) continue;
    if (line.find(fmt::format("{}=\"{}\"", label, value)) == std::string::npos) continue;
    return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}
double RoleValue(const std::string& text, const std::string& name, const std::string& role) {
  return LabelValue(text, name, "role", role);
}

// Workers of `role` in the state file (the launcher rewrites it as they come and go).
int StateWorkers(const std::string& state_path, const std::string& role) {
  const std::string text = ReadText(state_path);
  if (text.empty()) return -1;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    int n = 0;
    for (const auto& w : j.at("workers")) n += w.at("role") == role ? 1 : 0;
    return n;
  } catch (const std::exception&) {
    return -1;
  }
}

TEST(AutoscaleFleet, LauncherStartsAndDrainsWorkersFollowingThePlanner) {
  FleetOptions o;
  o.prefill = 1;
  o.decode = 1;
  o.max_batched_tokens = 512;
  o.policy = "kv_aware";
  o.log_level = "info";  // the launcher's autoscale lines are asserted on
  o.model_yaml = "  backend: sim\n  name: itest\n  max_model_len: 4096\n";
  o.extra_yaml = fmt::format(
      "sim:\n  profile: H100\n  model_shape: {}/configs/sim/models/llama-3-8b\n"
      "  link_gbps: 100\n  link_latency_us: 10\n  kv_scale: 256\n"
      "autoscale:\n  enabled: true\n  prefill:\n    min: 1\n    max: 2\n"
      "  decode:\n    min: 1\n    max: 2\n  interval_s: 0.2\n  window_s: 1.5\n"
      "  scale_up_cooldown_s: 0.5\n  scale_down_cooldown_s: 2\n"
      // Far below any real TTFT/ITL: every request counts as over target.
      "  ttft_target_ms: 1\n  itl_target_ms: 0.1\n",
      TANDEM_SOURCE_DIR);
  o.proxy_yaml = "  drain_seconds: 10\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = (*fleet)->proxy_grpc();
  const std::string metrics = (*fleet)->proxy_metrics();
  const std::string state =
      (std::filesystem::path((*fleet)->config_path()).parent_path() / "state.json").string();
  ASSERT_EQ(StateWorkers(state, "prefill"), 1) << state << ": " << ReadText(state);
  ASSERT_EQ(StateWorkers(state, "decode"), 1);
  {
    auto m = Scrape(metrics);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(RoleValue(*m, "tandem_planner_desired_workers", "prefill"), 1);
    EXPECT_EQ(RoleValue(*m, "tandem_planner_desired_workers", "decode"), 1);
    EXPECT_EQ(RoleValue(*m, "tandem_fleet_workers", "prefill"), 1);
    EXPECT_EQ(RoleValue(*m, "tandem_fleet_workers", "decode"), 1);
    EXPECT_EQ(RoleValue(*m, "tandem_fleet_workers", "both"), 0);
  }

  // The ramp: 1, then 2, then 4 clients, each sending requests one after
  // another until the fleet has grown to 2P2D (bounded: 600 requests, 90 s).
  std::atomic<bool> grown{false};
  std::atomic<int> sent{0}, failed{0};
  std::string first_error;
  std::mutex error_mu;
  auto client = [&](uint32_t seed) {
    for (uint32_t i = 0; !grown.load() && sent.fetch_add(1) < 600; ++i) {
      GenerateArgs a;
      a.prompt_ids = PromptIds(seed * 1000 + i, 200, 4000);
      a.max_tokens = 16;
      auto c = Generate(proxy, a);
      if (!c.ok() || c->token_ids.size() != 16) {
        ++failed;
        std::lock_guard lock(error_mu);
        if (first_error.empty()) first_error = c.ok() ? "short completion" : c.status().ToString();
      }
    }
  };
  std::vector<std::future<void>> clients;
  const auto ramp_start = std::chrono::steady_clock::now();
  for (uint32_t step : {1u, 2u, 4u}) {
    while (clients.size() < step) {
      clients.push_back(std::async(std::launch::async, client, static_cast<uint32_t>(clients.size())));
    }
    if (WaitUntil([&] { return StateWorkers(state, "prefill") == 2 &&
                               StateWorkers(state, "decode") == 2; },
                  step == 4 ? 90s : 3s)) {
      break;
    }
  }
  const bool reached = StateWorkers(state, "prefill") == 2 && StateWorkers(state, "decode") == 2;
  // The grown fleet serves a few more requests (the new workers are routed to).
  if (reached) {
    const int at = sent.load();
    WaitUntil([&] { return sent.load() >= at + 16; }, 30s);
  }
  grown = true;
  for (auto& c : clients) c.get();
  EXPECT_EQ(failed.load(), 0) << first_error;
  ASSERT_TRUE(reached) << "not grown to 2P2D after "
                       << std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                        ramp_start).count()
                       << " s; see " << (*fleet)->log_path();
  {
    auto m = Scrape(metrics);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(RoleValue(*m, "tandem_planner_desired_workers", "prefill"), 2);
    EXPECT_EQ(RoleValue(*m, "tandem_planner_desired_workers", "decode"), 2);
  }
  EXPECT_TRUE(WaitForLogLine((*fleet)->log_path(), "starting prefill-1", 1s).has_value());
  EXPECT_TRUE(WaitForLogLine((*fleet)->log_path(), "starting decode-1", 1s).has_value());
  // Both new workers registered with the proxy.
  EXPECT_TRUE(WaitUntil([&] {
    auto m = Scrape(metrics);
    return m.ok() && RoleValue(*m, "tandem_fleet_workers", "prefill") == 2 &&
           RoleValue(*m, "tandem_fleet_workers", "decode") == 2;
  }, 30s));

  // Idle: the window empties, the planner steps down after its cooldown and
  // the launcher drains the newest workers.
  ASSERT_TRUE(WaitUntil([&] { return StateWorkers(state, "prefill") == 1 &&
                                     StateWorkers(state, "decode") == 1; },
                        60s))
      << "still " << StateWorkers(state, "prefill") << "P" << StateWorkers(state, "decode")
      << "D; see " << (*fleet)->log_path();
  EXPECT_TRUE(WaitForLogLine((*fleet)->log_path(), "draining prefill-1", 5s).has_value());
  EXPECT_TRUE(WaitForLogLine((*fleet)->log_path(), "draining decode-1", 5s).has_value());
  // Each drained worker exits cleanly on its own (not killed).
  EXPECT_TRUE(
      WaitForLogLine((*fleet)->log_path(), "exited with status 0 after draining", 30s).has_value());
  auto m = Scrape(metrics);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(RoleValue(*m, "tandem_planner_desired_workers", "prefill"), 1);
  EXPECT_EQ(RoleValue(*m, "tandem_planner_desired_workers", "decode"), 1);
  EXPECT_TRUE(WaitUntil([&] {
    auto mm = Scrape(metrics);
    return mm.ok() && RoleValue(*mm, "tandem_fleet_workers", "prefill") == 1 &&
           RoleValue(*mm, "tandem_fleet_workers", "decode") == 1;
  }, 30s));

  // The smaller fleet still serves, and no request failed in the whole run.
  GenerateArgs a;
  a.prompt_ids = PromptIds(7, 100, 4000);
  a.max_tokens = 8;
  auto c = Generate(proxy, a);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->token_ids.size(), 8u);
  auto after = Scrape(metrics);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(LabelValue(*after, "tandem_requests_total", "outcome", "failed"), 0);
  EXPECT_EQ(LabelValue(*after, "tandem_requests_total", "outcome", "rejected"), 0);
  EXPECT_GT(LabelValue(*after, "tandem_requests_total", "outcome", "ok"), 16);
  auto stopped = (*fleet)->Stop(30s);
  ASSERT_TRUE(stopped.ok()) << stopped.status().ToString();
  EXPECT_EQ(*stopped, 0);
}

}  // namespace
}  // namespace tandem::testing
