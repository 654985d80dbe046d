// transport.encrypt end to end (docs/security.md, "KV plane"): a 1P1D fleet
// (`tandem launch`, real UCX) with every pushed KV block sealed
// (AES-256-GCM) by the prefiller and checked and opened by the decoder
// gives, token for token, what `tandem generate` gives (which is what the
// unencrypted fleet gives: kv_streaming_test), with transport.push
// `streaming` (sealed whole blocks pushed while the prompt is computed, in
// several transfers) and `after_prefill` (one transfer); the decoder refused
// nothing and the KV really crossed the transport. Tampered KV through real
// UCX: kv_security_test (tests/integration/serving).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 8;

// Lengths around block (16) and chunk (128) edges, up to five chunks; two
// share a prefix (the second push leaves the decoder's cached blocks out).
std::vector<std::vector<uint32_t>> Prompts() {
  std::vector<std::vector<uint32_t>> p;
  for (uint32_t len : {1u, 15u, 16u, 17u, 200u, 517u}) p.push_back(PromptIds(len, len, kVocab));
  p.push_back(PromptIds(11, 300, kVocab, /*prefix_seed=*/3, /*shared=*/128));
  p.push_back(PromptIds(12, 300, kVocab, /*prefix_seed=*/3, /*shared=*/128));
  return p;
}

// The "in N transfers" counts of the prefiller's push log lines.
std::vector<int> TransferCounts(const std::string& log_path) {
  std::ifstream f(log_path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string log = ss.str();
  std::vector<int> counts;
  static const std::regex re(
      "pushed \\d+ KV blocks \\(\\d+ bytes, \\d+ cached on the decoder\\) in (\\d+) transfers");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator(); ++it) {
    counts.push_back(std::stoi((*it)[1]));
  }
  return counts;
}

class KvEncryptFleet : public ::testing::TestWithParam<std::string> {};

TEST_P(KvEncryptFleet, GreedyOutputThroughEncryptedPushesEqualsGenerate) {
  if (!std::filesystem::exists(BundledModel() + "/model.safetensors")) {
    GTEST_SKIP() << "bundled model missing at " << BundledModel();
  }
  const std::string push = GetParam();
  const auto prompts = Prompts();
  std::vector<std::vector<uint32_t>> refs;
  for (const auto& p : prompts) {
    auto r = ReferenceGenerate(p, kMaxTokens);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    refs.push_back(*r);
  }
  FleetOptions o;
  o.max_batched_tokens = 128;
  o.log_level = "debug";
  o.extra_yaml = fmt::format("transport:\n  encrypt: true\n  push: {}\n", push);
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = (*fleet)->proxy_grpc();
  // All but the last at once; then the last alone, whose shared prefix the
  // one before left cached.
  auto one = [&proxy, &prompts](size_t i) {
    GenerateArgs a;
    a.prompt_ids = prompts[i];
    a.max_tokens = kMaxTokens;
    return Generate(proxy, a);
  };
  std::vector<std::future<Result<Completion>>> futures;
  for (size_t i = 0; i + 1 < prompts.size(); ++i) futures.push_back(std::async(std::launch::async, one, i));
  std::vector<Result<Completion>> results;
  for (auto& f : futures) results.push_back(f.get());
  results.push_back(one(prompts.size() - 1));
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << "prompt " << i << ": " << results[i].status().ToString();
    EXPECT_EQ(results[i]->token_ids, refs[i]) << "prompt " << i << " (" << prompts[i].size() << " tokens)";
  }
  EXPECT_GT(results.back()->cached_prompt_tokens, 0u) << "the shared prefix was not reused";
  std::string prefill_metrics, decode_metrics;
  for (const auto& w : (*fleet)->workers()) {
    auto text = Scrape(w.metrics);
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    (w.role == "prefill" ? prefill_metrics : decode_metrics) = *text;
  }
  EXPECT_GT(MetricValue(prefill_metrics, "tandem_kv_transfer_bytes_total"), 0.0);
  EXPECT_EQ(MetricValue(decode_metrics, "tandem_kv_notice_refused_total"), 0.0);
  auto stopped = (*fleet)->Stop(std::chrono::seconds(30));
  EXPECT_TRUE(stopped.ok());
  const std::vector<int> transfers = TransferCounts((*fleet)->log_path());
  ASSERT_EQ(transfers.size(), prompts.size());
  if (push == "after_prefill") {
    for (int n : transfers) EXPECT_EQ(n, 1) << "after_prefill: one transfer with the notice";
  } else {
    // The 517-token prompt spans five chunks: its sealed blocks went out
    // while later chunks were computed.
    EXPECT_GE(*std::max_element(transfers.begin(), transfers.end()), 4);
  }
}

INSTANTIATE_TEST_SUITE_P(Push, KvEncryptFleet, ::testing::Values("streaming", "after_prefill"));

}  // namespace
}  // namespace tandem::testing
