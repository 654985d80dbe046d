// PrefixCache's hash -> block table (session 29: open addressing in place
// of std::unordered_map): every operation agrees with a std::map model,
// including runs that wrap around the table's end, erases inside runs,
// hash 0, and growth past the size the block count gave.
#include "engine/prefix_cache.h"

#include <gtest/gtest.h>

#include <map>

#include "common/splitmix.h"

namespace tandem::engine {
namespace {

// Checks every key the model knows of, and a few it does not.
void ExpectSameAs(const PrefixCache& c, const std::map<uint64_t, uint32_t>& model,
                  const std::vector<uint64_t>& keys) {
  ASSERT_EQ(c.size(), model.size());
  for (uint64_t k : keys) {
    const auto it = model.find(k);
    const auto got = c.Lookup(k);
    if (it == model.end()) {
      EXPECT_FALSE(got.has_value()) << k;
    } else {
      ASSERT_TRUE(got.has_value()) << k;
      EXPECT_EQ(*got, it->second) << k;
    }
  }
}

// Keys crowded onto a few home slots at the end of any table up to 2^16
// slots (low 16 bits 0xFFFF - x, x < homes), so runs are long, overlap and
// wrap around to the table's start.
std::vector<uint64_t> CrowdedKeys(size_t n, uint64_t homes, uint64_t salt) {
  std::vector<uint64_t> keys;
  uint64_t s = salt;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = SplitMix64Next(s);
    keys.push_back((r & ~uint64_t{0xFFFF}) | (0xFFFF - r % homes));
  }
  keys.push_back(0);  // hash 0 is a key like any other
  return keys;
}

TEST(PrefixCache, AgreesWithAMapThroughInsertsErasesAndGrowth) {
  for (const uint32_t num_blocks : {4u, 64u}) {
    SCOPED_TRACE(num_blocks);
    PrefixCache c(num_blocks);
    std::map<uint64_t, uint32_t> model;
    const auto keys = CrowdedKeys(300, 6, num_blocks);
    uint64_t s = 99;
    for (int op = 0; op < 20000; ++op) {
      const uint64_t r = SplitMix64Next(s);
      const uint64_t k = keys[r % keys.size()];
      const uint32_t block = static_cast<uint32_t>(r >> 40);
      if ((r >> 8) % 3 != 0) {
        const bool fresh = model.emplace(k, block).second;
        EXPECT_EQ(c.Insert(k, block), fresh) << k;  // a second insert changes nothing
      } else {
        model.erase(k);
        c.Erase(k);  // also of keys that are not there
      }
      if (op % 500 == 0) ExpectSameAs(c, model, keys);
    }
    ExpectSameAs(c, model, keys);
    // Empty it: nothing is left behind.
    for (uint64_t k : keys) c.Erase(k);
    EXPECT_EQ(c.size(), 0u);
    for (uint64_t k : keys) EXPECT_FALSE(c.Lookup(k).has_value());
    // And it fills again past its first size (growth) with every key found.
    model.clear();
    for (uint32_t i = 0; i < keys.size(); ++i) {
      if (model.emplace(keys[i], i).second) {
        EXPECT_TRUE(c.Insert(keys[i], i));
      }
    }
    ExpectSameAs(c, model, keys);
  }
}

// PopLeastRecent(n, out) (session 51: an allocation's evictions in one
// batch) takes what n single pops take, and leaves the LRU as they leave it:
// driven alongside a cache that pops one at a time through pushes, removals
// and batches of every size, the empty list included.
TEST(PrefixCache, BatchPopAgreesWithSinglePops) {
  constexpr uint32_t kBlocks = 40;
  PrefixCache batch(kBlocks), single(kBlocks);
  uint64_t s = 5;
  for (int op = 0; op < 4000; ++op) {
    const uint64_t r = SplitMix64Next(s);
    const uint32_t block = static_cast<uint32_t>(r % kBlocks);
    switch ((r >> 20) % 3) {
      case 0:
      case 1:  // make a block the most recent (removing it first when listed)
        if (batch.IsEvictable(block)) {
          batch.RemoveEvictable(block);
          single.RemoveEvictable(block);
        }
        batch.PushEvictable(block);
        single.PushEvictable(block);
        break;
      default: {  // pop a batch: sometimes all of them, sometimes none
        const uint32_t n = static_cast<uint32_t>((r >> 32) % (batch.num_evictable() + 1));
        std::vector<uint32_t> got = {777};  // appended to, not replaced
        batch.PopLeastRecent(n, got);
        std::vector<uint32_t> want = {777};
        for (uint32_t i = 0; i < n; ++i) want.push_back(*single.PopLeastRecent());
        ASSERT_EQ(got, want) << "op " << op;
      }
    }
    ASSERT_EQ(batch.num_evictable(), single.num_evictable());
    ASSERT_EQ(batch.LeastRecent(), single.LeastRecent());
    for (uint32_t b = 0; b < kBlocks; ++b) ASSERT_EQ(batch.IsEvictable(b), single.IsEvictable(b));
  }
  // The whole order is the same: single pops of what is left agree.
  while (auto b = single.PopLeastRecent()) EXPECT_EQ(batch.PopLeastRecent(), b);
  EXPECT_FALSE(batch.PopLeastRecent().has_value());
}

}  // namespace
}  // namespace tandem::engine
