#include <gtest/gtest.h>

#include <fstream>

#include "loadgen/mooncake_trace.h"

namespace tandem::loadgen {
namespace {

constexpr uint32_t kVocab = 4096;

TEST(MooncakeTrace, ParsesRecords) {
  const std::string text =
      "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n"
      "\n"
      "{\"timestamp\": 40, \"input_length\": 512, \"output_length\": 7, \"hash_ids\": [0]}\n";
  auto r = ParseMooncakeTrace(text, "t.jsonl");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].input_length, 600u);
  EXPECT_EQ((*r)[0].hash_ids, (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ((*r)[1].timestamp_ms, 40u);
  EXPECT_EQ((*r)[1].line, 3u);  // the blank line counts
  auto first = ParseMooncakeTrace(text, "t.jsonl", 1);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->size(), 1u);
}

struct Bad {
  std::string line2;
  std::string message;
};

TEST(MooncakeTrace, MalformedLinesNameLineAndField) {
  const std::string good =
      "{\"timestamp\": 10, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0]}\n";
  const std::vector<Bad> cases = {
      {"{\"timestamp\": 20, \"input_length\": 10", "t.jsonl:2: not valid JSON"},
      {"[1, 2]", "t.jsonl:2: expected a JSON object"},
      {"{\"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0]}",
       "t.jsonl:2: missing field 'timestamp'"},
      {"{\"timestamp\": 20, \"input_length\": -1, \"output_length\": 5, \"hash_ids\": [0]}",
       "t.jsonl:2: field 'input_length' must be a non-negative integer, got -1"},
      {"{\"timestamp\": 20, \"input_length\": 1.5, \"output_length\": 5, \"hash_ids\": [0]}",
       "t.jsonl:2: field 'input_length' must be a non-negative integer, got 1.5"},
      {"{\"timestamp\": 20, \"input_length\": 0, \"output_length\": 5, \"hash_ids\": []}",
       "t.jsonl:2: field 'input_length' must be >= 1"},
      {"{\"timestamp\": 20, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [0]}",
       "t.jsonl:2: field 'output_length' must be >= 1"},
      {"{\"timestamp\": 20, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": 3}",
       "t.jsonl:2: field 'hash_ids' must be an array of integers"},
      {"{\"timestamp\": 20, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [\"a\"]}",
       "t.jsonl:2: field 'hash_ids[0]' must be a non-negative integer, got \"a\""},
      {"{\"timestamp\": 20, \"input_length\": 1025, \"output_length\": 5, \"hash_ids\": [0, 1]}",
       "t.jsonl:2: field 'hash_ids' has 2 ids; input_length 1025 needs 3 (blocks of 512 tokens)"},
      {"{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0]}",
       "t.jsonl:2: field 'timestamp' 5 is earlier than line 1's 10 (the trace must be in time "
       "order)"},
      {"{\"timestamp\": 20, \"input_length\": 100000001, \"output_length\": 5, \"hash_ids\": [0]}",
       "t.jsonl:2: field 'input_length' is 100000001; the limit is 100000000"},
  };
  for (const auto& c : cases) {
    auto r = ParseMooncakeTrace(good + c.line2 + "\n", "t.jsonl");
    ASSERT_FALSE(r.ok()) << c.line2;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), c.message) << c.line2;
  }
  EXPECT_EQ(ParseMooncakeTrace("\n\n", "e.jsonl").status().message(),
            "e.jsonl: no requests in the trace");
  EXPECT_EQ(ReadMooncakeTrace("/nonexistent/x.jsonl").status().code(), StatusCode::kNotFound);
}

TEST(MooncakeTrace, HashBlocksAreDeterministicPerId) {
  const auto a = HashBlockTokens(42, 512, kVocab);
  EXPECT_EQ(a, HashBlockTokens(42, 512, kVocab));
  EXPECT_NE(a, HashBlockTokens(43, 512, kVocab));
  // A shorter block is a prefix of the longer one: scaling keeps identity.
  const auto b = HashBlockTokens(42, 16, kVocab);
  EXPECT_TRUE(std::equal(b.begin(), b.end(), a.begin()));
  for (uint32_t t : a) {
    EXPECT_GE(t, kFirstTokenId);
    EXPECT_LT(t, kVocab);
  }
  // Golden values: the mapping must not change between versions, or
  // recorded replays stop being comparable.
  EXPECT_EQ(HashBlockTokens(0, 4, kVocab), (std::vector<uint32_t>{3296, 786, 1767, 552}))
      << "values from an independent Python SplitMix64";
}

TEST(MooncakeTrace, ReplayMapsSharedIdsToSharedPrefixes) {
  const std::string text =
      "{\"timestamp\": 1000, \"input_length\": 1500, \"output_length\": 100, \"hash_ids\": [5, 6, 7]}\n"
      "{\"timestamp\": 3000, \"input_length\": 1100, \"output_length\": 10, \"hash_ids\": [5, 6, 9]}\n";
  auto recs = ParseMooncakeTrace(text, "t");
  ASSERT_TRUE(recs.ok());
  TraceReplayOptions o;
  o.vocab = kVocab;
  o.block_tokens = 16;  // x 1/32
  o.output_scale = 0.5;
  o.time_scale = 0.5;
  auto r = BuildTraceReplay(*recs, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->sessions.size(), 2u);
  const auto& p0 = r->sessions[0].turns[0].new_tokens;
  const auto& p1 = r->sessions[1].turns[0].new_tokens;
  EXPECT_EQ(p0.size(), ScaledInputLength(1500, 16));  // ceil(1500 / 32) = 47
  EXPECT_EQ(p0.size(), 47u);
  EXPECT_EQ(p1.size(), 35u);  // ceil(1100 / 32)
  // Blocks 5 and 6 are shared: the first 32 tokens are equal, the third block differs.
  EXPECT_TRUE(std::equal(p0.begin(), p0.begin() + 32, p1.begin()));
  EXPECT_NE(std::vector<uint32_t>(p0.begin() + 32, p0.begin() + 35),
            std::vector<uint32_t>(p1.begin() + 32, p1.end()));
  // The block of an id is the same wherever it appears; the last block is cut.
  const auto b7 = HashBlockTokens(7, 16, kVocab);
  EXPECT_TRUE(std::equal(p0.begin() + 32, p0.end(), b7.begin()));
  EXPECT_EQ(r->sessions[0].turns[0].max_tokens, 50u);
  EXPECT_EQ(r->sessions[1].turns[0].max_tokens, 5u);
  EXPECT_DOUBLE_EQ(r->sessions[0].start_s, 0.0);  // relative to the first timestamp
  EXPECT_DOUBLE_EQ(r->sessions[1].start_s, 1.0);  // 2 s x 0.5
  EXPECT_EQ(r->truncated_prompts, 0u);
}

TEST(MooncakeTrace, ReplayTruncatesToTheContext) {
  const std::string text =
      "{\"timestamp\": 0, \"input_length\": 2048, \"output_length\": 10, \"hash_ids\": [1, 2, 3, 4]}\n";
  auto recs = ParseMooncakeTrace(text, "t");
  ASSERT_TRUE(recs.ok());
  TraceReplayOptions o;
  o.vocab = kVocab;
  o.max_model_len = 1000;
  auto r = BuildTraceReplay(*recs, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->truncated_prompts, 1u);
  EXPECT_EQ(r->sessions[0].turns[0].new_tokens.size(), 990u);
  // The kept prefix is exactly blocks 1 and the first 478 tokens of 2.
  const auto b1 = HashBlockTokens(1, 512, kVocab);
  EXPECT_TRUE(std::equal(b1.begin(), b1.end(), r->sessions[0].turns[0].new_tokens.begin()));

  o.block_tokens = 0;
  EXPECT_EQ(BuildTraceReplay(*recs, o).status().message(),
            "--trace-block-tokens must be in [1, 512], got 0");
}

TEST(MooncakeTrace, TheSharedTraceParses) {
  const std::string path = "/work/shared/workloads/mooncake_synthetic_trace.jsonl";
  if (!std::ifstream(path)) GTEST_SKIP() << path << " is not on this machine";
  auto r = ReadMooncakeTrace(path, 200);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->size(), 200u);
}

}  // namespace
}  // namespace tandem::loadgen
