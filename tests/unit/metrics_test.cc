#include "common/metrics.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace tandem {
namespace {

TEST(Metrics, RendersWithConstantLabels) {
  MetricsRegistry m({"tandem-kjv", "prefill", "prefill-0"});
  auto& c = m.Counter("tandem_test_total", "a test counter", {{"outcome", "ok"}});
  c.Increment(3);
  auto& h = m.Histogram("tandem_test_seconds", "a test histogram", {0.1, 1.0});
  h.Observe(0.5);
  h.Observe(2.0);
  const std::string text = m.Render();
  EXPECT_NE(text.find(R"(tandem_test_total{model="tandem-kjv",outcome="ok",role="prefill",worker="prefill-0"} 3)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(R"(tandem_test_seconds_count{model="tandem-kjv",role="prefill",worker="prefill-0"} 2)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(R"(le="1"} 1)"), std::string::npos) << text;
}

TEST(Metrics, SameNameAndLabelsIsTheSameSeries) {
  MetricsRegistry m({"m", "proxy", "proxy"});
  m.Counter("tandem_x_total", "x").Increment();
  m.Counter("tandem_x_total", "x").Increment();
  EXPECT_DOUBLE_EQ(m.Counter("tandem_x_total", "x").Value(), 2.0);
}

TEST(Metrics, ServesOnAFreePort) {
  MetricsRegistry m({"m", "proxy", "proxy"});
  ASSERT_TRUE(m.Serve("127.0.0.1:0").ok());
  EXPECT_NE(m.bound_address(), "127.0.0.1:0");
  EXPECT_EQ(m.bound_address().rfind("127.0.0.1:", 0), 0u);
}

TEST(Metrics, BadAddressIsAnError) {
  MetricsRegistry m({"m", "proxy", "proxy"});
  EXPECT_EQ(m.Serve("nonsense").code(), StatusCode::kInvalidArgument);
}

TEST(Metrics, ExponentialBuckets) {
  const auto b = MetricsRegistry::ExponentialBuckets(0.001, 2, 4);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_DOUBLE_EQ(b[3], 0.008);
}

using Check = RecentMedianCheck;

Check::Options Opts(size_t window, size_t min_samples, double threshold, int interval_s) {
  Check::Options o;
  o.window = window;
  o.min_samples = min_samples;
  o.threshold = threshold;
  o.min_interval = std::chrono::seconds(interval_s);
  return o;
}

TEST(RecentMedianCheck, MedianOfTheWindowOnly) {
  Check c(Opts(4, 1, 100.0, 60));
  const auto t = Check::Clock::time_point{} + std::chrono::hours(1);
  EXPECT_DOUBLE_EQ(c.Median(), 0.0);
  c.Observe(5.0, t);
  EXPECT_DOUBLE_EQ(c.Median(), 5.0);
  c.Observe(1.0, t);
  EXPECT_DOUBLE_EQ(c.Median(), 3.0);  // even count: mean of the middle two
  c.Observe(9.0, t);
  EXPECT_DOUBLE_EQ(c.Median(), 5.0);
  c.Observe(2.0, t);                  // {5,1,9,2}
  EXPECT_DOUBLE_EQ(c.Median(), 3.5);
  c.Observe(10.0, t);                 // 5 drops out: {10,1,9,2}
  c.Observe(11.0, t);                 // 1 drops out: {10,11,9,2}
  EXPECT_EQ(c.size(), 4u);
  EXPECT_DOUBLE_EQ(c.Median(), 9.5);
}

TEST(RecentMedianCheck, WarnsOnlyAboveThresholdWithEnoughSamples) {
  Check c(Opts(8, 4, 0.3, 60));
  const auto t = Check::Clock::time_point{} + std::chrono::hours(1);
  // Three high samples: not enough to judge.
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(c.Observe(0.9, t).has_value());
  // The fourth makes the median 0.9 > 0.3: warn, with the median.
  auto w = c.Observe(0.9, t);
  ASSERT_TRUE(w.has_value());
  EXPECT_DOUBLE_EQ(*w, 0.9);
}

TEST(RecentMedianCheck, ExactlyAtThresholdDoesNotWarn) {
  Check c(Opts(4, 1, 0.3, 0));
  const auto t = Check::Clock::time_point{} + std::chrono::hours(1);
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(c.Observe(0.3, t).has_value());
}

TEST(RecentMedianCheck, OneOutlierDoesNotMoveTheMedian) {
  Check c(Opts(9, 1, 0.3, 0));
  const auto t = Check::Clock::time_point{} + std::chrono::hours(1);
  for (int i = 0; i < 8; ++i) EXPECT_FALSE(c.Observe(0.05, t).has_value());
  EXPECT_FALSE(c.Observe(50.0, t).has_value());  // P50 is robust; a mean would be 5.6
  EXPECT_DOUBLE_EQ(c.Median(), 0.05);
}

TEST(RecentMedianCheck, RateLimitedAndRecovers) {
  Check c(Opts(5, 1, 0.3, 60));
  auto t = Check::Clock::time_point{} + std::chrono::hours(1);
  int warnings = 0;
  // 200 high observations over 100 s (one every 0.5 s): one warning at the
  // start and one after 60 s, never more.
  for (int i = 0; i < 200; ++i) {
    if (c.Observe(0.8, t).has_value()) ++warnings;
    t += std::chrono::milliseconds(500);
  }
  EXPECT_EQ(warnings, 2);
  // The ratio recovers (within the rate limit): the window fills with low
  // values; past the interval a low median stays silent.
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(c.Observe(0.1, t).has_value()) << i;
  EXPECT_DOUBLE_EQ(c.Median(), 0.1);
  t += std::chrono::seconds(120);
  EXPECT_FALSE(c.Observe(0.1, t).has_value());
  // It degrades again: warns at once (the last warning is long past).
  t += std::chrono::seconds(61);
  int again = 0;
  for (int i = 0; i < 5; ++i) again += c.Observe(0.7, t).has_value() ? 1 : 0;
  EXPECT_EQ(again, 1);  // once the median crosses (third of five), then rate-limited
}

TEST(RecentMedianCheck, ConcurrentObserversKeepTheWindowConsistent) {
  Check c(Opts(64, 8, 0.3, 3600));
  std::atomic<int> warnings{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) warnings += c.Observe(0.5).has_value() ? 1 : 0;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(c.size(), 64u);
  EXPECT_DOUBLE_EQ(c.Median(), 0.5);
  EXPECT_EQ(warnings.load(), 1);
}

// The held histogram's series as prometheus-cpp reports it.
prometheus::ClientMetric::Histogram Collected(prometheus::Histogram& h) {
  return h.Collect().histogram;
}

TEST(HeldHistogram, SamplesAppearAtTheNextCollectionCountedAsPrometheusCountsThem) {
  MetricsRegistry m({"m", "decode", "decode-0"});
  const std::vector<double> bounds = {0.001, 0.01};
  HeldHistogram held(m, "tandem_held_seconds", "held", bounds);
  prometheus::Histogram& series = m.Histogram("tandem_held_seconds", "held", bounds);
  prometheus::Histogram plain(bounds);  // the same samples, observed directly
  for (double v : {0.0005, 0.001, 0.005, 0.01, 1.0}) {  // two on a boundary, one past the last
    held.Observe(v);
    plain.Observe(v);
  }
  EXPECT_EQ(Collected(series).sample_count, 0u);  // held until a collection
  m.RunCollectHooks();
  const auto got = Collected(series);
  const auto want = plain.Collect().histogram;
  EXPECT_EQ(got.sample_count, 5u);
  EXPECT_DOUBLE_EQ(got.sample_sum, want.sample_sum);
  ASSERT_EQ(got.bucket.size(), want.bucket.size());
  for (size_t i = 0; i < got.bucket.size(); ++i) {
    EXPECT_EQ(got.bucket[i].cumulative_count, want.bucket[i].cumulative_count) << "bucket " << i;
  }
  EXPECT_EQ(got.bucket[0].cumulative_count, 2u);  // 0.0005 and 0.001 (le="0.001")
  // A scrape folds first; nothing is counted twice.
  held.Observe(0.002);
  EXPECT_NE(m.Render().find(R"(tandem_held_seconds_count{model="m",role="decode",worker="decode-0"} 6)"),
            std::string::npos);
  m.RunCollectHooks();
  EXPECT_EQ(Collected(series).sample_count, 6u);
}

TEST(HeldHistogram, ObserversOnManyThreadsWhileScrapedLoseNothing) {
  MetricsRegistry m({"m", "decode", "decode-0"});
  const std::vector<double> bounds = {0.001, 0.01};
  HeldHistogram held(m, "tandem_held_seconds", "held", bounds);
  constexpr int kThreads = 4, kEach = 20000;
  std::atomic<int> running{kThreads};
  std::vector<std::thread> observers;
  for (int t = 0; t < kThreads; ++t) {
    observers.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) held.Observe(t % 2 == 0 ? 0.0005 : 0.5);
      running.fetch_sub(1);
    });
  }
  size_t scrapes = 0;
  while (running.load() > 0 || scrapes == 0) {
    (void)m.Render();
    ++scrapes;
  }
  for (auto& t : observers) t.join();
  m.RunCollectHooks();
  const auto got = Collected(m.Histogram("tandem_held_seconds", "held", bounds));
  EXPECT_EQ(got.sample_count, uint64_t{kThreads} * kEach);
  EXPECT_EQ(got.bucket[0].cumulative_count, uint64_t{kThreads / 2} * kEach);
  EXPECT_NEAR(got.sample_sum, kEach * 2 * (0.0005 + 0.5), 1e-6 * kEach);
}

TEST(HeldHistogram, WhatIsObservedBeforeItIsDestroyedStaysInTheSeries) {
  MetricsRegistry m({"m", "decode", "decode-0"});
  const std::vector<double> bounds = {0.001};
  {
    HeldHistogram held(m, "tandem_held_seconds", "held", bounds);
    held.Observe(0.5);
    held.Observe(0.5);
  }
  // Its hook is gone (a collection after it does not touch it) and its
  // samples were folded on the way out.
  EXPECT_NE(m.Render().find(R"(tandem_held_seconds_count{model="m",role="decode",worker="decode-0"} 2)"),
            std::string::npos);
}

}  // namespace
}  // namespace tandem
