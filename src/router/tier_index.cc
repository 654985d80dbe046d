#include "router/tier_index.h"

#include <algorithm>
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
  // One pass over the blocks (one map lookup each): a worker joins at its
  // device overlap and drops out at the first block it holds in no tier.
  std::array<WorkerId, kMaxWorkers> joiners;  // [n]: workers with lower-tier blocks, by device overlap
  uint32_t n = 0;
  for (WorkerId w = 0; w < kMaxWorkers; ++w) {
    if (count_[w] != 0 && device[w] < hashes.size()) joiners[n++] = w;
  }
  std::sort(joiners.begin(), joiners.begin() + n,
            [&](WorkerId a, WorkerId b) { return device[a] < device[b]; });
  WorkerMask alive;
  uint32_t next = 0;
  for (size_t i = n > 0 ? device[joiners[0]] : hashes.size(); i < hashes.size(); ++i) {
    while (next < n && device[joiners[next]] == i) alive.Set(joiners[next++]);
    if (!alive.Any()) {
      if (next == n) break;
      continue;
    }
    auto it = map_.find(hashes[i]);
    if (it == map_.end()) {
      alive = WorkerMask{};
      continue;
    }
    const Entry& e = it->second;
    alive.ForEach([&](WorkerId w) {
      if (e.host.Test(w)) {
        ++out->host[w];
      } else if (e.disk.Test(w)) {
        ++out->disk[w];
      } else {
        alive.Clear(w);
      }
    });
  }
}

uint64_t TierIndex::BlocksOf(WorkerId worker, KvTier tier) const {
  std::shared_lock lock(mu_);
  uint64_t n = 0;
  for (const auto& [h, e] : map_) n += (tier == KvTier::kHost ? e.host : e.disk).Test(worker) ? 1 : 0;
  return n;
}

}  // namespace tandem::router
