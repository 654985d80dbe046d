// The engine's decoder side (docs/engine.md, docs/serving-workers.md): a
// prefill-only request's blocks reserved and added on another engine equal
// an aggregated run; Reserve refuses what does not fit and holds nothing;
// prefilled requests that fill the pool all finish (no deadlock); a
// reservation waits behind the requests the engine preempted.
#include <gtest/gtest.h>

#include <cstring>
#include <utility>

#include "engine/engine.h"
#include "test_models.h"

namespace tandem::engine {
namespace {
using testing::Collector;
using testing::GenerateAlone;
using testing::MakeEngine;
using testing::MakeRequest;
using testing::Prompt;
using testing::TinyModel;

// The serving path in one process: a prefill-only request on a "prefiller"
// engine, its blocks copied into a "decoder" engine's reservation, then
// decoded there: the tokens equal an aggregated run.
TEST(EngineTest, PrefillReserveAddPrefilledEqualsAggregated) {
  const auto& m = TinyModel();
  EngineOptions o;
  o.num_blocks = 64;
  auto prefiller = MakeEngine(m, o);
  auto decoder = MakeEngine(m, o);
  auto run = [&](const std::string& id, const std::vector<uint32_t>& prompt, float temperature,
                 uint32_t expect_cached_blocks) {
    auto res = decoder->Reserve(id, prompt);
    EXPECT_TRUE(res.ok()) << res.status().ToString();
    EXPECT_EQ(res->num_cached_blocks, expect_cached_blocks);
    EXPECT_EQ(res->block_ids.size(), (prompt.size() + 15) / 16);
    Collector pc;
    auto pr = MakeRequest(id, prompt, 20, &pc, temperature);
    pr.prefill_only = true;
    EXPECT_TRUE(prefiller->Submit(std::move(pr)).ok());
    prefiller->RunUntilIdle();
    EXPECT_EQ(pc.reason, FinishReason::kPrefillDone);
    EXPECT_EQ(pc.tokens.size(), 1u);
    EXPECT_EQ(pc.last.block_ids.size(), res->block_ids.size());
    // "Push" the blocks the decoder lacks.
    const size_t bytes = prefiller->pool().layout().block_bytes();
    for (size_t i = res->num_cached_blocks; i < res->block_ids.size(); ++i) {
      std::memcpy(decoder->pool().block(res->block_ids[i]),
                  prefiller->pool().block(pc.last.block_ids[i]), bytes);
    }
    EXPECT_TRUE(prefiller->ReleasePrefill(id).ok());
    Collector dc;
    EXPECT_TRUE(decoder
                    ->AddPrefilled(res->reservation_id,
                                   MakeRequest(id, prompt, 20, &dc, temperature), pc.tokens[0])
                    .ok());
    decoder->RunUntilIdle();
    EXPECT_EQ(dc.reason, FinishReason::kLength);
    EXPECT_EQ(dc.last.cached_prompt_tokens, expect_cached_blocks * 16);
    return std::make_pair(pc.last.cached_prompt_tokens, dc.tokens);
  };
  const auto p1 = Prompt(45, 11);
  auto [cached1, t1] = run("x", p1, 0, 0);
  EXPECT_EQ(cached1, 0u);
  EXPECT_EQ(t1, GenerateAlone(p1, 20));
  // Sharing 40 tokens with x: the decoder holds 2 blocks, the prefiller too.
  auto p2 = p1;
  p2.resize(40);
  auto tail = Prompt(9, 12);
  p2.insert(p2.end(), tail.begin(), tail.end());
  auto [cached2, t2] = run("y", p2, 0.8f, 2);
  EXPECT_EQ(cached2, 32u);
  EXPECT_EQ(t2, GenerateAlone(p2, 20, 0.8f));
  EXPECT_EQ(prefiller->stats().free_blocks, 64u);
  EXPECT_EQ(decoder->stats().free_blocks, 64u);
}

TEST(EngineTest, ReserveRefusesWithoutRoomAndHoldsNothing) {
  EngineOptions o;
  o.num_blocks = 4;
  auto e = MakeEngine(TinyModel(), o);
  auto a = e->Reserve("a", Prompt(40, 1));  // 3 blocks
  ASSERT_TRUE(a.ok());
  auto b = e->Reserve("b", Prompt(40, 2));
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("cannot reserve 3 KV blocks for a 40-token prompt: 1 of 4 "
                                      "blocks free"),
            std::string::npos)
      << b.status().message();
  // Larger than the whole pool: not a matter of waiting for blocks.
  auto huge = e->Reserve("h", Prompt(70, 3));
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(huge.status().message().find("a 70-token prompt needs 5 KV blocks of 16 tokens; this "
                                         "worker's whole pool has 4"),
            std::string::npos)
      << huge.status().message();
  EXPECT_EQ(e->stats().free_blocks, 1u);
  const std::vector<uint32_t> bad_ids = {1, 2, 600};
  EXPECT_EQ(e->Reserve("c", bad_ids).status().code(), StatusCode::kInvalidArgument);
  // A prompt that differs from the reserved one is refused; the reservation stays.
  EXPECT_EQ(e->AddPrefilled(a->reservation_id, MakeRequest("a", Prompt(40, 9), 4, nullptr), 5).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(e->stats().num_reservations, 1u);
  ASSERT_TRUE(e->ReleaseReservation(a->reservation_id).ok());
  EXPECT_EQ(e->ReleaseReservation(a->reservation_id).code(), StatusCode::kNotFound);
  EXPECT_EQ(e->stats().free_blocks, 4u);
}

// A decoder's pool filled by prefilled requests whose prompts end on a
// block boundary, so that each needs one more block for its next token,
// with nothing running: waiting requests holding blocks must not leave the
// engine idle for ever (the head of the line could never get its block; a
// decoder's only way out was a cancel). The newest waiting holder gives its
// blocks back (recomputed later, counted as a preemption) and every request
// finishes. Found by DecodeStream.ADecoderShortOfKvBlocks... once in a
// loaded run (124 s, three reserves refused "0 of 32 blocks free").
TEST(EngineTest, PrefilledRequestsThatFillThePoolAllFinish) {
  EngineOptions o;
  o.num_blocks = 8;
  auto e = MakeEngine(TinyModel(), o);
  auto ra = e->Reserve("a", Prompt(64, 1));  // 4 full blocks
  auto rb = e->Reserve("b", Prompt(64, 2));
  ASSERT_TRUE(ra.ok());
  ASSERT_TRUE(rb.ok());
  EXPECT_EQ(e->stats().free_blocks, 0u);
  Collector a, b;
  ASSERT_TRUE(e->AddPrefilled(ra->reservation_id, MakeRequest("a", {}, 6, &a), 5).ok());
  ASSERT_TRUE(e->AddPrefilled(rb->reservation_id, MakeRequest("b", {}, 6, &b), 6).ok());
  e->RunUntilIdle();  // returns when nothing can run
  EXPECT_EQ(a.reason, FinishReason::kLength);
  EXPECT_EQ(b.reason, FinishReason::kLength);
  EXPECT_EQ(a.tokens.size(), 6u);
  EXPECT_EQ(b.tokens.size(), 6u);
  const EngineStats st = e->stats();
  EXPECT_GE(st.preemptions, 1u);
  EXPECT_EQ(st.num_waiting, 0u);
  EXPECT_EQ(st.num_running, 0u);
  EXPECT_EQ(st.free_blocks, 8u);
}

// First come, first served: a request the engine preempted waits for
// blocks ahead of a new reservation (vLLM's waiting queue puts a preempted
// request first); the reservation is refused as short of blocks (a
// decoder's Reserve waits and tries again) until it has them.
TEST(EngineTest, AReservationWaitsBehindAPreemptedRequest) {
  EngineOptions o;
  o.num_blocks = 8;
  auto e = MakeEngine(TinyModel(), o);
  Collector a, b;
  // Two 48-token prompts (3 blocks) growing to 88 tokens (6 blocks) each:
  // 12 blocks wanted of 8, so one is preempted on the way.
  ASSERT_TRUE(e->Submit(MakeRequest("a", Prompt(48, 1), 40, &a)).ok());
  ASSERT_TRUE(e->Submit(MakeRequest("b", Prompt(48, 2), 40, &b)).ok());
  for (int i = 0; i < 200 && e->stats().preemptions == 0; ++i) ASSERT_TRUE(e->Step());
  ASSERT_EQ(e->stats().preemptions, 1u);
  ASSERT_EQ(e->stats().num_waiting, 1u);
  ASSERT_GE(e->stats().free_blocks, 1u);  // room for a 1-block prompt, but not its turn
  auto r = e->Reserve("r", Prompt(10, 3));
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("1 preempted requests wait for blocks first"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(e->stats().num_reservations, 0u);
  e->RunUntilIdle();
  EXPECT_EQ(a.tokens.size(), 40u);
  EXPECT_EQ(b.tokens.size(), 40u);
  auto later = e->Reserve("r", Prompt(10, 3));
  ASSERT_TRUE(later.ok()) << later.status().ToString();
  ASSERT_TRUE(e->ReleaseReservation(later->reservation_id).ok());
  EXPECT_EQ(e->stats().free_blocks, 8u);
}

}  // namespace
}  // namespace tandem::engine
