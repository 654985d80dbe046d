#include "common/tls_record.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/hmac.h>

#include <cstring>
#include <limits>
#include <utility>

namespace tandem {
namespace {

constexpr size_t kKeyBytes = 16;
constexpr size_t kIvBytes = 12;

// Fetched once (an EVP_CIPHER_fetch per connection would look the
// provider's algorithm up again).
const EVP_CIPHER* Aes128Gcm() {
  static EVP_CIPHER* const cipher = EVP_CIPHER_fetch(nullptr, "AES-128-GCM", nullptr);
  return cipher;
}

}  // namespace

Status HkdfExpandLabelSha256(std::span<const uint8_t> secret, std::string_view label,
                             std::span<uint8_t> out) {
  // HkdfLabel: uint16 length, opaque label<7..255> = "tls13 " + label,
  // opaque context<0..255> = "" (RFC 8446 7.1); one HKDF-Expand block
  // T(1) = HMAC(secret, HkdfLabel || 0x01) covers up to 32 bytes.
  if (out.size() > 32 || label.size() > 249) {
    return InvalidArgumentError("HKDF-Expand-Label: at most 32 bytes of a label up to 249 bytes");
  }
  uint8_t info[2 + 1 + 255 + 1 + 1];
  size_t n = 0;
  info[n++] = static_cast<uint8_t>(out.size() >> 8);
  info[n++] = static_cast<uint8_t>(out.size());
  info[n++] = static_cast<uint8_t>(6 + label.size());
  std::memcpy(info + n, "tls13 ", 6);
  n += 6;
  std::memcpy(info + n, label.data(), label.size());
  n += label.size();
  info[n++] = 0;  // empty context
  info[n++] = 1;  // HKDF-Expand's block counter
  uint8_t t[EVP_MAX_MD_SIZE];
  unsigned int t_len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), info, n, t, &t_len) ==
          nullptr ||
      t_len < out.size()) {
    ERR_clear_error();
    return InternalError("HKDF-Expand-Label: HMAC-SHA256 failed");
  }
  std::memcpy(out.data(), t, out.size());
  OPENSSL_cleanse(t, sizeof(t));
  return Status::Ok();
}

TlsRecordCipher::~TlsRecordCipher() {
  EVP_CIPHER_CTX_free(ctx_);
  OPENSSL_cleanse(iv_, sizeof(iv_));
}

TlsRecordCipher::TlsRecordCipher(TlsRecordCipher&& o) noexcept
    : ctx_(std::exchange(o.ctx_, nullptr)), seq_(o.seq_) {
  std::memcpy(iv_, o.iv_, sizeof(iv_));
  OPENSSL_cleanse(o.iv_, sizeof(o.iv_));
}

TlsRecordCipher& TlsRecordCipher::operator=(TlsRecordCipher&& o) noexcept {
  if (this != &o) {
    EVP_CIPHER_CTX_free(ctx_);
    ctx_ = std::exchange(o.ctx_, nullptr);
    seq_ = o.seq_;
    std::memcpy(iv_, o.iv_, sizeof(iv_));
    OPENSSL_cleanse(o.iv_, sizeof(o.iv_));
  }
  return *this;
}

Result<TlsRecordCipher> TlsRecordCipher::FromTrafficSecret(std::span<const uint8_t> secret,
                                                           Direction d) {
  if (secret.size() != 32) {
    return InvalidArgumentError(fmt::format(
        "a TLS_AES_128_GCM_SHA256 traffic secret has 32 bytes, not {}", secret.size()));
  }
  uint8_t key[kKeyBytes], iv[kIvBytes];
  Status st = HkdfExpandLabelSha256(secret, "key", key);
  if (st.ok()) st = HkdfExpandLabelSha256(secret, "iv", iv);
  Result<TlsRecordCipher> c = st.ok() ? FromKeyIv(key, iv, d) : Result<TlsRecordCipher>(st);
  OPENSSL_cleanse(key, sizeof(key));
  OPENSSL_cleanse(iv, sizeof(iv));
  return c;
}

Result<TlsRecordCipher> TlsRecordCipher::FromKeyIv(std::span<const uint8_t> key,
                                                   std::span<const uint8_t> iv, Direction d,
                                                   uint64_t sequence) {
  if (key.size() != kKeyBytes || iv.size() != kIvBytes) {
    return InvalidArgumentError(fmt::format(
        "AES-128-GCM records take a 16-byte key and a 12-byte IV, not {} and {}", key.size(),
        iv.size()));
  }
  TlsRecordCipher c;
  c.ctx_ = EVP_CIPHER_CTX_new();
  const EVP_CIPHER* cipher = Aes128Gcm();
  const int ok = c.ctx_ == nullptr || cipher == nullptr ? 0
                 : d == Direction::kSeal
                     ? EVP_EncryptInit_ex2(c.ctx_, cipher, key.data(), nullptr, nullptr)
                     : EVP_DecryptInit_ex2(c.ctx_, cipher, key.data(), nullptr, nullptr);
  if (ok != 1) {
    ERR_clear_error();
    return InternalError("AES-128-GCM: the cipher context could not be set up");
  }
  std::memcpy(c.iv_, iv.data(), kIvBytes);
  c.seq_ = sequence;
  return c;
}

void TlsRecordCipher::Nonce(uint8_t nonce[12]) const {
  std::memcpy(nonce, iv_, kIvBytes);
  for (int i = 0; i < 8; ++i) nonce[11 - i] ^= static_cast<uint8_t>(seq_ >> (8 * i));
}

Status TlsRecordCipher::Seal(std::span<const uint8_t> plain, TlsContentType type, uint8_t* out) {
  if (plain.size() > kTlsMaxPlaintextBytes) {
    return InvalidArgumentError(fmt::format("a TLS record holds at most {} bytes, not {}",
                                            kTlsMaxPlaintextBytes, plain.size()));
  }
  if (seq_ == std::numeric_limits<uint64_t>::max()) {
    return FailedPreconditionError("the TLS record sequence number would wrap");
  }
  const size_t body = plain.size() + 1 + kTlsRecordTagBytes;
  out[0] = static_cast<uint8_t>(TlsContentType::kApplicationData);
  out[1] = 0x03;
  out[2] = 0x03;
  out[3] = static_cast<uint8_t>(body >> 8);
  out[4] = static_cast<uint8_t>(body);
  uint8_t nonce[kIvBytes];
  Nonce(nonce);
  uint8_t* c = out + kTlsRecordHeaderBytes;
  const auto inner = static_cast<uint8_t>(type);
  int n = 0, m = 0, k = 0, f = 0;
  const bool ok =
      EVP_EncryptInit_ex2(ctx_, nullptr, nullptr, nonce, nullptr) == 1 &&
      EVP_EncryptUpdate(ctx_, nullptr, &n, out, kTlsRecordHeaderBytes) == 1 &&
      EVP_EncryptUpdate(ctx_, c, &m, plain.data(), static_cast<int>(plain.size())) == 1 &&
      EVP_EncryptUpdate(ctx_, c + m, &k, &inner, 1) == 1 &&
      EVP_EncryptFinal_ex(ctx_, c + m + k, &f) == 1 &&
      static_cast<size_t>(m + k + f) == plain.size() + 1 &&
      EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_GET_TAG, kTlsRecordTagBytes, c + plain.size() + 1) == 1;
  if (!ok) {
    ERR_clear_error();
    return InternalError("AES-128-GCM: sealing a TLS record failed");
  }
  ++seq_;
  return Status::Ok();
}

Status TlsRecordCipher::Open(std::span<uint8_t> record, size_t* content_bytes,
                             TlsContentType* type) {
  if (record.size() < kTlsRecordHeaderBytes + 1 + kTlsRecordTagBytes) {
    return DataLossError(fmt::format("a TLS record of {} bytes is too short", record.size()));
  }
  if (seq_ == std::numeric_limits<uint64_t>::max()) {
    return FailedPreconditionError("the TLS record sequence number would wrap");
  }
  uint8_t* c = record.data() + kTlsRecordHeaderBytes;
  const size_t clen = record.size() - kTlsRecordHeaderBytes - kTlsRecordTagBytes;
  uint8_t nonce[kIvBytes];
  Nonce(nonce);
  int n = 0, m = 0, f = 0;
  const bool ok =
      EVP_DecryptInit_ex2(ctx_, nullptr, nullptr, nonce, nullptr) == 1 &&
      EVP_DecryptUpdate(ctx_, nullptr, &n, record.data(), kTlsRecordHeaderBytes) == 1 &&
      EVP_DecryptUpdate(ctx_, c, &m, c, static_cast<int>(clen)) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_SET_TAG, kTlsRecordTagBytes, c + clen) == 1 &&
      EVP_DecryptFinal_ex(ctx_, c + m, &f) == 1;
  if (!ok) {
    ERR_clear_error();
    return DataLossError("a TLS record failed authentication (AES-128-GCM tag mismatch)");
  }
  ++seq_;
  // TLSInnerPlaintext: content || type || zeros (RFC 8446 5.2).
  size_t end = clen;
  while (end > 0 && c[end - 1] == 0) --end;
  if (end == 0) return DataLossError("a TLS record holds no content type (all padding)");
  *type = static_cast<TlsContentType>(c[end - 1]);
  *content_bytes = end - 1;
  return Status::Ok();
}

}  // namespace tandem
