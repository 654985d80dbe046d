// Block manager: reference-counted KV blocks, free list and prefix cache
// (DESIGN.md section 4).
//
// A block is in exactly one of these states:
//   free       ref 0, no hash, on the free list
//   in use     ref > 0 (held by sequences / reservations); may be cached
//   cached     ref 0 with a hash: reusable, on the LRU, evicted when needed
// A full block whose KV is final is "committed": it gets its chained hash
// and keeps its token ids; a later lookup reuses it only when both the hash
// and the tokens match. Committing publishes stored(...), eviction
// removed(...), ClearCache cleared.
//
// With lower tiers attached (AttachTiers: host memory, disk; see
// tiered_kv_store.h) an evicted committed block moves down instead of
// vanishing, and a prefix walk that misses on the device continues in the
// lower tiers: such a block is onboarded (copied into a fresh device block
// and committed there) by AcquireCachedPrefix.
//
// Thread-safety: none; the engine calls it under its lock.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/kv_events.h"
#include "engine/kv_pool.h"
#include "engine/kv_tier.h"
#include "engine/prefix_cache.h"
#include "engine/tiered_kv_store.h"

namespace tandem::engine {

// Where the blocks of one prefix hit came from, and how long onboarding
// the lower-tier ones took (wall time of the copies / reads).
struct PrefixHit {
  std::array<uint32_t, kNumKvTiers> blocks{};  // [tier]
  double onboard_seconds = 0;
  uint32_t total() const { return blocks[0] + blocks[1] + blocks[2]; }
  uint32_t onboarded() const { return blocks[1] + blocks[2]; }
};

class BlockManager {
 public:
  // `events` is borrowed and may be null (no events).
  BlockManager(uint32_t num_blocks, uint32_t block_size, KvEventPublisher* events);

  uint32_t num_blocks() const { return num_blocks_; }
  uint32_t block_size() const { return block_size_; }
  // Blocks with reference count zero: free or cached-evictable. Equals
  // num_blocks() when nothing is held.
  uint32_t num_free_blocks() const {
    return static_cast<uint32_t>(free_.size()) + cache_.num_evictable();
  }
  // Blocks on the free list (no KV kept).
  uint32_t num_empty_blocks() const { return static_cast<uint32_t>(free_.size()); }
  uint32_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  uint32_t num_cached_blocks() const { return static_cast<uint32_t>(cache_.size()); }
  uint32_t ref_count(uint32_t block) const { return blocks_[block].ref; }

  // Lower tiers below the device pool `pool` (borrowed; its blocks are the
  // ones this manager hands out). `on_onboard(seconds)` is called after
  // each acquisition that onboarded blocks (may be empty).
  void AttachTiers(std::unique_ptr<TieredKvStore> tiers, const KvPool* pool,
                   std::function<void(double)> on_onboard = {});
  const TieredKvStore* tiers() const { return tiers_.get(); }
  // Counters by tier (engine/kv_tier.h): evicted blocks (device: evicted
  // from the pool, moved down or dropped) and prefix-hit tokens counted by
  // CountHit.
  uint64_t evictions(KvTier tier) const;
  uint64_t hit_tokens(KvTier tier) const { return hit_tokens_[static_cast<size_t>(tier)]; }
  // Counts an admitted request's hit (the scheduler, Reserve).
  void CountHit(const PrefixHit& hit);
  bool is_committed(uint32_t block) const { return blocks_[block].committed; }

  // Number of leading blocks of `tokens` (full blocks only, at most
  // max_blocks) whose hash and tokens are cached in some tier. hashes[i] is
  // the chained hash of block i.
  uint32_t CountCachedPrefix(std::span<const uint64_t> hashes, std::span<const uint32_t> tokens,
                             uint32_t max_blocks) const;
  // The same blocks, each with its reference count raised; lower-tier ones
  // are onboarded into fresh device blocks first (the walk stops early when
  // no device block is free or a lower-tier read fails). `hit` (optional)
  // says which tier each came from.
  std::vector<uint32_t> AcquireCachedPrefix(std::span<const uint64_t> hashes,
                                            std::span<const uint32_t> tokens, uint32_t max_blocks,
                                            PrefixHit* hit = nullptr);

  bool CanAllocate(uint32_t n) const { return n <= num_free_blocks(); }
  // `n` fresh blocks (ref 1), all or nothing: evicts least recently used
  // cached blocks when the free list runs out. `quiet_evictions`: the
  // evictions' events (and their lower tiers' moves) are quiet
  // (KvEventPublisher::PublishRemoved): the room for a prompt's prefill
  // chunk (the scheduler) or a reservation (Engine::Reserve), whose
  // events leave with the prompt's blocks.
  Result<std::vector<uint32_t>> Allocate(uint32_t n, bool quiet_evictions = false);
  // Raises the reference count of held blocks (sharing).
  void Retain(std::span<const uint32_t> blocks);
  // Drops one reference from each block, last block first, so a released
  // sequence's tail is evicted before its head.
  void Release(std::span<const uint32_t> blocks);

  // Registers full, final blocks of one sequence. blocks[i] holds tokens
  // [i*block_size, (i+1)*block_size) of `tokens`, hashed as hashes[i]; the
  // chain parent of hashes[first] is hashes[first-1] or `root_hash`. Blocks
  // already committed are skipped; a block whose hash another block already
  // holds stays private. One stored event per contiguous run; `quiet`: the
  // events (and the lower tiers' moves) are quiet (KvEventPublisher).
  void Commit(std::span<const uint32_t> blocks, std::span<const uint64_t> hashes,
              std::span<const uint32_t> tokens, uint32_t first, uint32_t count, uint64_t root_hash,
              bool quiet = false);

  // Drops every cached block nobody holds and publishes `cleared`. Blocks in
  // use lose their hashes too (they return to the free list when released).
  void ClearCache();

  // Every committed block (hash, parent) for a resync; call under the same
  // lock as Commit so that it matches the publisher's last event id.
  KvSnapshot Snapshot() const;

 private:
  struct Block {
    uint32_t ref = 0;
    bool committed = false;
    uint64_t hash = 0;
    uint64_t parent = 0;
    std::vector<uint32_t> tokens;  // [block_size] when committed
  };
  bool Matches(uint32_t block, std::span<const uint32_t> tokens) const;
  void Evict(uint32_t block, std::vector<uint64_t>& removed);
  // Evict of each victim in order, their memory asked for ahead.
  void EvictBatch(std::span<const uint32_t> victims, std::vector<uint64_t>& removed);
  static constexpr size_t kPrefetchLead = 8;
  // One block off the free list or evicted (requires CanAllocate(1)).
  uint32_t TakeBlock(std::vector<uint64_t>& removed);
  void FlushTierEvents(bool quiet = false);

  const uint32_t num_blocks_;
  const uint32_t block_size_;
  KvEventPublisher* events_;
  std::vector<Block> blocks_;     // [num_blocks]
  std::vector<uint32_t> free_;    // stack; back() is allocated next
  PrefixCache cache_;
  std::unique_ptr<TieredKvStore> tiers_;  // null: device only
  const KvPool* pool_ = nullptr;
  std::function<void(double)> on_onboard_;
  uint64_t device_evictions_ = 0;
  std::array<uint64_t, kNumKvTiers> hit_tokens_{};
};

}  // namespace tandem::engine
