#include "kvtransfer/kv_cipher.h"

#include <openssl/err.h>
#include <openssl/evp.h>

#include <array>
#include <climits>
#include <cstring>

#include <fmt/format.h>

#include "kvtransfer/kv_secret.h"

namespace tandem::kvtransfer {

namespace {

constexpr size_t kNonceBytes = 12;  // GCM's natural IV size

Status OpenSslError(std::string_view what) {
  const unsigned long e = ERR_get_error();
  char buf[256] = "no detail";
  if (e != 0) ERR_error_string_n(e, buf, sizeof(buf));
  return InternalError(fmt::format("OpenSSL {} failed: {}", what, buf));
}

std::array<unsigned char, kNonceBytes> Nonce(uint32_t position) {
  // "TKV" + a zero byte, then the position, big-endian: unique per key.
  std::array<unsigned char, kNonceBytes> n{'T', 'K', 'V', 0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 4; ++i) n[8 + i] = static_cast<unsigned char>(position >> (24 - 8 * i));
  return n;
}

std::array<unsigned char, 12> Aad(uint64_t reservation_id, uint32_t position) {
  std::array<unsigned char, 12> a{};
  for (int i = 0; i < 8; ++i) a[i] = static_cast<unsigned char>(reservation_id >> (56 - 8 * i));
  for (int i = 0; i < 4; ++i) a[8 + i] = static_cast<unsigned char>(position >> (24 - 8 * i));
  return a;
}

}  // namespace

struct KvCipher::Ctx {
  EVP_CIPHER_CTX* enc = nullptr;
  EVP_CIPHER_CTX* dec = nullptr;
  uint64_t reservation_id = 0;
  ~Ctx() {
    EVP_CIPHER_CTX_free(enc);
    EVP_CIPHER_CTX_free(dec);
  }
};

Result<std::string> NewKvKey() { return RandomBytes(kKvKeyBytes); }

Result<KvCipher> KvCipher::Create(std::string_view key, uint64_t reservation_id) {
  if (key.size() != kKvKeyBytes) {
    return InvalidArgumentError(fmt::format("KV encryption key has {} bytes; AES-256-GCM needs {}",
                                            key.size(), kKvKeyBytes));
  }
  auto ctx = std::make_unique<Ctx>();
  ctx->reservation_id = reservation_id;
  ctx->enc = EVP_CIPHER_CTX_new();
  ctx->dec = EVP_CIPHER_CTX_new();
  if (ctx->enc == nullptr || ctx->dec == nullptr) return OpenSslError("EVP_CIPHER_CTX_new");
  const auto* k = reinterpret_cast<const unsigned char*>(key.data());
  // The key schedule once; each block then sets only its nonce.
  if (EVP_EncryptInit_ex(ctx->enc, EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx->enc, EVP_CTRL_GCM_SET_IVLEN, kNonceBytes, nullptr) != 1 ||
      EVP_EncryptInit_ex(ctx->enc, nullptr, nullptr, k, nullptr) != 1) {
    return OpenSslError("AES-256-GCM encrypt init");
  }
  if (EVP_DecryptInit_ex(ctx->dec, EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx->dec, EVP_CTRL_GCM_SET_IVLEN, kNonceBytes, nullptr) != 1 ||
      EVP_DecryptInit_ex(ctx->dec, nullptr, nullptr, k, nullptr) != 1) {
    return OpenSslError("AES-256-GCM decrypt init");
  }
  return KvCipher(std::move(ctx));
}

KvCipher::KvCipher(std::unique_ptr<Ctx> ctx) : ctx_(std::move(ctx)) {}
KvCipher::KvCipher(KvCipher&&) noexcept = default;
KvCipher& KvCipher::operator=(KvCipher&&) noexcept = default;
KvCipher::~KvCipher() = default;

Status KvCipher::Seal(uint32_t position, const std::byte* in, std::byte* out, size_t n,
                      std::byte* tag) {
  if (n > static_cast<size_t>(INT_MAX)) return InvalidArgumentError("KV block too large to seal");
  EVP_CIPHER_CTX* c = ctx_->enc;
  const auto nonce = Nonce(position);
  const auto aad = Aad(ctx_->reservation_id, position);
  int len = 0;
  if (EVP_EncryptInit_ex(c, nullptr, nullptr, nullptr, nonce.data()) != 1 ||
      EVP_EncryptUpdate(c, nullptr, &len, aad.data(), static_cast<int>(aad.size())) != 1 ||
      EVP_EncryptUpdate(c, reinterpret_cast<unsigned char*>(out), &len,
                        reinterpret_cast<const unsigned char*>(in), static_cast<int>(n)) != 1 ||
      EVP_EncryptFinal_ex(c, reinterpret_cast<unsigned char*>(out) + len, &len) != 1 ||
      EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, kKvTagBytes, tag) != 1) {
    return OpenSslError("AES-256-GCM seal");
  }
  return Status::Ok();
}

Status KvCipher::Open(uint32_t position, std::byte* data, size_t n, const std::byte* tag) {
  if (n > static_cast<size_t>(INT_MAX)) return InvalidArgumentError("KV block too large to open");
  EVP_CIPHER_CTX* c = ctx_->dec;
  const auto nonce = Nonce(position);
  const auto aad = Aad(ctx_->reservation_id, position);
  std::array<unsigned char, kKvTagBytes> t;
  std::memcpy(t.data(), tag, kKvTagBytes);
  int len = 0;
  auto* d = reinterpret_cast<unsigned char*>(data);
  if (EVP_DecryptInit_ex(c, nullptr, nullptr, nullptr, nonce.data()) != 1 ||
      EVP_DecryptUpdate(c, nullptr, &len, aad.data(), static_cast<int>(aad.size())) != 1 ||
      EVP_DecryptUpdate(c, d, &len, d, static_cast<int>(n)) != 1 ||
      EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_TAG, kKvTagBytes, t.data()) != 1) {
    return OpenSslError("AES-256-GCM open");
  }
  if (EVP_DecryptFinal_ex(c, d + len, &len) != 1) {
    ERR_clear_error();
    return DataLossError(fmt::format(
        "KV block {} failed authentication (AES-256-GCM tag mismatch: tampered, misplaced or "
        "sealed with another key)", position));
  }
  return Status::Ok();
}

}  // namespace tandem::kvtransfer
