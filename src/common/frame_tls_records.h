// The record layer of a framed mutual-TLS connection after its handshake
// (issue 23; docs/security.md "Framed connections' records"): FrameConn
// seals and opens TLS 1.3 application records itself (common/tls_record.h)
// instead of one SSL_read / SSL_write per record, whose per-call machinery
// cost twice the record's crypto (bench_tls_record,
// bench/results/proxy_cost/session-11.md). The wire stays TLS 1.3: the peer
// may be any TLS 1.3 stack.
//
// OpenSSL still does the handshake (certificates, verification, key
// exchange). Its keylog callback hands over the two application traffic
// secrets (CLIENT_/SERVER_TRAFFIC_SECRET_0), which stay in the connection's
// FrameTlsSecrets only until the record keys are derived, and are never
// logged. The switch happens only when nothing is left for OpenSSL to
// carry on: TLS 1.3 with TLS_AES_128_GCM_SHA256 (the internal contexts pin
// it), no byte read past the handshake (read-ahead is off until then), no
// session tickets due (the contexts send none), and OpenSSL's AES-128-GCM
// provider offers the functions TlsRecordCipher calls. Otherwise the
// connection stays on SSL_read / SSL_write.
//
// After the switch: an alert ends the connection with an error naming it
// (close_notify: the peer closed it); a handshake record (KeyUpdate,
// NewSessionTicket, ...) or any content type but application data ends it
// with an error naming what came; a record that fails authentication ends
// it with an error naming the peer, and none of its bytes is delivered; a
// record over 2^14 + 256 bytes, or one whose inner plaintext would be over
// 2^14 + 1 bytes (RFC 8446 5.4), is refused; the sequence numbers never
// wrap (the connection closes first).
//
// Thread-safety: sealing under FrameConn's mutex (from a sender's thread),
// opening by the connection's I/O thread alone, without it: the two
// directions share nothing (each its own key, cipher context and sequence
// number), so a seal and an open may run at once.
#pragma once

#include <openssl/ssl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tls_record.h"

namespace tandem {

// The application traffic secrets OpenSSL's keylog callback reports during
// one connection's handshake.
struct FrameTlsSecrets {
  uint8_t client[48] = {};
  uint8_t server[48] = {};
  size_t client_bytes = 0;
  size_t server_bytes = 0;
  ~FrameTlsSecrets() { Wipe(); }
  void Wipe();
};

// Sets the internal contexts up for the switch: TLS 1.3 ciphersuite pinned
// to TLS_AES_128_GCM_SHA256, the keylog callback that fills the secrets of
// the connection whose SSL was given to AttachSecrets.
Status SetupFrameTlsRecords(SSL_CTX* ctx);
// Before the handshake: `ssl` reports its secrets into `secrets` (which
// must outlive the handshake), and reads no byte past the handshake.
void AttachSecrets(SSL* ssl, FrameTlsSecrets* secrets);

class FrameTlsRecords {
 public:
  // After `ssl`'s handshake succeeded: the record layer when the switch is
  // possible (see above), else null (stay on OpenSSL; read-ahead is then
  // turned back on). `secrets` is wiped either way. An error: the
  // connection cannot go on (a key could not be derived).
  static Result<std::unique_ptr<FrameTlsRecords>> Start(SSL* ssl, bool is_server,
                                                         FrameTlsSecrets* secrets,
                                                         const std::string& peer);

  // The record layer from two ciphers keyed directly, without a handshake
  // (fuzz_tls_records' way to reach Open and Seal).
  static std::unique_ptr<FrameTlsRecords> FromCiphers(TlsRecordCipher seal, TlsRecordCipher open,
                                                      std::string peer);

  // Seals `plain` (any length: split into records of at most 2^14 bytes)
  // and appends the records to out[*out_len, ...), growing `out` when
  // needed.
  Status Seal(const uint8_t* plain, size_t plain_bytes, std::vector<uint8_t>* out,
              size_t* out_len);
  // Opens every whole record in raw[*raw_off, raw_len) (decrypting in
  // place) and appends their content to in[*in_len, ...), growing `in` when
  // needed; *raw_off moves past them. A partial record stays for the next
  // call. An error (alert, handshake message, failed record...) ends the
  // connection; the content of the records before it was appended.
  Status Open(uint8_t* raw, size_t* raw_off, size_t raw_len, std::string* in, size_t* in_len);

 private:
  FrameTlsRecords(TlsRecordCipher seal, TlsRecordCipher open, std::string peer)
      : seal_(std::move(seal)), open_(std::move(open)), peer_(std::move(peer)) {}
  // The error for a record of another type than application data.
  Status Refuse(TlsContentType type, const uint8_t* content, size_t bytes) const;
  TlsRecordCipher seal_;
  TlsRecordCipher open_;
  const std::string peer_;
};

}  // namespace tandem
