// The prefix cache's bookkeeping: which full blocks are reusable by hash,
// and an LRU order over those no sequence holds (reference count zero), the
// ones eviction may take. Holds no KV and no reference counts itself; the
// BlockManager drives it.
//
// Thread-safety: none; owned by BlockManager, which runs under the engine lock.
#pragma once

#include <cstdint>
#include <optional>
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
  // Asks for the cache line of `hash`'s home slot ahead of an Insert, Erase or
  // Lookup of it (a batch's later entries while this one is worked on).
  void Prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[hash & mask_], 1); }
  size_t size() const { return size_ + (has_zero_ ? 1 : 0); }

  // LRU of evictable blocks: PushEvictable makes `block` the most recent.
  void PushEvictable(uint32_t block);
  void RemoveEvictable(uint32_t block);
  bool IsEvictable(uint32_t block) const { return in_lru_[block]; }
  // Least recently used evictable block, removed from the LRU.
  std::optional<uint32_t> PopLeastRecent();
  // The `n` least recently used evictable blocks (n <= num_evictable()), in
  // that order, removed from the LRU: what n PopLeastRecent calls return.
  void PopLeastRecent(uint32_t n, std::vector<uint32_t>& out);
  // The same without removing it.
  std::optional<uint32_t> LeastRecent() const {
    if (head_ == kNone) return std::nullopt;
    return head_;
  }
  uint32_t num_evictable() const { return num_evictable_; }

 private:
  static constexpr uint32_t kNone = UINT32_MAX;
  // hash -> block: open addressing with linear probing over a power-of-two
  // table indexed by the hash's low bits (XXH3 outputs: uniform), key 0
  // marking an empty slot (hash 0 itself kept aside); erase shifts the
  // run back (no tombstones). Sized for twice the blocks (a block is
  // registered under one hash at most), so it never grows in use; it does
  // double past half full. Session 29: std::unordered_map's node per entry
  // and its bucket walk were 11 % of the workers' CPU on 8k-token prompts.
  struct Slot {
    uint64_t key = 0;
    uint32_t block = 0;
  };
  size_t SlotOf(uint64_t hash) const;  // hash's slot, or the empty one ending its run
  void Grow();
  std::vector<Slot> slots_;
  uint64_t mask_ = 0;
  size_t size_ = 0;  // occupied slots
  bool has_zero_ = false;
  uint32_t zero_block_ = 0;
  // Intrusive doubly linked list over block ids; head_ = least recent.
  std::vector<uint32_t> prev_, next_;  // [num_blocks]
  std::vector<bool> in_lru_;           // [num_blocks]
  uint32_t head_ = kNone, tail_ = kNone;
  uint32_t num_evictable_ = 0;
};

}  // namespace tandem::engine
