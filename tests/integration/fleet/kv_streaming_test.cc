// Issue 17, streaming push: greedy output through real 1P1D fleets (cpu and
// sim backends, `tandem launch`, UCX) is the same with transport.push
// `streaming` and `after_prefill`, and on cpu equals `tandem generate`;
// prompts span several prefill chunks and are sent all at once. The
// prefiller's log shows that the long prompts' KV went in several
// transfers when streaming and in one after the prefill otherwise.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kMaxTokens = 8;
constexpr uint32_t kVocab = 4000;

// Lengths from one block to several 128-token chunks, two sharing a prefix.
std::vector<std::vector<uint32_t>> Prompts() {
  std::vector<std::vector<uint32_t>> p;
  const uint32_t lens[] = {5, 40, 130, 300, 517, 700};
  for (uint32_t i = 0; i < 6; ++i) p.push_back(PromptIds(300 + i, lens[i], kVocab));
  p.push_back(PromptIds(310, 450, kVocab, /*prefix_seed=*/9, /*shared=*/256));
  p.push_back(PromptIds(311, 450, kVocab, /*prefix_seed=*/9, /*shared=*/256));
  return p;
}

// The "in N transfers" counts of the prefiller's push log lines.
std::vector<int> TransferCounts(const std::string& log_path) {
  std::ifstream f(log_path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string log = ss.str();
  std::vector<int> counts;
  static const std::regex re("pushed \\d+ KV blocks \\(\\d+ bytes, \\d+ cached on the decoder\\) in (\\d+) transfers");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator(); ++it) {
    counts.push_back(std::stoi((*it)[1]));
  }
  return counts;
}

// Runs every prompt at once through a fresh 1P1D fleet; tokens per prompt.
std::vector<std::vector<uint32_t>> Serve(FleetOptions o, const std::string& push,
                                         const std::vector<std::vector<uint32_t>>& prompts,
                                         std::vector<int>* transfer_counts) {
  o.prefill = 1;
  o.decode = 1;
  o.max_batched_tokens = 128;
  o.log_level = "debug";
  o.extra_yaml += fmt::format("transport:\n  push: {}\n", push);
  auto fleet = Fleet::Launch(o);
  EXPECT_TRUE(fleet.ok()) << fleet.status().ToString();
  if (!fleet.ok()) return {};
  const std::string proxy = (*fleet)->proxy_grpc();
  std::vector<std::future<Result<Completion>>> futures;
  for (const auto& p : prompts) {
    futures.push_back(std::async(std::launch::async, [&proxy, p] {
      GenerateArgs a;
      a.prompt_ids = p;
      a.max_tokens = kMaxTokens;
      return Generate(proxy, a);
    }));
  }
  std::vector<std::vector<uint32_t>> out;
  for (size_t i = 0; i < futures.size(); ++i) {
    auto c = futures[i].get();
    EXPECT_TRUE(c.ok()) << push << " prompt " << i << ": " << c.status().ToString();
    out.push_back(c.ok() ? c->token_ids : std::vector<uint32_t>{});
    if (c.ok()) {
      EXPECT_EQ(c->token_ids.size(), kMaxTokens) << push << " prompt " << i;
    }
  }
  auto stopped = (*fleet)->Stop(std::chrono::seconds(30));
  EXPECT_TRUE(stopped.ok());
  *transfer_counts = TransferCounts((*fleet)->log_path());
  return out;
}

void ExpectStreamedAndNot(const std::vector<int>& streaming, const std::vector<int>& after) {
  ASSERT_EQ(streaming.size(), Prompts().size());
  ASSERT_EQ(after.size(), Prompts().size());
  for (int n : after) EXPECT_EQ(n, 1) << "after_prefill: one transfer with the notice";
  // The 700-token prompt spans six chunks: at least one transfer per chunk.
  EXPECT_GE(*std::max_element(streaming.begin(), streaming.end()), 6);
}

TEST(KvStreaming, CpuFleetOutputsEqualAfterPrefillAndGenerate) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  const auto prompts = Prompts();
  std::vector<std::vector<uint32_t>> refs;
  for (const auto& p : prompts) {
    auto r = ReferenceGenerate(p, kMaxTokens);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    refs.push_back(*r);
  }
  std::vector<int> streamed, after;
  const auto s = Serve(FleetOptions{}, "streaming", prompts, &streamed);
  const auto a = Serve(FleetOptions{}, "after_prefill", prompts, &after);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(s[i], refs[i]) << "streaming, prompt " << i << " (" << prompts[i].size() << " tokens)";
    EXPECT_EQ(a[i], refs[i]) << "after_prefill, prompt " << i;
  }
  ExpectStreamedAndNot(streamed, after);
}

TEST(KvStreaming, SimFleetOutputsEqualAfterPrefill) {
  FleetOptions o;
  o.model_yaml = "  backend: sim\n  name: itest\n  max_model_len: 4096\n";
  o.extra_yaml = fmt::format(
      "sim:\n  profile: H100\n  model_shape: {}/configs/sim/models/llama-3-8b\n"
      "  link_gbps: 100\n  link_latency_us: 10\n  kv_scale: 256\n",
      TANDEM_SOURCE_DIR);
  const auto prompts = Prompts();
  std::vector<int> streamed, after;
  const auto s = Serve(o, "streaming", prompts, &streamed);
  const auto a = Serve(o, "after_prefill", prompts, &after);
  ASSERT_EQ(s.size(), prompts.size());
  ASSERT_EQ(a.size(), prompts.size());
  // Sim tokens are a hash of the KV the decoder received: equal tokens mean
  // equal bytes in every slot.
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(s[i], a[i]) << "prompt " << i;
  EXPECT_NE(s[0], s[1]);
  ExpectStreamedAndNot(streamed, after);
}

}  // namespace
}  // namespace tandem::testing
