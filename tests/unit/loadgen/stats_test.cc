#include "loadgen/stats.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tandem::loadgen {
namespace {

TEST(Percentile, LinearInterpolationLikeNumpy) {
  // numpy.percentile([1, 2, 3, 4], [0, 25, 50, 90, 99, 100]) =
  //   [1, 1.75, 2.5, 3.7, 3.97, 4]
  const std::vector<double> v = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1.0);
  EXPECT_DOUBLE_EQ(Percentile(v, 25), 1.75);
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 2.5);
  EXPECT_NEAR(Percentile(v, 90), 3.7, 1e-12);
  EXPECT_NEAR(Percentile(v, 99), 3.97, 1e-12);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 4.0);
}

TEST(Percentile, EdgeCases) {
  EXPECT_TRUE(std::isnan(Percentile({}, 50)));
  EXPECT_DOUBLE_EQ(Percentile({7}, 99), 7.0);
  // 1..100: p99 = 99.01 (rank 98.01).
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  EXPECT_NEAR(Percentile(v, 99), 99.01, 1e-9);
  EXPECT_NEAR(Percentile(v, 50), 50.5, 1e-9);
}

TEST(Summarize, Distribution) {
  auto d = Summarize(std::vector<double>{3, 1, 2});
  EXPECT_EQ(d.count, 3u);
  EXPECT_DOUBLE_EQ(d.mean, 2.0);
  EXPECT_DOUBLE_EQ(d.p50, 2.0);
  EXPECT_DOUBLE_EQ(d.min, 1.0);
  EXPECT_DOUBLE_EQ(d.max, 3.0);
  EXPECT_TRUE(std::isnan(Summarize({}).mean));
}

RequestRecord Rec(double send, double ttft, std::vector<double> itl, double e2e,
                  uint32_t out, bool ok = true) {
  RequestRecord r;
  r.send_s = send;
  r.ok = ok;
  if (!ok) r.error = "UNAVAILABLE";
  r.ttft_s = ttft;
  r.itl_s = std::move(itl);
  r.e2e_s = e2e;
  r.output_tokens = out;
  r.requested_tokens = out;
  r.prompt_tokens = 100;
  r.usage_prompt_tokens = ok ? 100 : 0;
  r.cached_prompt_tokens = ok ? 25 : 0;
  return r;
}

// A bench names each failure status with the first message of that status;
// a failure without a status counts as UNKNOWN, as in failed_by_status.
TEST(Summarize, FirstFailureMessageOfEachStatus) {
  std::vector<RequestRecord> records = {Rec(0, 0.1, {}, 1, 4), Rec(0, 0.1, {}, 1, 0, false),
                                        Rec(0, 0.1, {}, 1, 0, false), Rec(0, 0.1, {}, 1, 0, false)};
  records[1].message = "no worker can take the request";
  records[2].message = "a later one";
  records[3].error.clear();
  records[3].message = "no status";
  const auto first = FirstFailureMessages(records);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first.at("UNAVAILABLE"), "no worker can take the request");
  EXPECT_EQ(first.at("UNKNOWN"), "no status");
  const Summary s = Summarize(records, {});
  EXPECT_EQ(s.failed_by_status.at("UNAVAILABLE"), 2u);
  EXPECT_EQ(s.failed_by_status.at("UNKNOWN"), 1u);
}

TEST(Tpot, Definition) {
  // TPOT = (e2e - TTFT) / (output tokens - 1).
  auto r = Rec(0, 0.1, {0.05, 0.05}, 0.2, 3);
  ASSERT_TRUE(r.Tpot());
  EXPECT_NEAR(*r.Tpot(), 0.05, 1e-12);
  EXPECT_FALSE(Rec(0, 0.1, {}, 0.1, 1).Tpot());
}

TEST(Goodput, EachSloExcludesItsViolators) {
  std::vector<RequestRecord> rs = {
      Rec(0.0, 0.050, {0.010, 0.010}, 0.070, 3),  // meets everything
      Rec(0.0, 0.300, {0.010, 0.010}, 0.320, 3),  // TTFT too slow
      Rec(0.0, 0.050, {0.010, 0.200}, 0.260, 3),  // one gap too slow
      Rec(0.0, 0.050, {}, 0.050, 0, false),       // failed
  };
  Slo none;
  Summary s0 = Summarize(rs, none);
  EXPECT_EQ(s0.good, 3u);  // without SLOs every successful request is good

  Slo ttft;
  ttft.ttft_s = 0.1;
  EXPECT_EQ(Summarize(rs, ttft).good, 2u);

  Slo both = ttft;
  both.itl_s = 0.1;
  Summary s = Summarize(rs, both);
  EXPECT_EQ(s.good, 1u);
  EXPECT_NEAR(s.duration_s, 0.32, 1e-12);
  EXPECT_NEAR(s.goodput, 1.0 / 0.32, 1e-9);

  Slo tpot;
  tpot.tpot_s = 0.05;  // request 3: (0.26 - 0.05) / 2 = 0.105
  EXPECT_EQ(Summarize(rs, tpot).good, 2u);
  Slo e2e;
  e2e.e2e_s = 0.1;
  EXPECT_EQ(Summarize(rs, e2e).good, 1u);
}

TEST(Summarize, CountsTokensFailuresAndCacheRatio) {
  std::vector<RequestRecord> rs = {
      Rec(0.0, 0.1, {0.01}, 1.0, 2),
      Rec(0.5, 0.1, {0.01, 0.02}, 1.5, 3),
      Rec(1.0, -1, {}, 0.1, 0, false),
  };
  Summary s = Summarize(rs, Slo{});
  EXPECT_EQ(s.requests, 3u);
  EXPECT_EQ(s.ok, 2u);
  EXPECT_EQ(s.failed, 1u);
  EXPECT_EQ(s.failed_by_status.at("UNAVAILABLE"), 1u);
  EXPECT_EQ(s.output_tokens, 5u);
  EXPECT_EQ(s.prompt_tokens, 300u);
  EXPECT_NEAR(s.duration_s, 2.0, 1e-12);  // first send 0, last finish 0.5 + 1.5
  EXPECT_NEAR(s.output_throughput, 2.5, 1e-12);
  EXPECT_NEAR(s.cached_token_ratio, 0.25, 1e-12);
  EXPECT_EQ(s.itl_s.count, 3u);
  EXPECT_EQ(s.ttft_s.count, 2u);
  EXPECT_DOUBLE_EQ(s.max_inflight, 2.0);
}

// --tenant-api-keys / --priority: results per tenant and per priority.
TEST(Summarize, GroupsByTenantAndPriority) {
  std::vector<RequestRecord> rs = {
      Rec(0.0, 0.1, {0.01}, 1.0, 2),
      Rec(0.5, 0.3, {0.01, 0.02}, 1.5, 3),
      Rec(1.0, -1, {}, 0.1, 0, false),
  };
  rs[0].tenant = "a";
  rs[0].priority = 0;
  rs[1].tenant = "b";
  rs[1].priority = 10;
  rs[2].tenant = "a";
  rs[2].priority = 10;
  Summary s = Summarize(rs, Slo{});
  ASSERT_EQ(s.groups.size(), 4u);
  EXPECT_EQ(s.groups[0].kind, "tenant");
  EXPECT_EQ(s.groups[0].label, "a");
  EXPECT_EQ(s.groups[0].requests, 2u);
  EXPECT_EQ(s.groups[0].ok, 1u);
  EXPECT_EQ(s.groups[0].output_tokens, 2u);
  EXPECT_NEAR(s.groups[0].ttft_s.p50, 0.1, 1e-12);
  EXPECT_EQ(s.groups[1].label, "b");
  EXPECT_NEAR(s.groups[1].ttft_s.p50, 0.3, 1e-12);
  EXPECT_EQ(s.groups[2].kind, "priority");
  EXPECT_EQ(s.groups[2].label, "0");
  EXPECT_EQ(s.groups[3].label, "10");
  EXPECT_EQ(s.groups[3].requests, 2u);
  EXPECT_EQ(s.groups[3].output_tokens, 3u);
  EXPECT_NEAR(s.groups[3].output_throughput, 1.5, 1e-12);  // 3 tokens over 2 s
  // No mix: no groups.
  EXPECT_TRUE(Summarize({Rec(0.0, 0.1, {}, 1.0, 1)}, Slo{}).groups.empty());
}

TEST(TokensPerBin, SumsChunksIntoBins) {
  RequestRecord r;
  r.chunk_times_s = {0.05, 0.15, 0.16, 0.95};
  r.chunk_tokens = {1, 2, 3, 4};
  auto b = TokensPerBin({r}, 0.1);
  ASSERT_EQ(b.size(), 10u);
  EXPECT_EQ(b[0], 1);
  EXPECT_EQ(b[1], 5);
  EXPECT_EQ(b[9], 4);
  double sum = 0;
  for (double x : b) sum += x;
  EXPECT_EQ(sum, 10);
}

}  // namespace
}  // namespace tandem::loadgen
