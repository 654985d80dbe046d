#include "engine/block_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "common/check.h"

namespace tandem::engine {

BlockManager::BlockManager(uint32_t num_blocks, uint32_t block_size, KvEventPublisher* events)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      events_(events),
      blocks_(num_blocks),
      cache_(num_blocks) {
  free_.reserve(num_blocks);
  for (uint32_t b = num_blocks; b > 0; --b) free_.push_back(b - 1);  // block 0 first
}

bool BlockManager::Matches(uint32_t block, std::span<const uint32_t> tokens) const {
  const Block& b = blocks_[block];
  return b.committed && std::equal(b.tokens.begin(), b.tokens.end(), tokens.begin(), tokens.end());
}

void BlockManager::AttachTiers(std::unique_ptr<TieredKvStore> tiers, const KvPool* pool,
                               std::function<void(double)> on_onboard) {
  TANDEM_CHECK(pool != nullptr && pool->num_blocks() == num_blocks_, "tiers need the device pool");
  tiers_ = std::move(tiers);
  pool_ = pool;
  on_onboard_ = std::move(on_onboard);
}

uint64_t BlockManager::evictions(KvTier tier) const {
  if (tier == KvTier::kDevice) return device_evictions_;
  return tiers_ ? tiers_->evictions(tier) : 0;
}

void BlockManager::CountHit(const PrefixHit& hit) {
  for (size_t t = 0; t < kNumKvTiers; ++t) hit_tokens_[t] += uint64_t{hit.blocks[t]} * block_size_;
}

void BlockManager::FlushTierEvents(bool quiet) {
  if (tiers_) tiers_->Flush(quiet);
}

uint32_t BlockManager::CountCachedPrefix(std::span<const uint64_t> hashes,
                                         std::span<const uint32_t> tokens,
                                         uint32_t max_blocks) const {
  const uint32_t limit = std::min<uint32_t>(
      {max_blocks, static_cast<uint32_t>(hashes.size()),
       static_cast<uint32_t>(tokens.size() / block_size_)});
  uint32_t n = 0;
  for (; n < limit; ++n) {
    auto toks = tokens.subspan(size_t{n} * block_size_, block_size_);
    auto block = cache_.Lookup(hashes[n]);
    if (block && Matches(*block, toks)) continue;
    if (tiers_ && tiers_->Find(hashes[n], toks)) continue;
    break;
  }
  return n;
}

std::vector<uint32_t> BlockManager::AcquireCachedPrefix(std::span<const uint64_t> hashes,
                                                        std::span<const uint32_t> tokens,
                                                        uint32_t max_blocks, PrefixHit* hit) {
  const uint32_t limit = std::min<uint32_t>(
      {max_blocks, static_cast<uint32_t>(hashes.size()),
       static_cast<uint32_t>(tokens.size() / block_size_)});
  PrefixHit local;
  std::vector<uint32_t> out;
  std::vector<uint64_t> removed;  // device evictions made room for onboarded blocks
  std::vector<uint64_t> run;      // onboarded blocks committed on the device, one stored event
  uint64_t run_parent = 0;
  auto flush_run = [&] {
    if (events_ != nullptr && !run.empty()) events_->PublishStored(std::move(run), run_parent);
    run.clear();
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < limit; ++i) {
    auto toks = tokens.subspan(size_t{i} * block_size_, block_size_);
    auto cached = cache_.Lookup(hashes[i]);
    if (cached && Matches(*cached, toks)) {
      flush_run();
      if (blocks_[*cached].ref == 0) cache_.RemoveEvictable(*cached);
      ++blocks_[*cached].ref;
      out.push_back(*cached);
      ++local.blocks[static_cast<size_t>(KvTier::kDevice)];
      continue;
    }
    if (cached || !tiers_ || !tiers_->Find(hashes[i], toks) || !CanAllocate(1)) break;
    const uint32_t block = TakeBlock(removed);
    KvTier from = KvTier::kDevice;
    uint64_t parent = 0;
    // Re-checked inside Load: making room may have moved the block down a tier.
    if (!tiers_->Load(hashes[i], toks, pool_->block_bytes(block), &from, &parent).ok()) {
      free_.push_back(block);
      break;
    }
    Block& b = blocks_[block];
    b.ref = 1;
    b.committed = true;
    b.hash = hashes[i];
    b.parent = parent;
    b.tokens.assign(toks.begin(), toks.end());
    const bool inserted = cache_.Insert(hashes[i], block);
    TANDEM_CHECK(inserted, "onboarded block {:x} already on the device", hashes[i]);
    if (run.empty()) run_parent = b.parent;
    run.push_back(hashes[i]);
    out.push_back(block);
    ++local.blocks[static_cast<size_t>(from)];
  }
  if (events_ != nullptr) events_->PublishRemoved(std::move(removed));
  flush_run();
  FlushTierEvents();
  if (local.onboarded() > 0) {
    local.onboard_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (on_onboard_) on_onboard_(local.onboard_seconds);
  }
  if (hit != nullptr) *hit = local;
  return out;
}

void BlockManager::Evict(uint32_t block, std::vector<uint64_t>& removed) {
  Block& b = blocks_[block];
  cache_.Erase(b.hash);
  removed.push_back(b.hash);
  ++device_evictions_;
  if (tiers_) tiers_->Offload({b.hash, b.parent, b.tokens}, pool_->block_bytes(block));
  b.committed = false;
  b.tokens.clear();
}

void BlockManager::EvictBatch(std::span<const uint32_t> victims, std::vector<uint64_t>& removed) {
  // The victims' records and their hashes' table slots are cold when a
  // prompt's allocation evicts hundreds of blocks (session 51: ~0.15-0.2 us
  // per block with its registration): ask for them kPrefetchLead blocks
  // ahead (the record two leads ahead, so its hash is there when its slot
  // is asked for).
  removed.reserve(removed.size() + victims.size());
  for (size_t i = 0; i < victims.size(); ++i) {
    if (i + 2 * kPrefetchLead < victims.size())
      __builtin_prefetch(&blocks_[victims[i + 2 * kPrefetchLead]], 1);
    if (i + kPrefetchLead < victims.size())
      cache_.Prefetch(blocks_[victims[i + kPrefetchLead]].hash);
    Evict(victims[i], removed);
  }
}

uint32_t BlockManager::TakeBlock(std::vector<uint64_t>& removed) {
  uint32_t block;
  if (!free_.empty()) {
    block = free_.back();
    free_.pop_back();
  } else {
    block = *cache_.PopLeastRecent();
    Evict(block, removed);
  }
  TANDEM_CHECK(blocks_[block].ref == 0, "allocating block {} with ref {}", block, blocks_[block].ref);
  return block;
}

Result<std::vector<uint32_t>> BlockManager::Allocate(uint32_t n, bool quiet_evictions) {
  if (!CanAllocate(n)) {
    return ResourceExhaustedError(fmt::format("KV cache: {} blocks needed, {} of {} free", n,
                                              num_free_blocks(), num_blocks_));
  }
  std::vector<uint32_t> out;
  out.reserve(n);
  std::vector<uint64_t> removed;
  // Free blocks first, then the least recently used cached ones (what n
  // TakeBlock calls take, in the same order), evicted as one batch.
  const uint32_t from_free = std::min<uint32_t>(n, static_cast<uint32_t>(free_.size()));
  for (uint32_t i = 0; i < from_free; ++i) {
    out.push_back(free_.back());
    free_.pop_back();
  }
  if (n > from_free) {
    cache_.PopLeastRecent(n - from_free, out);
    EvictBatch(std::span<const uint32_t>(out).subspan(from_free), removed);
  }
  for (uint32_t block : out) {
    TANDEM_CHECK(blocks_[block].ref == 0, "allocating block {} with ref {}", block,
                 blocks_[block].ref);
    blocks_[block].ref = 1;
  }
  if (events_ != nullptr) {
    events_->PublishRemoved(std::move(removed), KvTier::kDevice, quiet_evictions);
  }
  FlushTierEvents(quiet_evictions);
  return out;
}

void BlockManager::Retain(std::span<const uint32_t> blocks) {
  for (uint32_t block : blocks) {
    TANDEM_CHECK(blocks_[block].ref > 0, "retaining free block {}", block);
    ++blocks_[block].ref;
  }
}

void BlockManager::Release(std::span<const uint32_t> blocks) {
  for (size_t i = blocks.size(); i > 0; --i) {
    const uint32_t block = blocks[i - 1];
    Block& b = blocks_[block];
    TANDEM_CHECK(b.ref > 0, "releasing block {} with ref 0", block);
    if (--b.ref > 0) continue;
    if (b.committed) {
      cache_.PushEvictable(block);
    } else {
      free_.push_back(block);
    }
  }
}

void BlockManager::Commit(std::span<const uint32_t> blocks, std::span<const uint64_t> hashes,
                          std::span<const uint32_t> tokens, uint32_t first, uint32_t count,
                          uint64_t root_hash, bool quiet) {
  std::vector<uint64_t> run;
  uint64_t run_parent = 0;
  auto flush = [&] {
    if (events_ != nullptr && !run.empty()) {
      events_->PublishStored(std::move(run), run_parent, KvTier::kDevice, quiet);
    }
    run.clear();
  };
  for (uint32_t i = first; i < first + count; ++i) {
    // The later blocks' records and hash slots, asked for ahead (EvictBatch).
    if (const size_t ahead = size_t{i} + kPrefetchLead;
        ahead < size_t{first} + count && ahead < blocks.size() && ahead < hashes.size()) {
      cache_.Prefetch(hashes[ahead]);
      __builtin_prefetch(&blocks_[blocks[ahead]], 1);
    }
    TANDEM_CHECK(i < blocks.size() && i < hashes.size() &&
                     (size_t{i} + 1) * block_size_ <= tokens.size(),
                 "commit of block {} out of range", i);
    Block& b = blocks_[blocks[i]];
    const uint64_t parent = i == 0 ? root_hash : hashes[i - 1];
    if (b.committed || !cache_.Insert(hashes[i], blocks[i])) {
      flush();  // already known (shared or a duplicate): the run breaks here
      continue;
    }
    b.committed = true;
    b.hash = hashes[i];
    b.parent = parent;
    if (tiers_) tiers_->DropHostCopy(hashes[i]);  // host and device hold disjoint sets
    auto toks = tokens.subspan(size_t{i} * block_size_, block_size_);
    b.tokens.assign(toks.begin(), toks.end());
    if (run.empty()) run_parent = parent;
    run.push_back(hashes[i]);
  }
  flush();
  FlushTierEvents(quiet);
}

void BlockManager::ClearCache() {
  while (auto block = cache_.PopLeastRecent()) {
    Block& b = blocks_[*block];
    cache_.Erase(b.hash);
    b.committed = false;
    b.tokens.clear();
    free_.push_back(*block);
  }
  if (tiers_) tiers_->Clear();
  for (uint32_t i = 0; i < num_blocks_; ++i) {
    Block& b = blocks_[i];
    if (!b.committed) continue;
    cache_.Erase(b.hash);
    b.committed = false;
    b.tokens.clear();
  }
  if (events_ != nullptr) events_->PublishCleared();
}

KvSnapshot BlockManager::Snapshot() const {
  KvSnapshot snap;
  if (events_ != nullptr) {
    snap.epoch = events_->epoch();
    snap.last_event_id = events_->last_event_id();
  }
  for (const Block& b : blocks_) {
    if (b.committed) snap.blocks.push_back({b.hash, b.parent, KvTier::kDevice});
  }
  if (tiers_) tiers_->AppendTo(&snap);
  return snap;
}

}  // namespace tandem::engine
