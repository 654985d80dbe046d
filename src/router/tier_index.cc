#include "router/tier_index.h"

#include <mutex>

namespace tandem::router {

void TierIndex::SetLocked(WorkerId worker, KvTier tier, uint64_t hash, bool on) {
  if (on) {
    Entry& e = map_[hash];
    WorkerMask& m = tier == KvTier::kHost ? e.host : e.disk;
    if (m.Test(worker)) return;
    m.Set(worker);
    ++count_[worker];
    total_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  auto it = map_.find(hash);
  if (it == map_.end()) return;
  WorkerMask& m = tier == KvTier::kHost ? it->second.host : it->second.disk;
  if (!m.Test(worker)) return;
  m.Clear(worker);
  --count_[worker];
  total_.fetch_sub(1, std::memory_order_relaxed);
  if (!it->second.host.Any() && !it->second.disk.Any()) map_.erase(it);
}

void TierIndex::ClearLocked(WorkerId worker) {
  if (count_[worker] == 0) return;
  for (auto it = map_.begin(); it != map_.end();) {
    Entry& e = it->second;
    uint64_t n = 0;
    if (e.host.Test(worker)) ++n, e.host.Clear(worker);
    if (e.disk.Test(worker)) ++n, e.disk.Clear(worker);
    count_[worker] -= n;
    total_.fetch_sub(n, std::memory_order_relaxed);
    it = !e.host.Any() && !e.disk.Any() ? map_.erase(it) : std::next(it);
  }
}

void TierIndex::SetEpoch(WorkerId worker, uint64_t epoch) {
  if (worker >= kMaxWorkers) return;
  {
    std::shared_lock lock(mu_);
    if (epoch_[worker] == epoch) return;
  }
  std::unique_lock lock(mu_);
  if (epoch_[worker] == epoch) return;
  ClearLocked(worker);
  epoch_[worker] = epoch;
}

void TierIndex::Apply(WorkerId worker, KvEventKind kind, KvTier tier, std::span<const uint64_t> hashes) {
  if (worker >= kMaxWorkers) return;
  if (kind == KvEventKind::kCleared) {
    Clear(worker);
    return;
  }
  if (tier != KvTier::kHost && tier != KvTier::kDisk) return;
  std::unique_lock lock(mu_);
  for (uint64_t h : hashes) SetLocked(worker, tier, h, kind == KvEventKind::kStored);
}

void TierIndex::Clear(WorkerId worker) {
  if (worker >= kMaxWorkers) return;
  std::unique_lock lock(mu_);
  ClearLocked(worker);
}

void TierIndex::Replace(WorkerId worker, uint64_t epoch, std::span<const uint64_t> host,
                        std::span<const uint64_t> disk) {
  if (worker >= kMaxWorkers) return;
  std::unique_lock lock(mu_);
  ClearLocked(worker);
  epoch_[worker] = epoch;
  for (uint64_t h : host) SetLocked(worker, KvTier::kHost, h, true);
  for (uint64_t h : disk) SetLocked(worker, KvTier::kDisk, h, true);
}

void TierIndex::Extend(std::span<const uint64_t> hashes, const OverlapBlocks& device,
                       TierOverlap* out) const {
  out->host.fill(0);
  out->disk.fill(0);
  if (empty()) return;
  std::shared_lock lock(mu_);
  for (WorkerId w = 0; w < kMaxWorkers; ++w) {
    if (count_[w] == 0) continue;
    for (size_t i = device[w]; i < hashes.size(); ++i) {
      auto it = map_.find(hashes[i]);
      if (it == map_.end()) break;
      if (it->second.host.Test(w)) {
        ++out->host[w];
      } else if (it->second.disk.Test(w)) {
        ++out->disk[w];
      } else {
        break;
      }
    }
  }
}

uint64_t TierIndex::BlocksOf(WorkerId worker, KvTier tier) const {
  std::shared_lock lock(mu_);
  uint64_t n = 0;
  for (const auto& [h, e] : map_) n += (tier == KvTier::kHost ? e.host : e.disk).Test(worker) ? 1 : 0;
  return n;
}

}  // namespace tandem::router
