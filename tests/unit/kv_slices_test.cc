#include "parallel/kv_slices.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace tandem::parallel {
namespace {

// The bundled model (models/tandem-kjv): 5 layers, 2 kv heads, head_dim 32.
constexpr KvDims kKjv{.num_layers = 5, .num_kv_heads = 2, .head_dim = 32, .block_size = 16};
// tests/fixtures/golden/tiny-llama: 2 layers, 1 kv head, head_dim 32.
constexpr KvDims kTinyLlama{.num_layers = 2, .num_kv_heads = 1, .head_dim = 32, .block_size = 16};

// The tag of one float of the model's KV block: unique per
// (layer, kv, head, token, dim), exact in f32 (< 2^24), never 0.
float Tag(const KvDims& d, uint32_t layer, uint32_t kv, uint32_t head, uint32_t token,
          uint32_t dim) {
  const uint32_t t =
      (((layer * 2 + kv) * d.num_kv_heads + head) * d.block_size + token) * d.head_dim + dim + 1;
  return static_cast<float>(t);
}

// Rank `rank`'s block as the engine would have written it: every float
// tagged with what it holds.
std::vector<float> RankBlock(const ParallelLayout& l, const KvDims& d, uint32_t rank) {
  const RankKvShape s = RankKvShapeOf(l, d, rank);
  std::vector<float> block(s.block_bytes() / sizeof(float));
  size_t i = 0;
  for (uint32_t layer = s.layers.begin; layer < s.layers.end; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t head = s.kv_heads.begin; head < s.kv_heads.end; ++head) {
        for (uint32_t token = 0; token < d.block_size; ++token) {
          for (uint32_t dim = 0; dim < d.head_dim; ++dim)
            block[i++] = Tag(d, layer, kv, head, token, dim);
        }
      }
    }
  }
  EXPECT_EQ(i, block.size());
  return block;
}

// Applies the plan to synthetic blocks and checks every float of every
// decode rank's block: right tag, written exactly once.
void CheckPlan(const ParallelLayout& src, const ParallelLayout& dst, const KvDims& d) {
  SCOPED_TRACE(fmt::format("{} -> {}, {} layers, {} kv heads", ToString(src), ToString(dst),
                           d.num_layers, d.num_kv_heads));
  auto plan = PlanKvSlices(src, dst, d);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::vector<std::vector<float>> src_blocks, dst_blocks, expect;
  std::vector<std::vector<int>> writes;
  for (uint32_t r = 0; r < src.world(); ++r) src_blocks.push_back(RankBlock(src, d, r));
  for (uint32_t r = 0; r < dst.world(); ++r) {
    expect.push_back(RankBlock(dst, d, r));
    dst_blocks.emplace_back(expect.back().size(), 0.0f);
    writes.emplace_back(expect.back().size(), 0);
  }
  uint32_t prev_src = 0, prev_dst = 0;
  bool first = true;
  for (const auto& pair : plan->pairs) {
    ASSERT_LT(pair.src_rank, src.world());
    ASSERT_LT(pair.dst_rank, dst.world());
    ASSERT_FALSE(pair.runs.empty());
    if (!first) {
      EXPECT_TRUE(pair.src_rank > prev_src ||
                  (pair.src_rank == prev_src && pair.dst_rank > prev_dst))
          << "pairs not sorted/unique at " << pair.src_rank << "->" << pair.dst_rank;
    }
    first = false;
    prev_src = pair.src_rank;
    prev_dst = pair.dst_rank;
    const auto& sb = src_blocks[pair.src_rank];
    auto& db = dst_blocks[pair.dst_rank];
    for (const auto& run : pair.runs) {
      ASSERT_EQ(run.bytes % sizeof(float), 0u);
      ASSERT_LE(run.src_offset_bytes + run.bytes, sb.size() * sizeof(float));
      ASSERT_LE(run.dst_offset_bytes + run.bytes, db.size() * sizeof(float));
      std::memcpy(reinterpret_cast<char*>(db.data()) + run.dst_offset_bytes,
                  reinterpret_cast<const char*>(sb.data()) + run.src_offset_bytes, run.bytes);
      for (uint64_t f = 0; f < run.bytes / sizeof(float); ++f) {
        ++writes[pair.dst_rank][run.dst_offset_bytes / sizeof(float) + f];
      }
    }
  }
  for (uint32_t r = 0; r < dst.world(); ++r) {
    size_t wrong = 0, not_once = 0;
    for (size_t i = 0; i < expect[r].size(); ++i) {
      if (dst_blocks[r][i] != expect[r][i]) ++wrong;
      if (writes[r][i] != 1) ++not_once;
    }
    EXPECT_EQ(wrong, 0u) << "decode rank " << r
                         << ": floats with the wrong (layer, kv, head, token, dim)";
    EXPECT_EQ(not_once, 0u) << "decode rank " << r << ": floats not written exactly once";
  }
}

struct Case {
  ParallelLayout src, dst;
};
const Case kCases[] = {
    {{1, 1}, {1, 1}}, {{2, 1}, {1, 1}}, {{1, 1}, {2, 1}}, {{4, 1}, {2, 1}},
    {{1, 1}, {1, 2}}, {{2, 1}, {1, 2}}, {{1, 2}, {2, 1}},
};

TEST(KvSlices, BundledModelEveryDecodeFloatExactlyOnce) {
  for (const Case& c : kCases) CheckPlan(c.src, c.dst, kKjv);
}

TEST(KvSlices, TinyLlamaOneKvHeadReplicatedOnEverySide) {
  for (const Case& c : kCases) CheckPlan(c.src, c.dst, kTinyLlama);
}

TEST(KvSlices, EveryLayoutPairUpToFourByThree) {
  for (uint32_t stp : {1u, 2u, 4u}) {
    for (uint32_t spp : {1u, 2u, 3u}) {
      for (uint32_t dtp : {1u, 2u, 4u}) {
        for (uint32_t dpp : {1u, 2u, 3u}) CheckPlan({stp, spp}, {dtp, dpp}, kKjv);
      }
    }
  }
}

TEST(KvSlices, SameLayoutIsOneWholeBlockRunPerRank) {
  auto plan = PlanKvSlices({2, 1}, {2, 1}, kKjv);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 2u);
  const uint64_t rank_block = 5ull * 2 * 1 * 16 * 32 * 4;  // one kv head per rank
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(plan->pairs[r].src_rank, r);
    EXPECT_EQ(plan->pairs[r].dst_rank, r);
    ASSERT_EQ(plan->pairs[r].runs.size(), 1u);
    EXPECT_EQ(plan->pairs[r].runs[0], (KvSliceRun{0, 0, rank_block}));
  }
}

TEST(KvSlices, TwoPrefillRanksIntoOneDecodeRankInterleaveHeads) {
  // Prefill TP=2 holds head 0 on rank 0 and head 1 on rank 1; the TP=1
  // decoder holds [layer][K,V][head 0, head 1]: each sender writes one
  // head plane per (layer, K/V): 10 runs each, never merged.
  auto plan = PlanKvSlices({2, 1}, {1, 1}, kKjv);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 2u);
  const uint64_t head_plane = 16 * 32 * 4;
  for (uint32_t s = 0; s < 2; ++s) {
    const auto& runs = plan->pairs[s].runs;
    ASSERT_EQ(runs.size(), 10u);
    EXPECT_EQ(runs[0], (KvSliceRun{0, s * head_plane, head_plane}));
    EXPECT_EQ(runs[1], (KvSliceRun{head_plane, (2 + s) * head_plane, head_plane}));
  }
  EXPECT_EQ(plan->FromRank(1).size(), 1u);
  EXPECT_EQ(plan->FromRank(1)[0]->dst_rank, 0u);
}

TEST(KvSlices, ReplicatedPrefillHeadHasOneSenderTheLowestRank) {
  // TP=4 over 2 kv heads: ranks 0,1 hold head 0 and ranks 2,3 head 1; only
  // ranks 0 and 2 send.
  auto plan = PlanKvSlices({4, 1}, {1, 1}, kKjv);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 2u);
  EXPECT_EQ(plan->pairs[0].src_rank, 0u);
  EXPECT_EQ(plan->pairs[1].src_rank, 2u);
  EXPECT_TRUE(plan->FromRank(1).empty());
  EXPECT_TRUE(plan->FromRank(3).empty());
}

TEST(KvSlices, PipelineStagesPushTheirLayersOnly) {
  // Prefill PP=2 (layers 0-2 | 3-4) into a TP=1 PP=1 decoder: rank 1's run
  // starts at layer 3 of the decoder's block and is one contiguous run.
  auto plan = PlanKvSlices({1, 2}, {1, 1}, kKjv);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 2u);
  const uint64_t layer_bytes = 2ull * 2 * 16 * 32 * 4;
  EXPECT_EQ(plan->pairs[1].runs, (std::vector<KvSliceRun>{{0, 3 * layer_bytes, 2 * layer_bytes}}));
}

TEST(KvSlices, LayoutsThatCannotSplitTheModelAreRefusedNamingTheDimension) {
  auto bad_tp = PlanKvSlices({3, 1}, {1, 1}, kKjv);
  ASSERT_FALSE(bad_tp.ok());
  EXPECT_NE(bad_tp.status().message().find("prefill tensor_parallel 3"), std::string::npos)
      << bad_tp.status().ToString();
  EXPECT_NE(bad_tp.status().message().find("num_key_value_heads 2"), std::string::npos);
  auto bad_pp = PlanKvSlices({1, 1}, {1, 6}, kKjv);
  ASSERT_FALSE(bad_pp.ok());
  EXPECT_NE(
      bad_pp.status().message().find("decode pipeline_parallel 6 exceeds num_hidden_layers 5"),
      std::string::npos)
      << bad_pp.status().ToString();
  KvDims zero = kKjv;
  zero.head_dim = 0;
  EXPECT_FALSE(PlanKvSlices({1, 1}, {1, 1}, zero).ok());

  constexpr ModelDims kjv{
      .num_layers = 5, .num_heads = 8, .num_kv_heads = 2, .intermediate = 688, .vocab = 4096};
  EXPECT_TRUE(KvLayoutsCompatible({2, 1}, {1, 2}, kjv).ok());
  const Status s = KvLayoutsCompatible({1, 1}, {3, 1}, kjv);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("decode layout tp3pp1"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace tandem::parallel
