#include "engine/host_kv_tier.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/check.h"
#include "common/kv_checksum.h"

namespace tandem::engine {

MappedKvAllocator::~MappedKvAllocator() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

Result<std::span<std::byte>> MappedKvAllocator::Allocate(size_t bytes) {
  if (data_ != nullptr) return FailedPreconditionError("MappedKvAllocator: allocated twice");
  const size_t len = bytes == 0 ? 4096 : bytes;
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    return ResourceExhaustedError(
        fmt::format("host KV tier: cannot map {} bytes: {}", len, std::strerror(errno)));
  }
  data_ = p;
  bytes_ = len;
  return std::span<std::byte>(static_cast<std::byte*>(p), bytes);
}

HostKvTier::HostKvTier(uint32_t capacity, size_t block_bytes)
    : capacity_(capacity), block_bytes_(block_bytes), index_(capacity), meta_(capacity) {
  free_.reserve(capacity);
  for (uint32_t s = capacity; s > 0; --s) free_.push_back(s - 1);
}

Result<std::unique_ptr<HostKvTier>> HostKvTier::Create(uint32_t capacity, size_t block_bytes,
                                                       uint32_t block_size,
                                                       KvPoolAllocator* allocator) {
  if (capacity == 0 || block_bytes == 0 || block_size == 0) {
    return InvalidArgumentError(fmt::format(
        "host KV tier: capacity {} blocks, block bytes {}, block size {} must all be > 0", capacity,
        block_bytes, block_size));
  }
  std::unique_ptr<HostKvTier> t(new HostKvTier(capacity, block_bytes));
  if (allocator == nullptr) {
    t->own_allocator_ = std::make_unique<MappedKvAllocator>();
    allocator = t->own_allocator_.get();
  }
  TANDEM_ASSIGN_OR_RETURN(std::span<std::byte> mem, allocator->Allocate(size_t{capacity} * block_bytes));
  if (mem.size() < size_t{capacity} * block_bytes) {
    return InternalError("host KV tier: the allocator returned too little memory");
  }
  t->base_ = mem.data();
  for (auto& m : t->meta_) m.tokens.reserve(block_size);
  return t;
}

std::optional<uint32_t> HostKvTier::Find(uint64_t hash, std::span<const uint32_t> tokens) const {
  auto slot = index_.Lookup(hash);
  if (!slot) return std::nullopt;
  const auto& t = meta_[*slot].tokens;
  if (!std::equal(t.begin(), t.end(), tokens.begin(), tokens.end())) return std::nullopt;
  return slot;
}

void HostKvTier::Insert(const TierBlockMeta& meta, std::span<const std::byte> bytes) {
  TANDEM_CHECK(!free_.empty(), "host KV tier full on insert");
  TANDEM_CHECK(bytes.size() == block_bytes_, "host KV tier: block of {} bytes, expected {}",
               bytes.size(), block_bytes_);
  const uint32_t slot = free_.back();
  const bool inserted = index_.Insert(meta.hash, slot);
  TANDEM_CHECK(inserted, "host KV tier: hash {:x} inserted twice", meta.hash);
  free_.pop_back();
  std::memcpy(base_ + size_t{slot} * block_bytes_, bytes.data(), block_bytes_);
  meta_[slot].hash = meta.hash;
  meta_[slot].parent = meta.parent;
  meta_[slot].tokens.assign(meta.tokens.begin(), meta.tokens.end());
  if (sums_.size() < capacity_) sums_.resize(capacity_, 0);
  sums_[slot] = KvChecksum(base_ + size_t{slot} * block_bytes_, block_bytes_);
  index_.PushEvictable(slot);
}

bool HostKvTier::Verify(uint32_t slot) const {
  return slot < sums_.size() &&
         KvChecksum(base_ + size_t{slot} * block_bytes_, block_bytes_) == sums_[slot];
}

std::optional<uint32_t> HostKvTier::LeastRecent() const { return index_.LeastRecent(); }

void HostKvTier::Erase(uint64_t hash) {
  auto slot = index_.Lookup(hash);
  if (!slot) return;
  index_.RemoveEvictable(*slot);
  index_.Erase(hash);
  meta_[*slot].tokens.clear();
  free_.push_back(*slot);
}

std::vector<std::pair<uint64_t, uint64_t>> HostKvTier::Entries() const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  out.reserve(size());
  for (uint32_t s = 0; s < capacity_; ++s) {
    if (index_.IsEvictable(s)) out.emplace_back(meta_[s].hash, meta_[s].parent);
  }
  return out;
}

}  // namespace tandem::engine
