#include "parallel/parallel_layout.h"

#include <gtest/gtest.h>

namespace tandem::parallel {
namespace {

// The bundled model's dimensions (models/tandem-kjv/config.json).
constexpr ModelDims kKjv{.num_layers = 5, .num_heads = 8, .num_kv_heads = 2,
                         .intermediate = 688, .vocab = 4096};

TEST(ParallelLayout, RanksMapToStageAndTensorRank) {
  const ParallelLayout l{.tp = 2, .pp = 3};
  EXPECT_EQ(l.world(), 6u);
  EXPECT_EQ(l.stage_of(5), 2u);
  EXPECT_EQ(l.tp_rank_of(5), 1u);
  EXPECT_EQ(l.rank_of(2, 1), 5u);
  EXPECT_EQ(ToString(l), "tp2pp3");
}

TEST(ParallelLayout, StagesCoverEveryLayerOnceFirstStagesTakeTheRemainder) {
  const ParallelLayout l{.tp = 1, .pp = 2};
  EXPECT_EQ(StageLayers(l, 5, 0), (Range{0, 3}));
  EXPECT_EQ(StageLayers(l, 5, 1), (Range{3, 5}));
  const ParallelLayout l4{.tp = 1, .pp = 4};
  uint32_t next = 0;
  for (uint32_t s = 0; s < 4; ++s) {
    const Range r = StageLayers(l4, 10, s);
    EXPECT_EQ(r.begin, next);
    EXPECT_GE(r.size(), 2u);
    next = r.end;
  }
  EXPECT_EQ(next, 10u);
}

TEST(ParallelLayout, KvHeadsAreSplitOrReplicated) {
  const ParallelLayout tp2{.tp = 2, .pp = 1};
  EXPECT_EQ(TpKvHeads(tp2, 2, 0), (Range{0, 1}));
  EXPECT_EQ(TpKvHeads(tp2, 2, 1), (Range{1, 2}));
  EXPECT_EQ(TpHeads(tp2, 8, 1), (Range{4, 8}));
  const ParallelLayout tp4{.tp = 4, .pp = 1};  // 2 kv heads over 4 ranks: each held twice
  EXPECT_EQ(TpKvHeads(tp4, 2, 0), (Range{0, 1}));
  EXPECT_EQ(TpKvHeads(tp4, 2, 1), (Range{0, 1}));
  EXPECT_EQ(TpKvHeads(tp4, 2, 2), (Range{1, 2}));
  EXPECT_EQ(TpKvHeads(tp4, 2, 3), (Range{1, 2}));
  EXPECT_EQ(TpSlice(tp4, 688, 3), (Range{516, 688}));
}

TEST(ParallelLayout, CheckNamesTheDimensionAndTheDegree) {
  EXPECT_TRUE(CheckLayout({.tp = 1, .pp = 1}, kKjv).ok());
  EXPECT_TRUE(CheckLayout({.tp = 2, .pp = 2}, kKjv).ok());
  EXPECT_TRUE(CheckLayout({.tp = 4, .pp = 1}, kKjv).ok());
  const Status three = CheckLayout({.tp = 3, .pp = 1}, kKjv);
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.message().find("tensor_parallel 3 does not divide num_attention_heads 8"),
            std::string::npos)
      << three.message();
  const Status deep = CheckLayout({.tp = 1, .pp = 6}, kKjv);
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.message().find("pipeline_parallel 6 exceeds num_hidden_layers 5"),
            std::string::npos)
      << deep.message();
  EXPECT_FALSE(CheckLayout({.tp = 0, .pp = 1}, kKjv).ok());
}

}  // namespace
}  // namespace tandem::parallel
