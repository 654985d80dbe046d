// The tiers below the device pool (docs/engine.md, "KV tiers"): an optional
// host tier and an optional disk tier, driven by the BlockManager.
//   - Offload: a committed block the device evicts moves to the host tier;
//     when the host tier is full its least recently used block moves to the
//     disk tier (without a host tier, device evictions go to disk directly);
//     when the disk tier is full its least recently used file is deleted.
//   - Find / Load: a prefix walk that misses on the device continues here
//     (same hash, same token-id check); Load copies the block into a device
//     block. A host block leaves the host tier (it is on the device now); a
//     disk file stays (the disk tier is inclusive and survives restarts).
// Every move publishes KV events with the tier (stored/removed), in the
// order the moves happen, when Flush() is called.
//
// Thread-safety: none; the BlockManager calls it under the engine lock.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/disk_kv_tier.h"
#include "engine/host_kv_tier.h"
#include "engine/kv_events.h"
#include "engine/kv_tier.h"

namespace tandem::engine {

class TieredKvStore {
 public:
  // Either tier may be null (not configured). `events` is borrowed, may be null.
  TieredKvStore(std::unique_ptr<HostKvTier> host, std::unique_ptr<DiskKvTier> disk,
                KvEventPublisher* events);

  HostKvTier* host() const { return host_.get(); }
  DiskKvTier* disk() const { return disk_.get(); }

  // A committed block the device tier evicts (bytes valid for the call).
  void Offload(const TierBlockMeta& meta, std::span<const std::byte> bytes);
  // The highest lower tier holding `hash` with these token ids.
  std::optional<KvTier> Find(uint64_t hash, std::span<const uint32_t> tokens) const;
  // Copies the block into `out`; `*from` = the tier it came from. A failed
  // disk read (DATA_LOSS: the file is discarded) or a miss is an error and
  // nothing is copied.
  Status Load(uint64_t hash, std::span<const uint32_t> tokens, std::span<std::byte> out,
              KvTier* from, uint64_t* parent);
  // The device committed `hash` itself (computed again): a host copy goes.
  void DropHostCopy(uint64_t hash);
  // Drops every block of both tiers (disk files deleted).
  void Clear();
  // Publishes the events of the moves since the last Flush, in order
  // (quiet: KvEventPublisher::PublishStored).
  void Flush(bool quiet = false);
  // Appends every block of both tiers to a snapshot.
  void AppendTo(KvSnapshot* snapshot) const;

  // Blocks held / capacity (0 when the tier is off).
  double usage_ratio(KvTier tier) const;
  uint64_t evictions(KvTier tier) const { return evictions_[static_cast<size_t>(tier)]; }

 private:
  void Note(KvEventKind kind, KvTier tier, uint64_t hash, uint64_t parent);
  // Writes to disk, evicting its least recently used file when full.
  void ToDisk(const TierBlockMeta& meta, std::span<const std::byte> bytes);

  struct Pending {
    KvEventKind kind;
    KvTier tier;
    uint64_t parent;
    std::vector<uint64_t> hashes;
  };
  std::unique_ptr<HostKvTier> host_;
  std::unique_ptr<DiskKvTier> disk_;
  KvEventPublisher* events_;
  std::vector<Pending> pending_;
  std::array<uint64_t, kNumKvTiers> evictions_{};
};

}  // namespace tandem::engine
