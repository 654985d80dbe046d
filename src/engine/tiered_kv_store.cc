#include "engine/tiered_kv_store.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace tandem::engine {

TieredKvStore::TieredKvStore(std::unique_ptr<HostKvTier> host, std::unique_ptr<DiskKvTier> disk,
                             KvEventPublisher* events)
    : host_(std::move(host)), disk_(std::move(disk)), events_(events) {}

void TieredKvStore::Note(KvEventKind kind, KvTier tier, uint64_t hash, uint64_t parent) {
  if (events_ == nullptr) return;
  if (!pending_.empty() && pending_.back().kind == kind && pending_.back().tier == tier) {
    pending_.back().hashes.push_back(hash);
    return;
  }
  pending_.push_back({kind, tier, parent, {hash}});
}

void TieredKvStore::Flush(bool quiet) {
  if (events_ == nullptr) return;
  for (Pending& p : pending_) {
    if (p.kind == KvEventKind::kStored) {
      events_->PublishStored(std::move(p.hashes), p.parent, p.tier, quiet);
    } else {
      events_->PublishRemoved(std::move(p.hashes), p.tier, quiet);
    }
  }
  pending_.clear();
}

void TieredKvStore::ToDisk(const TierBlockMeta& meta, std::span<const std::byte> bytes) {
  if (disk_->Contains(meta.hash)) return;  // inclusive: already there
  if (disk_->full()) {
    const uint64_t victim = *disk_->LeastRecent();
    disk_->Erase(victim);
    ++evictions_[static_cast<size_t>(KvTier::kDisk)];
    Note(KvEventKind::kRemoved, KvTier::kDisk, victim, 0);
  }
  if (Status s = disk_->Write(meta, bytes); !s.ok()) {
    spdlog::warn("disk KV tier: block {:016x} not kept: {}", meta.hash, s.ToString());
    return;
  }
  Note(KvEventKind::kStored, KvTier::kDisk, meta.hash, meta.parent);
}

void TieredKvStore::Offload(const TierBlockMeta& meta, std::span<const std::byte> bytes) {
  if (!host_) {
    if (disk_) ToDisk(meta, bytes);
    return;
  }
  if (host_->Contains(meta.hash)) return;
  if (host_->full()) {
    const uint32_t slot = *host_->LeastRecent();
    const TierBlockMeta& victim = host_->meta(slot);
    const uint64_t victim_hash = victim.hash;
    if (disk_) ToDisk(victim, host_->bytes(slot));
    host_->Erase(victim_hash);
    ++evictions_[static_cast<size_t>(KvTier::kHost)];
    Note(KvEventKind::kRemoved, KvTier::kHost, victim_hash, 0);
  }
  host_->Insert(meta, bytes);
  Note(KvEventKind::kStored, KvTier::kHost, meta.hash, meta.parent);
}

std::optional<KvTier> TieredKvStore::Find(uint64_t hash, std::span<const uint32_t> tokens) const {
  if (host_ && host_->Find(hash, tokens)) return KvTier::kHost;
  if (disk_ && disk_->Find(hash, tokens)) return KvTier::kDisk;
  return std::nullopt;
}

Status TieredKvStore::Load(uint64_t hash, std::span<const uint32_t> tokens,
                           std::span<std::byte> out, KvTier* from, uint64_t* parent) {
  if (host_) {
    if (auto slot = host_->Find(hash, tokens)) {
      auto src = host_->bytes(*slot);
      if (out.size() != src.size()) return InternalError("host KV tier: block size mismatch");
      if (!host_->Verify(*slot)) {
        // Never onboard bad KV: dropped, the caller recomputes it.
        host_->Erase(hash);
        Note(KvEventKind::kRemoved, KvTier::kHost, hash, 0);
        spdlog::error("host KV tier: block {:016x} failed its XXH3 checksum; dropped", hash);
        return DataLossError(fmt::format("host KV tier: block {:016x} failed its checksum", hash));
      }
      std::copy(src.begin(), src.end(), out.begin());
      *parent = host_->meta(*slot).parent;
      host_->Erase(hash);
      Note(KvEventKind::kRemoved, KvTier::kHost, hash, 0);
      *from = KvTier::kHost;
      return Status::Ok();
    }
  }
  if (disk_ && disk_->Find(hash, tokens)) {
    Status s = disk_->Read(hash, tokens, out);
    if (!s.ok()) {
      if (!disk_->Contains(hash)) Note(KvEventKind::kRemoved, KvTier::kDisk, hash, 0);
      return s;
    }
    *from = KvTier::kDisk;
    *parent = disk_->Parent(hash);
    return Status::Ok();
  }
  return NotFoundError(fmt::format("block {:016x} is in no lower KV tier", hash));
}

void TieredKvStore::DropHostCopy(uint64_t hash) {
  if (!host_ || !host_->Contains(hash)) return;
  host_->Erase(hash);
  Note(KvEventKind::kRemoved, KvTier::kHost, hash, 0);
}

void TieredKvStore::Clear() {
  if (host_) {
    for (const auto& [hash, parent] : host_->Entries()) host_->Erase(hash);
  }
  if (disk_) disk_->Clear();
  pending_.clear();  // the caller publishes `cleared`
}

void TieredKvStore::AppendTo(KvSnapshot* snap) const {
  if (host_) {
    for (const auto& [hash, parent] : host_->Entries()) snap->blocks.push_back({hash, parent, KvTier::kHost});
  }
  if (disk_) {
    for (const auto& [hash, parent] : disk_->Entries()) snap->blocks.push_back({hash, parent, KvTier::kDisk});
  }
}

double TieredKvStore::usage_ratio(KvTier tier) const {
  if (tier == KvTier::kHost && host_) return static_cast<double>(host_->size()) / host_->capacity();
  if (tier == KvTier::kDisk && disk_) return static_cast<double>(disk_->size()) / static_cast<double>(disk_->capacity());
  return 0;
}

}  // namespace tandem::engine
