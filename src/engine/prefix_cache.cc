#include "engine/prefix_cache.h"

#include "common/check.h"

namespace tandem::engine {

PrefixCache::PrefixCache(uint32_t num_blocks)
    : prev_(num_blocks, kNone), next_(num_blocks, kNone), in_lru_(num_blocks, false) {}

std::optional<uint32_t> PrefixCache::Lookup(uint64_t hash) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return std::nullopt;
  return it->second;
}

bool PrefixCache::Insert(uint64_t hash, uint32_t block) {
  return by_hash_.emplace(hash, block).second;
}

void PrefixCache::Erase(uint64_t hash) { by_hash_.erase(hash); }

void PrefixCache::PushEvictable(uint32_t block) {
  TANDEM_CHECK(!in_lru_[block], "block {} already evictable", block);
  in_lru_[block] = true;
  prev_[block] = tail_;
  next_[block] = kNone;
  if (tail_ != kNone) next_[tail_] = block;
  tail_ = block;
  if (head_ == kNone) head_ = block;
  ++num_evictable_;
}

void PrefixCache::RemoveEvictable(uint32_t block) {
  TANDEM_CHECK(in_lru_[block], "block {} not evictable", block);
  const uint32_t p = prev_[block], n = next_[block];
  if (p != kNone) next_[p] = n; else head_ = n;
  if (n != kNone) prev_[n] = p; else tail_ = p;
  prev_[block] = next_[block] = kNone;
  in_lru_[block] = false;
  --num_evictable_;
}

std::optional<uint32_t> PrefixCache::PopLeastRecent() {
  if (head_ == kNone) return std::nullopt;
  const uint32_t b = head_;
  RemoveEvictable(b);
  return b;
}

}  // namespace tandem::engine
