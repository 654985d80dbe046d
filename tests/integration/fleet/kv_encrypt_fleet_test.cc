// transport.encrypt end to end (docs/security.md, "KV plane"): a 1P1D fleet
// with every pushed KV block sealed (AES-256-GCM) by the prefiller and
// checked and opened by the decoder gives, token for token, what
// `tandem generate` gives; the decoder refused nothing, and the KV really
// crossed the transport (transferred bytes counted).
#include <gtest/gtest.h>

#include <filesystem>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 12;

TEST(KvEncryptFleet, GreedyOutputThroughEncryptedPushesEqualsGenerate) {
  if (!std::filesystem::exists(BundledModel() + "/model.safetensors")) {
    GTEST_SKIP() << "bundled model missing at " << BundledModel();
  }
  // Lengths around block (16) and chunk (128) edges, two sharing a prefix
  // (the second push leaves the decoder's cached blocks out of the seal).
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t len : {1u, 15u, 16u, 17u, 100u, 200u}) prompts.push_back(PromptIds(len, len, kVocab));
  prompts.push_back(PromptIds(11, 150, kVocab, /*prefix_seed=*/3, /*shared=*/64));
  prompts.push_back(PromptIds(12, 170, kVocab, /*prefix_seed=*/3, /*shared=*/64));
  std::vector<std::vector<uint32_t>> refs;
  for (const auto& p : prompts) {
    auto r = ReferenceGenerate(p, kMaxTokens);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    refs.push_back(*r);
  }
  FleetOptions o;
  o.extra_yaml = "transport:\n  encrypt: true\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateArgs a;
    a.prompt_ids = prompts[i];
    a.max_tokens = kMaxTokens;
    auto c = Generate((*fleet)->proxy_grpc(), a);
    ASSERT_TRUE(c.ok()) << "prompt " << i << ": " << c.status().ToString();
    EXPECT_EQ(c->token_ids, refs[i]) << "prompt " << i << " (" << prompts[i].size() << " tokens)";
  }
  std::string prefill_metrics, decode_metrics;
  for (const auto& w : (*fleet)->workers()) {
    auto text = Scrape(w.metrics);
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    (w.role == "prefill" ? prefill_metrics : decode_metrics) = *text;
  }
  EXPECT_GT(MetricValue(prefill_metrics, "tandem_kv_transfer_bytes_total"), 0.0);
  EXPECT_EQ(MetricValue(decode_metrics, "tandem_kv_notice_refused_total"), 0.0);
}

}  // namespace
}  // namespace tandem::testing
