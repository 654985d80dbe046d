#include "prefiller/kv_sealer.h"

#include <fmt/format.h>

#include "kvtransfer/kv_cipher.h"

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

Result<KvSealer::Sealed> KvSealer::Seal(std::string_view key, uint64_t reservation_id,
                                        uint32_t first_position,
                                        std::vector<kvtransfer::BlockPair>& pairs) {
  if (transport_.staging_blocks() == 0) {
    return FailedPreconditionError(
        "the decoder wants its KV encrypted but transport.encrypt is off on this prefiller, so it "
        "has no staging blocks to seal into (the fleet file's transport.encrypt must agree)");
  }
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::KvCipher cipher,
                          kvtransfer::KvCipher::Create(key, reservation_id));
  Sealed out;
  {
    std::lock_guard lock(mu_);
    if (free_.size() < pairs.size()) {
      return ResourceExhaustedError(fmt::format(
          "transport.encrypt: {} staging blocks needed, {} of {} free (pushes in flight hold the "
          "rest)", pairs.size(), free_.size(), transport_.staging_blocks()));
    }
    out.staging.assign(free_.end() - static_cast<std::ptrdiff_t>(pairs.size()), free_.end());
    free_.resize(free_.size() - pairs.size());
  }
  out.tags.resize(pairs.size() * kvtransfer::kKvTagBytes);
  const uint32_t pool_blocks = transport_.num_blocks();
  for (size_t i = 0; i < pairs.size(); ++i) {
    const uint32_t staging_block = pool_blocks + out.staging[i];
    Status s = cipher.Seal(first_position + static_cast<uint32_t>(i),
                           transport_.block(pairs[i].local_block), transport_.block(staging_block),
                           transport_.block_bytes(),
                           reinterpret_cast<std::byte*>(out.tags.data()) + i * kvtransfer::kKvTagBytes);
    if (!s.ok()) {
      Release(out.staging);
      return s;
    }
    pairs[i].local_block = staging_block;
  }
  return out;
}

void KvSealer::Release(std::vector<uint32_t>& staging) {
  if (staging.empty()) return;
  std::lock_guard lock(mu_);
  free_.insert(free_.end(), staging.begin(), staging.end());
  staging.clear();
}

}  // namespace tandem::prefiller
