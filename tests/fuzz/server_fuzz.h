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
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

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
inline bool Exchange(int fd, const std::string& out, size_t chunk, const std::string* marker,
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
        shutdown(fd, SHUT_WR);
        half_closed = true;
      }
    }
    if (now >= until) __builtin_trap();  // the server kept the connection open
    const bool waiting = !half_closed && sent == out.size();
    pollfd p{fd, static_cast<short>(POLLIN | (half_closed || waiting ? 0 : POLLOUT)), 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now);
    // While waiting for the calls, look at them every millisecond.
    const int r = poll(&p, 1, waiting ? 1 : static_cast<int>(left.count()) + 1);
    if (r < 0 && errno == EINTR) continue;
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        return whole && sent == out.size();  // the server closed
      }
      if (n > 0) got->append(buf, static_cast<size_t>(n));
    }
    if (!half_closed && !waiting && (p.revents & POLLOUT)) {
      const ssize_t w =
          send(fd, out.data() + sent, std::min(chunk, out.size() - sent), MSG_NOSIGNAL);
      if (w > 0) sent += static_cast<size_t>(w);
      if (w < 0 && errno != EAGAIN && errno != EINTR) whole = false;
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

// One input's connection: connects to `port`, exchanges `out` (one byte
// per write when `bytewise`; `marker` as for Exchange), closes, and waits
// until every admission slot is free again and every worker call has
// ended (else a trap: a slot leaked, or a call left a worker's
// registration and KV blocks reserved).
struct Connection {
  bool whole = false;  // Exchange's result
  std::string got;     // what the server sent
};
inline Connection OneConnection(uint16_t port, const std::string& out, bool bytewise,
                                const std::string* marker, const FuzzProxy& p) {
  Connection c;
  const int fd = ConnectLoopback(port);
  c.whole = Exchange(fd, out, bytewise ? 1 : out.size(), marker, *p.frontend, &c.got);
  close(fd);
  WaitUntil([&] { return p.frontend->inflight() == 0; });
  WaitUntil([&] { return p.workers->live() == 0; });
  // TANDEM_FUZZ_SHOW=1: what the server sent, for reading a seed's run.
  static const bool show = std::getenv("TANDEM_FUZZ_SHOW") != nullptr;
  if (show)
    std::fprintf(stderr, "--- the server sent %zu bytes:\n%s\n", c.got.size(), c.got.c_str());
  return c;
}

// Sends `request` on a new connection and reads until `reply` has come
// (a trap when the server closes first or takes longer than kPatience).
inline void ExpectAnswer(uint16_t port, const std::string& request, const std::string& reply) {
  const int fd = ConnectLoopback(port);
  // A fresh socket's buffer takes the small request at once.
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    __builtin_trap();
  }
  std::string got;
  char buf[4096];
  const auto until = std::chrono::steady_clock::now() + kPatience;
  while (got.find(reply) == std::string::npos) {
    if (std::chrono::steady_clock::now() > until) __builtin_trap();
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) __builtin_trap();  // closed without the reply
    got.append(buf, static_cast<size_t>(n));
  }
  close(fd);
}

}  // namespace tandem::fuzz
