// SentTokens (proxy/sent_tokens.h): the lifecycle's append-only record of
// the completion tokens sent, checked against a std::vector model across
// chunk boundaries.
#include "proxy/sent_tokens.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace tandem::proxy {
namespace {

TEST(SentTokens, EmptyAtFirst) {
  SentTokens s;
  EXPECT_TRUE(s.empty());
  EXPECT_EQ(s.size(), 0u);
  std::vector<uint32_t> out{7};
  s.CopyPrefixTo(5, &out);
  EXPECT_EQ(out, std::vector<uint32_t>{7});
}

TEST(SentTokens, AppendsOfEveryLengthMatchAVector) {
  std::mt19937 rng(23);
  SentTokens s;
  std::vector<uint32_t> model;
  // Appends of 0..40 ids up to ~9 chunks, one id at a time near the
  // boundaries too (a chunk that just filled keeps back()).
  while (model.size() < 9 * SentTokens::kChunk + 3) {
    const size_t n = rng() % 41;
    std::vector<uint32_t> ids(n);
    for (auto& id : ids) id = rng();
    s.Append(ids);
    model.insert(model.end(), ids.begin(), ids.end());
    ASSERT_EQ(s.size(), model.size());
    ASSERT_EQ(s.empty(), model.empty());
    if (!model.empty()) {
      ASSERT_EQ(s.back(), model.back());
    }
  }
  for (size_t i = 0; i < model.size(); ++i) ASSERT_EQ(s[i], model[i]) << i;
  for (size_t n : {size_t{0}, size_t{1}, SentTokens::kChunk - 1, SentTokens::kChunk,
                   SentTokens::kChunk + 1, 3 * SentTokens::kChunk, model.size() - 1, model.size(),
                   model.size() + 10}) {
    std::vector<uint32_t> out{1, 2};  // appended after what is there
    s.CopyPrefixTo(n, &out);
    const size_t k = std::min(n, model.size());
    ASSERT_EQ(out.size(), 2 + k) << n;
    EXPECT_EQ(out[0], 1u);
    EXPECT_EQ(out[1], 2u);
    EXPECT_TRUE(std::equal(out.begin() + 2, out.end(), model.begin())) << n;
  }
}

TEST(SentTokens, OneAtATimeAcrossAChunkBoundary) {
  SentTokens s;
  for (uint32_t i = 0; i < 2 * SentTokens::kChunk + 1; ++i) {
    s.Append(std::span<const uint32_t>(&i, 1));
    ASSERT_EQ(s.back(), i);
    ASSERT_EQ(s.size(), i + 1);
  }
  EXPECT_EQ(s[SentTokens::kChunk - 1], SentTokens::kChunk - 1);
  EXPECT_EQ(s[SentTokens::kChunk], SentTokens::kChunk);
  EXPECT_EQ(s[2 * SentTokens::kChunk], 2 * SentTokens::kChunk);
}

}  // namespace
}  // namespace tandem::proxy
