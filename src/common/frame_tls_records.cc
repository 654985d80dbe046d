#include "common/frame_tls_records.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/tls1.h>

#include <algorithm>
#include <cstring>
#include <string_view>

namespace tandem {
namespace {

constexpr char kCipherSuite[] = "TLS_AES_128_GCM_SHA256";
constexpr size_t kSecretBytes = 32;  // SHA-256

// The ex_data slot of an SSL that points at its FrameTlsSecrets.
int SecretsIndex() {
  static const int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// "LABEL <client random hex> <secret hex>" (NSS key log format): keeps the
// two application traffic secrets, ignores every other line.
void Keylog(const SSL* ssl, const char* line) {
  auto* s = static_cast<FrameTlsSecrets*>(SSL_get_ex_data(ssl, SecretsIndex()));
  if (s == nullptr) return;
  const std::string_view l(line);
  uint8_t* out = nullptr;
  size_t* out_bytes = nullptr;
  if (l.starts_with("CLIENT_TRAFFIC_SECRET_0 ")) {
    out = s->client;
    out_bytes = &s->client_bytes;
  } else if (l.starts_with("SERVER_TRAFFIC_SECRET_0 ")) {
    out = s->server;
    out_bytes = &s->server_bytes;
  } else {
    return;
  }
  const size_t sp = l.rfind(' ');
  const std::string_view hex = l.substr(sp + 1);
  if (hex.size() % 2 != 0 || hex.size() / 2 > sizeof(s->client)) return;
  for (size_t i = 0; i < hex.size() / 2; ++i) {
    const int hi = HexDigit(hex[2 * i]), lo = HexDigit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      OPENSSL_cleanse(out, sizeof(s->client));
      return;
    }
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  *out_bytes = hex.size() / 2;
}

const char* HandshakeName(uint8_t type) {
  switch (type) {
    case 4: return "NewSessionTicket";
    case 5: return "EndOfEarlyData";
    case 13: return "CertificateRequest";
    case 24: return "KeyUpdate";
    default: return "handshake message";
  }
}

}  // namespace

void FrameTlsSecrets::Wipe() {
  OPENSSL_cleanse(client, sizeof(client));
  OPENSSL_cleanse(server, sizeof(server));
  client_bytes = server_bytes = 0;
}

Status SetupFrameTlsRecords(SSL_CTX* ctx) {
  if (SSL_CTX_set_ciphersuites(ctx, kCipherSuite) != 1) {
    ERR_clear_error();
    return InternalError(fmt::format("OpenSSL does not offer the TLS 1.3 ciphersuite {}", kCipherSuite));
  }
  if (SecretsIndex() < 0) return InternalError("SSL_get_ex_new_index failed");
  SSL_CTX_set_keylog_callback(ctx, &Keylog);
  return Status::Ok();
}

void AttachSecrets(SSL* ssl, FrameTlsSecrets* secrets) {
  SSL_set_ex_data(ssl, SecretsIndex(), secrets);
  // Read-ahead off until the handshake is done: OpenSSL then reads record
  // by record and holds no byte past the handshake's last record.
  SSL_set_read_ahead(ssl, 0);
}

Result<std::unique_ptr<FrameTlsRecords>> FrameTlsRecords::Start(SSL* ssl, bool is_server,
                                                                FrameTlsSecrets* secrets,
                                                                const std::string& peer) {
  SSL_set_ex_data(ssl, SecretsIndex(), nullptr);
  const SSL_CIPHER* cipher = SSL_get_current_cipher(ssl);
  const bool direct = TlsRecordCipher::Available() && SSL_version(ssl) == TLS1_3_VERSION &&
                      cipher != nullptr &&
                      SSL_CIPHER_get_id(cipher) == TLS1_3_CK_AES_128_GCM_SHA256 &&
                      SSL_has_pending(ssl) == 0 && secrets->client_bytes == kSecretBytes &&
                      secrets->server_bytes == kSecretBytes;
  if (!direct) {
    secrets->Wipe();
    SSL_set_read_ahead(ssl, 1);
    return std::unique_ptr<FrameTlsRecords>();
  }
  const std::span<const uint8_t> client(secrets->client, kSecretBytes);
  const std::span<const uint8_t> server(secrets->server, kSecretBytes);
  auto seal = TlsRecordCipher::FromTrafficSecret(is_server ? server : client,
                                                 TlsRecordCipher::Direction::kSeal);
  auto open = TlsRecordCipher::FromTrafficSecret(is_server ? client : server,
                                                 TlsRecordCipher::Direction::kOpen);
  secrets->Wipe();
  if (!seal.ok()) return seal.status();
  if (!open.ok()) return open.status();
  return std::unique_ptr<FrameTlsRecords>(
      new FrameTlsRecords(std::move(*seal), std::move(*open), peer));
}

std::unique_ptr<FrameTlsRecords> FrameTlsRecords::FromCiphers(TlsRecordCipher seal,
                                                              TlsRecordCipher open,
                                                              std::string peer) {
  return std::unique_ptr<FrameTlsRecords>(
      new FrameTlsRecords(std::move(seal), std::move(open), std::move(peer)));
}

Status FrameTlsRecords::Seal(const uint8_t* plain, size_t plain_bytes, std::vector<uint8_t>* out,
                             size_t* out_len) {
  const size_t records = (plain_bytes + kTlsMaxPlaintextBytes - 1) / kTlsMaxPlaintextBytes;
  const size_t need = *out_len + plain_bytes + records * TlsRecordBytes(0);
  if (out->size() < need) out->resize(std::max(need, out->size() * 2));
  for (size_t off = 0; off < plain_bytes;) {
    const size_t n = std::min(plain_bytes - off, kTlsMaxPlaintextBytes);
    Status st = seal_.Seal({plain + off, n}, TlsContentType::kApplicationData,
                           out->data() + *out_len);
    if (!st.ok()) {
      return UnavailableError(fmt::format("writing to {} failed: {}", peer_, st.message()));
    }
    *out_len += TlsRecordBytes(n);
    off += n;
  }
  return Status::Ok();
}

Status FrameTlsRecords::Open(uint8_t* raw, size_t* raw_off, size_t raw_len, std::string* in,
                             size_t* in_len) {
  while (raw_len - *raw_off >= kTlsRecordHeaderBytes) {
    uint8_t* rec = raw + *raw_off;
    const size_t body = size_t{rec[3]} << 8 | rec[4];
    if (rec[0] != static_cast<uint8_t>(TlsContentType::kApplicationData)) {
      return UnavailableError(fmt::format(
          "{} sent an unprotected TLS record of content type {} after the handshake", peer_,
          rec[0]));
    }
    if (body > kTlsMaxCiphertextBytes) {
      return UnavailableError(fmt::format("{} sent a TLS record of {} bytes; the limit is {} bytes",
                                          peer_, body, kTlsMaxCiphertextBytes));
    }
    if (raw_len - *raw_off < kTlsRecordHeaderBytes + body) break;
    size_t content = 0;
    TlsContentType type{};
    Status st = open_.Open({rec, kTlsRecordHeaderBytes + body}, &content, &type);
    if (!st.ok()) {
      return UnavailableError(fmt::format("a TLS record from {} was refused: {}", peer_, st.message()));
    }
    *raw_off += kTlsRecordHeaderBytes + body;
    const uint8_t* c = rec + kTlsRecordHeaderBytes;
    if (type != TlsContentType::kApplicationData) return Refuse(type, c, content);
    if (in->size() < *in_len + content) in->resize(std::max(*in_len + content, in->size() * 2));
    std::memcpy(in->data() + *in_len, c, content);
    *in_len += content;
  }
  return Status::Ok();
}

Status FrameTlsRecords::Refuse(TlsContentType type, const uint8_t* content, size_t bytes) const {
  if (type == TlsContentType::kAlert && bytes >= 2) {
    if (content[1] == SSL_AD_CLOSE_NOTIFY) {
      return UnavailableError(fmt::format("{} closed the connection", peer_));
    }
    return UnavailableError(fmt::format("{} sent TLS alert {} ({})", peer_, content[1],
                                        SSL_alert_desc_string_long(content[1])));
  }
  if (type == TlsContentType::kHandshake && bytes >= 1) {
    return UnavailableError(fmt::format(
        "{} sent a TLS {} (handshake type {}) after the handshake; this connection takes none",
        peer_, HandshakeName(content[0]), content[0]));
  }
  return UnavailableError(fmt::format(
      "{} sent a TLS record of content type {} after the handshake; only application data is taken",
      peer_, static_cast<int>(type)));
}

}  // namespace tandem
