// The router with KV tiers: host/disk events pass through the event-id
// bookkeeping without touching the device index, the TierIndex extends each
// worker's device overlap into its lower tiers, and kv_aware prefers
// device > host > disk hits (docs/router.md, "Tiers").
#include <gtest/gtest.h>

#include <vector>

#include "router/router.h"

namespace tandem::router {
namespace {

uint64_t H(uint64_t i) { return (i + 1) * 0x9E3779B97F4A7C15ull; }
std::vector<uint64_t> Chain(uint64_t first, uint64_t n) {
  std::vector<uint64_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = H(first + i);
  return v;
}

struct Fleet {
  std::unique_ptr<Router> router = Router::Create({}, {}).value();
  std::vector<uint64_t> next_id = std::vector<uint64_t>(8, 1);

  WorkerId Add(const std::string& name, WorkerRole role) {
    WorkerInfo info;
    info.name = name;
    info.role = role;
    info.epoch = 1;
    info.num_blocks = 100000;
    return router->AddWorker(info).value();
  }
  EventResult Event(WorkerId w, KvEventKind kind, KvTier tier, std::span<const uint64_t> hashes,
                    uint64_t epoch = 1) {
    auto r = router->ApplyEvent(w, {kind, epoch, next_id[w]++, 0, hashes, tier});
    EXPECT_TRUE(r.ok());
    return r.ok() ? *r : EventResult::kDuplicate;
  }
  RouteDecision Route(std::span<const uint64_t> hashes) {
    RouteDecision d;
    Status st = router->Route({hashes, static_cast<uint32_t>(hashes.size() * 16)}, &d);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return d;
  }
};

TEST(TierRoutingTest, LowerTierEventsKeepTheIdSequenceAndTheirOwnIndex) {
  Fleet f;
  const WorkerId p = f.Add("p", WorkerRole::kPrefill);
  f.Add("d", WorkerRole::kDecode);
  const auto chain = Chain(0, 8);
  EXPECT_EQ(f.Event(p, KvEventKind::kStored, KvTier::kDevice, chain), EventResult::kApplied);
  // The device evicts the tail to host: removed(device) + stored(host).
  std::span<const uint64_t> tail(chain.data() + 4, 4);
  EXPECT_EQ(f.Event(p, KvEventKind::kRemoved, KvTier::kDevice, tail), EventResult::kApplied);
  EXPECT_EQ(f.Event(p, KvEventKind::kStored, KvTier::kHost, tail), EventResult::kApplied);
  EXPECT_EQ(f.router->index().BlocksOf(p), 4u);
  EXPECT_EQ(f.router->tier_index().BlocksOf(p, KvTier::kHost), 4u);
  // The host tier overflows to disk.
  std::span<const uint64_t> last(chain.data() + 6, 2);
  EXPECT_EQ(f.Event(p, KvEventKind::kRemoved, KvTier::kHost, last), EventResult::kApplied);
  EXPECT_EQ(f.Event(p, KvEventKind::kStored, KvTier::kDisk, last), EventResult::kApplied);
  EXPECT_EQ(f.router->tier_index().BlocksOf(p, KvTier::kHost), 2u);
  EXPECT_EQ(f.router->tier_index().BlocksOf(p, KvTier::kDisk), 2u);
  const RouteDecision d = f.Route(chain);
  EXPECT_EQ(d.prefill_overlap_blocks, 4u);
  EXPECT_EQ(d.prefill_tier_blocks, 4u);
  EXPECT_EQ(f.router->counters().snapshots_requested, 0u);

  // A restart (new epoch) forgets the lower tiers; its snapshot brings them back.
  EXPECT_EQ(f.Event(p, KvEventKind::kStored, KvTier::kDevice, Chain(100, 1), 2), EventResult::kNeedsSnapshot);
  EXPECT_EQ(f.router->tier_index().BlocksOf(p, KvTier::kDisk), 0u);
  auto r = f.router->ApplySnapshot(p, 2, 10, {}, {}, chain);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(f.router->tier_index().BlocksOf(p, KvTier::kDisk), 8u);
  EXPECT_EQ(f.Route(chain).prefill_tier_blocks, 8u);
  // cleared drops every tier.
  f.next_id[p] = 11;
  EXPECT_EQ(f.router->ApplyEvent(p, {KvEventKind::kCleared, 2, 11, 0, {}}).value(), EventResult::kApplied);
  EXPECT_TRUE(f.router->tier_index().empty());
}

TEST(TierRoutingTest, KvAwarePrefersDeviceThenHostThenDisk) {
  Fleet f;
  const WorkerId p0 = f.Add("p0", WorkerRole::kPrefill);
  const WorkerId p1 = f.Add("p1", WorkerRole::kPrefill);
  const WorkerId p2 = f.Add("p2", WorkerRole::kPrefill);
  const WorkerId p3 = f.Add("p3", WorkerRole::kPrefill);
  f.Add("d", WorkerRole::kDecode);
  const auto chain = Chain(0, 64);
  f.Event(p0, KvEventKind::kStored, KvTier::kDevice, chain);
  f.Event(p1, KvEventKind::kStored, KvTier::kHost, chain);
  f.Event(p2, KvEventKind::kStored, KvTier::kDisk, chain);
  (void)p3;
  EXPECT_EQ(f.Route(chain).prefill, p0);
  RouteDecision d;
  f.Event(p0, KvEventKind::kRemoved, KvTier::kDevice, chain);
  d = f.Route(chain);
  EXPECT_EQ(d.prefill, p1);
  EXPECT_EQ(d.prefill_tier_blocks, 64u);
  f.Event(p1, KvEventKind::kRemoved, KvTier::kHost, chain);
  EXPECT_EQ(f.Route(chain).prefill, p2);
  // A longer disk run still loses to a device run long enough to be worth more.
  f.Event(p3, KvEventKind::kStored, KvTier::kDevice, std::span<const uint64_t>(chain.data(), 40));
  EXPECT_EQ(f.Route(chain).prefill, p3);  // 40 device blocks > 64 * (1 - 0.6) disk credit
}

// Extend directly: workers join at their own device overlap, stop at their
// first block in no tier, host preferred when a block is on both.
TEST(TierRoutingTest, ExtendFollowsEachWorkerFromItsDeviceOverlap) {
  TierIndex t;
  const auto chain = Chain(0, 40);
  auto part = [&](size_t a, size_t b) { return std::span<const uint64_t>(chain.data() + a, b - a); };
  t.Apply(1, KvEventKind::kStored, KvTier::kHost, part(10, 30));   // w1: device 0..10, host 10..30
  t.Apply(2, KvEventKind::kStored, KvTier::kDisk, part(0, 25));    // w2: disk 0..25
  t.Apply(2, KvEventKind::kStored, KvTier::kHost, part(5, 8));     //     and host 5..8
  t.Apply(3, KvEventKind::kStored, KvTier::kHost, part(20, 40));   // w3: device 0..15, host 20..40
  OverlapBlocks device{};
  device[1] = 10;
  device[2] = 0;
  device[3] = 15;
  device[4] = 40;  // no lower-tier entries: untouched
  TierOverlap out;
  t.Extend(chain, device, &out);
  EXPECT_EQ(out.host[1], 20u);
  EXPECT_EQ(out.disk[1], 0u);
  EXPECT_EQ(out.host[2], 3u);
  EXPECT_EQ(out.disk[2], 22u);
  EXPECT_EQ(out.host[3], 0u);  // block 15 is in no tier of w3
  EXPECT_EQ(out.host[4] + out.disk[4], 0u);
  t.Apply(2, KvEventKind::kRemoved, KvTier::kDisk, part(12, 13));  // a hole: w2 stops at 12
  t.Extend(chain, device, &out);
  EXPECT_EQ(out.host[2] + out.disk[2], 12u);
}

}  // namespace
}  // namespace tandem::router
