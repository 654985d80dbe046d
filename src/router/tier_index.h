// TierIndex: which workers hold which blocks in their host-memory and disk
// KV tiers (docs/engine.md, "KV tiers"; docs/router.md, "Tiers"), fed by
// the tier-tagged KV events the PrefixIndex passes over (it keeps the
// device tier and the event-id bookkeeping; the Router forwards an applied
// host/disk event here).
//
// Extend() continues each worker's device overlap into its lower tiers: the
// blocks right after the device prefix that the worker holds on host or
// disk (the engine onboards them on a hit), counted by tier.
//
// Thread-safety: every method may be called from any thread; one
// std::shared_mutex (writers exclusive, Extend shared). The index is empty
// (and Extend returns at once) in fleets without lower tiers.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <shared_mutex>
#include <span>
#include <unordered_map>

#include "router/prefix_index.h"
#include "router/types.h"

namespace tandem::router {

// Per worker: lower-tier blocks right after its device overlap.
struct TierOverlap {
  std::array<uint32_t, kMaxWorkers> host{};
  std::array<uint32_t, kMaxWorkers> disk{};
};

class TierIndex {
 public:
  // The worker's events now come from `epoch`: a different one than before
  // drops its entries (the worker restarted; its snapshot refills them).
  void SetEpoch(WorkerId worker, uint64_t epoch);
  // One applied host/disk stored or removed event, or a cleared event (any tier).
  void Apply(WorkerId worker, KvEventKind kind, KvTier tier, std::span<const uint64_t> hashes);
  // Drops the worker's entries (cleared, removed worker).
  void Clear(WorkerId worker);
  // Replaces the worker's entries (a snapshot).
  void Replace(WorkerId worker, uint64_t epoch, std::span<const uint64_t> host,
               std::span<const uint64_t> disk);

  // out->host[w] / out->disk[w]: for each worker holding lower-tier blocks,
  // the blocks from device[w] on that it holds on host / disk, up to the
  // first it holds nowhere (host preferred when both). Others: 0. One pass
  // over the blocks, one map lookup each, whatever the number of workers.
  void Extend(std::span<const uint64_t> block_hashes, const OverlapBlocks& device,
              TierOverlap* out) const;

  // (hash, worker) pairs in the tier (tests).
  uint64_t BlocksOf(WorkerId worker, KvTier tier) const;
  bool empty() const { return total_.load(std::memory_order_relaxed) == 0; }

 private:
  struct Entry {
    WorkerMask host;
    WorkerMask disk;
  };
  void ClearLocked(WorkerId worker);
  void SetLocked(WorkerId worker, KvTier tier, uint64_t hash, bool on);

  mutable std::shared_mutex mu_;
  std::unordered_map<uint64_t, Entry> map_;          // guarded by mu_
  std::array<uint64_t, kMaxWorkers> epoch_{};        // guarded by mu_
  std::array<uint64_t, kMaxWorkers> count_{};        // guarded by mu_: entries per worker
  std::atomic<uint64_t> total_{0};                   // Σ count_
};

}  // namespace tandem::router
