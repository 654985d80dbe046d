// Engine behaviour: prefix-cache reuse, abort at every stage, admission
// limits, deadlines, stop conditions and the engine thread. The decoder's
// side (Reserve, AddPrefilled, a pool they fill): engine_decoder_test.cc.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <optional>
#include <set>

#include "test_models.h"

namespace tandem::engine {
namespace {
using testing::Collector;
using testing::MakeEngine;
using testing::Prompt;
using testing::TinyModel;

using testing::GenerateAlone;

GenerateRequest Req(const std::string& id, std::vector<uint32_t> prompt, uint32_t max_tokens,
                    Collector* c, float temperature = 0) {
  return testing::MakeRequest(id, std::move(prompt), max_tokens, c, temperature);
}

TEST(EngineTest, SecondRequestReusesPrefixBlocksWithUnchangedOutput) {
  EngineOptions o;
  o.num_blocks = 64;
  auto e = MakeEngine(TinyModel(), o);
  auto shared = Prompt(40, 1);
  Collector a;
  ASSERT_TRUE(e->Submit(Req("a", shared, 8, &a)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(a.last.cached_prompt_tokens, 0u);

  auto second = shared;
  second.resize(35);
  auto tail = Prompt(10, 2);
  second.insert(second.end(), tail.begin(), tail.end());  // shares 35 tokens: 2 full blocks
  Collector b;
  ASSERT_TRUE(e->Submit(Req("b", second, 8, &b)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(b.last.cached_prompt_tokens, 32u);
  EXPECT_EQ(b.tokens, GenerateAlone(second, 8));

  // The same prompt again: all full blocks but the one holding the last
  // token (always computed for its logits).
  Collector c;
  ASSERT_TRUE(e->Submit(Req("c", shared, 8, &c)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(c.last.cached_prompt_tokens, 32u);
  EXPECT_EQ(c.tokens, a.tokens);
  const auto s = e->stats();
  EXPECT_EQ(s.prefix_query_tokens, 40u + 45u + 40u);
  EXPECT_EQ(s.prefix_hit_tokens, 64u);
  EXPECT_EQ(s.free_blocks, o.num_blocks);
  EXPECT_GT(s.cached_blocks, 0u);
}

// Tenants (docs/security.md): requests with different cache salts never
// reuse each other's blocks, through Submit or Reserve; the same salt does.
TEST(EngineTest, CacheSaltSeparatesPrefixCacheEntries) {
  EngineOptions o;
  o.num_blocks = 64;
  auto e = MakeEngine(TinyModel(), o);
  const auto prompt = Prompt(40, 3);
  auto salted = [&](const std::string& id, const std::string& salt, Collector* c) {
    GenerateRequest r = Req(id, prompt, 4, c);
    r.cache_salt = salt;
    return r;
  };
  Collector a1, b1, b2, none;
  ASSERT_TRUE(e->Submit(salted("a1", "tenant:a", &a1)).ok());
  e->RunUntilIdle();
  ASSERT_TRUE(e->Submit(salted("b1", "tenant:b", &b1)).ok());
  e->RunUntilIdle();
  ASSERT_TRUE(e->Submit(salted("b2", "tenant:b", &b2)).ok());
  e->RunUntilIdle();
  ASSERT_TRUE(e->Submit(salted("n", "", &none)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(b1.last.cached_prompt_tokens, 0u);   // a's blocks are not b's
  EXPECT_EQ(b2.last.cached_prompt_tokens, 32u);  // b's own are
  EXPECT_EQ(none.last.cached_prompt_tokens, 0u);
  EXPECT_EQ(b1.tokens, a1.tokens);  // the output does not depend on the salt
  EXPECT_NE(e->RootHashFor("tenant:a"), e->root_hash());
  EXPECT_EQ(e->RootHashFor(""), e->root_hash());

  auto other = e->Reserve("r1", prompt, "tenant:c");
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  EXPECT_EQ(other->num_cached_blocks, 0u);
  auto same = e->Reserve("r2", prompt, "tenant:a");
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(same->num_cached_blocks, 2u);
  ASSERT_TRUE(e->ReleaseReservation(other->reservation_id).ok());
  ASSERT_TRUE(e->ReleaseReservation(same->reservation_id).ok());
  EXPECT_EQ(e->stats().free_blocks, o.num_blocks);
}

TEST(EngineTest, KvEventsFollowTheCache) {
  EngineOptions o;
  o.num_blocks = 8;
  o.epoch = 5;
  auto e = MakeEngine(TinyModel(), o);
  Collector a;
  ASSERT_TRUE(e->Submit(Req("a", Prompt(50, 3), 14, &a)).ok());  // 64 tokens: 4 blocks
  e->RunUntilIdle();
  auto ev = e->events().Drain();
  std::vector<uint64_t> stored;
  uint64_t last_id = 0;
  for (const auto& x : ev) {
    EXPECT_EQ(x.event_id, last_id + 1);
    last_id = x.event_id;
    EXPECT_EQ(x.epoch, 5u);
    ASSERT_EQ(x.kind, KvEventKind::kStored);
    EXPECT_EQ(x.parent_hash, stored.empty() ? e->root_hash() : stored.back());
    stored.insert(stored.end(), x.hashes.begin(), x.hashes.end());
  }
  // 63 tokens have KV (the last sampled token never does): 3 full blocks.
  ASSERT_EQ(stored.size(), 3u);
  std::vector<uint32_t> all = Prompt(50, 3);
  all.insert(all.end(), a.tokens.begin(), a.tokens.end());
  EXPECT_EQ(stored, HashBlocks(e->root_hash(), std::span<const uint32_t>(all).first(48), 16));
  auto snap = e->SnapshotKv();
  EXPECT_EQ(snap.last_event_id, last_id);
  EXPECT_EQ(snap.blocks.size(), 3u);

  // A different long request evicts them: removed events carry those hashes.
  Collector b;
  ASSERT_TRUE(e->Submit(Req("b", Prompt(100, 4), 20, &b)).ok());
  e->RunUntilIdle();
  std::vector<uint64_t> removed;
  for (const auto& x : e->events().Drain()) {
    EXPECT_EQ(x.event_id, ++last_id);
    if (x.kind == KvEventKind::kRemoved) removed.insert(removed.end(), x.hashes.begin(), x.hashes.end());
  }
  std::sort(removed.begin(), removed.end());
  auto want = stored;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(removed, want);
}

// Output blocks join the prefix cache in runs of kDecodeCommitBlocks and
// the rest when the request ends (one wake-up of the worker's Watch loop
// per run, not per filled block); the chain is the one committing each
// block at once gives, and a later request reuses the generated blocks.
TEST(EngineTest, DecodeBlocksAreCommittedInRunsAndAtTheEnd) {
  static_assert(Engine::kDecodeCommitBlocks == 8);
  EngineOptions o;
  o.num_blocks = 64;
  auto e = MakeEngine(TinyModel(), o);
  Collector a;
  // 20-token prompt (1 full block), 200 output tokens: 219 tokens have KV,
  // 13 full blocks, 12 of them filled by decode steps.
  ASSERT_TRUE(e->Submit(Req("a", Prompt(20, 9), 200, &a)).ok());
  std::vector<size_t> per_step;  // hashes stored by each step that stored any
  std::vector<uint64_t> stored;
  while (e->Step()) {
    size_t n = 0;
    for (const auto& x : e->events().Drain()) {
      ASSERT_EQ(x.kind, KvEventKind::kStored);
      EXPECT_EQ(x.parent_hash, stored.empty() ? e->root_hash() : stored.back());
      stored.insert(stored.end(), x.hashes.begin(), x.hashes.end());
      n += x.hashes.size();
    }
    if (n > 0) per_step.push_back(n);
  }
  ASSERT_EQ(a.tokens.size(), 200u);
  // The prompt's block at once, then a run of 8 output blocks, then the 4
  // left when the request finished.
  EXPECT_EQ(per_step, (std::vector<size_t>{1, 8, 4}));
  std::vector<uint32_t> all = Prompt(20, 9);
  all.insert(all.end(), a.tokens.begin(), a.tokens.end());
  EXPECT_EQ(stored, HashBlocks(e->root_hash(), std::span<const uint32_t>(all).first(13 * 16), 16));
  // The prompt plus the output as a new prompt: every full block but the
  // last token's is a hit, and the continuation is the same.
  Collector b;
  std::vector<uint32_t> again(all.begin(), all.begin() + 13 * 16 + 1);
  ASSERT_TRUE(e->Submit(Req("b", again, 4, &b)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(b.last.cached_prompt_tokens, 13u * 16);
  EXPECT_EQ(b.tokens, std::vector<uint32_t>(all.begin() + 13 * 16 + 1, all.begin() + 13 * 16 + 5));
}

// Issue 23: a step's KV events wake a drainer (the worker's Watch loop) once,
// not once per event; every event is still delivered and drained in order.
TEST(EngineTest, StepEventsWakeSubscribersOnce) {
  EngineOptions o;
  o.num_blocks = 32;
  auto e = MakeEngine(TinyModel(), o);
  std::atomic<int> wakes{0};
  std::vector<uint64_t> seen;
  e->events().SubscribeWake([&] { ++wakes; });
  e->events().Subscribe([&](const KvEvent& x) { seen.push_back(x.event_id); });
  Collector a, b;
  ASSERT_TRUE(e->Submit(Req("a", Prompt(40, 3), 2, &a)).ok());  // 2 full blocks each
  ASSERT_TRUE(e->Submit(Req("b", Prompt(40, 9), 2, &b)).ok());
  ASSERT_TRUE(e->Step());  // both prefills: each commits its first block, then the rest
  ASSERT_GE(seen.size(), 4u);
  EXPECT_EQ(wakes.load(), 1);
  const auto drained = e->events().Drain();
  ASSERT_EQ(drained.size(), seen.size());
  for (size_t i = 0; i < drained.size(); ++i) EXPECT_EQ(drained[i].event_id, seen[i]);
  e->RunUntilIdle();  // decode steps: no new block is full, nothing published
}

// Issue 23: the stored event of a run of output blocks is quiet (wakes no
// drainer; it is queued and leaves with the next wake-up), while the
// prompt's block and the blocks committed at the end wake it as before.
TEST(EngineTest, DecodeRunEventsAreQueuedWithoutAWakeUp) {
  EngineOptions o;
  o.num_blocks = 64;
  auto e = MakeEngine(TinyModel(), o);
  int wakes = 0;
  e->events().SubscribeWake([&] { ++wakes; });
  Collector a;
  // As DecodeBlocksAreCommittedInRunsAndAtTheEnd: the prompt's block, a
  // run of 8 output blocks, then the 4 left at the end.
  ASSERT_TRUE(e->Submit(Req("a", Prompt(20, 9), 200, &a)).ok());
  std::vector<size_t> stored;  // hashes per stored event, in order
  std::vector<int> wakes_at;   // the wake count when each was drained
  while (e->Step()) {
    for (const auto& x : e->events().Drain()) {
      stored.push_back(x.hashes.size());
      wakes_at.push_back(wakes);
    }
  }
  ASSERT_EQ(a.tokens.size(), 200u);
  // (CommitFullBlocks publishes a run's first block, then the rest.)
  EXPECT_EQ(stored, (std::vector<size_t>{1, 1, 7, 1, 3}));
  // The prompt's block woke the drainer; the run of 8 did not (still 1
  // wake when it was drained); the request's end did.
  EXPECT_EQ(wakes_at, (std::vector<int>{1, 1, 1, 2, 2}));
  EXPECT_EQ(wakes, 2);
}

// Issue 23: the blocks a long prompt's chunk steps store before its last
// chunk are quiet (queued, no wake-up); the last chunk's step wakes the
// drainer once even when it stores no block itself, and every event is
// drained in chain order.
TEST(EngineTest, PrefillChunkEventsLeaveWithTheLastChunk) {
  EngineOptions o;
  o.num_blocks = 64;
  o.scheduler.max_batched_tokens = 32;
  auto e = MakeEngine(TinyModel(), o);
  int wakes = 0;
  e->events().SubscribeWake([&] { ++wakes; });
  Collector a;
  // 100 tokens in chunks of 32, 32, 32, 4: 2 full blocks per chunk of 32,
  // none in the last (96..100 fills no block).
  ASSERT_TRUE(e->Submit(Req("a", Prompt(100, 4), 2, &a)).ok());
  for (int chunk = 1; chunk <= 3; ++chunk) {
    ASSERT_TRUE(e->Step());
    EXPECT_EQ(wakes, 0) << "chunk " << chunk;
    EXPECT_TRUE(a.tokens.empty());
  }
  EXPECT_GE(e->events().last_event_id(), 3u);  // stored, queued without a wake-up
  ASSERT_TRUE(e->Step());  // the last chunk: samples the first token
  EXPECT_EQ(a.tokens.size(), 1u);
  EXPECT_EQ(wakes, 1);
  std::vector<uint64_t> stored;
  uint64_t last_id = 0;
  for (const auto& x : e->events().Drain()) {
    ASSERT_EQ(x.kind, KvEventKind::kStored);
    EXPECT_EQ(x.event_id, ++last_id);
    EXPECT_EQ(x.parent_hash, stored.empty() ? e->root_hash() : stored.back());
    stored.insert(stored.end(), x.hashes.begin(), x.hashes.end());
  }
  EXPECT_EQ(stored, HashBlocks(e->root_hash(), std::span<const uint32_t>(Prompt(100, 4)).first(96), 16));
  e->RunUntilIdle();
  EXPECT_EQ(a.tokens, GenerateAlone(Prompt(100, 4), 2));
  // A prompt of one chunk wakes the drainer as before.
  Collector b;
  ASSERT_TRUE(e->Submit(Req("b", Prompt(20, 6), 1, &b)).ok());
  const int before = wakes;
  ASSERT_TRUE(e->Step());
  EXPECT_EQ(wakes, before + 1);
}

// Issue 23 (session 31): the evictions that make room for a long prompt's
// chunks are quiet as well, so a prompt that evicts at every chunk still
// wakes the drainer once, at its last chunk, with its removals and blocks in
// order; a decode step's eviction wakes it at once, as before.
TEST(EngineTest, EvictionsForAPromptsChunksLeaveWithItsBlocks) {
  EngineOptions o;
  o.num_blocks = 8;
  o.scheduler.max_batched_tokens = 32;
  auto e = MakeEngine(TinyModel(), o);
  int wakes = 0;
  e->events().SubscribeWake([&] { ++wakes; });
  // A first prompt leaves 6 committed blocks cached (96 of its 100 tokens)
  // and 2 blocks free.
  Collector warm;
  ASSERT_TRUE(e->Submit(Req("warm", Prompt(100, 7), 1, &warm)).ok());
  e->RunUntilIdle();
  const std::vector<uint64_t> warm_hashes =
      HashBlocks(e->root_hash(), std::span<const uint32_t>(Prompt(100, 7)).first(96), 16);
  ASSERT_EQ(e->stats().free_blocks, 8u);
  (void)e->events().Drain();

  // 100 more tokens in chunks of 32, 32, 32, 4 (blocks 2, 2, 2, 1): the
  // first chunk takes the free blocks, the others evict the cached ones,
  // least recently used first (the first prompt's tail).
  Collector a;
  ASSERT_TRUE(e->Submit(Req("a", Prompt(100, 4), 1, &a)).ok());
  const int before = wakes;
  for (int chunk = 1; chunk <= 3; ++chunk) {
    ASSERT_TRUE(e->Step());
    EXPECT_EQ(wakes, before) << "chunk " << chunk;
  }
  ASSERT_TRUE(e->Step());  // the last chunk
  ASSERT_EQ(a.tokens.size(), 1u);
  EXPECT_EQ(wakes, before + 1);
  std::vector<uint64_t> removed, stored;
  uint64_t last_id = 0;
  for (const auto& x : e->events().Drain()) {
    EXPECT_EQ(x.event_id, last_id == 0 ? x.event_id : last_id + 1);
    last_id = x.event_id;
    ASSERT_NE(x.kind, KvEventKind::kCleared);
    auto& into = x.kind == KvEventKind::kRemoved ? removed : stored;
    into.insert(into.end(), x.hashes.begin(), x.hashes.end());
  }
  EXPECT_EQ(removed, (std::vector<uint64_t>{warm_hashes[5], warm_hashes[4], warm_hashes[3],
                                            warm_hashes[2], warm_hashes[1]}));
  EXPECT_EQ(stored,
            HashBlocks(e->root_hash(), std::span<const uint32_t>(Prompt(100, 4)).first(96), 16));
  e->RunUntilIdle();
  EXPECT_EQ(a.tokens, GenerateAlone(Prompt(100, 4), 1));
  (void)e->events().Drain();

  // A decode step that needs a block evicts (nothing is free but cached
  // blocks): that removal wakes the drainer in its own step.
  Collector c;
  ASSERT_TRUE(e->Submit(Req("c", Prompt(20, 6), 40, &c)).ok());
  bool saw_decode_eviction = false;
  for (int step = 0; step < 100 && !saw_decode_eviction; ++step) {
    const int at = wakes;
    if (!e->Step()) break;
    bool evicted = false;
    for (const auto& x : e->events().Drain()) evicted |= x.kind == KvEventKind::kRemoved;
    if (evicted && c.tokens.size() >= 2) {  // past the prompt's step
      saw_decode_eviction = true;
      EXPECT_EQ(wakes, at + 1) << "woken in the step that evicted";
    }
  }
  ASSERT_TRUE(saw_decode_eviction);
  e->RunUntilIdle();
  EXPECT_EQ(c.tokens, GenerateAlone(Prompt(20, 6), 40));
}

// Issue 23: work that does not fit waits for a release without polling;
// a release, and a queued request's deadline, end the wait.
TEST(EngineTest, BlockedWorkWaitsForAReleaseOrItsDeadline) {
  EngineOptions o;
  o.num_blocks = 8;
  auto e = MakeEngine(TinyModel(), o);
  e->Start();
  // A reservation holds the whole pool (127 tokens: 8 blocks of 16).
  auto held = e->Reserve("hold", Prompt(127, 5));
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  ASSERT_EQ(e->stats().free_blocks, 0u);

  // Blocked with a deadline and nothing else happening: ended at the
  // deadline, without being computed.
  std::promise<RequestOutput> late_done;
  auto late = Req("late", Prompt(20, 1), 4, nullptr);
  late.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  late.on_output = [&](const RequestOutput& out) {
    if (out.finished) late_done.set_value(out);
  };
  ASSERT_TRUE(e->Submit(std::move(late)).ok());
  auto late_future = late_done.get_future();
  ASSERT_EQ(late_future.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  const RequestOutput late_out = late_future.get();
  EXPECT_EQ(late_out.finish_reason, FinishReason::kDeadline);
  EXPECT_EQ(late_out.status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(late_out.token_ids.empty());

  // Blocked without a deadline: runs once the reservation is released,
  // with the tokens it gives alone.
  std::promise<void> done;
  Collector c;
  auto r = Req("b", Prompt(20, 2), 4, nullptr);
  auto inner = c.Callback();
  r.on_output = [&, inner](const RequestOutput& out) {
    inner(out);
    if (out.finished) done.set_value();
  };
  ASSERT_TRUE(e->Submit(std::move(r)).ok());
  ASSERT_TRUE(e->ReleaseReservation(held->reservation_id).ok());
  auto f = done.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  e->Stop();
  EXPECT_EQ(c.reason, FinishReason::kLength);
  EXPECT_EQ(c.tokens, GenerateAlone(Prompt(20, 2), 4));
  EXPECT_EQ(e->stats().free_blocks, 8u);
}

// Two prefills of one prefix in the same step: the second one's copies of
// the shared blocks stay private, and so does everything after them — a
// block committed after a private duplicate would hang under the other
// request's chain and could outlive its parent there (the hole of
// BlockManagerTest.ConcurrentDuplicateCanLeaveAChildWithoutItsParent),
// which the router's prefix search must not meet (docs/router.md). The
// cache stays prefix-closed through evictions; outputs are unchanged.
TEST(EngineTest, ConcurrentDuplicatePrefillCommitsNoBlockWithoutItsParent) {
  EngineOptions o;
  o.num_blocks = 16;
  o.scheduler.max_batched_tokens = 256;
  auto e = MakeEngine(TinyModel(), o);
  auto shared = Prompt(32, 1);
  auto a = shared, b = shared;
  for (uint32_t t : Prompt(20, 2)) a.push_back(t);
  for (uint32_t t : Prompt(20, 3)) b.push_back(t);  // 52 tokens each: 3 full blocks
  Collector ca, cb;
  ASSERT_TRUE(e->Submit(Req("a", a, 4, &ca)).ok());
  ASSERT_TRUE(e->Submit(Req("b", b, 4, &cb)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(ca.tokens, GenerateAlone(a, 4));
  EXPECT_EQ(cb.tokens, GenerateAlone(b, 4));
  const auto hb = HashBlocks(e->root_hash(), std::span<const uint32_t>(b).first(48), 16);
  auto cached = [&](uint64_t h) {
    for (const auto& x : e->SnapshotKv().blocks) {
      if (x.hash == h) return true;
    }
    return false;
  };
  EXPECT_TRUE(cached(hb[0]));   // a's block, shared by chain
  EXPECT_FALSE(cached(hb[2]));  // b's own block after its private duplicates
  // Every committed block's parent is the root or committed, now and after
  // other prompts evicted blocks in LRU order.
  auto expect_prefix_closed = [&](const char* when) {
    const auto snap = e->SnapshotKv();
    std::set<uint64_t> hashes;
    for (const auto& x : snap.blocks) hashes.insert(x.hash);
    for (const auto& x : snap.blocks) {
      EXPECT_TRUE(x.parent_hash == e->root_hash() || hashes.count(x.parent_hash) == 1)
          << when << ": block " << x.hash << " without its parent";
    }
  };
  expect_prefix_closed("after the duplicates");
  for (uint32_t i = 0; i < 6; ++i) {
    Collector c;
    std::string id = "x";  // (GCC 12 -Wrestrict false positive on "literal" + std::string)
    id += std::to_string(i);
    ASSERT_TRUE(e->Submit(Req(id, Prompt(40, 10 + i), 2, &c)).ok());
    e->RunUntilIdle();
    expect_prefix_closed("after an eviction round");
  }
}

TEST(EngineTest, AbortAtEveryStageFreesEveryBlock) {
  EngineOptions o;
  o.num_blocks = 32;
  o.scheduler.max_batched_tokens = 16;
  auto e = MakeEngine(TinyModel(), o);
  const uint32_t idle = e->stats().free_blocks;
  ASSERT_EQ(idle, 32u);
  auto expect_idle = [&](const char* stage) {
    const auto s = e->stats();
    EXPECT_EQ(s.free_blocks, idle) << stage;
    EXPECT_EQ(s.num_running + s.num_waiting + s.num_parked + s.num_reservations, 0u) << stage;
  };

  // Waiting.
  Collector w;
  ASSERT_TRUE(e->Submit(Req("w", Prompt(40, 1), 10, &w)).ok());
  ASSERT_TRUE(e->Abort("w").ok());
  EXPECT_EQ(w.reason, FinishReason::kAbort);
  EXPECT_EQ(w.status.code(), StatusCode::kCancelled);
  expect_idle("waiting");

  // Mid chunked prefill.
  Collector p;
  ASSERT_TRUE(e->Submit(Req("p", Prompt(40, 2), 10, &p)).ok());
  ASSERT_TRUE(e->Step());
  EXPECT_GT(e->stats().num_running, 0u);
  ASSERT_TRUE(e->Abort("p").ok());
  EXPECT_TRUE(p.tokens.empty());
  expect_idle("prefill");

  // Decoding.
  Collector d;
  ASSERT_TRUE(e->Submit(Req("d", Prompt(5, 3), 50, &d)).ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e->Step());
  EXPECT_EQ(d.tokens.size(), 4u);
  ASSERT_TRUE(e->Abort("d").ok());
  EXPECT_EQ(d.reason, FinishReason::kAbort);
  expect_idle("decode");

  // Parked prefill-only.
  Collector f;
  auto pr = Req("f", Prompt(20, 4), 10, &f);
  pr.prefill_only = true;
  ASSERT_TRUE(e->Submit(std::move(pr)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(f.reason, FinishReason::kPrefillDone);
  EXPECT_EQ(e->stats().num_parked, 1u);
  ASSERT_TRUE(e->Abort("f").ok());
  expect_idle("parked");

  // Reservation, and a prefilled sequence built from one.
  auto res = e->Reserve("r", Prompt(30, 5));
  ASSERT_TRUE(res.ok());
  EXPECT_LT(e->stats().free_blocks, idle);
  ASSERT_TRUE(e->Abort("r").ok());
  expect_idle("reservation");
  auto res2 = e->Reserve("q", Prompt(30, 6));
  ASSERT_TRUE(res2.ok());
  Collector q;
  ASSERT_TRUE(e->AddPrefilled(res2->reservation_id, Req("q", {}, 10, &q), 9).ok());
  ASSERT_TRUE(e->Step());
  ASSERT_TRUE(e->Abort("q").ok());
  expect_idle("prefilled");
  EXPECT_EQ(e->Abort("nobody").code(), StatusCode::kNotFound);
}

TEST(EngineTest, AbortWhileInFlightOnTheEngineThread) {
  EngineOptions o;
  o.num_blocks = 64;
  auto e = MakeEngine(TinyModel(), o);
  std::promise<void> first;
  std::atomic<bool> got_first{false};
  Collector c;
  auto inner = c.Callback();
  std::promise<void> done;
  auto r = Req("long", Prompt(30, 9), 400, nullptr);
  r.on_output = [&](const RequestOutput& out) {
    inner(out);
    if (!got_first.exchange(true)) first.set_value();
    if (out.finished) done.set_value();
  };
  e->Start();
  ASSERT_TRUE(e->Submit(std::move(r)).ok());
  first.get_future().wait();
  ASSERT_TRUE(e->Abort("long").ok());
  done.get_future().wait();
  EXPECT_EQ(c.reason, FinishReason::kAbort);
  EXPECT_LT(c.tokens.size(), 400u);
  e->Stop();
  EXPECT_EQ(e->stats().free_blocks, 64u);
}

// The attention pairs of prefill tokens (the TTFT prediction's attention
// term, docs/router.md): a prompt of L tokens prefilled in chunks counts
// L(L+1)/2, however it is chunked; its decode steps count none; a prefix
// hit counts only the uncached tokens' pairs, each over the whole context.
TEST(EngineTest, PrefillCountsItsAttentionPairsWhateverTheChunks) {
  EngineOptions o;
  o.num_blocks = 64;
  o.scheduler.max_batched_tokens = 32;  // 100 tokens: chunks of 32, 32, 32, 4
  auto e = MakeEngine(TinyModel(), o);
  const auto prompt = Prompt(100, 3);
  Collector a;
  ASSERT_TRUE(e->Submit(Req("a", prompt, 5, &a)).ok());
  e->RunUntilIdle();
  EngineStats st = e->stats();
  EXPECT_EQ(st.prefill_step_tokens, 100u);
  EXPECT_EQ(st.prefill_step_pairs, 100u * 101 / 2);
  EXPECT_GT(st.prefill_pair_cost, 0);  // from the model's shape
  // The same prompt again: 96 tokens (6 blocks) cached, 4 computed after them.
  Collector b;
  ASSERT_TRUE(e->Submit(Req("b", prompt, 5, &b)).ok());
  e->RunUntilIdle();
  ASSERT_EQ(b.last.cached_prompt_tokens, 96u);
  st = e->stats();
  EXPECT_EQ(st.prefill_step_tokens, 104u);
  EXPECT_EQ(st.prefill_step_pairs, 100u * 101 / 2 + 4 * 96 + 4 * 5 / 2);
}

TEST(EngineTest, ContextLimitsGiveBothNumbers) {
  EngineOptions o;
  o.max_model_len = 100;
  auto e = MakeEngine(TinyModel(), o);
  Status s1 = e->Submit(Req("a", Prompt(101, 1), 1, nullptr));
  EXPECT_EQ(s1.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s1.message().find("101"), std::string::npos) << s1.message();
  EXPECT_NE(s1.message().find("100"), std::string::npos) << s1.message();
  Status s2 = e->Submit(Req("b", Prompt(90, 1), 20, nullptr));
  EXPECT_EQ(s2.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s2.message().find("90"), std::string::npos) << s2.message();
  EXPECT_NE(s2.message().find("20"), std::string::npos) << s2.message();
  EXPECT_NE(s2.message().find("100"), std::string::npos) << s2.message();
  EXPECT_EQ(e->Submit(Req("c", {600}, 1, nullptr)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Submit(Req("d", {}, 1, nullptr)).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(e->Submit(Req("ok", Prompt(90, 1), 10, nullptr)).ok());
  EXPECT_EQ(e->Submit(Req("ok", Prompt(9, 1), 10, nullptr)).code(), StatusCode::kAlreadyExists);
}

TEST(EngineTest, FullWaitingQueueIsRefusedAtOnce) {
  EngineOptions o;
  o.scheduler.max_waiting = 3;
  auto e = MakeEngine(TinyModel(), o);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(e->Submit(Req(testing::Id("r", i), Prompt(5, i), 2, nullptr)).ok());
  }
  EXPECT_EQ(e->Submit(Req("r3", Prompt(5, 3), 2, nullptr)).code(),
            StatusCode::kResourceExhausted);
  e->RunUntilIdle();
  EXPECT_TRUE(e->Submit(Req("r4", Prompt(5, 3), 2, nullptr)).ok());
}

TEST(EngineTest, ExpiredQueuedWorkIsDroppedNotComputed) {
  auto e = MakeEngine(TinyModel());
  Collector c;
  auto r = Req("late", Prompt(20, 1), 5, &c);
  r.deadline = std::chrono::steady_clock::now() - std::chrono::milliseconds(1);
  ASSERT_TRUE(e->Submit(std::move(r)).ok());
  EXPECT_FALSE(e->Step());
  EXPECT_EQ(c.reason, FinishReason::kDeadline);
  EXPECT_EQ(c.status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(e->stats().steps, 0u);
}

TEST(EngineTest, StopTokenIdsAndMaxTokens) {
  const auto prompt = Prompt(12, 5);
  const auto full = GenerateAlone(prompt, 10);
  auto e = MakeEngine(TinyModel());
  Collector c;
  auto r = Req("s", prompt, 10, &c);
  r.sampling.stop_token_ids = {full[3]};
  ASSERT_TRUE(e->Submit(std::move(r)).ok());
  e->RunUntilIdle();
  const auto first = std::find(full.begin(), full.end(), full[3]) - full.begin();
  EXPECT_EQ(c.tokens, std::vector<uint32_t>(full.begin(), full.begin() + first + 1));
  EXPECT_EQ(c.reason, FinishReason::kStop);
  EXPECT_EQ(c.last.completion_tokens, c.tokens.size());
  Collector l;
  ASSERT_TRUE(e->Submit(Req("l", prompt, 3, &l)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(l.reason, FinishReason::kLength);
  EXPECT_EQ(l.tokens, std::vector<uint32_t>(full.begin(), full.begin() + 3));
}

TEST(EngineTest, ThreadedEngineServesConcurrentSubmitters) {
  EngineOptions o;
  o.num_blocks = 128;
  auto e = MakeEngine(TinyModel(), o);
  std::atomic<int> steps{0};
  e->Start();
  constexpr int kN = 8;
  std::vector<Collector> col(kN);
  std::vector<std::promise<void>> done(kN);
  std::vector<std::thread> submitters;
  for (int i = 0; i < kN; ++i) {
    submitters.emplace_back([&, i] {
      auto r = Req(testing::Id("t", i), Prompt(10 + i, 40 + i), 6, nullptr, 0.7f);
      auto inner = col[i].Callback();
      r.on_output = [&, i, inner](const RequestOutput& out) {
        inner(out);
        if (out.finished) done[i].set_value();
      };
      EXPECT_TRUE(e->Submit(std::move(r)).ok());
    });
  }
  for (auto& t : submitters) t.join();
  for (auto& d : done) d.get_future().wait();
  e->Stop();
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(col[i].tokens, GenerateAlone(Prompt(10 + i, 40 + i), 6, 0.7f)) << i;
  }
  EXPECT_EQ(e->stats().free_blocks, 128u);
  (void)steps;
}

// One lowercase letter per token id: enough to exercise text and stop strings.
class LetterTokenizer final : public model::Tokenizer {
 public:
  std::vector<uint32_t> Encode(std::string_view, bool) const override { return {}; }
  std::string Decode(std::span<const uint32_t> ids, bool) const override {
    std::string s;
    for (uint32_t id : ids) s += TokenBytes(id);
    return s;
  }
  std::string TokenBytes(uint32_t id) const override { return std::string(1, char('a' + id % 26)); }
  bool IsSpecial(uint32_t) const override { return false; }
  uint32_t vocab_size() const override { return 512; }
  std::optional<uint32_t> TokenToId(std::string_view) const override { return std::nullopt; }
};

TEST(EngineTest, StopStringsAreCutFromTheTextAndEndTheRequest) {
  LetterTokenizer tok;
  EngineOptions o;
  o.tokenizer = &tok;
  auto e = MakeEngine(TinyModel(), o);
  const auto prompt = Prompt(9, 21);
  Collector all;
  ASSERT_TRUE(e->Submit(Req("all", prompt, 20, &all)).ok());
  e->RunUntilIdle();
  ASSERT_EQ(all.tokens.size(), 20u);
  EXPECT_EQ(all.text, tok.Decode(all.tokens, false));
  const std::string stop = all.text.substr(6, 2);
  const size_t at = all.text.find(stop);
  Collector cut;
  auto r = Req("cut", prompt, 20, &cut);
  r.sampling.stop = {stop, "never-there"};
  ASSERT_TRUE(e->Submit(std::move(r)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(cut.reason, FinishReason::kStop);
  EXPECT_EQ(cut.text, all.text.substr(0, at));
  EXPECT_EQ(cut.tokens, std::vector<uint32_t>(all.tokens.begin(), all.tokens.begin() + at + 2));
  // Without a tokenizer stop strings are refused.
  auto plain = MakeEngine(TinyModel());
  auto r2 = Req("x", prompt, 5, nullptr);
  r2.sampling.stop = {"a"};
  EXPECT_EQ(plain->Submit(std::move(r2)).code(), StatusCode::kInvalidArgument);
}

TEST(EngineTest, ResetPrefixCachePublishesClearedAndForgetsBlocks) {
  auto e = MakeEngine(TinyModel());
  const auto prompt = Prompt(40, 2);
  Collector a, b;
  ASSERT_TRUE(e->Submit(Req("a", prompt, 4, &a)).ok());
  e->RunUntilIdle();
  EXPECT_GT(e->stats().cached_blocks, 0u);
  e->events().Drain();
  e->ResetPrefixCache();
  auto ev = e->events().Drain();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvEventKind::kCleared);
  EXPECT_EQ(e->stats().cached_blocks, 0u);
  EXPECT_TRUE(e->SnapshotKv().blocks.empty());
  ASSERT_TRUE(e->Submit(Req("b", prompt, 4, &b)).ok());
  e->RunUntilIdle();
  EXPECT_EQ(b.last.cached_prompt_tokens, 0u);
  EXPECT_EQ(b.tokens, a.tokens);
}

// Weights loaded as bf16 (WeightFormat::kBf16, for backend cuda) are
// refused by the cpu backend with an error naming the tensor, not computed.
TEST(EngineTest, CpuBackendRefusesBf16Weights) {
  const std::string dir = testing::RepoPath("tests/fixtures/golden/tiny-llama");
  auto cfg = model::LoadModelConfig(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto w = model::LoadWeights(dir, *cfg, model::WeightFormat::kBf16);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EngineOptions o;
  o.num_blocks = 8;
  auto e = Engine::Create(*cfg, *w, o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status().ToString();
  EXPECT_NE(e.status().message().find("loaded as bf16"), std::string::npos) << e.status().ToString();
}

// A request without a seed samples with its own: the engine draws it from a
// stream the OS seeds once per engine (session 29; before, a
// std::random_device per request). Same prompt, temperature 1.5: four
// unseeded requests on one engine and one on another all differ, while two
// with one seed agree (so the difference is the seeds').
TEST(EngineTest, UnseededRequestsSampleWithSeedsOfTheirOwn) {
  const auto prompt = Prompt(12, 5);
  auto run = [&](Engine& e, const std::string& id, std::optional<uint64_t> seed) {
    Collector c;
    GenerateRequest r = MakeRequest(id, prompt, 24, &c, /*temperature=*/1.5f);
    r.sampling.seed = seed;
    EXPECT_TRUE(e.Submit(std::move(r)).ok());
    e.RunUntilIdle();
    EXPECT_EQ(c.tokens.size(), 24u);
    return c.tokens;
  };
  auto a = MakeEngine(TinyModel());
  auto b = MakeEngine(TinyModel());
  ASSERT_TRUE(a && b);
  std::set<std::vector<uint32_t>> outputs;
  for (int i = 0; i < 4; ++i) outputs.insert(run(*a, testing::Id("a", i), std::nullopt));
  outputs.insert(run(*b, "b", std::nullopt));
  EXPECT_EQ(outputs.size(), 5u);
  EXPECT_EQ(run(*a, "s1", 11), run(*b, "s2", 11));
}

}  // namespace
}  // namespace tandem::engine
