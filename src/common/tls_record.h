// TLS 1.3 application records sealed and opened directly with EVP (issue
// 23, docs/security.md "Framed connections' records"): what OpenSSL's
// SSL_read / SSL_write do per record, without their per-call machinery
// (BIO_ctrl, OSSL_PARAM_*, the error-queue marks, CRYPTO_malloc...).
//
// One TlsRecordCipher is one direction of one connection: the AES-128-GCM
// key and IV of TLS_AES_128_GCM_SHA256, derived from that direction's
// application traffic secret (RFC 8446 section 7.3), and the record
// sequence number. Records are RFC 8446 section 5.2 TLSCiphertext:
//   header 0x17 0x03 0x03 len16 (also the AAD), then AES-GCM of
//   (content || inner content type), then the 16-byte tag; the nonce is the
//   IV XOR the 64-bit sequence number (big-endian, right-aligned).
// No padding is added; padding received is stripped.
//
// Per record, the cipher calls the provider's AES-128-GCM functions
// directly (looked up once from the fetched EVP_CIPHER's provider: the same
// functions EVP_EncryptInit_ex2 / Update / Final dispatch to), without
// EVP's per-call wrappers: evp_cipher_init_internal, the IV length query it
// redoes after every parameter set (an OSSL_PARAM round trip of ~8
// OSSL_PARAM_locate), EVP_CIPHER_CTX_ctrl. Per record: init with the nonce
// (and, opening, the expected tag), the header as AAD, one update over
// content || type, final, and for a seal one get of the tag. Cold (after
// a 6 ms sim step) that is ~0.65-0.7 of the EVP calls' time
// (bench_tls_record; bench/results/proxy_cost/session-12.md).
//
// Thread-safety: none; one connection's reader or writer owns each cipher.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"

namespace tandem {

inline constexpr size_t kTlsRecordHeaderBytes = 5;
inline constexpr size_t kTlsRecordTagBytes = 16;
inline constexpr size_t kTlsMaxPlaintextBytes = size_t{1} << 14;  // RFC 8446 5.1
// RFC 8446 5.2: a TLSCiphertext body over 2^14 + 256 is a record_overflow.
inline constexpr size_t kTlsMaxCiphertextBytes = kTlsMaxPlaintextBytes + 256;
// RFC 8446 5.4: the whole TLSInnerPlaintext (content, type and padding) is
// at most 2^14 + 1 bytes; a record decrypting to more is a record_overflow.
// With AES-GCM's 16-byte tag the body is then at most 2^14 + 17 bytes.
inline constexpr size_t kTlsMaxInnerPlaintextBytes = kTlsMaxPlaintextBytes + 1;
// The bytes one record of `plain` bytes takes on the wire.
inline constexpr size_t TlsRecordBytes(size_t plain) {
  return kTlsRecordHeaderBytes + plain + 1 + kTlsRecordTagBytes;
}

// TLS 1.3 content types (RFC 8446 5.1).
enum class TlsContentType : uint8_t {
  kChangeCipherSpec = 20,
  kAlert = 21,
  kHandshake = 22,
  kApplicationData = 23,
};

// HKDF-Expand-Label(secret, label, "", out.size()) with SHA-256 (RFC 8446
// section 7.1); `out` at most 32 bytes.
Status HkdfExpandLabelSha256(std::span<const uint8_t> secret, std::string_view label,
                             std::span<uint8_t> out);

class TlsRecordCipher {
 public:
  enum class Direction { kSeal, kOpen };
  TlsRecordCipher() = default;
  ~TlsRecordCipher();
  TlsRecordCipher(TlsRecordCipher&& o) noexcept;
  TlsRecordCipher& operator=(TlsRecordCipher&& o) noexcept;
  TlsRecordCipher(const TlsRecordCipher&) = delete;
  TlsRecordCipher& operator=(const TlsRecordCipher&) = delete;

  // From a direction's application traffic secret (32 bytes, SHA-256):
  // key = HKDF-Expand-Label(secret, "key", "", 16), iv = (..., "iv", "", 12).
  static Result<TlsRecordCipher> FromTrafficSecret(std::span<const uint8_t> secret, Direction d);
  // From a key (16 bytes) and IV (12 bytes) directly; the first record's
  // sequence number `sequence` (a test starts near the end of the range).
  static Result<TlsRecordCipher> FromKeyIv(std::span<const uint8_t> key,
                                           std::span<const uint8_t> iv, Direction d,
                                           uint64_t sequence = 0);

  // Whether this OpenSSL's provider of AES-128-GCM offers the functions
  // the cipher calls (the default and FIPS providers do); if not, every
  // From* fails and FrameTlsRecords stays on SSL_read / SSL_write.
  static bool Available();

  bool valid() const { return ctx_ != nullptr; }
  uint64_t sequence() const { return seq_; }

  // kSeal: writes one record of `plain` (at most kTlsMaxPlaintextBytes) of
  // type `type` to `out`, which must hold TlsRecordBytes(plain.size()) and
  // must not overlap `plain` (the content is copied there and encrypted in
  // place). Fails (nothing usable written) when the sequence number would
  // wrap.
  Status Seal(std::span<const uint8_t> plain, TlsContentType type, uint8_t* out);

  // kOpen: `record` is one whole record (header and body, the body at most
  // kTlsMaxCiphertextBytes, checked by the caller). Decrypts in place:
  // the content is then record[5, 5 + *content_bytes) and *type its inner
  // type. A record that fails authentication, whose inner plaintext would
  // be over kTlsMaxInnerPlaintextBytes (refused before decrypting) or is all
  // padding is an error (nothing of it may be used).
  Status Open(std::span<uint8_t> record, size_t* content_bytes, TlsContentType* type);

 private:
  void Nonce(uint8_t nonce[12]) const;
  // The provider's AES-128-GCM context (its key schedule and GHASH table),
  // keyed once for this direction.
  void* ctx_ = nullptr;
  uint8_t iv_[12] = {};
  uint64_t seq_ = 0;
};

}  // namespace tandem
