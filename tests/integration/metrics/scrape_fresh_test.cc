// Issue 20: a scrape right after a request's last byte includes that
// request (docs/metrics.md, "When values are current"), on a worker no
// proxy watches and on the workers of a fleet. Worker counters sampled
// from the engine and the decoder/prefiller (prefix-cache queries, ...)
// used to be copied into Prometheus on a 150 ms tick; now every scrape
// samples them afresh. No waiting, no retry: one scrape, right after the
// stream ended.
#include <gtest/gtest.h>

#include <filesystem>

#include "fleet_harness.h"
#include "reaper.h"
#include "serving_harness.h"

namespace tandem {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kVocab = 4096;

double Sample(const std::string& metrics_address, const std::string& name) {
  auto text = testing::Scrape(metrics_address);
  EXPECT_TRUE(text.ok()) << text.status().ToString();
  return text.ok() ? testing::MetricValue(*text, name) : -1;
}

// A `tandem both` worker started alone (no --join: nobody watches it), one
// request through its Decoder service with prefill_locally, as a proxy
// would send it.
TEST(ScrapeFresh, WorkerWithoutProxyCountsTheRequestJustFinished) {
  namespace st = serving_test;
  const auto dir = std::filesystem::temp_directory_path() /
                   ("tandem-scrape-" + std::to_string(getpid()));
  const std::string fleet = st::WriteFleetFile(dir);
  cli::Supervisor sup;
  auto both = st::StartWorker(sup, fleet, "both", "both-0");
  ASSERT_TRUE(both.ok()) << both.status().ToString();
  testing::ReapOnExit((*both)->pid);
  const std::string metrics = (*both)->metrics;
  auto stub = st::pb::Decoder::NewStub(st::InternalChannel(fleet, (*both)->grpc));

  double queried = 0;
  for (uint32_t i = 0; i < 3; ++i) {
    const std::vector<uint32_t> prompt = st::Prompt(20 + 9 * i, 300 + i, 200);
    st::pb::DecodeRequest req;
    req.set_request_id("alone-" + std::to_string(i));
    req.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
    *req.mutable_params() = st::Greedy(8, true);
    req.set_prefill_locally(true);
    st::DecodeCall call(*stub, req);
    st::Outcome out;
    call.ReadInto(out);
    ASSERT_TRUE(call.Finish().ok());
    ASSERT_TRUE(out.finished.has_value());
    queried += static_cast<double>(prompt.size());
    // The one scrape, right after the last message.
    EXPECT_EQ(Sample(metrics, "tandem_prefix_cache_queries_tokens_total"), queried)
        << "request " << i;
  }
  EXPECT_EQ(sup.StopAll(10s), 0);
  testing::Forget((*both)->pid);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// A 1P1D fleet: right after Generate returns, the prefiller counts the
// prompt it prefilled and the decoder the prompt it reserved for.
TEST(ScrapeFresh, FleetWorkersCountTheRequestJustFinished) {
  if (!testing::HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  auto fleet = testing::Fleet::Launch(testing::FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  std::string prefill, decode;
  for (const auto& w : (*fleet)->workers()) (w.role == "prefill" ? prefill : decode) = w.metrics;
  double tokens = 0;
  for (uint32_t i = 0; i < 3; ++i) {
    testing::GenerateArgs a;
    a.prompt_ids = testing::PromptIds(3100 + i, 40 + 16 * i, kVocab);
    a.max_tokens = 4;
    auto c = testing::Generate((*fleet)->proxy_grpc(), a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    tokens += static_cast<double>(a.prompt_ids.size());
    EXPECT_EQ(Sample(prefill, "tandem_prefix_cache_queries_tokens_total"), tokens) << i;
    EXPECT_EQ(Sample(decode, "tandem_prefix_cache_queries_tokens_total"), tokens) << i;
    EXPECT_EQ(Sample((*fleet)->proxy_metrics(), "tandem_requests_total"), i + 1.0) << i;
  }
}

}  // namespace
}  // namespace tandem
