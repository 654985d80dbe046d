#include "prefiller/kv_sealer.h"

#include <fmt/format.h>

namespace tandem::prefiller {

KvSealer::KvSealer(kvtransfer::Transport& transport) : transport_(transport) {
  const uint32_t n = transport.staging_blocks();
  free_.reserve(n);
  for (uint32_t i = n; i > 0; --i) free_.push_back(i - 1);
}

uint32_t KvSealer::free_blocks() const {
  std::lock_guard lock(mu_);
  return static_cast<uint32_t>(free_.size());
}

Result<KvSealer::Sealed> KvSealer::Seal(kvtransfer::KvCipher& cipher,
                                        std::span<const uint32_t> positions,
                                        std::span<const uint32_t> local_blocks) {
  if (positions.size() != local_blocks.size()) {
    return InvalidArgumentError(fmt::format("{} positions for {} blocks", positions.size(),
                                            local_blocks.size()));
  }
  if (transport_.staging_blocks() == 0) {
    return FailedPreconditionError(
        "the decoder wants its KV encrypted but transport.encrypt is off on this prefiller, so it "
        "has no staging blocks to seal into (the fleet file's transport.encrypt must agree)");
  }
  const uint32_t pool_blocks = transport_.num_blocks();
  for (uint32_t b : local_blocks) {
    if (b >= pool_blocks) {
      return OutOfRangeError(fmt::format("block {} is outside the pool of {} blocks", b,
                                         pool_blocks));
    }
  }
  const size_t n = local_blocks.size();
  Sealed out;
  {
    std::lock_guard lock(mu_);
    if (free_.size() < n) {
      return ResourceExhaustedError(fmt::format(
          "transport.encrypt: {} staging blocks needed, {} of {} free (pushes in flight hold the "
          "rest)", n, free_.size(), transport_.staging_blocks()));
    }
    out.staging.reserve(n);
    for (size_t i = 0; i < n; ++i) {  // lowest first: neighbours coalesce into one put
      out.staging.push_back(free_.back());
      free_.pop_back();
    }
  }
  out.blocks.resize(n);
  out.tags.resize(n * kvtransfer::kKvTagBytes);
  for (size_t i = 0; i < n; ++i) {
    out.blocks[i] = pool_blocks + out.staging[i];
    Status s = cipher.Seal(positions[i], transport_.block(local_blocks[i]),
                           transport_.block(out.blocks[i]), transport_.block_bytes(),
                           reinterpret_cast<std::byte*>(out.tags.data()) + i * kvtransfer::kKvTagBytes);
    if (!s.ok()) {
      Release(out.staging);
      return s;
    }
  }
  return out;
}

void KvSealer::Release(std::vector<uint32_t>& staging) {
  if (staging.empty()) return;
  std::lock_guard lock(mu_);
  free_.insert(free_.end(), staging.rbegin(), staging.rend());  // lowest on top again
  staging.clear();
}

}  // namespace tandem::prefiller
