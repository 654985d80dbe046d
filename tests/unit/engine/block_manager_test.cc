// Block manager, prefix cache (LRU, token comparison) and KV events.
#include "engine/block_manager.h"

#include <gtest/gtest.h>

#include <numeric>

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
