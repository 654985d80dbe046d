// transport.encrypt on the sending side (docs/security.md, "KV plane"):
// before a block is pushed it is sealed (AES-256-GCM with the
// reservation's key) into a staging block of the transport — its pool
// blocks stay plaintext for the prefix cache and other requests — and the
// push then sends the staging block. Tags travel in the KvNotice.
//
// A staging block holds its ciphertext until Release: a push may re-send
// it (same bytes, same tag) but never re-seals a position under the same
// key (GCM nonce = position).
//
// Threads: any; Seal runs on the caller's thread (the engine's, for the
// prefiller: its cost is measured in bench/results/kv_encrypt.md).
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "kvtransfer/kv_cipher.h"
#include "kvtransfer/transport.h"

namespace tandem::prefiller {

class KvSealer {
 public:
  explicit KvSealer(kvtransfer::Transport& transport);

  struct Sealed {
    std::vector<uint32_t> staging;  // staging block indices (0-based), held until Release
    std::vector<uint32_t> blocks;   // the same as transport block indices (pool + staging)
    std::string tags;               // kKvTagBytes per block, in the order of the input
  };
  // Seals local pool block `local_blocks[i]` as prompt block `positions[i]`
  // into a free staging block each. FAILED_PRECONDITION when the transport
  // has no staging blocks, RESOURCE_EXHAUSTED when too few are free
  // (nothing is held after an error).
  Result<Sealed> Seal(kvtransfer::KvCipher& cipher, std::span<const uint32_t> positions,
                      std::span<const uint32_t> local_blocks);
  // Returns staging blocks once no write reads them any more; clears `staging`.
  void Release(std::vector<uint32_t>& staging);
  uint32_t free_blocks() const;

 private:
  kvtransfer::Transport& transport_;
  mutable std::mutex mu_;
  std::vector<uint32_t> free_;  // guarded by mu_
};

}  // namespace tandem::prefiller
