#include "router/prefix_index.h"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <functional>
#include <numeric>
#include <random>
#include <algorithm>
#include <thread>
#include <vector>

#include "common/block_hash.h"

namespace tandem::router {
namespace {

// Distinct, well-spread fake hashes (the index relies on hashes being XXH3
// outputs: top bits pick the shard, low bits the slot).
uint64_t H(uint64_t i) { return (i + 1) * 0x9E3779B97F4A7C15ull; }

std::vector<uint64_t> Chain(uint64_t first, uint64_t n) {
  std::vector<uint64_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = H(first + i);
  return v;
}

KvEventView Stored(uint64_t epoch, uint64_t id, std::span<const uint64_t> h) {
  return {KvEventKind::kStored, epoch, id, 0, h};
}
KvEventView Removed(uint64_t epoch, uint64_t id, std::span<const uint64_t> h) {
  return {KvEventKind::kRemoved, epoch, id, 0, h};
}
KvEventView Cleared(uint64_t epoch, uint64_t id) { return {KvEventKind::kCleared, epoch, id, 0, {}}; }

uint32_t OverlapOf(const PrefixIndex& index, WorkerId w, std::span<const uint64_t> h) {
  OverlapBlocks out;
  index.Overlap(h, &out);
  return out[w];
}

// The model tests' reference: the holders of each key, for three workers.
constexpr WorkerId kModelWorkers = 3;
using HolderModel = std::vector<std::array<bool, kModelWorkers>>;  // [key]: holders

// Every key's holders (`hash(k)` is key k's hash), the index's size and each
// worker's HeldBlocks, and with `scan` its BlocksOf, equal the model's.
void ExpectIndexEqualsModel(const PrefixIndex& index, const HolderModel& model,
                            const std::function<uint64_t(uint64_t)>& hash, uint64_t round, bool scan) {
  uint64_t live = 0;
  std::array<uint64_t, kModelWorkers> held{};
  for (uint64_t k = 0; k < model.size(); ++k) {
    const WorkerMask m = index.Holders(hash(k));
    bool any = false;
    for (WorkerId x = 0; x < kModelWorkers; ++x) {
      ASSERT_EQ(m.Test(x), model[k][x]) << "key " << k << " worker " << x << " round " << round;
      held[x] += model[k][x];
      any |= model[k][x];
    }
    live += any;
  }
  ASSERT_EQ(index.size(), live) << "round " << round;
  for (WorkerId x = 0; x < kModelWorkers; ++x) {
    ASSERT_EQ(index.HeldBlocks(x), held[x]) << "worker " << x << " round " << round;
    if (scan) {
      ASSERT_EQ(index.BlocksOf(x), held[x]) << "worker " << x << " round " << round;
    }
  }
}

TEST(PrefixIndexTest, OverlapStopsAtEachWorkersFirstMiss) {
  PrefixIndex index;
  const std::vector<uint64_t> q = Chain(0, 4);  // a b c d
  for (WorkerId w : {0u, 1u, 2u, 5u}) ASSERT_TRUE(index.AddWorker(w, 7).ok());
  const std::vector<uint64_t> w0 = {q[0], q[1], q[3]};  // lacks c
  const std::vector<uint64_t> w1 = {q[0]};
  const std::vector<uint64_t> w2 = {q[1], q[2], q[3]};  // lacks a
  ASSERT_EQ(*index.Apply(0, Stored(7, 1, w0)), EventResult::kApplied);
  ASSERT_EQ(*index.Apply(1, Stored(7, 1, w1)), EventResult::kApplied);
  ASSERT_EQ(*index.Apply(2, Stored(7, 1, w2)), EventResult::kApplied);
  ASSERT_EQ(*index.Apply(5, Stored(7, 1, q)), EventResult::kApplied);
  OverlapBlocks out;
  index.Overlap(q, &out);
  EXPECT_EQ(out[0], 2u);
  EXPECT_EQ(out[1], 1u);
  EXPECT_EQ(out[2], 0u);
  EXPECT_EQ(out[5], 4u);
  EXPECT_EQ(out[3], 0u);
  index.Overlap({}, &out);
  EXPECT_EQ(out[5], 0u);
}

TEST(PrefixIndexTest, LongPromptsCrossChunkBoundaries) {
  PrefixIndex index;
  const std::vector<uint64_t> q = Chain(100, 700);
  const struct {
    WorkerId worker;
    uint32_t held;
  } kRows[] = {{0, 700}, {1, 300}, {2, 17}, {3, 16}, {4, 1}, {5, 511}, {6, 0}};
  for (const auto& r : kRows) {
    ASSERT_TRUE(index.AddWorker(r.worker, 1).ok());
    ASSERT_EQ(*index.Apply(r.worker, Stored(1, 1, std::span(q).first(r.held))), EventResult::kApplied);
  }
  OverlapBlocks out;
  index.Overlap(q, &out);
  for (const auto& r : kRows) EXPECT_EQ(out[r.worker], r.held) << "worker " << r.worker;
  EXPECT_EQ(index.size(), 700u);
  EXPECT_EQ(index.BlocksOf(1), 300u);
}

TEST(PrefixIndexTest, HashZeroIsAnOrdinaryKey) {
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0, 1).ok());
  const std::vector<uint64_t> q = {0, H(1)};
  ASSERT_EQ(*index.Apply(0, Stored(1, 1, q)), EventResult::kApplied);
  EXPECT_EQ(OverlapOf(index, 0, q), 2u);
  ASSERT_EQ(*index.Apply(0, Removed(1, 2, std::span(q).first(1))), EventResult::kApplied);
  EXPECT_EQ(OverlapOf(index, 0, q), 0u);
  EXPECT_EQ(index.size(), 1u);
}

TEST(PrefixIndexTest, RemovingAndStoringAgainKeepsCountsAndOverlap) {
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0, 1).ok());
  ASSERT_TRUE(index.AddWorker(1, 1).ok());
  const std::vector<uint64_t> all = Chain(0, 20000);
  ASSERT_EQ(*index.Apply(0, Stored(1, 1, all)), EventResult::kApplied);
  ASSERT_EQ(*index.Apply(1, Stored(1, 1, std::span(all).first(10))), EventResult::kApplied);
  uint64_t id = 2;
  for (int round = 0; round < 5; ++round) {
    ASSERT_EQ(*index.Apply(0, Removed(1, id++, std::span(all).subspan(5000))), EventResult::kApplied);
    EXPECT_EQ(index.size(), 5000u);
    EXPECT_EQ(OverlapOf(index, 0, all), 5000u);
    ASSERT_EQ(*index.Apply(0, Stored(1, id++, std::span(all).subspan(5000))), EventResult::kApplied);
    EXPECT_EQ(index.size(), 20000u);
    EXPECT_EQ(OverlapOf(index, 0, all), 20000u);
  }
  EXPECT_EQ(OverlapOf(index, 1, all), 10u);
  EXPECT_EQ(index.BlocksOf(0), 20000u);
}

// Reserve sizes the tables for the fleet's capacity up front: storing that
// many distinct hashes grows no table, and it never shrinks them.
TEST(PrefixIndexTest, ReserveSizesTheTablesSoStoresDoNotGrowThem) {
  constexpr uint64_t kPerWorker = 26'624;  // the sim fleet's KV pool (blocks)
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0, 1).ok());
  ASSERT_TRUE(index.AddWorker(1, 1).ok());
  const uint64_t unreserved = index.TableSlots();
  index.Reserve(2 * kPerWorker);
  const uint64_t slots = index.TableSlots();
  EXPECT_GT(slots, unreserved);
  EXPECT_GE(slots, 4 * kPerWorker);  // under half full when every hash is distinct
  const uint64_t rehashes = index.Rehashes();
  const std::vector<uint64_t> a = Chain(0, kPerWorker), b = Chain(kPerWorker, kPerWorker);
  ASSERT_EQ(*index.Apply(0, Stored(1, 1, a)), EventResult::kApplied);
  ASSERT_EQ(*index.Apply(1, Stored(1, 1, b)), EventResult::kApplied);
  EXPECT_EQ(index.TableSlots(), slots);
  EXPECT_EQ(index.Rehashes(), rehashes);
  EXPECT_EQ(index.size(), 2 * kPerWorker);
  EXPECT_EQ(OverlapOf(index, 0, a), kPerWorker);
  EXPECT_EQ(OverlapOf(index, 1, b), kPerWorker);
  index.Reserve(10);  // never shrinks
  EXPECT_EQ(index.TableSlots(), slots);
  // Capped: a huge fleet reserves at most kReserveMaxHashes' worth.
  PrefixIndex big;
  big.Reserve(uint64_t{1} << 40);
  EXPECT_LE(big.TableSlots(), 8 * PrefixIndex::kReserveMaxHashes);
  EXPECT_GE(big.TableSlots(), 2 * PrefixIndex::kReserveMaxHashes);
}

// Store/remove churn by three workers on tables reserved for `reserve`
// hashes: a window of keys slides on, stores and removals of 1 to 64
// blocks (every tenth of up to 600: several write chunks). Differential
// check against a plain model every 100 rounds: holders of every key ever
// used, sizes, per-worker counts. Removals shift entries back, so no table
// is rebuilt.
void ChurnAgainstAModel(uint64_t reserve, bool in_order) {
  constexpr WorkerId kWorkers = kModelWorkers;
  constexpr uint64_t kWindow = 2000, kSlide = 20;
  PrefixIndex index;
  for (WorkerId w = 0; w < kWorkers; ++w) ASSERT_TRUE(index.AddWorker(w, 1).ok());
  index.Reserve(reserve);
  // Which of the two write paths (prefix_index.cc, ForEachByShard) runs.
  ASSERT_EQ(index.InOrderWrites(), in_order);
  const uint64_t slots = index.TableSlots();
  const uint64_t rehashes = index.Rehashes();
  const auto hash = [](uint64_t k) { return k == 7 ? 0 : H(k); };  // the hash 0 too
  HolderModel model;
  std::vector<uint64_t> next_id(kWorkers, 1);
  std::mt19937_64 rng(23);
  const auto apply = [&](WorkerId w, bool store, uint64_t first, uint64_t end) {
    if (model.size() < end) model.resize(end, {false, false, false});
    std::vector<uint64_t> hashes;
    for (uint64_t k = first; k < end; ++k) {
      hashes.push_back(hash(k));
      model[k][w] = store;
    }
    const KvEventView e = store ? Stored(1, next_id[w]++, hashes) : Removed(1, next_id[w]++, hashes);
    ASSERT_EQ(*index.Apply(w, e), EventResult::kApplied);
  };
  for (uint64_t round = 0; round < 3000; ++round) {
    const uint64_t base = round * kSlide;  // the window is [base, base + kWindow)
    const WorkerId w = static_cast<WorkerId>(rng() % kWorkers);
    const uint64_t first = base + rng() % kWindow;
    const uint64_t blocks = 1 + (round % 10 == 9 ? rng() % 600 : rng() % 64);
    apply(w, rng() % 3 != 0, first, first + blocks);
    if (base >= kSlide) {
      for (WorkerId x = 0; x < kWorkers; ++x) apply(x, false, base - kSlide, base);  // left the window
    }
    if (round % 100 != 99) continue;
    ASSERT_NO_FATAL_FAILURE(ExpectIndexEqualsModel(index, model, hash, round, true));
  }
  // Removals shift entries back instead of leaving tombstones: the churn
  // rebuilds no table.
  EXPECT_EQ(index.Rehashes(), rehashes);
  EXPECT_EQ(index.TableSlots(), slots);
  EXPECT_EQ(index.InOrderWrites(), in_order);
}

// Small tables (written in order, a chunk under every shard's lock).
TEST(PrefixIndexTest, ChurnOnReservedTablesMatchesAModel) {
  ChurnAgainstAModel(kModelWorkers * 3000, /*in_order=*/true);
}

// Tables past 4 MiB together (the largest reservation: 16 of 1.5 MiB) are
// written grouped by shard.
TEST(PrefixIndexTest, ChurnOnTheLargestReservationMatchesAModel) {
  ChurnAgainstAModel(PrefixIndex::kReserveMaxHashes, /*in_order=*/false);
}

// The proxy's steady state (sim 1P1D): a prefiller and a decoder store each
// prompt's blocks and remove the oldest prompt's once their pools are full.
// Ten times the reserved number of distinct hashes go through the tables;
// with removals deleting their slots (backward shift) no table is ever
// rebuilt, and every count and answer stays exact.
TEST(PrefixIndexTest, SteadyStoreRemoveChurnRebuildsNoTable) {
  constexpr uint64_t kPerPrompt = 100, kPool = 2000, kPrompts = 10 * kPool / kPerPrompt;
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0, 1).ok());
  ASSERT_TRUE(index.AddWorker(1, 1).ok());
  index.Reserve(2 * kPool);
  const uint64_t slots = index.TableSlots();
  const uint64_t rehashes = index.Rehashes();
  std::array<uint64_t, 2> next_id = {1, 1};
  const auto prompt = [](uint64_t p) { return Chain(p * kPerPrompt, kPerPrompt); };
  for (uint64_t p = 0; p < kPrompts; ++p) {
    for (WorkerId w : {0u, 1u}) {
      ASSERT_EQ(*index.Apply(w, Stored(1, next_id[w]++, prompt(p))), EventResult::kApplied);
    }
    if (p * kPerPrompt >= kPool) {
      const uint64_t old = p - kPool / kPerPrompt;
      for (WorkerId w : {0u, 1u}) {
        ASSERT_EQ(*index.Apply(w, Removed(1, next_id[w]++, prompt(old))), EventResult::kApplied);
      }
      EXPECT_EQ(index.Holders(prompt(old)[0]).Any(), false) << "prompt " << old;
    }
  }
  EXPECT_EQ(index.Rehashes(), rehashes);
  EXPECT_EQ(index.TableSlots(), slots);
  EXPECT_EQ(index.size(), kPool);
  for (WorkerId w : {0u, 1u}) {
    EXPECT_EQ(index.HeldBlocks(w), kPool);
    EXPECT_EQ(index.BlocksOf(w), kPool);
    EXPECT_EQ(OverlapOf(index, w, prompt(kPrompts - 1)), kPerPrompt);
    EXPECT_EQ(OverlapOf(index, w, prompt(kPrompts - kPool / kPerPrompt)), kPerPrompt);  // the oldest held
    EXPECT_EQ(OverlapOf(index, w, prompt(kPrompts - 1 - kPool / kPerPrompt)), 0u);
  }
}

// Keys of shard 0 whose home slots crowd both ends of the smallest table
// (1024 slots: low bits 1020..1023 and 0..3), so probe runs are long and
// wrap from the last slot to the first. Random stores and removals of
// single hashes and of whole groups (the chunked path), by three workers,
// with a worker's entries dropped now and then (its drop leaves
// tombstones, which later removals shift like entries): after every event
// each key's holders, the sizes and the per-worker counts equal a model.
TEST(PrefixIndexTest, RemovalsShiftCrowdedProbeRunsAcrossTheTableEnd) {
  constexpr WorkerId kWorkers = kModelWorkers;
  constexpr uint64_t kKeys = 48;
  const auto key = [](uint64_t k) {
    const uint64_t home = (1020 + k % 8) & 1023;  // 1020..1023, 0..3
    return ((k + 1) << 20) | home;                 // top bits 0: shard 0
  };
  std::vector<uint64_t> keys(kKeys);
  for (uint64_t k = 0; k < kKeys; ++k) keys[k] = key(k);
  PrefixIndex index;
  for (WorkerId w = 0; w < kWorkers; ++w) ASSERT_TRUE(index.AddWorker(w, 1).ok());
  HolderModel model(kKeys, {false, false, false});
  std::array<uint64_t, kWorkers> next_id{1, 1, 1};
  std::mt19937_64 rng(41);
  for (uint64_t round = 0; round < 4000; ++round) {
    const WorkerId w = static_cast<WorkerId>(rng() % kWorkers);
    const uint64_t r = rng() % 100;
    if (r < 2) {  // a drop: the worker's entries go, as after a restart
      ASSERT_EQ(*index.Apply(w, Cleared(1, next_id[w]++)), EventResult::kApplied);
      for (auto& m : model) m[w] = false;
    } else {
      const bool store = r < 55;
      // One hash, or a group of 8-24 (ForEachByShard's chunked path).
      const uint64_t n = rng() % 4 == 0 ? 8 + rng() % 17 : 1;
      std::vector<uint64_t> hashes;
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t k = rng() % kKeys;
        if (std::find(hashes.begin(), hashes.end(), keys[k]) != hashes.end()) continue;
        hashes.push_back(keys[k]);
        model[k][w] = store;
      }
      const KvEventView e = store ? Stored(1, next_id[w]++, hashes) : Removed(1, next_id[w]++, hashes);
      ASSERT_EQ(*index.Apply(w, e), EventResult::kApplied);
    }
    ASSERT_NO_FATAL_FAILURE(ExpectIndexEqualsModel(index, model, key, round, round % 500 == 499));
  }
}

// Overlap searches (probes a few blocks per round) for prompts longer than
// kEveryBlockMax. When every worker's blocks of the prompt's chain form a
// prefix (what the engine's eviction order keeps), the answer must equal
// the block-by-block walk exactly. Random fleets: per worker a held length
// drawn to hit the edges (0, 1, n-1, n, next to a probe) and spots between.
TEST(PrefixIndexTest, SearchEqualsTheBlockByBlockWalkWhenHoldingsArePrefixes) {
  std::mt19937_64 rng(7);
  uint64_t checked = 0;
  for (uint64_t trial = 0; trial < 300; ++trial) {
    const uint32_t n = std::uniform_int_distribution<uint32_t>(1, 1500)(rng);
    const uint32_t workers = std::uniform_int_distribution<uint32_t>(1, 40)(rng);
    PrefixIndex index;
    const std::vector<uint64_t> q = Chain(trial * 100000, n);
    std::vector<uint32_t> held(workers);
    for (WorkerId w = 0; w < workers; ++w) {
      ASSERT_TRUE(index.AddWorker(w, 1).ok());
      const uint32_t edges[] = {0, 1, n - 1, n, n / 16, n / 16 + 1, (n - 1) / 16 * 3, n / 2};
      held[w] = rng() % 2 ? edges[rng() % 8] : std::uniform_int_distribution<uint32_t>(0, n)(rng);
      held[w] = std::min(held[w], n);
      // Other chains too, so the table is not just this prompt.
      const std::vector<uint64_t> other = Chain(trial * 100000 + 50000 + w * 100, 30);
      ASSERT_EQ(*index.Apply(w, Stored(1, 1, other)), EventResult::kApplied);
      if (held[w] > 0) {
        ASSERT_EQ(*index.Apply(w, Stored(1, 2, std::span(q).first(held[w]))), EventResult::kApplied);
      }
    }
    OverlapBlocks search, walk;
    index.Overlap(q, &search);
    index.OverlapEveryBlock(q, &walk);
    for (WorkerId w = 0; w < kMaxWorkers; ++w) {
      ASSERT_EQ(search[w], walk[w]) << "trial " << trial << " n " << n << " worker " << w;
      if (w < workers) {
        ASSERT_EQ(search[w], held[w]) << "trial " << trial << " n " << n << " worker " << w;
      }
    }
    checked += workers;
  }
  EXPECT_GT(checked, 3000u);
}

// With a hole (a worker holds block i+1 but not block i: an event half
// applied, or the engine corner case of docs/router.md) the search may
// answer past the hole. What it promises, checked on random holdings with
// holes: the answer p is a drop-out point of the worker (it holds block p-1
// or p = 0, and misses block p or p = n), never before the first miss, and
// it never shrinks as the worker stores more blocks.
TEST(PrefixIndexTest, SearchWithHolesAnswersADropOutPointThatNeverShrinks) {
  std::mt19937_64 rng(11);
  constexpr WorkerId kWorkers = 6;
  for (uint64_t trial = 0; trial < 40; ++trial) {
    const uint32_t n = std::uniform_int_distribution<uint32_t>(49, 700)(rng);
    const std::vector<uint64_t> q = Chain(trial * 10000, n);
    PrefixIndex index;
    std::vector<std::vector<bool>> holds(kWorkers, std::vector<bool>(n, false));
    std::vector<uint64_t> next_id(kWorkers, 1);
    std::vector<uint32_t> previous(kWorkers, 0);
    for (WorkerId w = 0; w < kWorkers; ++w) ASSERT_TRUE(index.AddWorker(w, 1).ok());
    // Blocks arrive in random order, one event each, so every state in
    // between has holes; check after each few.
    std::vector<std::pair<WorkerId, uint32_t>> order;
    for (WorkerId w = 0; w < kWorkers; ++w) {
      const uint32_t upto = std::uniform_int_distribution<uint32_t>(0, n)(rng);
      for (uint32_t i = 0; i < upto; ++i) order.emplace_back(w, i);
    }
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t k = 0; k < order.size(); ++k) {
      const auto [w, i] = order[k];
      ASSERT_EQ(*index.Apply(w, Stored(1, next_id[w]++, std::span(q).subspan(i, 1))), EventResult::kApplied);
      holds[w][i] = true;
      if (k % 7 != 0 && k + 1 != order.size()) continue;
      OverlapBlocks search, walk;
      index.Overlap(q, &search);
      index.OverlapEveryBlock(q, &walk);
      for (WorkerId v = 0; v < kWorkers; ++v) {
        const uint32_t p = search[v];
        ASSERT_LE(p, n);
        EXPECT_TRUE(p == 0 || holds[v][p - 1]) << "trial " << trial << " worker " << v << " p " << p;
        EXPECT_TRUE(p == n || !holds[v][p]) << "trial " << trial << " worker " << v << " p " << p;
        EXPECT_GE(p, walk[v]) << "trial " << trial << " worker " << v;
        EXPECT_GE(p, previous[v]) << "trial " << trial << " worker " << v << ": answer shrank";
        previous[v] = p;
      }
    }
    // Every worker's blocks are a prefix again: both agree.
    OverlapBlocks search, walk;
    index.Overlap(q, &search);
    index.OverlapEveryBlock(q, &walk);
    for (WorkerId v = 0; v < kWorkers; ++v) {
      uint32_t first_miss = 0;
      while (first_miss < n && holds[v][first_miss]) ++first_miss;
      EXPECT_EQ(walk[v], first_miss);
      if (std::find(holds[v].begin() + first_miss, holds[v].end(), true) == holds[v].end()) {
        EXPECT_EQ(search[v], first_miss) << "trial " << trial << " worker " << v;
      }
    }
  }
}

// A known hole the search skips: 100 blocks held except block 5. The
// block-by-block walk says 5; the search probes blocks 0, 6, 12, ... and
// answers 100 (documented: a routing hint that over-counts until the hole
// is filled or the tail is evicted).
TEST(PrefixIndexTest, SearchSkipsAHoleBetweenProbesWalkDoesNot) {
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0, 1).ok());
  const std::vector<uint64_t> q = Chain(0, 100);
  std::vector<uint64_t> held = q;
  held.erase(held.begin() + 5);
  ASSERT_EQ(*index.Apply(0, Stored(1, 1, held)), EventResult::kApplied);
  OverlapBlocks search, walk;
  index.Overlap(q, &search);
  index.OverlapEveryBlock(q, &walk);
  EXPECT_EQ(walk[0], 5u);
  EXPECT_EQ(search[0], 100u);
  // A short prompt (<= kEveryBlockMax blocks) is read whole.
  EXPECT_EQ(OverlapOf(index, 0, std::span(q).first(PrefixIndex::kEveryBlockMax)), 5u);
}

// The event-stream rules, as sequences of events for worker 0 (registered
// with epoch 1) and what each returns, then the overlap of a query.
TEST(PrefixIndexTest, EventStreamRules) {
  const std::vector<uint64_t> a = Chain(0, 2), b = Chain(2, 1), x = Chain(50, 1);
  std::vector<uint64_t> ab = a;
  ab.push_back(b[0]);
  struct Ev {
    KvEventView view;
    EventResult want;
  };
  const struct {
    const char* name;
    std::vector<Ev> events;
    std::vector<uint64_t> query;
    uint32_t want_overlap;
  } kCases[] = {
      {"in order", {{Stored(1, 1, a), EventResult::kApplied}, {Stored(1, 2, b), EventResult::kApplied}}, ab, 3},
      {"duplicate id ignored",
       {{Stored(1, 1, a), EventResult::kApplied}, {Removed(1, 1, a), EventResult::kDuplicate}},
       a,
       2},
      {"first event after 1 is a gap", {{Stored(1, 2, a), EventResult::kNeedsSnapshot}}, a, 0},
      {"gap keeps entries, later events wait for the snapshot",
       {{Stored(1, 1, a), EventResult::kApplied},
        {Stored(1, 3, b), EventResult::kNeedsSnapshot},
        {Removed(1, 4, a), EventResult::kAwaitingSnapshot}},
       ab,
       2},
      {"restart at id 1 starts afresh",
       {{Stored(1, 1, a), EventResult::kApplied}, {Stored(2, 1, x), EventResult::kApplied}},
       a,
       0},
      {"restart mid-history drops entries and needs a snapshot",
       {{Stored(1, 1, a), EventResult::kApplied}, {Stored(2, 9, x), EventResult::kNeedsSnapshot}},
       a,
       0},
      {"late event of the old epoch is stale",
       {{Stored(1, 1, a), EventResult::kApplied},
        {Stored(2, 1, x), EventResult::kApplied},
        {Stored(1, 2, a), EventResult::kStaleEpoch}},
       a,
       0},
      {"removed", {{Stored(1, 1, ab), EventResult::kApplied}, {Removed(1, 2, b), EventResult::kApplied}}, ab, 2},
      {"removed middle block cuts the prefix",
       {{Stored(1, 1, ab), EventResult::kApplied},
        {Removed(1, 2, std::span(a).subspan(1)), EventResult::kApplied}},
       ab,
       1},
      {"cleared", {{Stored(1, 1, ab), EventResult::kApplied}, {Cleared(1, 2), EventResult::kApplied}}, ab, 0},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    PrefixIndex index;
    ASSERT_TRUE(index.AddWorker(0, 1).ok());
    for (size_t i = 0; i < c.events.size(); ++i) {
      Result<EventResult> r = index.Apply(0, c.events[i].view);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_EQ(*r, c.events[i].want) << "event " << i << ": got " << EventResultName(*r);
    }
    EXPECT_EQ(OverlapOf(index, 0, c.query), c.want_overlap);
  }
}

TEST(PrefixIndexTest, SnapshotReplacesEntriesAndResumesEvents) {
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0, 1).ok());
  const std::vector<uint64_t> q = Chain(0, 6);
  ASSERT_EQ(*index.Apply(0, Stored(1, 1, std::span(q).first(2))), EventResult::kApplied);
  ASSERT_EQ(*index.Apply(0, Stored(1, 5, std::span(q).subspan(2, 1))), EventResult::kNeedsSnapshot);
  // The worker's snapshot at event 10: blocks 0..3 (not the stale view).
  Result<EventResult> r = index.ApplySnapshot(0, 1, 10, std::span(q).first(4));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, EventResult::kApplied);
  EXPECT_EQ(OverlapOf(index, 0, q), 4u);
  EXPECT_EQ(*index.Apply(0, Stored(1, 10, std::span(q).subspan(4))), EventResult::kDuplicate);
  EXPECT_EQ(*index.Apply(0, Stored(1, 11, std::span(q).subspan(4))), EventResult::kApplied);
  EXPECT_EQ(OverlapOf(index, 0, q), 6u);
  // A restart, then a snapshot from the new epoch; the old epoch's snapshot
  // arriving late is refused.
  EXPECT_EQ(*index.Apply(0, Stored(9, 3, q)), EventResult::kNeedsSnapshot);
  EXPECT_EQ(OverlapOf(index, 0, q), 0u);
  EXPECT_EQ(*index.ApplySnapshot(0, 9, 3, std::span(q).first(1)), EventResult::kApplied);
  EXPECT_EQ(*index.ApplySnapshot(0, 1, 12, q), EventResult::kStaleEpoch);
  EXPECT_EQ(OverlapOf(index, 0, q), 1u);
}

TEST(PrefixIndexTest, RemovedWorkerIsForgottenAndItsLateEventsAreRefused) {
  PrefixIndex index;
  const std::vector<uint64_t> q = Chain(0, 8);
  ASSERT_TRUE(index.AddWorker(0, 1).ok());
  ASSERT_TRUE(index.AddWorker(1, 1).ok());
  ASSERT_EQ(*index.Apply(0, Stored(1, 1, q)), EventResult::kApplied);
  ASSERT_EQ(*index.Apply(1, Stored(1, 1, q)), EventResult::kApplied);
  ASSERT_TRUE(index.RemoveWorker(0).ok());
  EXPECT_EQ(index.BlocksOf(0), 0u);
  EXPECT_EQ(OverlapOf(index, 0, q), 0u);
  EXPECT_EQ(OverlapOf(index, 1, q), 8u);
  EXPECT_EQ(index.Apply(0, Stored(1, 2, q)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(index.RemoveWorker(0).code(), StatusCode::kNotFound);
  // The id goes to a new worker (epoch 2): the old one's late events are stale.
  ASSERT_TRUE(index.AddWorker(0, 2).ok());
  EXPECT_EQ(*index.Apply(0, Stored(1, 2, q)), EventResult::kStaleEpoch);
  EXPECT_EQ(*index.Apply(0, Stored(2, 1, std::span(q).first(3))), EventResult::kApplied);
  EXPECT_EQ(OverlapOf(index, 0, q), 3u);
  EXPECT_EQ(index.AddWorker(0, 3).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(index.AddWorker(kMaxWorkers, 3).code(), StatusCode::kInvalidArgument);
}

TEST(PrefixIndexTest, TenantsWithTheSamePromptDoNotShareBlocks) {
  HashContext a{.model_id = "m", .fleet_salt = "s", .tenant_salt = "tenant-a"};
  HashContext b = a;
  b.tenant_salt = "tenant-b";
  std::vector<uint32_t> tokens(16 * 8);
  std::iota(tokens.begin(), tokens.end(), 1000u);
  const std::vector<uint64_t> ha = HashBlocks(RootHash(a), tokens, 16);
  const std::vector<uint64_t> hb = HashBlocks(RootHash(b), tokens, 16);
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0, 1).ok());
  ASSERT_EQ(*index.Apply(0, Stored(1, 1, ha)), EventResult::kApplied);
  EXPECT_EQ(OverlapOf(index, 0, ha), 8u);
  EXPECT_EQ(OverlapOf(index, 0, hb), 0u);
}

// Writers apply events for their own workers (all storing one shared chain,
// so they contend on the same entries) while readers look up; one more
// thread keeps adding and removing a worker (shard scans). Chains are
// stored in order and never removed, so each reader must see every
// writer's overlap never decrease, and the end state must be complete.
void ConcurrentApplyAndLookup(uint64_t reserve, bool in_order) {
  constexpr uint64_t kBlocks = 3000, kPerEvent = 10;
  constexpr WorkerId kWriters = 3, kChurn = 10;
  PrefixIndex index;
  index.Reserve(reserve);
  ASSERT_EQ(index.InOrderWrites(), in_order);
  const std::vector<uint64_t> chain = Chain(0, kBlocks);
  for (WorkerId w = 0; w < kWriters; ++w) ASSERT_TRUE(index.AddWorker(w, 1).ok());
  std::atomic<int> writers_left{kWriters};
  std::atomic<bool> failed{false};
  std::vector<std::jthread> threads;
  for (WorkerId w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      for (uint64_t e = 0; e < kBlocks / kPerEvent; ++e) {
        auto r = index.Apply(w, Stored(1, e + 1, std::span(chain).subspan(e * kPerEvent, kPerEvent)));
        if (!r.ok() || *r != EventResult::kApplied) failed = true;
      }
      --writers_left;
    });
  }
  threads.emplace_back([&] {
    for (uint64_t epoch = 1; writers_left > 0 && epoch < 200; ++epoch) {
      if (!index.AddWorker(kChurn, epoch).ok()) failed = true;
      if (!index.Apply(kChurn, Stored(epoch, 1, std::span(chain).first(500))).ok()) failed = true;
      if (!index.RemoveWorker(kChurn).ok()) failed = true;
    }
  });
  std::vector<std::vector<uint32_t>> last(2, std::vector<uint32_t>(kWriters, 0));
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      for (int i = 0; i < 100000 && writers_left > 0; ++i) {
        OverlapBlocks out;
        index.Overlap(chain, &out);
        for (WorkerId w = 0; w < kWriters; ++w) {
          if (out[w] < last[r][w]) failed = true;
          last[r][w] = out[w];
        }
      }
    });
  }
  threads.clear();  // joins
  EXPECT_FALSE(failed);
  OverlapBlocks out;
  index.Overlap(chain, &out);
  for (WorkerId w = 0; w < kWriters; ++w) EXPECT_EQ(out[w], kBlocks);
  EXPECT_EQ(out[kChurn], 0u);
  EXPECT_EQ(index.BlocksOf(kChurn), 0u);
  EXPECT_EQ(index.size(), kBlocks);
}

// Both write paths: writes in order under every shard's lock (small
// tables) and grouped by shard (the largest reservation).
TEST(PrefixIndexTest, ConcurrentApplyAndLookup) { ConcurrentApplyAndLookup(0, true); }
TEST(PrefixIndexTest, ConcurrentApplyAndLookupOnTheLargestReservation) {
  ConcurrentApplyAndLookup(PrefixIndex::kReserveMaxHashes, false);
}

}  // namespace
}  // namespace tandem::router
