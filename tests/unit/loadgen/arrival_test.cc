#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "loadgen/arrival.h"

namespace tandem::loadgen {
namespace {

TEST(Poisson, FixedSeedGivesTheSameSchedule) {
  const auto a = PoissonSchedule(10.0, 42, 100);
  EXPECT_EQ(a, PoissonSchedule(10.0, 42, 100));
  EXPECT_NE(a, PoissonSchedule(10.0, 43, 100));
  EXPECT_DOUBLE_EQ(a[0], 0.0);
  for (size_t i = 1; i < a.size(); ++i) EXPECT_GT(a[i], a[i - 1]);
}

TEST(Poisson, GapsAreExponentialWithMeanOneOverRate) {
  PoissonArrivals p(20.0, 7);
  const int n = 20000;
  double sum = 0, sq = 0;
  int below_mean = 0;
  for (int i = 0; i < n; ++i) {
    const double g = p.NextGapSeconds();
    ASSERT_GT(g, 0.0);
    sum += g;
    sq += g * g;
    if (g < 0.05) ++below_mean;
  }
  const double mean = sum / n;
  const double var = sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.05, 0.05 * 0.03);       // 1/rate
  EXPECT_NEAR(std::sqrt(var), 0.05, 0.05 * 0.05);  // exponential: stddev = mean
  // P(gap < mean) = 1 - 1/e = 0.632.
  EXPECT_NEAR(double(below_mean) / n, 0.632, 0.015);
}

TEST(Poisson, InfiniteRateIsAllAtOnce) {
  const auto s = PoissonSchedule(std::numeric_limits<double>::infinity(), 1, 10);
  for (double t : s) EXPECT_EQ(t, 0.0);
}

TEST(Describe, NamesTheProcess) {
  ArrivalOptions o;
  o.rate = 2.5;
  o.seed = 9;
  EXPECT_EQ(Describe(o), "Poisson, 2.5 sessions/s (seed 9)");
  o.kind = ArrivalKind::kConcurrency;
  o.concurrency = 8;
  EXPECT_EQ(Describe(o), "fixed concurrency 8");
  o.kind = ArrivalKind::kTrace;
  o.max_concurrency = 4;
  EXPECT_EQ(Describe(o), "trace timestamps, at most 4 in flight");
}

}  // namespace
}  // namespace tandem::loadgen
