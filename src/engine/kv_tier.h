// KV memory tiers (docs/engine.md, "KV tiers"): the device pool the
// kernels compute on, and the lower tiers committed blocks move down to
// when the tier above evicts them: host memory, then disk. A block is
// identified in every tier by the same chained content hash (which folds in
// the hash context and the tenant salt) and carries its token ids, which a
// lookup compares, exactly as in the device tier.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace tandem::engine {

enum class KvTier : uint8_t { kDevice = 0, kHost = 1, kDisk = 2 };
inline constexpr uint32_t kNumKvTiers = 3;

// "device" | "host" | "disk" (metric labels, logs).
constexpr std::string_view KvTierName(KvTier tier) {
  switch (tier) {
    case KvTier::kDevice: return "device";
    case KvTier::kHost: return "host";
    case KvTier::kDisk: return "disk";
  }
  return "unknown";
}

// What a lower tier keeps about a block besides its bytes.
struct TierBlockMeta {
  uint64_t hash = 0;
  uint64_t parent = 0;            // chain parent (root hash for block 0)
  std::vector<uint32_t> tokens;   // [block_size]
};

}  // namespace tandem::engine
