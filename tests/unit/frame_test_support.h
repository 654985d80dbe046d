// What the framed-transport tests share (frame_conn_test,
// frame_tls_records_test, proxy/decode_mux_tcp_client_test,
// proxy/watch_tcp_test, worker/prefill_tcp_test): certificates of a test CA
// for 127.0.0.1, their framed-connection TLS, a framed listener on
// 127.0.0.1, and a client connection that keeps the frames it reads.
#pragma once

#include <gtest/gtest.h>
#include <openssl/err.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/frame_conn.h"
#include "common/frame_reader.h"
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

// A client connection served by a FrameReader: a thread of its own (as the
// decode stream's), or `loop`'s (as the Watch and Prefill connections').
// It keeps every frame's payload and how the connection ended.
class FrameClient {
 public:
  // `stale_error`: an OpenSSL error entry is left in the reader thread's
  // queue before every wait, as another TLS call on that thread could.
  FrameClient(const std::string& address, std::shared_ptr<FrameTls> tls, FrameOptions o = {},
              FrameLoop* loop = nullptr, bool stale_error = false)
      : conn_(FrameConn::Client(address, std::move(tls), o)), reader_(conn_, loop) {
    FrameReader::Hooks hooks;
    if (stale_error) {
      hooks.before_wait = [] {
        ERR_raise_data(ERR_LIB_USER, 1, "stale entry left by the test");
        return std::chrono::steady_clock::time_point::max();
      };
    }
    hooks.on_frame = [this](std::string_view payload) {
      std::lock_guard lock(mu_);
      frames_.emplace_back(payload);
      cv_.notify_all();
      return Status::Ok();
    };
    hooks.on_end = [this](const Status& why) {
      std::lock_guard lock(mu_);
      ended_ = true;
      end_ = why;
      cv_.notify_all();
    };
    // The connection is what the reader keeps; the destructor's Join
    // waits for the end before the reader goes.
    reader_.Start("test-frame-rd", std::move(hooks), conn_);
  }
  ~FrameClient() {
    conn_->Close(CancelledError("test over"));
    reader_.Wake();
    reader_.Join();
  }
  FrameClient(const FrameClient&) = delete;
  FrameClient& operator=(const FrameClient&) = delete;
  FrameConn& conn() { return *conn_; }
  // Waits for `n` frames (or the end); the payloads received.
  std::vector<std::string> WaitFrames(size_t n) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(20), [&] { return frames_.size() >= n || ended_; });
    return frames_;
  }
  Status WaitEnd() {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(20), [&] { return ended_; });
    return ended_ ? end_ : InternalError("still open");
  }
  bool ended() {
    std::lock_guard lock(mu_);
    return ended_;
  }

 private:
  std::shared_ptr<FrameConn> conn_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> frames_;
  bool ended_ = false;
  Status end_ = Status::Ok();
  FrameReader reader_;  // last: it ends before the members above go
};

}  // namespace tandem::frame_testing
