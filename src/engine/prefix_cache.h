// The prefix cache's bookkeeping: which full blocks are reusable by hash,
// and an LRU order over those no sequence holds (reference count zero), the
// ones eviction may take. Holds no KV and no reference counts itself; the
// BlockManager drives it.
//
// Thread-safety: none; owned by BlockManager, which runs under the engine lock.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

namespace tandem::engine {

class PrefixCache {
 public:
  explicit PrefixCache(uint32_t num_blocks);

  // Block registered under `hash`, if any.
  std::optional<uint32_t> Lookup(uint64_t hash) const;
  // False (and no change) when `hash` is already registered.
  bool Insert(uint64_t hash, uint32_t block);
  void Erase(uint64_t hash);
  size_t size() const { return by_hash_.size(); }

  // LRU of evictable blocks: PushEvictable makes `block` the most recent.
  void PushEvictable(uint32_t block);
  void RemoveEvictable(uint32_t block);
  bool IsEvictable(uint32_t block) const { return in_lru_[block]; }
  // Least recently used evictable block, removed from the LRU.
  std::optional<uint32_t> PopLeastRecent();
  // The same without removing it.
  std::optional<uint32_t> LeastRecent() const {
    if (head_ == kNone) return std::nullopt;
    return head_;
  }
  uint32_t num_evictable() const { return num_evictable_; }

 private:
  static constexpr uint32_t kNone = UINT32_MAX;
  std::unordered_map<uint64_t, uint32_t> by_hash_;
  // Intrusive doubly linked list over block ids; head_ = least recent.
  std::vector<uint32_t> prev_, next_;  // [num_blocks]
  std::vector<bool> in_lru_;           // [num_blocks]
  uint32_t head_ = kNone, tail_ = kNone;
  uint32_t num_evictable_ = 0;
};

}  // namespace tandem::engine
