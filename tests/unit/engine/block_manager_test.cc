// Block manager, prefix cache (LRU, token comparison) and KV events.
#include "engine/block_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <set>

#include "common/block_hash.h"
#include "engine/kv_events.h"
#include "engine/kv_pool.h"

namespace tandem::engine {
namespace {

constexpr uint32_t kBs = 4;

std::vector<uint32_t> Seq(uint32_t n, uint32_t start) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(BlockManagerTest, AllocateReleaseRefcounts) {
  BlockManager bm(8, kBs, nullptr);
  EXPECT_EQ(bm.num_free_blocks(), 8u);
  auto a = bm.Allocate(3);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(bm.num_free_blocks(), 5u);
  bm.Retain(*a);
  EXPECT_EQ(bm.ref_count(1), 2u);
  bm.Release(*a);
  EXPECT_EQ(bm.num_free_blocks(), 5u);
  bm.Release(*a);
  EXPECT_EQ(bm.num_free_blocks(), 8u);
  auto too_many = bm.Allocate(9);
  EXPECT_EQ(too_many.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(bm.num_free_blocks(), 8u);  // all or nothing
}

TEST(BlockManagerTest, CommittedBlocksAreReusedOnlyWhenTokensMatch) {
  KvEventPublisher events(7);
  BlockManager bm(8, kBs, &events);
  const uint64_t root = 99;
  auto tokens = Seq(8, 10);
  auto hashes = HashBlocks(root, tokens, kBs);
  auto blocks = *bm.Allocate(2);
  bm.Commit(blocks, hashes, tokens, 0, 2, root);
  EXPECT_EQ(bm.num_cached_blocks(), 2u);
  bm.Release(blocks);
  EXPECT_EQ(bm.num_free_blocks(), 8u);  // cached blocks are evictable

  // Same tokens: both blocks found.
  EXPECT_EQ(bm.CountCachedPrefix(hashes, tokens, 8), 2u);
  // Same hashes but different tokens (a collision): not reused.
  auto other = tokens;
  other[5] = 1234;
  EXPECT_EQ(bm.CountCachedPrefix(hashes, other, 8), 1u);
  // max_blocks caps the match.
  EXPECT_EQ(bm.CountCachedPrefix(hashes, tokens, 1), 1u);

  auto got = bm.AcquireCachedPrefix(hashes, tokens, 8);
  EXPECT_EQ(got, blocks);
  EXPECT_EQ(bm.ref_count(blocks[0]), 1u);
  EXPECT_EQ(bm.num_free_blocks(), 6u);
  bm.Release(got);
}

TEST(BlockManagerTest, LruEvictsLeastRecentAndTailFirst) {
  KvEventPublisher events(1);
  BlockManager bm(4, kBs, &events);
  const uint64_t root = 5;
  auto ta = Seq(8, 100), tb = Seq(8, 200);
  auto ha = HashBlocks(root, ta, kBs), hb = HashBlocks(root, tb, kBs);
  auto a = *bm.Allocate(2);
  auto b = *bm.Allocate(2);
  bm.Commit(a, ha, ta, 0, 2, root);
  bm.Commit(b, hb, tb, 0, 2, root);
  bm.Release(a);  // a's tail, then a's head become evictable first
  bm.Release(b);
  events.Drain();
  auto one = *bm.Allocate(1);
  EXPECT_EQ(one[0], a[1]);  // least recent, the tail of sequence a
  auto ev = events.Drain();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvEventKind::kRemoved);
  EXPECT_EQ(ev[0].hashes, (std::vector<uint64_t>{ha[1]}));
  EXPECT_EQ(bm.CountCachedPrefix(ha, ta, 2), 1u);  // a's head still cached
  // Touching b (acquire + release) makes a's head the least recent.
  auto bb = bm.AcquireCachedPrefix(hb, tb, 2);
  bm.Release(bb);
  auto two = *bm.Allocate(1);
  EXPECT_EQ(two[0], a[0]);
  EXPECT_EQ(bm.CountCachedPrefix(hb, tb, 2), 2u);
  bm.Release(one);
  bm.Release(two);
  EXPECT_EQ(bm.num_free_blocks(), 4u);
}

// An allocation larger than the free list takes the free blocks, then evicts
// the least recently used cached ones in one batch (session 51): the same
// blocks, in the same order, with the same removed event, as one-block
// allocations take one at a time.
TEST(BlockManagerTest, AllocationOfManyEvictsWhatOneAtATimeEvicts) {
  KvEventPublisher ev_many(1), ev_one(1);
  BlockManager many(12, kBs, &ev_many), one(12, kBs, &ev_one);
  const uint64_t root = 3;
  for (BlockManager* bm : {&many, &one}) {
    // Three sequences of three blocks cached in the order c, a, b (c's tail
    // first); three blocks stay free.
    for (uint32_t start : {300u, 100u, 200u}) {
      auto t = Seq(12, start);
      auto h = HashBlocks(root, t, kBs);
      auto blocks = *bm->Allocate(3);
      bm->Commit(blocks, h, t, 0, 3, root);
      bm->Release(blocks);
    }
  }
  ev_many.Drain();
  ev_one.Drain();
  auto got = *many.Allocate(8);  // 3 free, then 5 evictions
  std::vector<uint32_t> want;
  std::vector<uint64_t> removed_one;
  for (int i = 0; i < 8; ++i) {
    want.push_back((*one.Allocate(1))[0]);
    for (const auto& e : ev_one.Drain()) {
      if (e.kind == KvEventKind::kRemoved)
        removed_one.insert(removed_one.end(), e.hashes.begin(), e.hashes.end());
    }
  }
  EXPECT_EQ(got, want);
  const auto ev = ev_many.Drain();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvEventKind::kRemoved);
  EXPECT_EQ(ev[0].hashes, removed_one);
  ASSERT_EQ(removed_one.size(), 5u);
  EXPECT_EQ(many.evictions(KvTier::kDevice), 5u);
  EXPECT_EQ(many.num_free_blocks(), one.num_free_blocks());
  EXPECT_EQ(many.num_cached_blocks(), 4u);
  for (uint32_t b : got) EXPECT_EQ(many.ref_count(b), 1u);
  // What is left cached is the same, and still found by its tokens.
  for (uint32_t start : {300u, 100u, 200u}) {
    auto t = Seq(12, start);
    auto h = HashBlocks(root, t, kBs);
    EXPECT_EQ(many.CountCachedPrefix(h, t, 3), one.CountCachedPrefix(h, t, 3)) << start;
  }
  many.Release(got);
  one.Release(want);
  EXPECT_EQ(many.num_free_blocks(), 12u);
}

TEST(BlockManagerTest, HeldBlocksAreNeverEvicted) {
  BlockManager bm(3, kBs, nullptr);
  auto t = Seq(8, 1);
  auto h = HashBlocks(1, t, kBs);
  auto held = *bm.Allocate(2);
  bm.Commit(held, h, t, 0, 2, 1);
  auto x = bm.Allocate(2);
  EXPECT_FALSE(x.ok());
  auto y = *bm.Allocate(1);
  EXPECT_EQ(bm.ref_count(held[0]), 1u);
  EXPECT_EQ(bm.ref_count(held[1]), 1u);
  bm.Release(y);
  bm.Release(held);
}

TEST(BlockManagerTest, DuplicateHashStaysPrivateAndIsFreed) {
  KvEventPublisher events(1);
  BlockManager bm(4, kBs, &events);
  auto t = Seq(4, 1);
  auto h = HashBlocks(3, t, kBs);
  auto a = *bm.Allocate(1);
  auto b = *bm.Allocate(1);
  bm.Commit(a, h, t, 0, 1, 3);
  bm.Commit(b, h, t, 0, 1, 3);  // computed twice concurrently: second is not registered
  EXPECT_TRUE(bm.is_committed(a[0]));
  EXPECT_FALSE(bm.is_committed(b[0]));
  auto ev = events.Drain();
  ASSERT_EQ(ev.size(), 1u);  // one stored event only
  bm.Release(b);
  bm.Release(a);
  EXPECT_EQ(bm.num_free_blocks(), 4u);
  EXPECT_EQ(bm.num_cached_blocks(), 1u);
}

// The router's prefix search (docs/router.md, "Prefix index") relies on
// this: a worker's cached blocks of one chain form a prefix of it, i.e.
// every committed block's parent is committed too. Random workload on a
// small pool (constant eviction): sequences built from 4 documents with
// random shared lengths and private tails, each committing its blocks as
// soon as it has them (so none computes a block another one already
// holds), up to 3 alive at once, released in random order.
TEST(BlockManagerTest, CachedBlocksOfAChainFormAPrefixUnderEviction) {
  KvEventPublisher events(1);
  BlockManager bm(24, kBs, &events);
  const uint64_t root = 99;
  std::mt19937 rng(5);
  struct Live {
    std::vector<uint32_t> blocks;
  };
  std::vector<Live> live;
  uint64_t evictions = 0, reused = 0;
  for (int step = 0; step < 3000; ++step) {
    if (!live.empty() && (live.size() >= 3 || rng() % 2 == 0)) {
      const size_t k = rng() % live.size();
      bm.Release(live[k].blocks);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const uint32_t doc = rng() % 4;
      const uint32_t shared = kBs * (rng() % 6);
      std::vector<uint32_t> tokens = Seq(shared, 1000 * (doc + 1));
      const uint32_t tail = kBs * (1 + rng() % 3);
      for (uint32_t i = 0; i < tail; ++i) tokens.push_back(50000 + static_cast<uint32_t>(rng() % 7));
      const auto hashes = HashBlocks(root, tokens, kBs);
      const uint32_t n = static_cast<uint32_t>(hashes.size());
      std::vector<uint32_t> blocks = bm.AcquireCachedPrefix(hashes, tokens, n);
      const uint32_t cached = static_cast<uint32_t>(blocks.size());
      reused += cached;
      auto fresh = bm.Allocate(n - cached);
      if (!fresh.ok()) {
        bm.Release(blocks);
        continue;
      }
      blocks.insert(blocks.end(), fresh->begin(), fresh->end());
      bm.Commit(blocks, hashes, tokens, cached, n - cached, root);
      live.push_back({std::move(blocks)});
    }
    for (const auto& e : events.Drain()) evictions += e.kind == KvEventKind::kRemoved ? e.hashes.size() : 0;
    const KvSnapshot snap = bm.Snapshot();
    std::set<uint64_t> committed;
    for (const auto& b : snap.blocks) committed.insert(b.hash);
    for (const auto& b : snap.blocks) {
      ASSERT_TRUE(b.parent_hash == root || committed.count(b.parent_hash))
          << "step " << step << ": block " << b.hash << " cached without its parent " << b.parent_hash;
    }
  }
  EXPECT_GT(evictions, 500u);  // the pool was under pressure
  EXPECT_GT(reused, 500u);     // and prefixes were shared
}

// The one way a hole appears (documented in docs/router.md): two sequences
// compute the same block at the same time; the second one's copy stays
// private, its next block is committed under the first one's chain, and
// evicting the first one's blocks leaves that next block without its
// parent. The engine's own lookup stops at the hole.
TEST(BlockManagerTest, ConcurrentDuplicateCanLeaveAChildWithoutItsParent) {
  KvEventPublisher events(1);
  BlockManager bm(4, kBs, &events);
  const uint64_t root = 7;
  auto ta = Seq(4, 1);
  auto tb = Seq(4, 1);
  for (uint32_t t : Seq(4, 500)) tb.push_back(t);
  auto ha = HashBlocks(root, ta, kBs), hb = HashBlocks(root, tb, kBs);
  auto a = *bm.Allocate(1);
  auto b = *bm.Allocate(2);
  bm.Commit(a, ha, ta, 0, 1, root);
  bm.Commit(b, hb, tb, 0, 2, root);  // b[0] duplicates a[0]: private; b[1] committed
  EXPECT_FALSE(bm.is_committed(b[0]));
  EXPECT_TRUE(bm.is_committed(b[1]));
  bm.Release(a);
  bm.Release(b);  // frees b[0]; b[1] evictable, more recent than a[0]
  auto x = *bm.Allocate(3);  // two free blocks, then evicts a[0] (least recent)
  EXPECT_FALSE(bm.is_committed(a[0]));
  EXPECT_TRUE(bm.is_committed(b[1]));                 // the child, without its parent
  EXPECT_EQ(bm.CountCachedPrefix(hb, tb, 2), 0u);     // unreachable for the engine
  bm.Release(x);
}

TEST(KvEventsTest, WakeSubscribersOncePerHold) {
  KvEventPublisher events(1);
  int wakes = 0;
  std::vector<uint64_t> seen;
  const uint64_t wake = events.SubscribeWake([&] { ++wakes; });
  events.Subscribe([&](const KvEvent& e) { seen.push_back(e.event_id); });
  events.PublishStored({1, 2}, 0);
  EXPECT_EQ(wakes, 1);  // outside a hold: at once
  events.Hold();
  events.Hold();  // holds nest
  events.PublishStored({3}, 2);
  events.PublishRemoved({1});
  events.Release();
  EXPECT_EQ(wakes, 1);
  EXPECT_EQ(seen, (std::vector<uint64_t>{1, 2, 3}));  // per-event subscribers: at once
  EXPECT_EQ(events.Drain().size(), 3u);               // queued at once too
  events.Release();
  EXPECT_EQ(wakes, 2);  // the outer release: one wake for both events
  events.Hold();
  events.Release();
  EXPECT_EQ(wakes, 2);  // nothing published: no wake
  events.Release();     // unbalanced: ignored
  events.Unsubscribe(wake);
  events.PublishCleared();
  EXPECT_EQ(wakes, 2);
}

// WakeNow (session 32): wakes at once, inside a hold too, for events no
// wake-up has announced (quiet ones, or ones a hold defers), and leaves the
// hold's release nothing to announce for them; nothing otherwise.
TEST(KvEventsTest, WakeNowAnnouncesQueuedEventsThroughAHold) {
  KvEventPublisher events(1);
  int wakes = 0;
  events.SubscribeWake([&] { ++wakes; });
  events.WakeNow();
  EXPECT_EQ(wakes, 0);  // nothing queued
  events.PublishStored({1}, 0, KvTier::kDevice, /*quiet=*/true);
  EXPECT_EQ(wakes, 0);
  events.WakeNow();
  EXPECT_EQ(wakes, 1);  // the quiet event, outside a hold
  events.WakeNow();
  EXPECT_EQ(wakes, 1);  // announced already
  events.Hold();
  events.PublishStored({2}, 1, KvTier::kDevice, /*quiet=*/true);
  events.WakeIfQuiet();
  EXPECT_EQ(wakes, 1);  // WakeIfQuiet waits for the release
  events.WakeNow();
  EXPECT_EQ(wakes, 2);         // WakeNow does not
  events.PublishRemoved({1});  // deferred by the hold
  events.WakeNow();
  EXPECT_EQ(wakes, 3);
  events.Release();
  EXPECT_EQ(wakes, 3);  // nothing left for the release to announce
  events.Hold();
  events.WakeNow();
  events.PublishStored({3}, 2);  // after the wake-up: the release announces it
  events.Release();
  EXPECT_EQ(wakes, 4);
  EXPECT_EQ(events.Drain().size(), 4u);
}

TEST(KvEventsTest, IdsMonotonicStoredRemovedClearedAndSnapshot) {
  KvEventPublisher events(42);
  std::vector<KvEvent> seen;
  const uint64_t sub = events.Subscribe([&](const KvEvent& e) { seen.push_back(e); });
  BlockManager bm(3, kBs, &events);
  const uint64_t root = 77;
  auto t = Seq(12, 50);
  auto h = HashBlocks(root, t, kBs);
  auto blocks = *bm.Allocate(3);
  bm.Commit(blocks, h, t, 0, 1, root);
  bm.Commit(blocks, h, t, 1, 2, root);
  bm.Release(blocks);
  auto snap = bm.Snapshot();
  EXPECT_EQ(snap.epoch, 42u);
  EXPECT_EQ(snap.last_event_id, 2u);
  ASSERT_EQ(snap.blocks.size(), 3u);
  auto fresh = *bm.Allocate(2);  // evicts blocks[2], then blocks[1]
  bm.Release(fresh);
  bm.ClearCache();
  ASSERT_EQ(seen.size(), 4u);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].event_id, i + 1);
    EXPECT_EQ(seen[i].epoch, 42u);
  }
  EXPECT_EQ(seen[0].kind, KvEventKind::kStored);
  EXPECT_EQ(seen[0].hashes, (std::vector<uint64_t>{h[0]}));
  EXPECT_EQ(seen[0].parent_hash, root);
  EXPECT_EQ(seen[1].kind, KvEventKind::kStored);
  EXPECT_EQ(seen[1].hashes, (std::vector<uint64_t>{h[1], h[2]}));
  EXPECT_EQ(seen[1].parent_hash, h[0]);
  EXPECT_EQ(seen[2].kind, KvEventKind::kRemoved);
  EXPECT_EQ(seen[2].hashes, (std::vector<uint64_t>{h[2], h[1]}));
  EXPECT_EQ(seen[3].kind, KvEventKind::kCleared);
  EXPECT_EQ(bm.num_cached_blocks(), 0u);
  EXPECT_EQ(bm.num_free_blocks(), 3u);
  EXPECT_EQ(events.Drain().size(), 4u);
  events.Unsubscribe(sub);
}

TEST(KvEventsTest, QueueDropsOldestPastCapacity) {
  KvEventPublisher events(1, 2);
  for (int i = 0; i < 5; ++i) events.PublishCleared();
  auto ev = events.Drain();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].event_id, 4u);  // the drainer sees the gap (1..3 lost)
  EXPECT_EQ(ev[1].event_id, 5u);
  EXPECT_EQ(events.last_event_id(), 5u);
}

TEST(KvPoolTest, BlockMajorLayoutAndAllocator) {
  KvLayout l{.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .block_size = 4};
  EXPECT_EQ(l.plane_floats(), 2u * 4 * 8);
  EXPECT_EQ(l.block_floats(), 3u * 2 * 64);
  EXPECT_EQ(l.plane_offset(2, 1), 5u * 64);
  AlignedKvPoolAllocator alloc;
  auto pool = KvPool::Create(l, 10, alloc);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->size_bytes(), 10 * l.block_bytes());
  EXPECT_EQ((*pool)->block(3) - (*pool)->base(), static_cast<ptrdiff_t>(3 * l.block_floats()));
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*pool)->base()) % 64, 0u);
  AlignedKvPoolAllocator alloc2;
  EXPECT_FALSE(KvPool::Create(KvLayout{}, 10, alloc2).ok());
}

}  // namespace
}  // namespace tandem::engine
