// RFC 8446 6.1 on the public TLS front ends (security.public_tls): each
// side sends close_notify before closing its write side, unless it sent an
// error alert, so that a client reading to the end can tell a complete
// stream from a cut one. Every way the server ends a connection after the
// handshake is checked with a plain OpenSSL client on 127.0.0.1:
//   - native gRPC front end (proxy/h2, h2_io.cc): the client's close, a
//     protocol error (GOAWAY, then the close);
//   - OpenAI HTTP API (http/, http_session.cc): the client's close, a
//     `Connection: close` request, a body over the limit (413, then the
//     linger; the 413 itself was lost under TLS before), the idle timeout.
// Before session 49 both closed the TCP connection without close_notify
// (the client's OpenSSL 3 reports "unexpected eof while reading").
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "common/config.h"
#include "common/metrics.h"
#include "common/tls_certs.h"
#include "http/http_server.h"
#include "model/tokenizer.h"
#include "proxy/fleet.h"
#include "proxy/frontend.h"
#include "proxy/h2/h2_server.h"
#include "proxy/proxy_server.h"
#include "router/router.h"

namespace tandem {
namespace {

const std::string kAlpnH2 = "\x02h2";
const std::string kAlpnHttp = "\x08http/1.1";

uint16_t PortOf(const std::string& address) {
  return static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
}

// How a connection's bytes from the server ended.
enum class End { kCloseNotify, kNoCloseNotify, kTimedOut };

std::string Name(End e) {
  switch (e) {
    case End::kCloseNotify:
      return "close_notify";
    case End::kNoCloseNotify:
      return "closed without close_notify";
    case End::kTimedOut:
      return "not closed within 10 s";
  }
  return "?";
}

// A TLS client on a blocking socket whose reads give up after 10 s (a
// server that never closes fails the test, it does not hang it). The
// server's certificate is not checked: the test is about the close.
class TlsClient {
 public:
  TlsClient(uint16_t port, const std::string& alpn) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) return;
    timeval tv{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ctx_ = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_verify(ctx_, SSL_VERIFY_NONE, nullptr);
    ssl_ = SSL_new(ctx_);
    SSL_set_fd(ssl_, fd_);
    SSL_set_alpn_protos(ssl_, reinterpret_cast<const unsigned char*>(alpn.data()),
                        static_cast<unsigned>(alpn.size()));
    connected_ = SSL_connect(ssl_) == 1;
    ERR_clear_error();
  }
  ~TlsClient() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    if (ctx_ != nullptr) SSL_CTX_free(ctx_);
    close(fd_);
  }
  bool connected() const { return connected_; }

  bool Send(const std::string& bytes) {
    size_t n = 0;
    return SSL_write_ex(ssl_, bytes.data(), bytes.size(), &n) == 1 && n == bytes.size();
  }
  // Reads until `want` has come (or the connection ended); what was read
  // stays in got().
  bool ReadUntil(const std::string& want) {
    while (got_.find(want) == std::string::npos) {
      if (ReadOnce() <= 0) return false;
    }
    return true;
  }
  // Sends our close_notify (and keeps reading).
  void CloseNotify() {
    SSL_shutdown(ssl_);
    ERR_clear_error();
  }
  // Reads until the server's end.
  End ReadToEnd() {
    for (;;) {
      const int r = ReadOnce();
      if (r > 0) continue;
      if (r == 0) return End::kCloseNotify;
      return r == -2 ? End::kTimedOut : End::kNoCloseNotify;
    }
  }
  const std::string& got() const { return got_; }
  // How the last read failed (for a failure's message).
  const std::string& end() const { return end_; }

 private:
  // > 0 bytes; 0: close_notify; -1: the connection ended without it; -2:
  // the receive timeout.
  int ReadOnce() {
    char buf[4096];
    size_t n = 0;
    if (SSL_read_ex(ssl_, buf, sizeof buf, &n) == 1) {
      got_.append(buf, n);
      return static_cast<int>(n);
    }
    const int e = SSL_get_error(ssl_, 0);
    // SO_RCVTIMEO's EAGAIN reads as a read to retry, or as a system error.
    const bool timed_out = e == SSL_ERROR_WANT_READ ||
                           (e == SSL_ERROR_SYSCALL && (errno == EAGAIN || errno == EWOULDBLOCK));
    char why[256] = "";
    ERR_error_string_n(ERR_peek_error(), why, sizeof why);
    end_ = "SSL error " + std::to_string(e) + " (" + why + "), errno " + std::to_string(errno);
    ERR_clear_error();
    if (e == SSL_ERROR_ZERO_RETURN) return 0;
    return timed_out ? -2 : -1;
  }

  int fd_ = -1;
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
  bool connected_ = false;
  std::string got_;
  std::string end_;
};

// A proxy Frontend over an empty fleet (nothing here reaches a worker), a
// certificate for 127.0.0.1 and no client certificate asked for.
class PublicTlsCloseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tandem-tls-close-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    auto ca = FleetCa::OpenOrCreate(dir_, "test public CA");
    ASSERT_TRUE(ca.ok()) << ca.status().ToString();
    auto files = ca->Issue("proxy", {"127.0.0.1"});
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    tls_ = *files;
    tls_.ca_file.clear();
    auto tok = model::Tokenizer::Load(std::string(TANDEM_SOURCE_DIR) +
                                      "/models/tandem-kjv/tokenizer.json");
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tokenizer_ = std::move(tok).value();
    auto router = router::Router::Create(RouterConfig{}, router::RouterOptions{});
    ASSERT_TRUE(router.ok());
    proxy::FleetRequirements req;
    req.model = "tandem-kjv";
    fleet_ = std::make_unique<proxy::Fleet>(req, std::move(router).value());
    proxy::ServingLimits limits;
    limits.model = "tandem-kjv";
    limits.vocab_size = tokenizer_->vocab_size();
    limits.max_model_len = 2048;
    proxy::LifecycleDeps deps;
    deps.fleet = fleet_.get();
    deps.tokenizer = tokenizer_.get();
    frontend_ = std::make_unique<proxy::Frontend>(limits, deps, /*max_inflight=*/8, "");
  }
  void TearDown() override {
    h2_.reset();
    http_.reset();
    std::filesystem::remove_all(dir_);
  }

  uint16_t StartH2() {
    auto s = proxy::h2::H2Server::Start("127.0.0.1:0", frontend_.get(), tls_);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return 0;
    h2_ = std::move(s).value();
    h2_->SetServing(true);
    return PortOf(h2_->address());
  }
  // The HTTP API's limits come from config_.proxy (set them before).
  uint16_t StartHttp(const http::ServerOptions& options = {}) {
    config_.model.path = std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv";
    metrics_ = std::make_unique<MetricsRegistry>(MetricLabels{"tandem-kjv", "proxy", "proxy"});
    proxy::HttpContext ctx;
    ctx.config = &config_;
    ctx.frontend = frontend_.get();
    ctx.fleet = fleet_.get();
    ctx.metrics = metrics_.get();
    ctx.public_tls = tls_;
    auto s = http::HttpServer::Start("127.0.0.1:0", ctx, options);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return 0;
    http_ = std::move(s).value();
    return PortOf(http_->address());
  }

  std::string dir_;
  TlsFiles tls_;
  std::unique_ptr<model::Tokenizer> tokenizer_;
  std::unique_ptr<proxy::Fleet> fleet_;
  std::unique_ptr<proxy::Frontend> frontend_;
  FleetConfig config_;
  std::unique_ptr<MetricsRegistry> metrics_;
  std::unique_ptr<proxy::h2::H2Server> h2_;
  std::unique_ptr<http::HttpServer> http_;
};

// Whether the HTTP/2 frames the server sent (walked by their headers)
// include a GOAWAY (type 7).
bool HasGoaway(const std::string& got) {
  for (size_t at = 0; at + 9 <= got.size();) {
    const size_t len = (size_t{static_cast<uint8_t>(got[at])} << 16) |
                       (size_t{static_cast<uint8_t>(got[at + 1])} << 8) |
                       static_cast<uint8_t>(got[at + 2]);
    if (got[at + 3] == 0x7) return true;
    at += 9 + len;
  }
  return false;
}

const std::string kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const std::string kEmptySettings = std::string("\0\0\0\x04\0\0\0\0\0", 9);

TEST_F(PublicTlsCloseTest, NativeGrpcAnswersTheClientsCloseNotifyWithItsOwn) {
  TlsClient c(StartH2(), kAlpnH2);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send(kPreface + kEmptySettings));
  // The server's SETTINGS and its ACK of ours: the session is up.
  ASSERT_TRUE(c.ReadUntil(std::string("\0\0\0\x04\x01\0\0\0\0", 9)));
  c.CloseNotify();
  EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
}

TEST_F(PublicTlsCloseTest, NativeGrpcSendsCloseNotifyAfterTheGoawayOfAProtocolError) {
  TlsClient c(StartH2(), kAlpnH2);
  ASSERT_TRUE(c.connected());
  // A preface, then a DATA frame on stream 0 (RFC 9113 6.1: PROTOCOL_ERROR).
  ASSERT_TRUE(c.Send(kPreface + kEmptySettings + std::string("\0\0\x01\0\0\0\0\0\0x", 10)));
  EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
  // Its GOAWAY came before.
  EXPECT_TRUE(HasGoaway(c.got())) << c.got().size() << " bytes from the server";
}

TEST_F(PublicTlsCloseTest, HttpAnswersTheClientsCloseNotifyWithItsOwn) {
  TlsClient c(StartHttp(), kAlpnHttp);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send("GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"));
  ASSERT_TRUE(c.ReadUntil("\"tandem-kjv\""));
  c.CloseNotify();
  EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
}

TEST_F(PublicTlsCloseTest, HttpClosesAConnectionCloseRequestWithCloseNotify) {
  TlsClient c(StartHttp(), kAlpnHttp);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send("GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"));
  EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
  EXPECT_NE(c.got().find("\"tandem-kjv\""), std::string::npos) << c.got();
}

// Since session 50: after our close_notify, the client's close ends the
// connection on the server at once. Before, the TLS layer's read took the
// client's close (EOF) and the linger's read of the raw socket waited for
// a readiness edge that never came, so the socket stayed open until the
// linger time (2 s) closed it. Here that time is 60 s and the wait for the
// server's side to close has a 30 s bound: only the client's close can end
// it in time.
TEST_F(PublicTlsCloseTest, HttpEndsAConnectionCloseRequestAtTheClientsClose) {
  http::ServerOptions options;
  options.linger_seconds = 60;
  const uint16_t port = StartHttp(options);
  {
    TlsClient c(port, kAlpnHttp);
    ASSERT_TRUE(c.connected());
    ASSERT_TRUE(c.Send("GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"));
    EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
  }  // the client closes its socket
  EXPECT_TRUE(http_->WaitForNoConnections(30)) << http_->open_connections() << " open";
}

// Also: before session 49 the 413 itself never left under TLS (its bytes
// wait for the strand's flush, and the session went with the handler of the
// read that failed, before the flush ran: http_session.cc, OnReadError).
TEST_F(PublicTlsCloseTest, HttpRefusesABodyOverTheLimitThenSendsCloseNotify) {
  config_.proxy.limits.max_http_body_bytes = 1024;
  TlsClient c(StartHttp(), kAlpnHttp);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(
      c.Send("POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
             "Content-Length: 4096\r\n\r\n" +
             std::string(2048, ' ')));
  EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
  EXPECT_TRUE(c.got().starts_with("HTTP/1.1 413 ")) << c.got();
}

TEST_F(PublicTlsCloseTest, HttpClosesAnIdleConnectionWithCloseNotify) {
  config_.proxy.http_idle_timeout_seconds = 0.2;
  TlsClient c(StartHttp(), kAlpnHttp);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send("GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"));
  ASSERT_TRUE(c.ReadUntil("\"tandem-kjv\""));
  // Nothing more: the server ends the keep-alive connection at its timeout.
  EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
}

// Since session 50: a connection still open when the server stops (after
// the proxy's drain) ends with close_notify, as an idle one does; before,
// the I/O threads stopped and the socket closed bare when the server went.
TEST_F(PublicTlsCloseTest, HttpStopsAnOpenConnectionWithCloseNotify) {
  TlsClient c(StartHttp(), kAlpnHttp);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send("GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"));
  ASSERT_TRUE(c.ReadUntil("\"tandem-kjv\""));
  http_->Shutdown();
  EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
}

// The native front end's stop: its GOAWAY, then close_notify.
TEST_F(PublicTlsCloseTest, NativeGrpcStopsAnOpenConnectionWithCloseNotify) {
  TlsClient c(StartH2(), kAlpnH2);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send(kPreface + kEmptySettings));
  ASSERT_TRUE(c.ReadUntil(std::string("\0\0\0\x04\x01\0\0\0\0", 9)));
  h2_->Shutdown();
  EXPECT_EQ(Name(c.ReadToEnd()), Name(End::kCloseNotify)) << c.end();
  EXPECT_TRUE(HasGoaway(c.got())) << c.got().size() << " bytes from the server";
}

}  // namespace
}  // namespace tandem
