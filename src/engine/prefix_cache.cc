#include "engine/prefix_cache.h"

#include <utility>

#include "common/check.h"

namespace tandem::engine {

PrefixCache::PrefixCache(uint32_t num_blocks)
    : prev_(num_blocks, kNone), next_(num_blocks, kNone), in_lru_(num_blocks, false) {
  size_t n = 16;
  while (n < 2 * size_t{num_blocks}) n *= 2;
  slots_.resize(n);
  mask_ = n - 1;
}

size_t PrefixCache::SlotOf(uint64_t hash) const {
  size_t i = hash & mask_;
  while (slots_[i].key != 0 && slots_[i].key != hash) i = (i + 1) & mask_;
  return i;
}

std::optional<uint32_t> PrefixCache::Lookup(uint64_t hash) const {
  if (hash == 0) return has_zero_ ? std::optional<uint32_t>(zero_block_) : std::nullopt;
  const Slot& s = slots_[SlotOf(hash)];
  if (s.key == 0) return std::nullopt;
  return s.block;
}

bool PrefixCache::Insert(uint64_t hash, uint32_t block) {
  if (hash == 0) {
    if (has_zero_) return false;
    has_zero_ = true;
    zero_block_ = block;
    return true;
  }
  size_t i = SlotOf(hash);
  if (slots_[i].key == hash) return false;
  if (2 * (size_ + 1) > slots_.size()) {
    Grow();
    i = SlotOf(hash);
  }
  slots_[i] = {hash, block};
  ++size_;
  return true;
}

void PrefixCache::Erase(uint64_t hash) {
  if (hash == 0) {
    has_zero_ = false;
    return;
  }
  size_t i = SlotOf(hash);
  if (slots_[i].key == 0) return;
  // Backward shift: move each later entry of the run whose home slot does
  // not lie in (i, j] into the hole, until the run ends.
  for (size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
    const size_t home = slots_[j].key & mask_;
    const bool stays = i < j ? (home > i && home <= j) : (home > i || home <= j);
    if (stays) continue;
    slots_[i] = slots_[j];
    i = j;
  }
  slots_[i] = Slot{};
  --size_;
}

void PrefixCache::Grow() {
  const std::vector<Slot> old = std::exchange(slots_, std::vector<Slot>(slots_.size() * 2));
  mask_ = slots_.size() - 1;
  for (const Slot& s : old) {
    if (s.key != 0) slots_[SlotOf(s.key)] = s;
  }
}

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

void PrefixCache::PopLeastRecent(uint32_t n, std::vector<uint32_t>& out) {
  TANDEM_CHECK(n <= num_evictable_, "{} blocks asked of {} evictable", n, num_evictable_);
  // Unlinked as one run off the head: only the run's last block's successor
  // changes, instead of each block's.
  uint32_t b = head_;
  for (uint32_t i = 0; i < n; ++i) {
    out.push_back(b);
    const uint32_t next = next_[b];
    prev_[b] = next_[b] = kNone;
    in_lru_[b] = false;
    b = next;
  }
  head_ = b;
  if (b != kNone)
    prev_[b] = kNone;
  else
    tail_ = kNone;
  num_evictable_ -= n;
}

}  // namespace tandem::engine
