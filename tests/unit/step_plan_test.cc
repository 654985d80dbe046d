// The step plan's wire format (parallel/step_plan.h): round trips, the
// extension fields kv-reshard adds, every malformed input refused with a
// message (never a crash), and the micro-batch cut.
#include "parallel/step_plan.h"

#include <gtest/gtest.h>

#include <cstring>

namespace tandem::parallel {
namespace {

StepPlan SamplePlan() {
  StepPlan p;
  p.kind = StepKind::kForward;
  p.step = 0x0102030405060708ull;
  p.chunks.push_back({{1, 2, 3, 4, 5}, 0, {7, 9}, 1});
  p.chunks.push_back({{42}, 37, {3, 4, 5}, 1});
  p.chunks.push_back({{8, 8}, 16, {1, 2}, 0});
  p.micro_batch_ends = {1, 3};
  return p;
}

TEST(StepPlan, RoundTripsEveryField) {
  StepPlan p = SamplePlan();
  p.extensions.push_back({kFirstExtensionTag, {std::byte{1}, std::byte{2}, std::byte{3}}});
  p.extensions.push_back({31, {}});
  const auto bytes = SerializeStepPlan(p);
  auto back = ParseStepPlan(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, p);
  EXPECT_EQ(back->chunks[1].tokens, std::vector<uint32_t>{42});
  EXPECT_EQ(back->chunks[1].start_pos, 37u);
  EXPECT_EQ(back->chunks[1].block_table, (std::vector<uint32_t>{3, 4, 5}));
}

TEST(StepPlan, ShutdownAndEmptyPlansRoundTrip) {
  StepPlan p;
  p.kind = StepKind::kShutdown;
  p.step = 9;
  auto back = ParseStepPlan(SerializeStepPlan(p));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->kind, StepKind::kShutdown);
  EXPECT_EQ(back->step, 9u);
  EXPECT_TRUE(back->chunks.empty());
  EXPECT_STREQ(StepKindName(StepKind::kPushKv), "push_kv");
}

TEST(StepPlan, EveryTruncationIsRefusedWithAMessage) {
  const auto bytes = SerializeStepPlan(SamplePlan());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = ParseStepPlan(std::span<const std::byte>(bytes.data(), n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << n;
    EXPECT_NE(r.status().message().find("step plan"), std::string::npos) << r.status().message();
  }
}

TEST(StepPlan, CorruptHeadersAndFieldsAreRefused) {
  auto bytes = SerializeStepPlan(SamplePlan());
  auto magic = bytes;
  magic[0] = std::byte{0};
  EXPECT_NE(ParseStepPlan(magic).status().message().find("magic"), std::string::npos);
  auto version = bytes;
  version[4] = std::byte{7};
  EXPECT_NE(ParseStepPlan(version).status().message().find("version 7"), std::string::npos);
  auto kind = bytes;
  kind[6] = std::byte{9};
  EXPECT_NE(ParseStepPlan(kind).status().message().find("unknown kind 9"), std::string::npos);
  auto trailing = bytes;
  trailing.push_back(std::byte{0});
  EXPECT_FALSE(ParseStepPlan(trailing).ok());
  // A chunk count far beyond what the field holds.
  auto count = bytes;
  const uint32_t huge = 0x7fffffff;
  std::memcpy(count.data() + 20 + 8, &huge, 4);  // header, field header, then the count
  EXPECT_NE(ParseStepPlan(count).status().message().find("cannot fit"), std::string::npos);
  // A reserved tag below the extension range.
  StepPlan p;
  p.extensions.push_back({5, {}});
  EXPECT_NE(ParseStepPlan(SerializeStepPlan(p)).status().message().find("unknown field tag 5"),
            std::string::npos);
}

TEST(StepPlan, MicroBatchEndsMustCoverTheChunksInOrder) {
  StepPlan p = SamplePlan();
  p.micro_batch_ends = {2, 2, 3};
  EXPECT_NE(ParseStepPlan(SerializeStepPlan(p)).status().message().find("not ascending"),
            std::string::npos);
  p.micro_batch_ends = {1, 2};
  EXPECT_NE(ParseStepPlan(SerializeStepPlan(p)).status().message().find("end at chunk 2 of 3"),
            std::string::npos);
  p.micro_batch_ends = {4};
  EXPECT_FALSE(ParseStepPlan(SerializeStepPlan(p)).ok());
}

TEST(SplitMicroBatches, CutsBalancedNonEmptyContiguousRanges) {
  using V = std::vector<uint32_t>;
  EXPECT_EQ(SplitMicroBatches(V{}, 2), V{});
  EXPECT_EQ(SplitMicroBatches(V{5}, 2), V{1});
  EXPECT_EQ(SplitMicroBatches(V{10, 10, 10, 10}, 2), (V{2, 4}));
  EXPECT_EQ(SplitMicroBatches(V{10, 10, 10, 10}, 1), (V{4}));
  EXPECT_EQ(SplitMicroBatches(V{100, 1, 1}, 2), (V{1, 3}));
  EXPECT_EQ(SplitMicroBatches(V{1, 1, 100}, 3), (V{1, 2, 3}));
  EXPECT_EQ(SplitMicroBatches(V{1, 1, 1, 1, 1, 1}, 3), (V{2, 4, 6}));
  EXPECT_EQ(SplitMicroBatches(V{3, 1}, 0), (V{2}));  // 0 means 1
  // Every cut: ascending, non-empty, ends at the chunk count.
  for (uint32_t n = 1; n < 12; ++n) {
    for (uint32_t m = 1; m < 6; ++m) {
      V tokens(n);
      for (uint32_t i = 0; i < n; ++i) tokens[i] = 1 + (i * 7) % 5;
      const V ends = SplitMicroBatches(tokens, m);
      ASSERT_EQ(ends.size(), std::min(n, m)) << n << " " << m;
      uint32_t prev = 0;
      for (uint32_t e : ends) {
        EXPECT_GT(e, prev);
        prev = e;
      }
      EXPECT_EQ(prev, n);
    }
  }
}

}  // namespace
}  // namespace tandem::parallel
