// The engine's prefiller side (docs/engine.md, "KV events"): a
// prefill-only request parks its blocks until the prefiller has pushed
// them (ReleasePrefill) or gives up (Abort), and its prompt's stored
// events wake the Watch loop then, not at its last chunk (issue 23: the
// proxy reads them with the Prefill reply, on one wake-up); a request that
// does not park wakes at its last chunk as before.
#include <gtest/gtest.h>

#include <span>
#include <vector>

#include "common/block_hash.h"
#include "engine/engine.h"
#include "test_models.h"

namespace tandem::engine {
namespace {
using testing::Collector;
using testing::MakeEngine;
using testing::MakeRequest;
using testing::Prompt;
using testing::TinyModel;

// Every hash the queued events store, in order; fails on any other kind.
std::vector<uint64_t> DrainStored(Engine& e) {
  std::vector<uint64_t> stored;
  for (const auto& x : e.events().Drain()) {
    EXPECT_EQ(x.kind, KvEventKind::kStored);
    stored.insert(stored.end(), x.hashes.begin(), x.hashes.end());
  }
  return stored;
}

TEST(EnginePrefillerTest, AParkedPromptsBlocksLeaveWhenItIsReleased) {
  EngineOptions o;
  o.num_blocks = 64;
  o.scheduler.max_batched_tokens = 32;
  auto e = MakeEngine(TinyModel(), o);
  int wakes = 0;
  e->events().SubscribeWake([&] { ++wakes; });

  // 100 tokens in chunks of 32, 32, 32, 4: no wake-up at any chunk, the
  // last one included; the request parks with its 7 blocks pinned.
  Collector a;
  auto ra = MakeRequest("a", Prompt(100, 4), 5, &a);
  ra.prefill_only = true;
  ASSERT_TRUE(e->Submit(std::move(ra)).ok());
  for (int chunk = 1; chunk <= 4; ++chunk) {
    ASSERT_TRUE(e->Step());
    EXPECT_EQ(wakes, 0) << "chunk " << chunk;
  }
  ASSERT_EQ(a.reason, FinishReason::kPrefillDone);
  EXPECT_EQ(a.tokens.size(), 1u);
  EXPECT_EQ(a.last.block_ids.size(), 7u);
  EXPECT_EQ(e->stats().num_parked, 1u);
  EXPECT_EQ(e->stats().free_blocks, 64u - 7u);
  EXPECT_GE(e->events().last_event_id(), 3u);  // queued without a wake-up

  // Released: one wake-up at once, even while the engine holds its wake-ups
  // (as it does through a step: the prefiller releases one prompt while
  // computing the next), none at the hold's end; the queued events store
  // the prompt's 6 full blocks in order; the blocks are free (and stay
  // cached).
  EXPECT_EQ(e->ReleasePrefill("nobody").code(), StatusCode::kNotFound);
  EXPECT_EQ(wakes, 0);
  e->events().Hold();
  ASSERT_TRUE(e->ReleasePrefill("a").ok());
  EXPECT_EQ(wakes, 1);
  e->events().Release();
  EXPECT_EQ(wakes, 1);
  const std::vector<uint64_t> a_hashes =
      HashBlocks(e->root_hash(), std::span<const uint32_t>(Prompt(100, 4)).first(96), 16);
  EXPECT_EQ(DrainStored(*e), a_hashes);
  EXPECT_EQ(e->stats().num_parked, 0u);
  EXPECT_EQ(e->stats().free_blocks, 64u);

  // Aborted while parked: one wake-up with its blocks, all free after.
  Collector b;
  auto rb = MakeRequest("b", Prompt(40, 5), 5, &b);
  rb.prefill_only = true;
  ASSERT_TRUE(e->Submit(std::move(rb)).ok());
  e->RunUntilIdle();
  ASSERT_EQ(b.reason, FinishReason::kPrefillDone);
  EXPECT_EQ(wakes, 1);
  ASSERT_TRUE(e->Abort("b").ok());
  EXPECT_EQ(wakes, 2);
  EXPECT_EQ(DrainStored(*e),
            HashBlocks(e->root_hash(), std::span<const uint32_t>(Prompt(40, 5)).first(32), 16));
  EXPECT_EQ(e->stats().free_blocks, 64u);

  // A request that does not park wakes at its last chunk, as before.
  Collector c;
  ASSERT_TRUE(e->Submit(MakeRequest("c", Prompt(40, 6), 1, &c)).ok());
  ASSERT_TRUE(e->Step());  // 32 tokens: quiet
  EXPECT_EQ(wakes, 2);
  ASSERT_TRUE(e->Step());  // the last chunk, which ends it
  EXPECT_EQ(c.tokens.size(), 1u);
  EXPECT_EQ(wakes, 3);
  EXPECT_EQ(DrainStored(*e),
            HashBlocks(e->root_hash(), std::span<const uint32_t>(Prompt(40, 6)).first(32), 16));
}

}  // namespace
}  // namespace tandem::engine
