#include "engine/block_manager.h"

#include <fmt/format.h>

#include <algorithm>

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

uint32_t BlockManager::CountCachedPrefix(std::span<const uint64_t> hashes,
                                         std::span<const uint32_t> tokens,
                                         uint32_t max_blocks) const {
  const uint32_t limit = std::min<uint32_t>(
      {max_blocks, static_cast<uint32_t>(hashes.size()),
       static_cast<uint32_t>(tokens.size() / block_size_)});
  uint32_t n = 0;
  for (; n < limit; ++n) {
    auto block = cache_.Lookup(hashes[n]);
    if (!block || !Matches(*block, tokens.subspan(size_t{n} * block_size_, block_size_))) break;
  }
  return n;
}

std::vector<uint32_t> BlockManager::AcquireCachedPrefix(std::span<const uint64_t> hashes,
                                                        std::span<const uint32_t> tokens,
                                                        uint32_t max_blocks) {
  const uint32_t n = CountCachedPrefix(hashes, tokens, max_blocks);
  std::vector<uint32_t> out;
  out.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t block = *cache_.Lookup(hashes[i]);
    if (blocks_[block].ref == 0) cache_.RemoveEvictable(block);
    ++blocks_[block].ref;
    out.push_back(block);
  }
  return out;
}

void BlockManager::Evict(uint32_t block, std::vector<uint64_t>& removed) {
  Block& b = blocks_[block];
  cache_.Erase(b.hash);
  removed.push_back(b.hash);
  b.committed = false;
  b.tokens.clear();
}

Result<std::vector<uint32_t>> BlockManager::Allocate(uint32_t n) {
  if (!CanAllocate(n)) {
    return ResourceExhaustedError(fmt::format("KV cache: {} blocks needed, {} of {} free", n,
                                              num_free_blocks(), num_blocks_));
  }
  std::vector<uint32_t> out;
  out.reserve(n);
  std::vector<uint64_t> removed;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t block;
    if (!free_.empty()) {
      block = free_.back();
      free_.pop_back();
    } else {
      block = *cache_.PopLeastRecent();
      Evict(block, removed);
    }
    TANDEM_CHECK(blocks_[block].ref == 0, "allocating block {} with ref {}", block,
                 blocks_[block].ref);
    blocks_[block].ref = 1;
    out.push_back(block);
  }
  if (events_ != nullptr) events_->PublishRemoved(std::move(removed));
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
                          uint64_t root_hash) {
  std::vector<uint64_t> run;
  uint64_t run_parent = 0;
  auto flush = [&] {
    if (events_ != nullptr && !run.empty()) events_->PublishStored(std::move(run), run_parent);
    run.clear();
  };
  for (uint32_t i = first; i < first + count; ++i) {
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
    auto toks = tokens.subspan(size_t{i} * block_size_, block_size_);
    b.tokens.assign(toks.begin(), toks.end());
    if (run.empty()) run_parent = parent;
    run.push_back(hashes[i]);
  }
  flush();
}

void BlockManager::ClearCache() {
  while (auto block = cache_.PopLeastRecent()) {
    std::vector<uint64_t> ignored;
    Evict(*block, ignored);
    free_.push_back(*block);
  }
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
    if (b.committed) snap.blocks.push_back({b.hash, b.parent});
  }
  return snap;
}

}  // namespace tandem::engine
