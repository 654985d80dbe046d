#include "common/tls_record.h"

#include <fmt/format.h>
#include <openssl/core_dispatch.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/params.h>
#include <openssl/provider.h>

#include <cstring>
#include <limits>
#include <string_view>
#include <utility>

namespace tandem {
namespace {

constexpr size_t kKeyBytes = 16;
constexpr size_t kIvBytes = 12;

// The provider functions behind the fetched AES-128-GCM: what EVP's
// EVP_CIPHER_CTX_new / Init / Update / Final / get_params / free call.
struct GcmFunctions {
  OSSL_FUNC_cipher_newctx_fn* newctx = nullptr;
  OSSL_FUNC_cipher_freectx_fn* freectx = nullptr;
  OSSL_FUNC_cipher_encrypt_init_fn* encrypt_init = nullptr;
  OSSL_FUNC_cipher_decrypt_init_fn* decrypt_init = nullptr;
  OSSL_FUNC_cipher_update_fn* update = nullptr;
  OSSL_FUNC_cipher_final_fn* final = nullptr;
  OSSL_FUNC_cipher_get_ctx_params_fn* get_ctx_params = nullptr;
  void* provider_ctx = nullptr;
  bool complete() const {
    return newctx != nullptr && freectx != nullptr && encrypt_init != nullptr &&
           decrypt_init != nullptr && update != nullptr && final != nullptr &&
           get_ctx_params != nullptr;
  }
};

bool NamesAes128Gcm(const char* names) {
  // "AES-128-GCM:id-aes128-GCM:2.16.840.1.101.3.4.1.6": names split by ':'.
  for (std::string_view rest = names; !rest.empty();) {
    const size_t colon = rest.find(':');
    if (rest.substr(0, colon) == "AES-128-GCM") return true;
    if (colon == std::string_view::npos) break;
    rest.remove_prefix(colon + 1);
  }
  return false;
}

GcmFunctions LookUpGcm() {
  GcmFunctions g;
  // Fetched once and kept: it holds the provider (and the functions' code)
  // loaded for the process's life.
  static EVP_CIPHER* const cipher = EVP_CIPHER_fetch(nullptr, "AES-128-GCM", nullptr);
  const OSSL_PROVIDER* prov = cipher == nullptr ? nullptr : EVP_CIPHER_get0_provider(cipher);
  if (prov == nullptr) {
    ERR_clear_error();
    return g;
  }
  int no_cache = 0;
  const OSSL_ALGORITHM* algs = OSSL_PROVIDER_query_operation(prov, OSSL_OP_CIPHER, &no_cache);
  for (const OSSL_ALGORITHM* a = algs; a != nullptr && a->algorithm_names != nullptr; ++a) {
    if (!NamesAes128Gcm(a->algorithm_names)) continue;
    for (const OSSL_DISPATCH* f = a->implementation; f->function_id != 0; ++f) {
      switch (f->function_id) {
        case OSSL_FUNC_CIPHER_NEWCTX:
          g.newctx = OSSL_FUNC_cipher_newctx(f);
          break;
        case OSSL_FUNC_CIPHER_FREECTX:
          g.freectx = OSSL_FUNC_cipher_freectx(f);
          break;
        case OSSL_FUNC_CIPHER_ENCRYPT_INIT:
          g.encrypt_init = OSSL_FUNC_cipher_encrypt_init(f);
          break;
        case OSSL_FUNC_CIPHER_DECRYPT_INIT:
          g.decrypt_init = OSSL_FUNC_cipher_decrypt_init(f);
          break;
        case OSSL_FUNC_CIPHER_UPDATE:
          g.update = OSSL_FUNC_cipher_update(f);
          break;
        case OSSL_FUNC_CIPHER_FINAL:
          g.final = OSSL_FUNC_cipher_final(f);
          break;
        case OSSL_FUNC_CIPHER_GET_CTX_PARAMS:
          g.get_ctx_params = OSSL_FUNC_cipher_get_ctx_params(f);
          break;
        default:
          break;
      }
    }
    break;
  }
  if (algs != nullptr) OSSL_PROVIDER_unquery_operation(prov, OSSL_OP_CIPHER, algs);
  g.provider_ctx = OSSL_PROVIDER_get0_provider_ctx(prov);
  if (!g.complete()) g = GcmFunctions{};
  return g;
}

const GcmFunctions& Gcm() {
  static const GcmFunctions g = LookUpGcm();
  return g;
}

// The one parameter a record passes: the tag (read after sealing, given
// before opening). Filled in place (what OSSL_PARAM_construct_octet_string
// and OSSL_PARAM_construct_end return), not by two calls into libcrypto
// per record.
void TagParams(uint8_t* tag, OSSL_PARAM (&params)[2]) {
  params[0] = OSSL_PARAM{OSSL_CIPHER_PARAM_AEAD_TAG, OSSL_PARAM_OCTET_STRING, tag,
                         kTlsRecordTagBytes, OSSL_PARAM_UNMODIFIED};
  params[1] = OSSL_PARAM{nullptr, 0, nullptr, 0, 0};
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

bool TlsRecordCipher::Available() { return Gcm().complete(); }

TlsRecordCipher::~TlsRecordCipher() {
  if (ctx_ != nullptr) Gcm().freectx(ctx_);
  OPENSSL_cleanse(iv_, sizeof(iv_));
}

TlsRecordCipher::TlsRecordCipher(TlsRecordCipher&& o) noexcept
    : ctx_(std::exchange(o.ctx_, nullptr)), seq_(o.seq_) {
  std::memcpy(iv_, o.iv_, sizeof(iv_));
  OPENSSL_cleanse(o.iv_, sizeof(o.iv_));
}

TlsRecordCipher& TlsRecordCipher::operator=(TlsRecordCipher&& o) noexcept {
  if (this != &o) {
    if (ctx_ != nullptr) Gcm().freectx(ctx_);
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
    return InvalidArgumentError(
        fmt::format("a TLS_AES_128_GCM_SHA256 traffic secret has 32 bytes, not {}", secret.size()));
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
    return InvalidArgumentError(
        fmt::format("AES-128-GCM records take a 16-byte key and a 12-byte IV, not {} and {}",
                    key.size(), iv.size()));
  }
  const GcmFunctions& g = Gcm();
  if (!g.complete()) {
    return UnimplementedError(
        "AES-128-GCM: OpenSSL's provider offers no cipher functions for TLS records");
  }
  TlsRecordCipher c;
  c.ctx_ = g.newctx(g.provider_ctx);
  const int ok = c.ctx_ == nullptr ? 0
                 : d == Direction::kSeal
                     ? g.encrypt_init(c.ctx_, key.data(), kKeyBytes, nullptr, 0, nullptr)
                     : g.decrypt_init(c.ctx_, key.data(), kKeyBytes, nullptr, 0, nullptr);
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
  // TLSInnerPlaintext (content || type) in place: one update for both.
  uint8_t* c = out + kTlsRecordHeaderBytes;
  const size_t inner = plain.size() + 1;
  if (!plain.empty()) std::memcpy(c, plain.data(), plain.size());
  c[plain.size()] = static_cast<uint8_t>(type);
  OSSL_PARAM tag[2];
  TagParams(c + inner, tag);
  const GcmFunctions& g = Gcm();
  size_t n = 0, m = 0, f = 0;
  const bool ok =
      g.encrypt_init(ctx_, nullptr, 0, nonce, kIvBytes, nullptr) == 1 &&
      g.update(ctx_, nullptr, &n, kTlsRecordHeaderBytes, out, kTlsRecordHeaderBytes) == 1 &&
      g.update(ctx_, c, &m, inner, c, inner) == 1 && m == inner &&
      g.final(ctx_, c + inner, &f, 0) == 1 && f == 0 && g.get_ctx_params(ctx_, tag) == 1;
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
  if (clen > kTlsMaxInnerPlaintextBytes) {
    return DataLossError(
        fmt::format("a TLS record of {} bytes would decrypt to {} bytes; the limit is {} bytes "
                    "(content, type and padding; RFC 8446 5.4, record_overflow)",
                    record.size() - kTlsRecordHeaderBytes, clen, kTlsMaxInnerPlaintextBytes));
  }
  uint8_t nonce[kIvBytes];
  Nonce(nonce);
  // The expected tag goes in with the nonce (no separate call to set it).
  OSSL_PARAM tag[2];
  TagParams(c + clen, tag);
  const GcmFunctions& g = Gcm();
  size_t n = 0, m = 0, f = 0;
  const bool ok = g.decrypt_init(ctx_, nullptr, 0, nonce, kIvBytes, tag) == 1 &&
                  g.update(ctx_, nullptr, &n, kTlsRecordHeaderBytes, record.data(),
                           kTlsRecordHeaderBytes) == 1 &&
                  g.update(ctx_, c, &m, clen, c, clen) == 1 && m == clen &&
                  g.final(ctx_, c + m, &f, 0) == 1;
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
