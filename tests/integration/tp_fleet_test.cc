// Issue 18's fleet Must-show (docs/parallelism.md, "KV transfer between
// different layouts"), with real processes started by `tandem launch`, real
// gRPC (mTLS as launch sets it up) and real UCX between every rank's pool:
//   - 1P1D CPU with prefill TP=2 and decode TP=1, and with prefill TP=1 and
//     decode PP=2: greedy outputs of 16 prompts sent concurrently equal
//     `tandem generate` token for token (a decode rank missing any slice of
//     any block would decode different tokens);
//   - 1P2D with decode PP=2: kill -9 of rank 1 of one decoder under load:
//     its requests migrate and complete with the generate output, and the
//     launcher's log names the rank and its pid.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <mutex>
#include <thread>

#include "fleet/fleet_harness.h"

namespace tandem::testing {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 16;

// 16 prompts, 5 .. ~290 tokens (several longer than one 128-token chunk,
// so blocks are pushed whole and partial), four sharing a 64-token prefix.
std::vector<std::vector<uint32_t>> Prompts() {
  std::vector<std::vector<uint32_t>> p;
  for (uint32_t i = 0; i < 16; ++i) {
    const uint32_t len = 5 + (i * 53) % 290;
    const bool shared = i % 4 == 0 && len > 64;
    p.push_back(PromptIds(1800 + i, len, kVocab, shared ? 7 : 0, shared ? 64 : 0));
  }
  return p;
}

const std::vector<std::vector<uint32_t>>& References() {
  static std::vector<std::vector<uint32_t>> refs = [] {
    std::vector<std::vector<uint32_t>> r;
    for (const auto& p : Prompts()) {
      auto ids = ReferenceGenerate(p, kMaxTokens);
      EXPECT_TRUE(ids.ok()) << ids.status().ToString();
      r.push_back(ids.ok() ? *ids : std::vector<uint32_t>{});
    }
    return r;
  }();
  return refs;
}

FleetOptions LayoutFleet(const std::string& prefill_yaml, const std::string& decode_yaml,
                         int decoders = 1) {
  FleetOptions o;
  o.prefill = 1;
  o.decode = decoders;
  o.prefill_yaml = prefill_yaml;
  o.decode_yaml = decode_yaml;
  // docs/parallelism.md: pushes between multi-rank workers are neither
  // checksummed nor sealed.
  o.extra_yaml = "transport:\n  checksum: false\n  lease_seconds: 5\n  peer_timeout_seconds: 1.5\n";
  o.proxy_yaml = "  liveness_timeout_seconds: 1\n  max_migrations: 3\n";
  return o;
}


// Sends every prompt at once and checks every completion.
void ExpectConcurrentGreedyEqualsGenerate(const Fleet& fleet) {
  const auto prompts = Prompts();
  const auto& refs = References();
  std::vector<std::future<Result<Completion>>> futures;
  for (const auto& p : prompts) {
    futures.push_back(std::async(std::launch::async, [&fleet, p] {
      GenerateArgs a;
      a.prompt_ids = p;
      a.max_tokens = kMaxTokens;
      return Generate(fleet.proxy_grpc(), a);
    }));
  }
  for (size_t i = 0; i < futures.size(); ++i) {
    auto c = futures[i].get();
    ASSERT_TRUE(c.ok()) << "prompt " << i << ": " << c.status().ToString();
    EXPECT_EQ(c->token_ids, refs[i]) << "prompt " << i << " (" << prompts[i].size() << " tokens)";
    EXPECT_EQ(c->completion_tokens, kMaxTokens) << "prompt " << i;
  }
}

TEST(TpFleet, PrefillTp2DecodeTp1GreedyEqualsGenerate) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  ASSERT_EQ(References().size(), 16u);
  auto fleet = Fleet::Launch(LayoutFleet("  tensor_parallel: 2\n", ""));
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* p0 = FindWorker(**fleet, "prefill-0");
  ASSERT_NE(p0, nullptr);
  EXPECT_EQ(p0->ranks.size(), 2u) << "the prefiller runs as two rank processes";
  ExpectConcurrentGreedyEqualsGenerate(**fleet);
}

TEST(TpFleet, PrefillTp1DecodePp2GreedyEqualsGenerate) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  ASSERT_EQ(References().size(), 16u);
  auto fleet = Fleet::Launch(LayoutFleet("", "  pipeline_parallel: 2\n"));
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* d0 = FindWorker(**fleet, "decode-0");
  ASSERT_NE(d0, nullptr);
  EXPECT_EQ(d0->ranks.size(), 2u) << "the decoder runs as two rank processes";
  ExpectConcurrentGreedyEqualsGenerate(**fleet);
}

TEST(TpFleet, KillMinus9OfADecoderFollowerRankMigratesItsRequests) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  const auto prompts = Prompts();
  const auto& refs = References();
  ASSERT_EQ(refs.size(), prompts.size());
  auto fleet = Fleet::Launch(LayoutFleet("", "  pipeline_parallel: 2\n", /*decoders=*/2));
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* d0 = FindWorker(**fleet, "decode-0");
  ASSERT_NE(d0, nullptr);
  ASSERT_EQ(d0->ranks.size(), 2u);
  const pid_t victim = d0->ranks[1].second;
  ASSERT_EQ(d0->ranks[1].first, 1u);

  // 8 clients, each a bounded series of requests (count and time).
  constexpr int kClients = 8;
  std::atomic<int> completed{0}, wrong{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> clients;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < kClients; ++t) {
    clients.emplace_back([&, t] {
      for (int i = 0; i < 24 && !stop && std::chrono::steady_clock::now() - start < 90s; ++i) {
        const size_t k = (t * 5 + i) % prompts.size();
        GenerateArgs a;
        a.prompt_ids = prompts[k];
        a.max_tokens = kMaxTokens;
        a.timeout = 30s;
        auto c = Generate((*fleet)->proxy_grpc(), a);
        if (c.ok()) {
          ++completed;
          if (c->token_ids != refs[k]) ++wrong;
        } else {
          std::lock_guard lock(mu);
          errors.push_back(c.status().ToString());
        }
      }
    });
  }
  ASSERT_TRUE(WaitUntil([&] { return completed.load() >= kClients; }, 60s)) << "no steady load";
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  const int at_kill = completed;
  EXPECT_TRUE(WaitUntil([&] { return completed.load() >= at_kill + 2 * kClients; }, 60s))
      << "no progress after decode-0's rank 1 died";
  stop = true;
  for (auto& c : clients) c.join();

  EXPECT_EQ(wrong, 0) << "completed requests whose output differs from tandem generate";
  EXPECT_TRUE(errors.empty()) << errors.size() << " requests failed, first: " << errors.front();
  const std::string needle = fmt::format("decode-0 rank 1 (pid {}) was killed by signal 9", victim);
  EXPECT_TRUE(WaitUntil(
      [&] { return ReadText((*fleet)->log_path()).find(needle) != std::string::npos; }, 10s))
      << "the launcher's log does not name the rank: want '" << needle << "'";
  auto m = Scrape((*fleet)->proxy_metrics());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const double moved = MetricValue(*m, "tandem_request_migrations_total") +
                       MetricValue(*m, "tandem_request_retries_total");
  EXPECT_GE(moved, 1) << "no request was on decode-0 when its rank 1 died?";
  std::printf(
      "[tp_fleet] kill -9 decode-0 rank 1 under %d clients: completed %d, migrations %.0f, retries "
      "%.0f\n",
      kClients, completed.load(), MetricValue(*m, "tandem_request_migrations_total"),
      MetricValue(*m, "tandem_request_retries_total"));
}

}  // namespace
}  // namespace tandem::testing
