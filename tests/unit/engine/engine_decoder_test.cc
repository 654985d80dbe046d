// The engine's decoder side (docs/engine.md, docs/serving-workers.md): a
// prefill-only request's blocks reserved and added on another engine equal
// an aggregated run; Reserve refuses what does not fit and holds nothing;
// prefilled requests that fill the pool all finish (no deadlock); a
// reservation waits behind the requests the engine preempted, and leaves
// room for the decoding requests to grow (the growth reserve, whose ratio
// falls to a floor learned from the requests that ended); a new request the
// reserve holds does not hold up the prefilled ones behind it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

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

// Issue 23 (session 31): the evictions that make a reservation's room wake
// no drainer (the Watch loop); they leave with the prompt's blocks when its
// KV lands (AddPrefilled), in one wake-up, removals first; or when the
// reservation is released or aborted without them.
TEST(EngineTest, AReservationsEvictionsLeaveWithItsBlocksOrItsEnd) {
  EngineOptions o;
  o.num_blocks = 4;
  auto e = MakeEngine(TinyModel(), o);
  int wakes = 0, removals = 0;
  e->events().SubscribeWake([&] { ++wakes; });
  e->events().Subscribe([&](const KvEvent& x) { removals += x.kind == KvEventKind::kRemoved; });
  // Fill the cache: 3 committed blocks of a first request, all released.
  Collector first;
  ASSERT_TRUE(e->Submit(MakeRequest("first", Prompt(60, 1), 1, &first)).ok());
  e->RunUntilIdle();
  ASSERT_EQ(e->stats().cached_blocks, 3u);
  (void)e->events().Drain();

  auto evicting_reserve = [&](const std::string& id, const std::vector<uint32_t>& prompt) {
    const int before = wakes, removed_before = removals;
    auto r = e->Reserve(id, prompt);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(removals, removed_before + 1) << "the reservation evicted nothing";
    EXPECT_EQ(wakes, before) << "a reservation's evictions woke the drainer";
    return r.ok() ? r->reservation_id : 0;
  };
  auto drained_kinds = [&] {
    std::vector<KvEventKind> kinds;
    for (const auto& x : e->events().Drain()) kinds.push_back(x.kind);
    return kinds;
  };

  // Landed: one wake-up for the removals (1 block free, 2 evicted) and the
  // prompt's 2 full blocks (stored as the run's first block, then the rest).
  const uint64_t a = evicting_reserve("a", Prompt(40, 2));
  int before = wakes;
  Collector ac;
  ASSERT_TRUE(e->AddPrefilled(a, MakeRequest("a", Prompt(40, 2), 1, &ac), 5).ok());
  EXPECT_EQ(wakes, before + 1);
  EXPECT_EQ(drained_kinds(), (std::vector<KvEventKind>{KvEventKind::kRemoved, KvEventKind::kStored,
                                                       KvEventKind::kStored}));
  e->RunUntilIdle();

  // Released without its KV: the removals leave at the release.
  const uint64_t b = evicting_reserve("b", Prompt(40, 3));
  before = wakes;
  ASSERT_TRUE(e->ReleaseReservation(b).ok());
  EXPECT_EQ(wakes, before + 1);
  EXPECT_EQ(drained_kinds(), (std::vector<KvEventKind>{KvEventKind::kRemoved}));

  // Aborted: the same (4 blocks: 3 free, the last cached one evicted).
  evicting_reserve("c", Prompt(60, 4));
  before = wakes;
  ASSERT_TRUE(e->Abort("c").ok());
  EXPECT_EQ(wakes, before + 1);
  EXPECT_EQ(drained_kinds(), (std::vector<KvEventKind>{KvEventKind::kRemoved}));
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
  auto e = testing::MakeSmallPoolEngine(8, 0);  // with the growth reserve b would wait for a
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

// A new request the growth reserve holds does not hold up a decoder's
// prefilled request queued behind it (docs/engine.md "Growth reserve"):
// the prefilled one's blocks are already held (and counted in the
// reserve), so it decodes at once while the new one waits for `a` to end.
// Admission used to stop at the first request held, the prefilled one
// waiting with it.
TEST(EngineTest, APrefilledRequestDoesNotWaitBehindANewRequestTheReserveHolds) {
  auto e = testing::MakeSmallPoolEngine(8, 1.0);
  Collector a, b, c;
  // 48 prompt tokens and 40 to generate: a's KV ends at 87 tokens, 6 blocks.
  ASSERT_TRUE(e->Submit(MakeRequest("a", Prompt(48, 1), 40, &a)).ok());
  ASSERT_TRUE(e->Step());
  ASSERT_TRUE(e->Step());
  ASSERT_EQ(e->stats().free_blocks, 4u);  // a took its 4th block
  // c: a 16-token prompt (1 block) to generate 2; the reserve keeps
  // ceil(0.7 x (23 + 1) / 16) = 2 of the 3 left.
  const auto pc = Prompt(16, 3);
  auto res = e->Reserve("c", pc, "", /*max_tokens=*/2);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  // b, new: 32 and 40 (2 blocks growing to 5) fit the 3 free blocks, but
  // the reserve keeps ceil(0.7 x (23 + 1 + 39) / 16) = 3 of them.
  ASSERT_TRUE(e->Submit(MakeRequest("b", Prompt(32, 2), 40, &b)).ok());
  ASSERT_TRUE(e->Step());
  ASSERT_TRUE(b.tokens.empty());
  ASSERT_EQ(e->stats().num_waiting, 1u);
  // c prefilled on another engine, its block pushed, added behind b.
  auto prefiller = MakeEngine(TinyModel());
  Collector pcol;
  auto pr = MakeRequest("c", pc, 2, &pcol);
  pr.prefill_only = true;
  ASSERT_TRUE(prefiller->Submit(std::move(pr)).ok());
  prefiller->RunUntilIdle();
  ASSERT_EQ(pcol.tokens.size(), 1u);
  ASSERT_EQ(res->block_ids.size(), 1u);
  std::memcpy(e->pool().block(res->block_ids[0]), prefiller->pool().block(pcol.last.block_ids[0]),
              prefiller->pool().layout().block_bytes());
  ASSERT_TRUE(prefiller->ReleasePrefill("c").ok());
  ASSERT_TRUE(
      e->AddPrefilled(res->reservation_id, MakeRequest("c", pc, 2, &c), pcol.tokens[0]).ok());
  ASSERT_TRUE(e->Step());
  EXPECT_TRUE(c.finished);
  EXPECT_EQ(c.tokens, GenerateAlone(pc, 2));
  EXPECT_TRUE(b.tokens.empty());  // still held: a has not ended
  e->RunUntilIdle();
  EXPECT_EQ(e->stats().preemptions, 0u);
  EXPECT_EQ(a.tokens, GenerateAlone(Prompt(48, 1), 40));
  EXPECT_EQ(b.tokens, GenerateAlone(Prompt(32, 2), 40));
  EXPECT_EQ(e->stats().free_blocks, 8u);
}

// The growth reserve (docs/engine.md "Growth reserve"): while a request
// decodes, a reservation is granted only if the blocks left free cover the
// growth ratio x the tokens the holders may still write past their blocks.
// Without it (schedule_conservativeness 0) the same reservation is granted
// and the decoding request, short of blocks to grow into, is preempted.
TEST(EngineTest, AReservationLeavesRoomForTheDecodingRequestsToGrow) {
  for (const double conservativeness : {1.0, 0.0}) {
    SCOPED_TRACE(conservativeness);
    auto e = testing::MakeSmallPoolEngine(8, conservativeness);
    Collector a;
    // 16 prompt tokens and 64 to generate: its KV ends at 79 tokens, 5 blocks.
    ASSERT_TRUE(e->Submit(MakeRequest("a", Prompt(16, 1), 64, &a)).ok());
    ASSERT_TRUE(e->Step());
    ASSERT_TRUE(e->Step());
    ASSERT_EQ(e->stats().free_blocks, 6u);  // a holds 2 blocks and grows into 3 more
    // A 64-token prompt (4 blocks) fits the 6 free blocks, but a would have
    // 2 left for its 3: the reserve keeps ceil(0.7 x (47 + 1) / 16) = 3 free.
    auto r = e->Reserve("r", Prompt(64, 2), "", /*max_tokens=*/2);
    if (conservativeness > 0) {
      EXPECT_NEAR(e->stats().growth_ratio, 0.7, 0.01);
      EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
      EXPECT_NE(r.status().message().find("cannot reserve 4 KV blocks for a 64-token prompt: 3 more "
                                          "are kept free for the growth of the requests holding "
                                          "blocks"),
                std::string::npos)
          << r.status().message();
      EXPECT_EQ(e->stats().num_reservations, 0u);
      EXPECT_EQ(e->stats().free_blocks, 6u);  // nothing held by the refusal
      EXPECT_EQ(e->stats().growth_reserve_blocks, 3u);  // a's alone (a decoder's load report)
      e->RunUntilIdle();
      EXPECT_EQ(a.tokens.size(), 64u);
      EXPECT_EQ(e->stats().preemptions, 0u);
      r = e->Reserve("r", Prompt(64, 2), "", 2);  // nothing else holds blocks now
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    } else {
      EXPECT_EQ(e->stats().growth_ratio, 0.0);
      EXPECT_EQ(e->stats().growth_reserve_blocks, 0u);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      e->RunUntilIdle();  // a cannot grow past 4 blocks: preempted, waits for the reservation's
      EXPECT_GE(e->stats().preemptions, 1u);
      EXPECT_LT(a.tokens.size(), 64u);
      ASSERT_TRUE(e->ReleaseReservation(r->reservation_id).ok());
      e->RunUntilIdle();
      EXPECT_EQ(a.tokens.size(), 64u);
      r = e->Reserve("r", Prompt(64, 2), "", 2);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
    EXPECT_EQ(a.tokens, GenerateAlone(Prompt(16, 1), 64));
    ASSERT_TRUE(e->ReleaseReservation(r->reservation_id).ok());
    EXPECT_EQ(e->stats().free_blocks, 8u);
  }
}

// The growth ratio (after SGLang's new-token ratio): 0.7 x conservativeness
// (at most 1) at the start, falling by (0.7 - 0.098) / 600 each step that
// decodes without preempting, 1 after a preemption, back to the start when
// nothing runs.
TEST(EngineTest, TheGrowthRatioFallsWhileDecodingJumpsOnAPreemptionAndResetsWhenIdle) {
  EngineOptions o;
  o.num_blocks = 8;
  auto e = MakeEngine(TinyModel(), o);
  EXPECT_DOUBLE_EQ(e->stats().growth_ratio, 0.7);
  const double fall = (0.7 - 0.7 * 0.14) / 600;
  Collector a, b;
  // Two 48-token prompts (3 blocks) growing to 88 tokens (6 blocks) each:
  // 12 blocks wanted of 8, so one is preempted on the way. b's better
  // priority admits it past the growth reserve while a (worse) runs.
  GenerateRequest ra = MakeRequest("a", Prompt(48, 1), 40, &a);
  ra.priority = 1;
  ASSERT_TRUE(e->Submit(std::move(ra)).ok());
  ASSERT_TRUE(e->Step());  // a's prompt: no decode yet
  EXPECT_DOUBLE_EQ(e->stats().growth_ratio, 0.7);
  ASSERT_TRUE(e->Submit(MakeRequest("b", Prompt(48, 2), 40, &b)).ok());
  uint32_t decode_steps = 0;
  while (e->stats().preemptions == 0) {
    ASSERT_TRUE(e->Step());
    ASSERT_LT(++decode_steps, 200u);
    if (e->stats().preemptions == 0) {
      EXPECT_NEAR(e->stats().growth_ratio, 0.7 - decode_steps * fall, 1e-9);
    }
  }
  EXPECT_GT(decode_steps, 1u);
  EXPECT_EQ(b.tokens.size(), decode_steps);  // admitted at once, never preempted
  EXPECT_DOUBLE_EQ(e->stats().growth_ratio, 1.0);
  ASSERT_TRUE(e->Step());  // a decode step without a new preemption
  EXPECT_NEAR(e->stats().growth_ratio, 1.0 - fall, 1e-9);
  e->RunUntilIdle();
  EXPECT_EQ(a.tokens.size(), 40u);
  EXPECT_EQ(b.tokens.size(), 40u);
  EXPECT_FALSE(e->Step());  // nothing to run: the ratio starts over
  EXPECT_DOUBLE_EQ(e->stats().growth_ratio, 0.7);

  o.scheduler.schedule_conservativeness = 2.0;  // 1.4, capped
  EXPECT_DOUBLE_EQ(MakeEngine(TinyModel(), o)->stats().growth_ratio, 1.0);
  o.scheduler.schedule_conservativeness = 0.5;
  auto half = MakeEngine(TinyModel(), o);
  EXPECT_DOUBLE_EQ(half->stats().growth_ratio, 0.35);
}

// The ratio's floor is learned from the requests that ended: the tokens
// they generated over their max_tokens (means over the first 64), once 16
// have ended, x conservativeness; SGLang's 0.098 until then or when
// larger. An aborted request does not count.
TEST(EngineTest, TheGrowthRatiosFloorIsLearnedFromTheRequestsThatEnded) {
  EngineOptions o;
  o.num_blocks = 64;
  // Each request stops at its own output's 3rd token (or earlier where
  // that token came before): it generates `ends[i]` of 8.
  std::vector<std::vector<uint32_t>> alone;
  std::vector<uint32_t> ends;
  for (uint32_t i = 0; i < 16; ++i) {
    alone.push_back(GenerateAlone(Prompt(8, i), 8));
    const auto& t = alone.back();
    ends.push_back(static_cast<uint32_t>(std::find(t.begin(), t.end(), t[2]) - t.begin()) + 1);
  }
  for (const bool stop_early : {true, false}) {
    SCOPED_TRACE(stop_early);
    auto e = MakeEngine(TinyModel(), o);
    EXPECT_DOUBLE_EQ(e->stats().growth_floor, 0.7 * 0.14);
    Collector aborted;
    ASSERT_TRUE(e->Submit(MakeRequest("x", Prompt(8, 99), 8, &aborted)).ok());
    ASSERT_TRUE(e->Step());
    ASSERT_TRUE(e->Abort("x").ok());
    std::vector<Collector> c(16);
    double generated = 0;
    for (uint32_t i = 0; i < 16; ++i) {
      GenerateRequest r = MakeRequest(testing::Id("r", i), Prompt(8, i), 8, &c[i]);
      if (stop_early) r.sampling.stop_token_ids = {alone[i][2]};
      ASSERT_TRUE(e->Submit(std::move(r)).ok());
      generated += stop_early ? ends[i] : 8;
      EXPECT_DOUBLE_EQ(e->stats().growth_floor, 0.7 * 0.14);  // i < 16 have ended
      e->RunUntilIdle();
      EXPECT_EQ(c[i].tokens.size(), stop_early ? ends[i] : 8u);
    }
    const double share = generated / (16 * 8);
    RecordProperty(stop_early ? "share_stop_early" : "share", std::to_string(share));
    EXPECT_NEAR(e->stats().growth_floor, std::max(0.7 * 0.14, share), 1e-9);
    EXPECT_FALSE(e->Step());  // idle: the ratio starts at the larger of 0.7 and the floor
    EXPECT_NEAR(e->stats().growth_ratio, std::max(0.7, share), 1e-9);
  }
  o.scheduler.schedule_conservativeness = 0.5;  // the learned share x 0.5
  auto half = MakeEngine(TinyModel(), o);
  for (uint32_t i = 0; i < 16; ++i) {
    Collector c;
    ASSERT_TRUE(half->Submit(MakeRequest(testing::Id("r", i), Prompt(8, i), 8, &c)).ok());
    half->RunUntilIdle();
  }
  EXPECT_DOUBLE_EQ(half->stats().growth_floor, 0.5);
}

}  // namespace
}  // namespace tandem::engine
