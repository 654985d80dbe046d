// Issue 17, KV tiers on a real CPU 1P1D fleet (tandem launch: real
// processes, gRPC, UCX) with a small device tier, a small host tier and a
// disk tier:
// - every tier series exists at zero at start-up;
// - after more distinct prompts than the device tier holds, the first prompt
//   again reports cached tokens, found in the host or disk tier (the
//   prefiller's tier metrics say which);
// - after the fleet is stopped and started on the same disk directory, the
//   first request of a known prompt reports cached tokens from disk;
// - outputs equal `tandem generate` throughout.
#include <gtest/gtest.h>

#include <iostream>

#include <chrono>
#include <filesystem>
#include <functional>
#include <regex>
#include <thread>
#include <string>
#include <vector>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 8;
constexpr uint32_t kPromptTokens = 200;  // 12 full blocks reusable (the last token is computed)
constexpr uint32_t kPrompts = 8;         // 96 committed blocks per worker > 64 device + 16 host

// Value of `metric{...tier="TIER"...}` in Prometheus text; -1 when absent.
double TierValue(const std::string& text, const std::string& metric, const std::string& tier) {
  const std::regex re("^" + metric + R"(\{[^}]*tier=")" + tier + R"("[^}]*\} ([-+0-9.eE]+)$)");
  std::smatch m;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    if (std::regex_match(line, m, re)) return std::stod(m[1]);
    pos = end + 1;
  }
  return -1;
}

// The prefiller's metrics once `done(text)` holds: workers publish their
// counters on a monitor tick, so the test waits for the tick (bounded).
std::string WaitForMetrics(const std::string& address, const std::function<bool(const std::string&)>& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  std::string last;
  while (std::chrono::steady_clock::now() < deadline) {
    auto m = Scrape(address);
    if (m.ok()) {
      last = *m;
      if (done(last)) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return last;
}

const WorkerAddr& Worker(const Fleet& f, const std::string& role) {
  for (const auto& w : f.workers()) {
    if (w.role == role) return w;
  }
  ADD_FAILURE() << "no " << role << " worker";
  return f.workers().front();
}
const WorkerAddr& Prefiller(const Fleet& f) { return Worker(f, "prefill"); }

FleetOptions Options(const std::string& disk_dir) {
  FleetOptions o;
  o.prefill = 1;
  o.decode = 1;
  o.num_blocks = 64;
  // Requests here follow each other within one load-report interval (150 ms)
  // on a 64-block decoder: the router's decode-block predictions of finished
  // requests would add up to "no decoder has room" (they end only with a
  // report). Let them expire quickly; routing is not what this test checks.
  o.router_yaml = "  max_prediction_age_s: 0.05\n";
  // A fixed fleet salt: the restarted fleet must hash blocks as the first
  // did to find them on disk (without one, each launch makes a random salt).
  o.cache_yaml = "  salt: kv-tiers-test\n  host_tier_blocks: 16\n  disk_tier:\n    path: " +
                 disk_dir + "\n    max_gib: 0.5\n";
  return o;
}

Result<Completion> Ask(const Fleet& f, const std::vector<uint32_t>& prompt) {
  GenerateArgs a;
  a.prompt_ids = prompt;
  a.max_tokens = kMaxTokens;
  return Generate(f.proxy_grpc(), a);
}

TEST(KvTiersFleet, LowerTiersServeEvictedPrefixesAndSurviveARestart) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  char tmpl[] = "/tmp/tandem-kv-disk-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string disk = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{disk};

  std::vector<std::vector<uint32_t>> prompts;
  std::vector<std::vector<uint32_t>> refs;
  for (uint32_t i = 0; i < kPrompts; ++i) {
    prompts.push_back(PromptIds(1000 + i, kPromptTokens, kVocab));
    auto ref = ReferenceGenerate(prompts.back(), kMaxTokens);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    refs.push_back(*ref);
  }
  constexpr uint32_t kCached = (kPromptTokens - 1) / 16 * 16;

  {
    auto fleet = Fleet::Launch(Options(disk));
    ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
    const Fleet& f = **fleet;
    auto start = Scrape(Prefiller(f).metrics);
    ASSERT_TRUE(start.ok());
    for (const char* tier : {"device", "host", "disk"}) {
      EXPECT_EQ(TierValue(*start, "tandem_kv_tier_hits_tokens_total", tier), 0) << tier;
      EXPECT_EQ(TierValue(*start, "tandem_kv_tier_evictions_total", tier), 0) << tier;
      EXPECT_EQ(TierValue(*start, "tandem_kv_tier_usage_ratio", tier), 0) << tier;
    }
    EXPECT_NE(start->find("tandem_kv_tier_onboard_seconds_count"), std::string::npos);

    for (uint32_t i = 0; i < kPrompts; ++i) {
      auto c = Ask(f, prompts[i]);
      ASSERT_TRUE(c.ok()) << i << ": " << c.status().ToString();
      EXPECT_EQ(c->token_ids, refs[i]) << "prompt " << i;
      EXPECT_EQ(c->cached_prompt_tokens, 0u) << "prompt " << i;
    }
    // The first prompt's blocks left the device long ago; they are found below.
    auto again = Ask(f, prompts[0]);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_EQ(again->token_ids, refs[0]);
    EXPECT_EQ(again->cached_prompt_tokens, kCached);
    auto lower_hits = [](const std::string& t) {
      return TierValue(t, "tandem_kv_tier_hits_tokens_total", "host") +
             TierValue(t, "tandem_kv_tier_hits_tokens_total", "disk");
    };
    const std::string m = WaitForMetrics(Prefiller(f).metrics, [&](const std::string& t) {
      return lower_hits(t) >= kCached && TierValue(t, "tandem_kv_tier_usage_ratio", "disk") > 0;
    });
    const double host = TierValue(m, "tandem_kv_tier_hits_tokens_total", "host");
    const double disk_hits = TierValue(m, "tandem_kv_tier_hits_tokens_total", "disk");
    EXPECT_EQ(TierValue(m, "tandem_kv_tier_hits_tokens_total", "device"), 0);
    EXPECT_EQ(host + disk_hits, kCached) << "host " << host << ", disk " << disk_hits;
    EXPECT_GT(TierValue(m, "tandem_kv_tier_evictions_total", "device"), 0);
    EXPECT_GT(TierValue(m, "tandem_kv_tier_evictions_total", "host"), 0);
    EXPECT_GT(TierValue(m, "tandem_kv_tier_usage_ratio", "disk"), 0);
    std::cout << "first prompt again: " << host << " cached tokens from host, " << disk_hits
              << " from disk\n";
    // Decoder-side reuse: its reservation found the prompt's full blocks in
    // its own lower tiers (it keeps the prompts it decoded, evicted likewise).
    const std::string dm = WaitForMetrics(Worker(f, "decode").metrics, [&](const std::string& t) {
      return lower_hits(t) >= kPromptTokens / 16 * 16;
    });
    EXPECT_EQ(lower_hits(dm), kPromptTokens / 16 * 16);
    auto st = (*fleet)->Stop(std::chrono::seconds(30));
    ASSERT_TRUE(st.ok()) << st.status().ToString();
  }
  ASSERT_TRUE(fs::exists(disk + "/prefill-0"));
  EXPECT_FALSE(fs::is_empty(disk + "/prefill-0"));

  // A new fleet on the same directory: the prefiller's disk tier is found
  // again and the first request of a known prompt reuses it.
  auto fleet = Fleet::Launch(Options(disk));
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const Fleet& f = **fleet;
  auto c = Ask(f, prompts[0]);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->token_ids, refs[0]);
  EXPECT_EQ(c->cached_prompt_tokens, kCached);
  const std::string m = WaitForMetrics(Prefiller(f).metrics, [&](const std::string& t) {
    return TierValue(t, "tandem_kv_tier_hits_tokens_total", "disk") >= kCached;
  });
  EXPECT_EQ(TierValue(m, "tandem_kv_tier_hits_tokens_total", "disk"), kCached);
  // An unknown prompt still computes from scratch, with the right output.
  auto fresh = PromptIds(77, kPromptTokens, kVocab);
  auto ref = ReferenceGenerate(fresh, kMaxTokens);
  ASSERT_TRUE(ref.ok());
  auto d = Ask(f, fresh);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->token_ids, *ref);
  EXPECT_EQ(d->cached_prompt_tokens, 0u);
}

}  // namespace
}  // namespace tandem::testing
