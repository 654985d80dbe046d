#include "proxy/h2/h2_server.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/delivery_scope.h"
#include "common/net.h"
#include "proxy/h2/grpc_calls.h"
#include "proxy/h2/h2_connection.h"
#include "proxy/h2/h2_tls.h"

namespace tandem::proxy::h2 {
namespace {

thread_local bool t_event_thread = false;

Result<int> Listen(const HostPort& hp, uint16_t* port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string host = hp.host;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                             std::to_string(hp.port).c_str(), &hints, &res);
  if (rc != 0) {
    return InvalidArgumentError(fmt::format("cannot resolve '{}': {}", hp.host, gai_strerror(rc)));
  }
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* ai = res; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // not SO_REUSEPORT
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 1024) != 0) {
      why = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) {
    return UnavailableError(fmt::format("gRPC server cannot listen on {}: {}", hp.ToString(), why));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  *port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd;
}

}  // namespace

Result<std::unique_ptr<H2Server>> H2Server::Start(const std::string& address, Frontend* frontend,
                                                  const TlsFiles& tls) {
  TANDEM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  std::unique_ptr<H2Server> s(new H2Server());
  s->frontend_ = frontend;
  if (!tls.empty()) {
    TANDEM_ASSIGN_OR_RETURN(s->tls_, H2TlsContext::Create(tls));
  }
  uint16_t port = 0;
  TANDEM_ASSIGN_OR_RETURN(s->listen_fd_, Listen(hp, &port));
  hp.port = port;
  s->address_ = hp.ToString();
  s->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  s->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s->epoll_fd_ < 0 || s->wake_fd_ < 0) {
    return InternalError(fmt::format("epoll/eventfd: {}", std::strerror(errno)));
  }
  for (int fd : {s->listen_fd_, s->wake_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(s->epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

H2Server::~H2Server() {
  Shutdown();
  for (int fd : {listen_fd_, epoll_fd_, wake_fd_}) {
    if (fd >= 0) close(fd);
  }
}

void H2Server::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  serving_ = false;
  stop_ = true;
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

void H2Server::Wake(const std::shared_ptr<H2Connection>& c) {
  bool first;
  {
    std::lock_guard lock(wake_mu_);
    first = woken_.empty();
    woken_.push_back(c);
  }
  if (first) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
  }
}

bool H2Server::OnEventThread() { return t_event_thread; }

Status H2Server::ReloadTls() { return tls_ ? tls_->Reload() : Status::Ok(); }

void H2Server::SetServing(bool serving) {
  if (serving_.exchange(serving) == serving) return;
  // grpc.health.v1.HealthCheckResponse { status = 1 (SERVING) | 2 }.
  const std::string msg = {'\x08', serving ? '\x01' : '\x02'};
  std::lock_guard lock(watch_mu_);
  std::erase_if(watchers_, [&](auto& w) {
    auto c = w.first.lock();
    auto s = w.second.lock();
    if (!c || !s) return true;
    c->PostStreamed(s, msg);
    return false;
  });
}

void H2Server::AddWatcher(const std::shared_ptr<H2Connection>& c,
                          const std::shared_ptr<H2Stream>& s) {
  std::lock_guard lock(watch_mu_);
  // Streams that ended leave here (a client re-opening Watch grows nothing).
  std::erase_if(watchers_, [](auto& w) { return w.second.expired(); });
  watchers_.emplace_back(c, s);
}

void H2Server::AddDeadline(const std::shared_ptr<H2Connection>& c,
                           const std::shared_ptr<H2Stream>& s) {
  bool earliest;
  {
    std::lock_guard lock(deadline_mu_);
    deadlines_.push(Deadline{s->deadline, c, s});
    earliest = deadlines_.top().stream.lock() == s;
  }
  // The event thread sleeps until its earliest deadline: a new earliest
  // one added elsewhere wakes it to sleep less.
  if (earliest && !t_event_thread) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
  }
}

void H2Server::WantWrite(int fd, bool on) {
  epoll_event ev{};
  ev.events = on ? uint32_t{EPOLLIN | EPOLLOUT} : uint32_t{EPOLLIN};
  ev.data.fd = fd;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &ev);
}

int H2Server::NextTimeoutMs() {
  // Quiet connections are looked at when the first of them may have
  // fallen quiet (h2_connection.h), new ones within kQuietFor.
  auto until = quiet_ > 0 ? std::min(next_cool_, std::chrono::steady_clock::now() + kQuietFor)
                          : std::chrono::steady_clock::time_point::max();
  {
    std::lock_guard lock(deadline_mu_);
    if (!deadlines_.empty()) until = std::min(until, deadlines_.top().at);
  }
  if (until == std::chrono::steady_clock::time_point::max()) return -1;
  const auto left = until - std::chrono::steady_clock::now();
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return ms <= 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 60'000));
}

void H2Server::ExpireDeadlines() {
  const auto now = std::chrono::steady_clock::now();
  std::vector<Deadline> due;
  {
    std::lock_guard lock(deadline_mu_);
    while (!deadlines_.empty() && deadlines_.top().at <= now) {
      due.push_back(deadlines_.top());
      deadlines_.pop();
    }
  }
  for (const Deadline& d : due) {
    auto c = d.conn.lock();
    auto s = d.stream.lock();
    if (c && s) c->Expire(s);
  }
}

void H2Server::Accept() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        spdlog::warn("gRPC (native): accept: {}", std::strerror(errno));
      }
      return;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    SSL* ssl = nullptr;
    if (tls_) {
      tls_->MaybeReload(std::chrono::steady_clock::now());  // renewed files (h2_tls.h)
      ssl = tls_->NewSsl();
      if (ssl == nullptr) {
        spdlog::warn("gRPC (native): SSL_new failed; connection refused");
        close(fd);
        continue;
      }
    }
    auto c = std::make_shared<H2Connection>(fd, ssl, this);
    if (Status st = c->Init(); !st.ok()) {
      spdlog::warn("gRPC (native): {}", st.ToString());
      c->Close();
      continue;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    conns_.emplace(fd, c);
    c->Flush();  // the server's SETTINGS (TLS: after the handshake)
  }
}

void H2Server::CloseConnection(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  std::shared_ptr<H2Connection> c = std::move(it->second);
  conns_.erase(it);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  c->Close();
}

void H2Server::Loop() {
  t_event_thread = true;
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  while (!stop_) {
    const int n = epoll_wait(epoll_fd_, events, kMaxEvents, NextTimeoutMs());
    if (n < 0 && errno != EINTR) {
      spdlog::error("gRPC (native): epoll_wait: {}", std::strerror(errno));
      break;
    }
    // What calls post while these events are handled is flushed once, at
    // the end of the batch (h2_connection.h).
    DeliveryScope scope;
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == listen_fd_) {
        Accept();
        continue;
      }
      if (fd == wake_fd_) {
        uint64_t v;
        [[maybe_unused]] ssize_t r = read(wake_fd_, &v, sizeof v);
        std::vector<std::weak_ptr<H2Connection>> woken;
        {
          std::lock_guard lock(wake_mu_);
          woken.swap(woken_);
        }
        for (auto& w : woken) {
          auto c = w.lock();
          if (!c) continue;
          c->Flush();
          if (c->broken()) CloseConnection(c->fd());
        }
        continue;
      }
      auto it = conns_.find(fd);
      if (it == conns_.end()) continue;
      std::shared_ptr<H2Connection> c = it->second;
      bool alive = true;
      if (events[i].events & EPOLLOUT) alive = c->OnWritable();
      if (alive && (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) alive = c->OnReadable();
      if (!alive) CloseConnection(fd);
    }
    ExpireDeadlines();
    const auto now = std::chrono::steady_clock::now();
    if (quiet_ > 0 && (now >= next_cool_ || next_cool_ == std::chrono::steady_clock::time_point::max())) {
      next_cool_ = std::chrono::steady_clock::time_point::max();
      std::vector<int> over;
      for (auto& [fd, c] : conns_) {
        next_cool_ = std::min(next_cool_, c->CoolDown(now));
        if (c->broken()) over.push_back(fd);
      }
      for (int fd : over) CloseConnection(fd);
    }
  }
  // Shutdown: open calls end, every connection hears GOAWAY.
  DeliveryScope scope;
  const Status bye = UnavailableError("the proxy is shutting down");
  for (auto& [fd, c] : conns_) {
    c->GoAway(bye);
    c->Flush();
  }
  while (!conns_.empty()) CloseConnection(conns_.begin()->first);
}

}  // namespace tandem::proxy::h2
