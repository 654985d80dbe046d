// ProxyMetrics' token path: samples summed in a TokenMetricsBatch reach the
// ITL histogram and the token counter exactly as one Observe / Increment
// per token would have put them there, once folded — and every collection
// of the registry (a scrape, Render) folds first.
#include "proxy/proxy_metrics.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace tandem::proxy {
namespace {

struct Snapshot {
  std::vector<uint64_t> cumulative;
  uint64_t count = 0;
  double sum = 0;
  double tokens = 0;
};

Snapshot Take(ProxyMetrics& m) {
  m.FoldTokenMetrics();
  Snapshot s;
  const auto h = m.itl.Collect().histogram;
  for (const auto& b : h.bucket) s.cumulative.push_back(b.cumulative_count);
  s.count = h.sample_count;
  s.sum = h.sample_sum;
  s.tokens = m.generation_tokens.Value();
  return s;
}

// Gaps as the lifecycle makes them: 0 within a message, a step's gap
// otherwise, values on bucket boundaries, past the last boundary, tiny.
const std::vector<double> kGaps = {0.0,    0.0063, 0.0,  0.00002, 0.0001, 0.005, 0.0050001,
                                   0.0064, 7.5,    5.0,  0.3,     1e-9,   0.0,   0.025};

TEST(ProxyMetricsTest, BatchedTokenMetricsEqualOneObservePerToken) {
  MetricsRegistry direct_reg{MetricLabels{"m", "proxy", "proxy"}};
  MetricsRegistry batch_reg{MetricLabels{"m", "proxy", "proxy"}};
  ProxyMetrics direct(direct_reg), batched(batch_reg);
  for (double g : kGaps) {
    direct.itl.Observe(g);
    direct.generation_tokens.Increment(1);
  }
  {
    TokenMetricsBatch outer;
    for (size_t i = 0; i < kGaps.size(); ++i) {
      TokenMetricsBatch inner;  // nested: the outermost applies
      batched.ObserveItl(kGaps[i]);
      batched.CountGenerationTokens(1);
    }
    EXPECT_EQ(Take(batched).count, 0u);  // held until the batch ends
  }
  const Snapshot want = Take(direct), got = Take(batched);
  EXPECT_EQ(got.cumulative, want.cumulative);
  EXPECT_EQ(got.count, kGaps.size());
  EXPECT_EQ(got.count, want.count);
  EXPECT_DOUBLE_EQ(got.sum, want.sum);
  EXPECT_EQ(got.tokens, want.tokens);

  // Outside a batch: at once.
  batched.ObserveItl(0.001);
  batched.CountGenerationTokens(3);
  EXPECT_EQ(Take(batched).count, kGaps.size() + 1);
  EXPECT_EQ(Take(batched).tokens, want.tokens + 3);
}

TEST(ProxyMetricsTest, ABatchHoldsTwoMetricsObjectsApart) {
  MetricsRegistry ra{MetricLabels{"m", "proxy", "a"}}, rb{MetricLabels{"m", "proxy", "b"}};
  ProxyMetrics a(ra), b(rb);
  {
    TokenMetricsBatch batch;
    a.ObserveItl(0.001);
    b.ObserveItl(0.002);
    b.ObserveItl(0.003);
    a.CountGenerationTokens(2);
    b.CountGenerationTokens(5);
  }
  EXPECT_EQ(Take(a).count, 1u);
  EXPECT_EQ(Take(b).count, 2u);
  EXPECT_DOUBLE_EQ(Take(a).sum, 0.001);
  EXPECT_DOUBLE_EQ(Take(b).sum, 0.005);
  EXPECT_EQ(Take(a).tokens, 2);
  EXPECT_EQ(Take(b).tokens, 5);
}

// The value of the series `name{...}` in Prometheus text (-1: absent).
double TextValue(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + "{", 0) == 0) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}

std::string WithoutSeries(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string out;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + "{", 0) != 0) out += line + "\n";
  }
  return out;
}

TEST(ProxyMetricsTest, AScrapeShowsEveryEndedBatchWithoutAnExplicitFold) {
  MetricsRegistry direct_reg{MetricLabels{"m", "proxy", "proxy"}};
  MetricsRegistry batch_reg{MetricLabels{"m", "proxy", "proxy"}};
  ProxyMetrics direct(direct_reg), batched(batch_reg);
  // Batches of a step's gaps (one per stream), then one within a message.
  for (size_t step = 0; step < 3; ++step) {
    TokenMetricsBatch batch;
    for (double g : kGaps) {
      batched.ObserveItl(g + 0.001 * static_cast<double>(step));
      batched.CountGenerationTokens(1);
    }
  }
  for (size_t step = 0; step < 3; ++step) {
    for (double g : kGaps) {
      direct.itl.Observe(g + 0.001 * static_cast<double>(step));
      direct.generation_tokens.Increment(1);
    }
  }
  const std::string got = batch_reg.Render(), want = direct_reg.Render();
  EXPECT_EQ(TextValue(got, "tandem_inter_token_latency_seconds_count"), 3.0 * kGaps.size());
  EXPECT_EQ(TextValue(got, "tandem_generation_tokens_total"), 3.0 * kGaps.size());
  // Every bucket and counter the same text; the sum the same up to the
  // order of its additions.
  const std::string sum = "tandem_inter_token_latency_seconds_sum";
  EXPECT_EQ(WithoutSeries(got, sum), WithoutSeries(want, sum));
  EXPECT_NEAR(TextValue(got, sum), TextValue(want, sum), 1e-12);
  // A second scrape folds nothing twice.
  EXPECT_EQ(batch_reg.Render(), got);
}

}  // namespace
}  // namespace tandem::proxy
