// TLS of the native gRPC front end's public port (docs/grpc-frontend.md
// "TLS", docs/security.md): the OpenSSL server context built from
// security.public_tls's files, and its renewal.
//
// Policy (as the gRPC C++ front end): TLS 1.2 and 1.3 only; for TLS 1.2 the
// ECDHE AES-GCM suites gRPC offers by default; ALPN must select "h2" (a
// client that offers ALPN without h2 gets the no_application_protocol
// alert; one that offers none is refused after the handshake, h2_io.h);
// with a client CA file a client certificate is required and verified
// against it. No session tickets (connections are long-lived).
//
// Renewal (docs/security.md "Renewing the public certificate"): Reload()
// (SIGHUP) builds a new context from the files now; MaybeReload() (the
// event thread, at every accept) re-reads them when their size, mtime or
// inode changed, at most once every kCheckSeconds — gRPC's file watcher's
// promise, without a timer that wakes an idle proxy. New connections get
// the new context; open ones keep theirs (an SSL holds a reference to its
// context). A reload that fails is logged and the old context stays.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <openssl/ssl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "common/tls.h"

namespace tandem::proxy::h2 {

struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxFree>;

// A server context for `files` (cert_file, key_file; ca_file: the client
// CA, may be empty). InvalidArgument naming the file that does not load.
Result<SslCtxPtr> NewPublicServerContext(const TlsFiles& files);

class H2TlsContext {
 public:
  static Result<std::unique_ptr<H2TlsContext>> Create(const TlsFiles& files);

  // A new SSL for an accepted connection, from the current context; null
  // when OpenSSL cannot make one.
  SSL* NewSsl();
  // Re-reads the files now; the old context stays on error.
  Status Reload();
  // Re-reads the files when they changed (at most every kCheckSeconds).
  void MaybeReload(std::chrono::steady_clock::time_point now);

  static constexpr int kCheckSeconds = 1;

 private:
  explicit H2TlsContext(TlsFiles files) : files_(std::move(files)) {}
  std::string Fingerprint() const;  // size, mtime and inode of the files

  const TlsFiles files_;
  std::mutex mu_;
  SslCtxPtr ctx_;                                    // guarded by mu_
  std::string loaded_;                               // guarded by mu_: files' fingerprint in ctx_
  std::string failed_;                               // guarded by mu_: last fingerprint that failed
  std::chrono::steady_clock::time_point checked_{};  // guarded by mu_
};

}  // namespace tandem::proxy::h2
