// What fuzz_h2_server and fuzz_http_server share: a proxy Frontend over a
// fleet of scripted workers in this process (fuzz_workers.h: a request that
// passes every check is routed and runs its whole lifecycle), and one
// client connection's exchange with a server on 127.0.0.1, read all along,
// with the checks both targets make.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "common/tls_certs.h"
#include "fuzz_workers.h"
#include "model/tokenizer.h"
#include "proxy/fleet.h"
#include "proxy/frontend.h"
#include "router/router.h"

namespace tandem::fuzz {

using namespace std::chrono_literals;

// Under tools/fuzz.sh's -timeout=10: a wait past it is the target's trap,
// which says what hung.
inline constexpr auto kPatience = 8s;

struct FuzzProxy {
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::unique_ptr<proxy::Fleet> fleet;
  std::unique_ptr<FuzzWorkers> workers;
  std::unique_ptr<proxy::Frontend> frontend;
};

// The bundled model's tokenizer, a fleet of two prefillers and two decoders
// (FuzzWorkers), a Frontend of 64 slots and an open API. Never destroyed
// (the servers' threads outlive inputs).
inline FuzzProxy* StartFuzzProxy() {
  auto* p = new FuzzProxy();
  signal(SIGPIPE, SIG_IGN);  // a TLS write to a connection the server closed
  auto tok = model::Tokenizer::Load(TANDEM_SOURCE_DIR "/models/tandem-kjv/tokenizer.json");
  if (!tok.ok()) std::abort();
  p->tokenizer = std::move(tok).value();
  auto router = router::Router::Create(RouterConfig{}, router::RouterOptions{});
  if (!router.ok()) std::abort();
  proxy::FleetRequirements req;
  req.model = "tandem-kjv";
  p->fleet = std::make_unique<proxy::Fleet>(req, std::move(router).value());
  p->workers = std::make_unique<FuzzWorkers>(p->tokenizer->vocab_size());
  if (!FuzzWorkers::Register(*p->fleet, req.model)) std::abort();
  proxy::ServingLimits limits;
  limits.model = "tandem-kjv";
  limits.vocab_size = p->tokenizer->vocab_size();
  limits.max_model_len = 2048;
  limits.max_request_bytes = 64 << 10;
  proxy::LifecycleDeps deps;
  deps.fleet = p->fleet.get();
  deps.client = p->workers.get();
  deps.tokenizer = p->tokenizer.get();
  deps.eos_token_ids = {0};
  p->frontend = std::make_unique<proxy::Frontend>(limits, deps, /*max_inflight=*/64, "");
  static FuzzWorkers* workers = p->workers.get();
  std::atexit([] { std::fprintf(stderr, "%s\n", workers->Summary().c_str()); });
  return p;
}

// A certificate for 127.0.0.1 from a CA made for this process, in a
// temporary folder removed at exit: the TLS servers' security.public_tls.
inline TlsFiles FuzzTlsFiles() {
  static const std::string* dir = [] {
    char tmpl[] = "/tmp/tandem-fuzz-tls-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) std::abort();
    std::atexit([] { std::filesystem::remove_all(*dir); });
    return new std::string(tmpl);  // never destroyed: read at exit
  }();
  auto ca = FleetCa::OpenOrCreate(*dir, "tandem fuzz CA");
  if (!ca.ok()) std::abort();
  auto files = ca->Issue("proxy", {"127.0.0.1"});
  if (!files.ok()) std::abort();
  files->ca_file.clear();  // no client certificate asked for (a public API's usual TLS)
  return *files;
}

// The port of a "host:port" address.
inline uint16_t PortOf(const std::string& address) {
  return static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
}

// A connected socket, non-blocking. The connect is non-blocking too:
// libFuzzer's timer signal (-timeout) interrupts a blocking one (EINTR),
// and a burst of short inputs can find every local port in TIME_WAIT for a
// moment (EADDRNOTAVAIL: tried again for up to kPatience). Any other
// failure ends the run naming it.
inline int ConnectLoopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const auto until = std::chrono::steady_clock::now() + kPatience;
  for (;;) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) std::abort();
    int err = 0;
    if (connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
      err = errno;
      if (err == EINPROGRESS || err == EINTR) {
        pollfd p{fd, POLLOUT, 0};
        while (poll(&p, 1, 1000) <= 0) {
          if (std::chrono::steady_clock::now() > until) __builtin_trap();  // never accepted
        }
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    if (err == 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return fd;
    }
    close(fd);
    if (err != EADDRNOTAVAIL || std::chrono::steady_clock::now() > until) {
      std::fprintf(stderr, "connecting to 127.0.0.1:%u: %s\n", port, std::strerror(err));
      std::abort();
    }
    std::this_thread::sleep_for(10ms);
  }
}

// One client connection's bytes: plain TCP, or TLS through OpenSSL over the
// same non-blocking socket (the public front ends with security.public_tls:
// h2_tls.cc, the HTTP API's TLS stream). Owns the socket.
class ClientIo {
 public:
  ClientIo(int fd, SSL* ssl) : fd_(fd), ssl_(ssl) {}
  ~ClientIo() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    close(fd_);
  }
  ClientIo(const ClientIo&) = delete;
  ClientIo& operator=(const ClientIo&) = delete;
  int fd() const { return fd_; }
  // Bytes read: > 0; 0: the server closed (or reset, or TLS failed); -1:
  // nothing to read now. Over TLS, close_notified() says whether the end
  // was the server's close_notify.
  ssize_t Read(char* buf, size_t n) {
    if (ssl_ == nullptr) {
      const ssize_t r = read(fd_, buf, n);
      if (r < 0) return errno == EAGAIN || errno == EINTR ? -1 : 0;
      return r;
    }
    const int r = SSL_read(ssl_, buf, static_cast<int>(n));
    if (r > 0) return r;
    const int e = SSL_get_error(ssl_, r);
    ERR_clear_error();
    close_notified_ = e == SSL_ERROR_ZERO_RETURN;
    return e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE ? -1 : 0;
  }
  bool close_notified() const { return close_notified_; }
  // Bytes written: > 0; -1: none now; -2: the connection is broken.
  ssize_t Write(const char* p, size_t n) {
    if (ssl_ == nullptr) {
      const ssize_t w = send(fd_, p, n, MSG_NOSIGNAL);
      if (w < 0) return errno == EAGAIN || errno == EINTR ? -1 : -2;
      return w;
    }
    const int w = SSL_write(ssl_, p, static_cast<int>(n));
    if (w > 0) return w;
    const int e = SSL_get_error(ssl_, w);
    ERR_clear_error();
    return e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE ? -1 : -2;
  }
  // The client's end: TLS's close_notify first, then the TCP half-close.
  void CloseWrite() {
    if (ssl_ != nullptr) {
      SSL_shutdown(ssl_);
      ERR_clear_error();
    }
    shutdown(fd_, SHUT_WR);
  }
  // Decrypted bytes waiting in OpenSSL (poll() cannot see them).
  bool Buffered() const { return ssl_ != nullptr && SSL_pending(ssl_) > 0; }

 private:
  int fd_;
  SSL* ssl_;
  bool close_notified_ = false;
};

// The client side of the TLS servers: TLS 1.2 or 1.3, the server's
// certificate not checked (the fuzzer tests the server, not the client),
// ALPN as given ("h2" for the gRPC front end, which refuses a handshake
// without it; "http/1.1" for the HTTP API).
inline SSL_CTX* ClientTlsContext() {
  static SSL_CTX* ctx = [] {
    SSL_CTX* c = SSL_CTX_new(TLS_client_method());
    if (c == nullptr) std::abort();
    SSL_CTX_set_verify(c, SSL_VERIFY_NONE, nullptr);
    SSL_CTX_set_mode(c, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    return c;
  }();
  return ctx;
}

// A connection to 127.0.0.1:`port`; with `alpn` (wire format: a length
// byte, then the protocol) the TLS handshake is done first (a server that
// does not complete it within kPatience is a trap).
inline std::unique_ptr<ClientIo> Dial(uint16_t port, const std::string* alpn) {
  const int fd = ConnectLoopback(port);
  if (alpn == nullptr) return std::make_unique<ClientIo>(fd, nullptr);
  SSL* ssl = SSL_new(ClientTlsContext());
  if (ssl == nullptr) std::abort();
  SSL_set_fd(ssl, fd);
  SSL_set_alpn_protos(ssl, reinterpret_cast<const unsigned char*>(alpn->data()),
                      static_cast<unsigned>(alpn->size()));
  auto io = std::make_unique<ClientIo>(fd, ssl);
  const auto until = std::chrono::steady_clock::now() + kPatience;
  for (;;) {
    const int r = SSL_connect(ssl);
    if (r == 1) return io;
    const int e = SSL_get_error(ssl, r);
    if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
      std::fprintf(stderr, "TLS handshake with 127.0.0.1:%u failed (SSL error %d)\n", port, e);
      __builtin_trap();  // the server refused a plain TLS client
    }
    if (std::chrono::steady_clock::now() > until) __builtin_trap();
    pollfd p{fd, static_cast<short>(e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
    poll(&p, 1, 100);
  }
}

// Sends `out` in writes of at most `chunk` bytes while reading what the
// server sends, closes the client's end, then reads until the server
// closes. Reading all along keeps a server that stops reading a client
// who does not read its replies from looking hung. With `marker`: the
// client's end stays open after the last byte until the server has sent
// `marker` (the answer to something sent last, so everything before it
// was read) and the frontend's calls have all ended, or for 100 ms after
// the marker (a call that waits on a stalled worker or on the client's
// flow-control window does not end by itself); when the marker does not
// come within 50 ms (an input that leaves something unfinished swallows
// what was sent last) the client closes as without it. A server that keeps
// the connection open past kPatience is a trap. False: the server closed
// or reset the connection before everything was sent.
inline bool Exchange(ClientIo& io, const std::string& out, size_t chunk, const std::string* marker,
                     const proxy::Frontend& fe, std::string* got) {
  const auto until = std::chrono::steady_clock::now() + kPatience;
  constexpr auto kNever = std::chrono::steady_clock::time_point::max();
  auto all_sent = kNever, marker_seen = kNever;
  size_t sent = 0;
  bool whole = true, half_closed = false;
  char buf[16384];
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (!half_closed && sent == out.size() && all_sent == kNever) all_sent = now;
    if (!half_closed && (!whole || sent == out.size())) {
      bool close_now = true;
      if (marker != nullptr && whole) {
        if (marker_seen == kNever && got->find(*marker) != std::string::npos) marker_seen = now;
        close_now = marker_seen != kNever ? fe.inflight() == 0 || now - marker_seen > 100ms
                                          : now - all_sent > 50ms;
      }
      if (close_now) {
        io.CloseWrite();
        half_closed = true;
      }
    }
    if (now >= until) __builtin_trap();  // the server kept the connection open
    const bool waiting = !half_closed && sent == out.size();
    pollfd p{io.fd(), static_cast<short>(POLLIN | (half_closed || waiting ? 0 : POLLOUT)), 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now);
    // While waiting for the calls, look at them every millisecond.
    const int r = io.Buffered() ? 0 : poll(&p, 1, waiting ? 1 : static_cast<int>(left.count()) + 1);
    if (r < 0 && errno == EINTR) continue;
    if (io.Buffered() || (p.revents & (POLLIN | POLLHUP | POLLERR))) {
      const ssize_t n = io.Read(buf, sizeof(buf));
      if (n == 0) return whole && sent == out.size();  // the server closed
      if (n > 0) got->append(buf, static_cast<size_t>(n));
    }
    if (!half_closed && !waiting && (p.revents & POLLOUT)) {
      const ssize_t w = io.Write(out.data() + sent, std::min(chunk, out.size() - sent));
      if (w > 0) sent += static_cast<size_t>(w);
      if (w == -2) whole = false;
    }
  }
}

// Waits until `done()`; a trap after kPatience. (Polled: the states waited
// on, a slot count and a connection count, have no event to wait on.)
template <typename Done>
void WaitUntil(Done done) {
  const auto until = std::chrono::steady_clock::now() + kPatience;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) __builtin_trap();
    std::this_thread::sleep_for(1ms);
  }
}

// One input's connection: connects to `port` (over TLS with `alpn`, as
// Dial), exchanges `out` (one byte per write when `bytewise`: over TLS one
// record per byte; `marker` as for Exchange), closes, and waits until
// every admission slot is free again and every worker call has ended (else
// a trap: a slot leaked, or a call left a worker's registration and KV
// blocks reserved). Over TLS the server's end must be its close_notify
// (RFC 8446 6.1; the client is a correct TLS client, so the server has no
// error alert to send instead).
struct Connection {
  bool whole = false;  // Exchange's result
  std::string got;     // what the server sent
};
inline Connection OneConnection(uint16_t port, const std::string* alpn, const std::string& out,
                                bool bytewise, const std::string* marker, const FuzzProxy& p) {
  Connection c;
  {
    const std::unique_ptr<ClientIo> io = Dial(port, alpn);
    c.whole = Exchange(*io, out, bytewise ? 1 : out.size(), marker, *p.frontend, &c.got);
    if (alpn != nullptr && !io->close_notified()) {
      std::fprintf(stderr, "the TLS server closed the connection without close_notify\n");
      __builtin_trap();
    }
  }
  WaitUntil([&] { return p.frontend->inflight() == 0; });
  if (!p.workers->WaitIdle(kPatience)) __builtin_trap();
  // TANDEM_FUZZ_SHOW=1: what the server sent, for reading a seed's run.
  static const bool show = std::getenv("TANDEM_FUZZ_SHOW") != nullptr;
  if (show) {
    std::fprintf(stderr, "--- the server sent %zu bytes%s:\n%s\n", c.got.size(),
                 alpn != nullptr ? " over TLS" : "", c.got.c_str());
  }
  return c;
}

// Sends `request` on a new connection (over TLS with `alpn`) and reads
// until `reply` has come (a trap when the server closes first or takes
// longer than kPatience).
inline void ExpectAnswer(uint16_t port, const std::string* alpn, const std::string& request,
                         const std::string& reply) {
  const std::unique_ptr<ClientIo> io = Dial(port, alpn);
  const auto until = std::chrono::steady_clock::now() + kPatience;
  size_t sent = 0;
  std::string got;
  char buf[4096];
  while (got.find(reply) == std::string::npos) {
    if (std::chrono::steady_clock::now() > until) __builtin_trap();
    if (sent < request.size()) {
      const ssize_t w = io->Write(request.data() + sent, request.size() - sent);
      if (w == -2) __builtin_trap();  // closed before the request was sent
      if (w > 0) sent += static_cast<size_t>(w);
    }
    pollfd p{io->fd(), static_cast<short>(POLLIN | (sent < request.size() ? POLLOUT : 0)), 0};
    if (!io->Buffered() && poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = io->Read(buf, sizeof(buf));
    if (n == 0) __builtin_trap();  // closed without the reply
    if (n > 0) got.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace tandem::fuzz
