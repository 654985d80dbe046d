// The decode stream's handle table (common/handle_table.h) against
// std::unordered_map: the same entries after every insert, take and find,
// for the proxy's own handles (consecutive) and for keys that all share a
// home slot (every probe run long, every erase shifting).
#include "common/handle_table.h"

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <unordered_map>
#include <vector>

namespace tandem::proxy {
namespace {

// Runs `ops` random operations on both tables over keys from `key_of`
// (an index in [0, key_space)), checking every result and, now and then,
// every entry.
template <class KeyOf>
void CheckAgainstMap(KeyOf key_of, size_t key_space, size_t ops, uint32_t seed) {
  HandleTable<std::shared_ptr<int>> table;
  std::unordered_map<uint64_t, int> ref;
  std::mt19937 rng(seed);
  for (size_t n = 0; n < ops; ++n) {
    const uint64_t key = key_of(rng() % key_space);
    const uint32_t op = rng() % 3;
    if (op == 0 && !ref.count(key)) {
      table.Insert(key, std::make_shared<int>(static_cast<int>(n)));
      ref[key] = static_cast<int>(n);
    } else if (op == 1) {
      std::shared_ptr<int> got = table.Take(key);
      auto it = ref.find(key);
      ASSERT_EQ(got != nullptr, it != ref.end()) << "take " << key;
      if (got) {
        EXPECT_EQ(*got, it->second);
        ref.erase(it);
      }
    } else {
      std::shared_ptr<int>* got = table.Find(key);
      auto it = ref.find(key);
      ASSERT_EQ(got != nullptr, it != ref.end()) << "find " << key;
      if (got) {
        EXPECT_EQ(**got, it->second);
      }
    }
    ASSERT_EQ(table.size(), ref.size());
    if (n % 997 == 0) {
      size_t seen = 0;
      table.ForEach([&](uint64_t k, std::shared_ptr<int>& v) {
        ++seen;
        auto it = ref.find(k);
        ASSERT_NE(it, ref.end()) << k;
        EXPECT_EQ(*v, it->second);
      });
      EXPECT_EQ(seen, ref.size());
      for (const auto& [k, v] : ref) {
        auto* got = table.Find(k);
        ASSERT_NE(got, nullptr) << k;
        EXPECT_EQ(**got, v);
      }
    }
  }
}

TEST(DecodeMuxHandles, ConsecutiveHandlesMatchAMap) {
  CheckAgainstMap([](uint64_t i) { return i + 1; }, 3000, 60000, 1);
}

TEST(DecodeMuxHandles, HandlesSharingAHomeSlotMatchAMap) {
  // Multiples of 4096: one home slot until the table outgrows 4096 slots.
  CheckAgainstMap([](uint64_t i) { return (i + 1) * 4096; }, 200, 20000, 2);
}

TEST(DecodeMuxHandles, WrappingProbeRunsMatchAMap) {
  // Homes at the table's last slots: runs wrap around to slot 0.
  CheckAgainstMap([](uint64_t i) { return 62 + (i % 2) + 64 * (i / 2); }, 40, 20000, 3);
}

TEST(DecodeMuxHandles, ZeroIsNeverFoundAndTakeOfAnAbsentHandleIsEmpty) {
  HandleTable<std::shared_ptr<int>> table;
  table.Insert(7, std::make_shared<int>(7));
  EXPECT_EQ(table.Find(0), nullptr);
  EXPECT_EQ(table.Take(8), nullptr);
  EXPECT_EQ(table.size(), 1u);
}

TEST(DecodeMuxHandles, TakeReleasesTheValueAndSwapMovesEverything) {
  HandleTable<std::shared_ptr<int>> table;
  auto v = std::make_shared<int>(1);
  std::weak_ptr<int> weak = v;
  table.Insert(1, std::move(v));
  for (uint64_t h = 2; h <= 200; ++h) table.Insert(h, std::make_shared<int>(static_cast<int>(h)));
  HandleTable<std::shared_ptr<int>> left;
  left.swap(table);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.Find(1), nullptr);
  EXPECT_EQ(left.size(), 200u);
  std::shared_ptr<int> one = left.Take(1);
  ASSERT_NE(one, nullptr);
  one.reset();
  EXPECT_TRUE(weak.expired());  // the table kept no copy
  EXPECT_EQ(**left.Find(200), 200);
}

// Clear (the decoder's batcher, every batch): nothing found after it, the
// values released, and the table refills (slots kept) as a fresh one.
TEST(DecodeMuxHandles, ClearEmptiesAndTheTableRefills) {
  HandleTable<std::shared_ptr<int>> table;
  auto v = std::make_shared<int>(1);
  std::weak_ptr<int> weak = v;
  table.Insert(1, std::move(v));
  for (uint64_t h = 2; h <= 100; ++h) table.Insert(h, std::make_shared<int>(static_cast<int>(h)));
  table.Clear();
  EXPECT_EQ(table.size(), 0u);
  EXPECT_TRUE(weak.expired());
  for (uint64_t h = 1; h <= 100; ++h) EXPECT_EQ(table.Find(h), nullptr) << h;
  table.Clear();  // empty: nothing to do
  for (uint64_t h = 101; h <= 140; ++h) table.Insert(h, std::make_shared<int>(static_cast<int>(h)));
  EXPECT_EQ(table.size(), 40u);
  for (uint64_t h = 101; h <= 140; ++h) EXPECT_EQ(**table.Find(h), static_cast<int>(h));
  EXPECT_EQ(table.Find(100), nullptr);
}

}  // namespace
}  // namespace tandem::proxy
