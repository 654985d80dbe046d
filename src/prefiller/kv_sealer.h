// transport.encrypt on the sending side (docs/security.md, "KV plane"):
// before a push, each outgoing block is sealed (AES-256-GCM with the
// reservation's key) into a staging block of the transport — its pool
// blocks stay plaintext for the prefix cache and other requests — and the
// push then sends the staging blocks. Tags travel in the KvNotice.
//
// Threads: any; Seal runs on the caller's thread (the engine's, for the
// prefiller: its cost is measured in bench/results/kv_encrypt.md).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "kvtransfer/transport.h"

namespace tandem::prefiller {

class KvSealer {
 public:
  explicit KvSealer(kvtransfer::Transport& transport);

  struct Sealed {
    std::vector<uint32_t> staging;  // staging block indices (0-based), held until Release
    std::string tags;               // kKvTagBytes per block, in the order of `pairs`
  };
  // `pairs[i]` carries prompt block `first_position + i`. Seals each local
  // block into a free staging block and points the pair at it.
  // FAILED_PRECONDITION when the transport has no staging blocks,
  // RESOURCE_EXHAUSTED when too few are free (nothing is held then).
  Result<Sealed> Seal(std::string_view key, uint64_t reservation_id, uint32_t first_position,
                      std::vector<kvtransfer::BlockPair>& pairs);
  // Returns staging blocks once no write reads them any more; clears `staging`.
  void Release(std::vector<uint32_t>& staging);
  uint32_t free_blocks() const;

 private:
  kvtransfer::Transport& transport_;
  mutable std::mutex mu_;
  std::vector<uint32_t> free_;  // guarded by mu_
};

}  // namespace tandem::prefiller
