// The host-memory KV tier: `capacity` slots of one block's bytes each, a
// hash -> slot map with token ids, and an LRU over the slots. Blocks the
// device tier evicts are copied in; a prefix hit copies a block back into a
// device block (onboarding) and frees its slot (host and device hold
// disjoint sets). When full, the least recently used slot is handed to the
// tier below (TieredKvStore does that) before it is reused.
//
// Memory: from a KvPoolAllocator. The CPU and sim backends use anonymous
// mappings (pages touched only when a slot is first written); a CUDA build
// passes pinned host memory (cudaHostAlloc) so that onboarding is one
// cudaMemcpyAsync per block on a copy stream.
//
// Thread-safety: none; owned by TieredKvStore, which runs under the engine
// lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/kv_pool.h"
#include "engine/kv_tier.h"
#include "engine/prefix_cache.h"

namespace tandem::engine {

// Anonymous private mapping (MAP_NORESERVE), 64-byte aligned, untouched
// until written: a large host tier costs memory only as it fills.
class MappedKvAllocator final : public KvPoolAllocator {
 public:
  MappedKvAllocator() = default;
  ~MappedKvAllocator() override;
  MappedKvAllocator(const MappedKvAllocator&) = delete;
  MappedKvAllocator& operator=(const MappedKvAllocator&) = delete;
  Result<std::span<std::byte>> Allocate(size_t bytes) override;

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class HostKvTier {
 public:
  // `allocator` is borrowed (must outlive the tier); null: a MappedKvAllocator
  // owned by the tier.
  static Result<std::unique_ptr<HostKvTier>> Create(uint32_t capacity, size_t block_bytes,
                                                    uint32_t block_size,
                                                    KvPoolAllocator* allocator = nullptr);

  uint32_t capacity() const { return capacity_; }
  uint32_t size() const { return capacity_ - static_cast<uint32_t>(free_.size()); }
  bool full() const { return free_.empty(); }
  size_t block_bytes() const { return block_bytes_; }

  // Slot of `hash` when its stored tokens equal `tokens`.
  std::optional<uint32_t> Find(uint64_t hash, std::span<const uint32_t> tokens) const;
  bool Contains(uint64_t hash) const { return index_.Lookup(hash).has_value(); }

  // Copies a block in as the most recently used. Requires !full() and the
  // hash absent.
  void Insert(const TierBlockMeta& meta, std::span<const std::byte> bytes);
  // The least recently used slot (to move down before Erase), if any.
  std::optional<uint32_t> LeastRecent() const;
  const TierBlockMeta& meta(uint32_t slot) const { return meta_[slot]; }
  std::span<const std::byte> bytes(uint32_t slot) const {
    return {base_ + size_t{slot} * block_bytes_, block_bytes_};
  }
  // XXH3-64 of the block as it was inserted (the KV plane's end-to-end
  // checksum, docs/failure-handling.md); checked when it is read back.
  uint64_t checksum(uint32_t slot) const { return sums_[slot]; }
  // Whether the slot's bytes still hash to checksum(slot).
  bool Verify(uint32_t slot) const;
  // Frees the slot of `hash` (no-op when absent).
  void Erase(uint64_t hash);
  // Every block held (hash, parent).
  std::vector<std::pair<uint64_t, uint64_t>> Entries() const;

 private:
  HostKvTier(uint32_t capacity, size_t block_bytes);

  const uint32_t capacity_;
  const size_t block_bytes_;
  std::unique_ptr<MappedKvAllocator> own_allocator_;
  std::byte* base_ = nullptr;          // [capacity][block_bytes]
  PrefixCache index_;                  // hash -> slot, LRU over occupied slots
  std::vector<TierBlockMeta> meta_;    // [capacity]
  std::vector<uint64_t> sums_;         // [capacity] XXH3-64 at insert
  std::vector<uint32_t> free_;         // free slots; back() used next
};

}  // namespace tandem::engine
