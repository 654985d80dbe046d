// What the framed-transport tests share (frame_conn_test,
// proxy/decode_mux_tcp_client_test, proxy/watch_tcp_test,
// worker/prefill_tcp_test): certificates of a test CA for 127.0.0.1, their
// framed-connection TLS, and a framed listener on 127.0.0.1.
#pragma once

#include <gtest/gtest.h>

#include <csignal>
#include <memory>
#include <string>

#include "common/frame_conn.h"
#include "common/frame_server.h"
#include "common/tls_certs.h"

namespace tandem::frame_testing {

// A CA named `name` (a test failure when it cannot be made). Also sets
// SIGPIPE to be ignored: a write to a connection the peer closed must fail
// with EPIPE, not kill the process, as in every tandem process (gRPC's
// init does it; OpenSSL writes with write(2), without MSG_NOSIGNAL).
inline CertKeyPem MakeCa(const std::string& name) {
  std::signal(SIGPIPE, SIG_IGN);
  auto ca = CreateCaCertificate(name, 1);
  EXPECT_TRUE(ca.ok()) << ca.status().ToString();
  return ca.ok() ? *ca : CertKeyPem{};
}

// An identity issued by `ca` for 127.0.0.1 and localhost, trusting `ca`.
inline TlsPem Identity(const CertKeyPem& ca, const std::string& name) {
  auto cert = IssueCertificate(ca, name, {"127.0.0.1", "localhost"}, 1);
  EXPECT_TRUE(cert.ok()) << cert.status().ToString();
  return cert.ok() ? TlsPem{ca.cert, cert->cert, cert->key} : TlsPem{};
}

// An identity of another CA that trusts `fleet_ca` (the peer it talks to
// is authenticated; it is refused by a fleet member).
inline TlsPem Stranger(const CertKeyPem& fleet_ca, const std::string& name) {
  TlsPem pem = Identity(MakeCa("other-ca"), name);
  pem.ca = fleet_ca.cert;
  return pem;
}

inline std::shared_ptr<FrameTls> Tls(const TlsPem& pem) {
  auto t = FrameTls::Create(pem);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? *t : nullptr;
}

// A framed listener on 127.0.0.1 (a free port); `tls` null = plaintext.
// Null (a test failure) when it cannot start.
inline std::unique_ptr<FrameServer> Listen(std::shared_ptr<FrameTls> tls, FrameServer::Accept accept,
                                           FrameOptions options = {}) {
  auto s = FrameServer::Start("127.0.0.1:0", std::move(tls), options, std::move(accept));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

}  // namespace tandem::frame_testing
