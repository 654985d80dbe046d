// SLO admission (proxy/slo_admission.h): the decision, the calibration's
// margin (proxy/ttft_calibration.h), and the admission step on a real Fleet
// and Router fed load reports (no network).
#include "proxy/slo_admission.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

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

TEST(DecideAdmission, TheMarginIsAddedToThePredictionAsAShareOfTheSlo) {
  using M = AdmissionMode;
  EXPECT_TRUE(DecideAdmission(M::kSlo, 1000, 700.0, 0.3).admit);  // 700 + 300: exactly the SLO
  const AdmissionVerdict late = DecideAdmission(M::kSlo, 1000, 800.0, 0.3);
  EXPECT_FALSE(late.admit);
  EXPECT_EQ(late.retry_after_seconds, 1.0);
  EXPECT_EQ(DecideAdmission(M::kSlo, 1000, 2800.0, 0.3).retry_after_seconds, 3.0);  // 2.1 s late
  // A prediction that runs late by habit is admitted over the SLO.
  EXPECT_TRUE(DecideAdmission(M::kSlo, 1000, 1200.0, -0.3).admit);
  EXPECT_FALSE(DecideAdmission(M::kSlo, 1000, 1400.0, -0.3).admit);
  EXPECT_TRUE(DecideAdmission(M::kQueue, 1000, 5000.0, 0.5).admit);  // queue: never refused
  EXPECT_TRUE(DecideAdmission(M::kSlo, 1000, std::nullopt, 0.5).admit);
}

using Clock = TtftCalibration::Clock;

TtftCalibration::Options Calibrated(double attainment) {
  TtftCalibration::Options o;
  o.attainment = attainment;
  return o;
}

// `n` requests predicted 1000 ms against an SLO of 1000 ms, the i-th
// arriving 10 x i ms late (error i / 100 of the SLO), at `at`.
void Feed(TtftCalibration& c, int n, Clock::time_point at, int first = 0) {
  for (int i = first; i < first + n; ++i) c.Observe(1000, 1000 + 10.0 * i, 1000, at);
}

TEST(TtftCalibration, TheMarginIsTheErrorAtTheAttainmentQuantileOnceEnoughAreKnown) {
  TtftCalibration c(Calibrated(0.9));
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(c.Margin(t0), 0);
  Feed(c, 15, t0);
  EXPECT_EQ(c.Margin(t0), 0);  // 15 < min_samples (16): the prediction alone
  Feed(c, 5, t0, 15);          // errors 0.00 ... 0.19
  // 20 samples: 18 of them (90 %) at or under 0.17.
  EXPECT_NEAR(c.Margin(t0), 0.17, 1e-9);
  // Early, never late: the margin goes below 0 (admits over the SLO).
  TtftCalibration early(Calibrated(0.5));
  for (int i = 0; i < 20; ++i) early.Observe(1000, 800, 1000, t0);  // 200 ms early
  EXPECT_NEAR(early.Margin(t0), -0.2, 1e-9);
}

TEST(TtftCalibration, OnlyRequestsPredictedNearTheirSloCountAndTheMarginIsBounded) {
  TtftCalibration c(Calibrated(0.9));
  const Clock::time_point t0 = Clock::now();
  // Predicted 200 ms of a 1000 ms SLO (under a quarter): an idle fleet's
  // predictions say nothing of a queue's spread, however late they come.
  for (int i = 0; i < 40; ++i) c.Observe(200, 5000, 1000, t0);
  EXPECT_EQ(c.Margin(t0), 0);
  // Predicted 250 ms (a quarter) counts; 4 s late is held to half the SLO.
  for (int i = 0; i < 16; ++i) c.Observe(250, 4250, 1000, t0);
  EXPECT_EQ(c.Margin(t0), TtftCalibration::kMaxMargin);
  TtftCalibration early(Calibrated(0.9));
  for (int i = 0; i < 16; ++i) early.Observe(1000, 0, 1000, t0);
  EXPECT_EQ(early.Margin(t0), -TtftCalibration::kMaxMargin);
  // Off (attainment 0): nothing is kept, no margin.
  TtftCalibration off(Calibrated(0));
  Feed(off, 40, t0, 20);
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(off.Margin(t0), 0);
}

TEST(TtftCalibration, OnlyTheLastWindowOfRecentErrorsCounts) {
  TtftCalibration c(Calibrated(0.5));
  const Clock::time_point t0 = Clock::now();
  Feed(c, 128, t0, 50);  // errors 0.50 ... 1.77: all held at 0.5
  EXPECT_EQ(c.Margin(t0), 0.5);
  // 128 more, on time: the window (128) holds only them.
  for (int i = 0; i < 128; ++i) c.Observe(1000, 1000, 1000, t0);
  EXPECT_EQ(c.Margin(t0), 0);
  // A minute with no new error: the load is gone, so is the margin.
  Feed(c, 16, t0, 30);  // 0.30 ... 0.45 among 112 zeros: the median is 0
  EXPECT_EQ(c.Margin(t0), 0);
  const Clock::time_point t1 = t0 + std::chrono::seconds(61);
  EXPECT_EQ(c.Margin(t1), 0);
  // Errors older than a minute do not count in a new quantile: 16 new ones
  // alone make it.
  Feed(c, 16, t1, 20);  // 0.20 ... 0.35
  EXPECT_NEAR(c.Margin(t1), 0.27, 1e-9);
  EXPECT_EQ(c.Margin(t1 + std::chrono::seconds(61)), 0);
}

TEST(TtftCalibration, TheGaugeShowsTheMarginAtEachCollection) {
  MetricsRegistry registry{MetricLabels{"m", "proxy", "proxy"}};
  auto c = std::make_unique<TtftCalibration>(Calibrated(0.9), &registry);
  EXPECT_NE(registry.Render().find("tandem_slo_admission_margin_ratio{"), std::string::npos);
  Feed(*c, 20, Clock::now());
  const std::string text = registry.Render();
  const size_t at = text.find("tandem_slo_admission_margin_ratio{");
  ASSERT_NE(at, std::string::npos);
  const size_t value = text.find("} ", at);
  ASSERT_NE(value, std::string::npos) << text;
  EXPECT_NEAR(std::strtod(text.c_str() + value + 2, nullptr), 0.17, 1e-9) << text;
  c.reset();  // its hook leaves with it
  EXPECT_NE(registry.Render().find("tandem_slo_admission_margin_ratio"), std::string::npos);
}

// First tokens come on the transports' threads, admissions on the front
// end's, scrapes on the metrics server's, all at once (run under TSAN by
// tools/tsan_unit.sh): readers see the margin before or after, never part.
TEST(TtftCalibration, ObserversReadersAndScrapesAtOnce) {
  MetricsRegistry registry{MetricLabels{"m", "proxy", "proxy"}};
  TtftCalibration c(Calibrated(0.9), &registry);
  const Clock::time_point t0 = Clock::now();
  std::atomic<int> odd{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) c.Observe(1000, 1200, 1000, t0);  // 0.2 late
    });
  }
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        const double m = c.Margin(t0);
        if (m != 0 && std::abs(m - 0.2) > 1e-12) odd.fetch_add(1);
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 0; i < 100; ++i) registry.Render();
  });
  for (auto& th : threads) th.join();
  EXPECT_EQ(odd.load(), 0);
  EXPECT_NEAR(c.Margin(t0), 0.2, 1e-12);
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

  SloAdmission Make(AdmissionMode mode, uint32_t ttft_ms, uint32_t tpot_ms,
                    TtftCalibration* calibration = nullptr) {
    SloAdmissionOptions o;
    o.mode = mode;
    o.default_ttft_ms = ttft_ms;
    o.default_tpot_ms = tpot_ms;
    o.calibration = calibration;
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

TEST_F(SloAdmissionTest, TheCalibrationsMarginRefusesWhatThePredictionAloneAdmits) {
  MeasurePrefiller();
  TtftCalibration cal(Calibrated(0.9));
  SloAdmission slo = Make(AdmissionMode::kSlo, 0, 0, &cal);
  // 160 ms predicted against 200 ms: admitted, and it keeps its prediction
  // for the calibration.
  ValidatedRequest first = Request(160, 200);
  ASSERT_TRUE(slo.Admit(first, nullptr).ok());
  EXPECT_NEAR(first.predicted_ttft_ms, 160, 0.01);  // (and a few us of KV transfer)
  // Recent requests came 30 % of their SLO late: 160 + 60 > 200.
  for (int i = 0; i < 16; ++i) cal.Observe(1000, 1300, 1000, Clock::now());
  ValidatedRequest r = Request(160, 200);
  double retry = 0;
  Status st = slo.Admit(r, &retry);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("160 ms on the best worker pair (220 ms with the recent prediction "
                              "error at the 90th percentile, proxy.slo.attainment)"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(retry, 1.0);
  EXPECT_EQ(r.predicted_ttft_ms, -1);  // refused: nothing to compare
  EXPECT_EQ(Refused("ttft_slo"), 1);
  // With a wider SLO it fits again: 160 + 90 <= 300.
  ValidatedRequest wide = Request(160, 300);
  EXPECT_TRUE(slo.Admit(wide, nullptr).ok());
  // Without a prediction (no SLO) there is nothing to calibrate.
  ValidatedRequest none = Request(160);
  EXPECT_TRUE(slo.Admit(none, nullptr).ok());
  EXPECT_EQ(none.predicted_ttft_ms, -1);
}

}  // namespace
}  // namespace tandem::proxy
