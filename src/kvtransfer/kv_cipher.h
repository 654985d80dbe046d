// transport.encrypt (docs/security.md, "KV plane"): AES-256-GCM over KV
// blocks with OpenSSL EVP. One key per reservation (made by the decoder,
// sent to the prefiller in the mTLS KvTarget); each block is its own GCM
// message: nonce = its position in the prompt's block list (unique under
// the key), additional data = reservation id + position (a block cannot be
// replayed into another slot or reservation unnoticed), 16-byte tag.
//
// Threads: a KvCipher is used by one thread at a time; distinct ones may
// run in parallel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem::kvtransfer {

inline constexpr size_t kKvKeyBytes = 32;  // AES-256
inline constexpr size_t kKvTagBytes = 16;

// A fresh random key (kKvKeyBytes).
Result<std::string> NewKvKey();

class KvCipher {
 public:
  // INVALID_ARGUMENT unless `key` has kKvKeyBytes bytes.
  static Result<KvCipher> Create(std::string_view key, uint64_t reservation_id);
  KvCipher(KvCipher&&) noexcept;
  KvCipher& operator=(KvCipher&&) noexcept;
  ~KvCipher();

  // Encrypts `n` bytes of `in` into `out` (may be the same memory) and
  // writes the tag (kKvTagBytes) to `tag`.
  Status Seal(uint32_t position, const std::byte* in, std::byte* out, size_t n,
              std::byte* tag);
  // Decrypts `data` in place and checks its tag; DATA_LOSS when the block,
  // its position or the reservation differ from what was sealed (the
  // contents of `data` are unspecified then: discard them).
  Status Open(uint32_t position, std::byte* data, size_t n, const std::byte* tag);

 private:
  struct Ctx;
  explicit KvCipher(std::unique_ptr<Ctx> ctx);
  std::unique_ptr<Ctx> ctx_;
};

}  // namespace tandem::kvtransfer
