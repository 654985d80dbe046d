// Sampler (greedy, temperature, top-k, top-p, seeds) and stop strings.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "model/stop_strings.h"

namespace tandem::engine {
namespace {

using model::StopStringMatcher;

TEST(SamplerTest, GreedyPicksLowestIdOnTiesAndSkipsNan) {
  Sampler s;
  SamplingParams p;
  p.temperature = 0;
  std::vector<float> l = {1.0f, 3.0f, NAN, 3.0f, -2.0f};
  EXPECT_EQ(s.Sample(l, p, 1, 0), 1u);
  p.temperature = 1.0f;
  p.top_k = 1;
  EXPECT_EQ(s.Sample(l, p, 1, 0), 1u);
}

// Argmax against the definition (first index of the largest non-NaN
// value; 0 when all are NaN), written out as the one-branch loop it
// replaced, on random vectors of every length 0..70 with NaNs, infinities,
// signed zeros and many ties.
TEST(SamplerTest, ArgmaxEqualsTheFirstNonNanMaximum) {
  const auto reference = [](const std::vector<float>& v) {
    uint32_t best = 0;
    bool found = false;
    for (uint32_t i = 0; i < v.size(); ++i) {
      if (std::isnan(v[i])) continue;
      if (!found || v[i] > v[best]) {
        best = i;
        found = true;
      }
    }
    return best;
  };
  const float pool[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f, 2.5f, 2.5f, 1e30f};
  uint64_t x = 12345;
  const auto next = [&x] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(x >> 33);
  };
  int cases = 0;
  for (size_t len = 0; len <= 70; ++len) {
    for (int rep = 0; rep < 200; ++rep) {
      std::vector<float> v(len);
      const uint32_t mode = next() % 3;  // 0: from the pool, 1: random, 2: mostly NaN / -inf
      for (float& f : v) {
        if (mode == 0) f = pool[next() % std::size(pool)];
        else if (mode == 1) f = static_cast<float>(next() % 64) - 32.0f;
        else f = next() % 4 == 0 ? -INFINITY : NAN;
      }
      ASSERT_EQ(Argmax(v), reference(v)) << "length " << len << " mode " << mode;
      ++cases;
    }
  }
  EXPECT_EQ(cases, 71 * 200);
  std::vector<float> big(4096, -3.0f);
  big[4000] = 7.0f;
  big[4001] = 7.0f;
  big[17] = NAN;
  EXPECT_EQ(Argmax(big), 4000u);
}

TEST(SamplerTest, SameSeedAndIndexSameTokenDifferentIndexVaries) {
  Sampler s;
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<float> l(64, 0.0f);  // uniform
  std::map<uint32_t, int> counts;
  for (uint64_t i = 0; i < 2000; ++i) {
    const uint32_t a = s.Sample(l, p, 1234, i);
    EXPECT_EQ(a, s.Sample(l, p, 1234, i));
    ++counts[a];
  }
  EXPECT_GT(counts.size(), 55u);  // all of 64 ids are hit roughly evenly
  for (auto& [id, c] : counts) EXPECT_LT(c, 80);
  int differ = 0;
  for (uint64_t i = 0; i < 50; ++i) differ += s.Sample(l, p, 1, i) != s.Sample(l, p, 2, i);
  EXPECT_GT(differ, 30);
}

TEST(SamplerTest, TemperatureShapesTheDistribution) {
  Sampler s;
  SamplingParams p;
  std::vector<float> l = {0.0f, std::log(3.0f)};  // p = 0.25, 0.75 at T = 1
  int ones = 0;
  const int n = 4000;
  for (int i = 0; i < n; ++i) ones += s.Sample(l, p, 9, i) == 1;
  EXPECT_NEAR(ones / double(n), 0.75, 0.03);
  p.temperature = 0.05f;  // nearly greedy
  ones = 0;
  for (int i = 0; i < 500; ++i) ones += s.Sample(l, p, 9, i) == 1;
  EXPECT_EQ(ones, 500);
}

TEST(SamplerTest, TopKAndTopPRestrictTheSupport) {
  Sampler s;
  SamplingParams p;
  std::vector<float> l = {5.0f, 4.9f, 4.8f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  p.top_k = 2;
  for (int i = 0; i < 300; ++i) EXPECT_LT(s.Sample(l, p, 3, i), 2u);
  p.top_k = 0;
  p.top_p = 0.5f;  // the two largest hold > 0.5 together, the first alone < 0.5
  std::map<uint32_t, int> c;
  for (int i = 0; i < 600; ++i) ++c[s.Sample(l, p, 3, i)];
  EXPECT_EQ(c.size(), 2u);
  EXPECT_GT(c[0], 0);
  EXPECT_GT(c[1], 0);
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  p.top_p = 0;
  EXPECT_NE(ValidateSamplingParams(p).message().find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1;
  EXPECT_NE(ValidateSamplingParams(p).message().find("temperature"), std::string::npos);
  p = {};
  p.max_tokens = 0;
  EXPECT_EQ(ValidateSamplingParams(p).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}).ok());
}

TEST(StopStringsTest, HoldsPossiblePrefixAndCutsBeforeStop) {
  StopStringMatcher m({"STOP", "\n\n"});
  auto a = m.Push("hello S");
  EXPECT_EQ(a.text, "hello ");
  EXPECT_FALSE(a.stopped);
  auto b = m.Push("T");
  EXPECT_EQ(b.text, "");
  auto c = m.Push("x");  // "STx" cannot become a stop string
  EXPECT_EQ(c.text, "STx");
  auto d = m.Push("yy\n");
  EXPECT_EQ(d.text, "yy");
  auto e = m.Push("\nmore");
  EXPECT_TRUE(e.stopped);
  EXPECT_EQ(e.text, "");
  EXPECT_EQ(m.Push("later").text, "");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringsTest, StopInsideOneChunkAndFlushWithoutStop) {
  StopStringMatcher m({"end"});
  auto a = m.Push("the end of it");
  EXPECT_TRUE(a.stopped);
  EXPECT_EQ(a.text, "the ");
  StopStringMatcher n({"end"});
  EXPECT_EQ(n.Push("we e").text, "we ");
  EXPECT_EQ(n.Flush(), "e");
  StopStringMatcher none({});
  EXPECT_EQ(none.Push("abc").text, "abc");
}


// The sim backend's rows: 0.0 at one id, -1e30 elsewhere. Where
// OneHotPickIsCertain says so, Sample returns the hot id for every seed and
// index (so the engine may take it without the row); at an absurd
// temperature the other ids get mass and it does not.
TEST(SamplerTest, OneHotRowsPickTheHotIdWhereCertain) {
  Sampler s;
  std::vector<float> row(4096, -1e30f);
  const uint32_t hot = 2771;
  row[hot] = 0.0f;
  std::vector<SamplingParams> certain(6);
  certain[0].temperature = 0;
  certain[1].temperature = 0.8f;
  certain[2].temperature = 1.0f;
  certain[2].top_p = 0.5f;
  certain[3].temperature = 2.0f;
  certain[3].top_k = 40;
  certain[4].temperature = 1e20f;
  certain[5].temperature = 3e38f;
  certain[5].top_k = 1;
  for (const SamplingParams& p : certain) {
    EXPECT_TRUE(OneHotPickIsCertain(p)) << p.temperature;
    for (uint64_t i = 0; i < 200; ++i) EXPECT_EQ(s.Sample(row, p, 7 + i, i), hot) << p.temperature;
  }
  SamplingParams hot_t;
  hot_t.temperature = 3e38f;
  EXPECT_FALSE(OneHotPickIsCertain(hot_t));
  uint32_t others = 0;
  for (uint64_t i = 0; i < 200; ++i) others += s.Sample(row, hot_t, 7 + i, i) != hot;
  EXPECT_GT(others, 0u);
}

}  // namespace
}  // namespace tandem::engine
