// SLO admission (proxy/slo_admission.h): the decision, and the admission
// step on a real Fleet and Router fed load reports (no network).
#include "proxy/slo_admission.h"

#include <gtest/gtest.h>

#include "common/metrics.h"

namespace tandem::proxy {
namespace {

TEST(DecideAdmission, RefusesOnlyUnderSloWithAKnownPredictionOverTheSlo) {
  using M = AdmissionMode;
  EXPECT_TRUE(DecideAdmission(M::kQueue, 100, 5000.0).admit);    // queue: it waits
  EXPECT_TRUE(DecideAdmission(M::kSlo, 0, 5000.0).admit);        // no SLO
  EXPECT_TRUE(DecideAdmission(M::kSlo, 100, std::nullopt).admit);  // rate not measured yet
  EXPECT_TRUE(DecideAdmission(M::kSlo, 100, 100.0).admit);       // exactly the SLO
  const AdmissionVerdict over = DecideAdmission(M::kSlo, 1000, 3500.0);
  EXPECT_FALSE(over.admit);
  EXPECT_EQ(over.retry_after_seconds, 3.0);  // 2.5 s predicted excess, whole seconds up
  const AdmissionVerdict just = DecideAdmission(M::kSlo, 1000, 1000.5);
  EXPECT_FALSE(just.admit);
  EXPECT_EQ(just.retry_after_seconds, 1.0);  // at least 1 s
  EXPECT_EQ(ParseAdmissionMode("slo").value(), M::kSlo);
  EXPECT_EQ(ParseAdmissionMode("queue").value(), M::kQueue);
  EXPECT_NE(ParseAdmissionMode("fifo").status().message().find("proxy.admission"), std::string::npos);
}

const std::string kModel = "m";
const std::string kDtype = "f32";

class SloAdmissionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto router = router::Router::Create(RouterConfig{}, router::RouterOptions{});
    ASSERT_TRUE(router.ok());
    FleetRequirements req;
    req.model = kModel;
    fleet_ = std::make_unique<Fleet>(req, std::move(router).value());
    AddWorker("p0", router::WorkerRole::kPrefill);
    AddWorker("d0", router::WorkerRole::kDecode);
  }

  void AddWorker(const std::string& name, router::WorkerRole role) {
    WorkerRecord w;
    w.name = name;
    w.role = role;
    w.grpc_address = name + ":1";
    w.protocol_version = 1;
    w.model = kModel;
    w.block_size = 16;
    w.kv_dtype = kDtype;
    w.block_bytes = 4096;
    w.num_blocks = 1000;
    ASSERT_TRUE(fleet_->Register(w).ok());
  }

  // p0's engine computed 100 prefill tokens in 0.1 s between two reports.
  void MeasurePrefiller() {
    const router::WorkerId p0 = *fleet_->router().FindWorker("p0");
    router::LoadReport r;
    r.free_blocks = 1000;
    ASSERT_TRUE(fleet_->router().ApplyLoadReport(p0, r).ok());
    r.prefill_tokens_total = 100;
    r.prefill_seconds_total = 0.1;
    ASSERT_TRUE(fleet_->router().ApplyLoadReport(p0, r).ok());
    ASSERT_NEAR(fleet_->router().prefill_rate(p0), 1000, 1e-6);
  }

  SloAdmission Make(AdmissionMode mode, uint32_t ttft_ms, uint32_t tpot_ms) {
    SloAdmissionOptions o;
    o.mode = mode;
    o.default_ttft_ms = ttft_ms;
    o.default_tpot_ms = tpot_ms;
    return SloAdmission(o, fleet_.get(), &metrics_);
  }

  static ValidatedRequest Request(uint32_t tokens, uint32_t ttft_slo_ms = 0) {
    ValidatedRequest r;
    r.prompt_ids.assign(tokens, 7);
    r.max_tokens = 4;
    r.ttft_slo_ms = ttft_slo_ms;
    return r;
  }

  double Refused(const char* reason) {
    const size_t i = reason == std::string("ttft_slo") ? 0 : 3;
    return metrics_.refused[i]->Value();
  }

  std::unique_ptr<Fleet> fleet_;
  MetricsRegistry registry_{MetricLabels{"m", "proxy", "proxy"}};
  ProxyMetrics metrics_{registry_};
};

TEST_F(SloAdmissionTest, RefusesAPredictionOverTheSloWithRetryAfterAndCountsIt) {
  SloAdmission slo = Make(AdmissionMode::kSlo, /*ttft_ms=*/0, /*tpot_ms=*/0);
  // Before any measurement: admitted (an unmeasured prefiller may be fast).
  ValidatedRequest early = Request(160, 100);
  double retry = 0;
  EXPECT_TRUE(slo.Admit(early, &retry).ok());
  MeasurePrefiller();
  // 160 tokens at 1000 tokens/s: 160 ms predicted.
  ValidatedRequest fits = Request(160, 200);
  EXPECT_TRUE(slo.Admit(fits, &retry).ok());
  EXPECT_EQ(retry, 0);
  // The prompt's block hashes stay with the request, so routing does not
  // hash it again (issue 23): exactly what hashing it would give.
  const HashContext ctx{};
  EXPECT_EQ(fits.block_hashes_root, RootHash(ctx));
  EXPECT_EQ(fits.block_hashes_block_size, 16u);
  EXPECT_EQ(fits.block_hashes, HashBlocks(RootHash(ctx), fits.prompt_ids, 16));
  EXPECT_EQ(fits.block_hashes.size(), 10u);
  ValidatedRequest over = Request(160, 100);
  Status st = slo.Admit(over, &retry);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("160 ms"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("SLO of 100 ms"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("proxy.admission: slo"), std::string::npos) << st.message();
  EXPECT_EQ(retry, 1.0);
  EXPECT_EQ(Refused("ttft_slo"), 1);
  // A request without an SLO is never refused for one.
  ValidatedRequest none = Request(4000);
  EXPECT_TRUE(slo.Admit(none, &retry).ok());
  EXPECT_EQ(Refused("ttft_slo"), 1);
}

TEST_F(SloAdmissionTest, FleetDefaultsFillUnsetSlosAndQueueModeNeverRefuses) {
  MeasurePrefiller();
  SloAdmission slo = Make(AdmissionMode::kSlo, /*ttft_ms=*/100, /*tpot_ms=*/40);
  ValidatedRequest r = Request(160);
  EXPECT_EQ(slo.Admit(r, nullptr).code(), StatusCode::kResourceExhausted);  // the default applies
  EXPECT_EQ(r.ttft_slo_ms, 100u);
  EXPECT_EQ(r.tpot_slo_ms, 40u);
  ValidatedRequest own = Request(160, 500);  // its own SLO wins over the default
  EXPECT_TRUE(slo.Admit(own, nullptr).ok());
  EXPECT_EQ(own.ttft_slo_ms, 500u);

  SloAdmission queue = Make(AdmissionMode::kQueue, 100, 40);
  ValidatedRequest q = Request(160);
  EXPECT_TRUE(queue.Admit(q, nullptr).ok());  // it waits instead
  EXPECT_EQ(q.ttft_slo_ms, 100u);
  EXPECT_EQ(Refused("ttft_slo"), 1);
  EXPECT_EQ(Refused("deadline"), 0);
}

}  // namespace
}  // namespace tandem::proxy
