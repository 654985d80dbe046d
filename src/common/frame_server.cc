#include "common/frame_server.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "common/net.h"

namespace tandem {
namespace {

std::string PeerName(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return HostPort{host, port}.ToString();
}

}  // namespace

Result<std::unique_ptr<FrameServer>> FrameServer::Serve(FrameListenOptions options, Accept accept) {
  return Start(options.address, std::move(options.tls), options.frame,
               [on_connection = std::move(options.on_connection),
                accept = std::move(accept)](const std::shared_ptr<FrameConn>& conn) {
                 if (on_connection) on_connection();
                 return accept(conn);
               });
}

Result<std::unique_ptr<FrameServer>> FrameServer::Start(const std::string& address,
                                                        std::shared_ptr<FrameTls> tls,
                                                        FrameOptions options, Accept accept) {
  TANDEM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp.port);
  if (int rc = getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return InvalidArgumentError(fmt::format("cannot resolve {}: {}", address, gai_strerror(rc)));
  }
  std::unique_ptr<FrameServer> s(new FrameServer());
  s->listen_fd_ = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int one = 1;
  if (s->listen_fd_ >= 0) setsockopt(s->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool ok = s->listen_fd_ >= 0 && bind(s->listen_fd_, res->ai_addr, res->ai_addrlen) == 0 &&
                  listen(s->listen_fd_, 128) == 0;
  const int err = errno;
  freeaddrinfo(res);
  if (!ok) {
    return UnavailableError(fmt::format("cannot listen on {}: {}", address, std::strerror(err)));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  const uint16_t bound_port = bound.ss_family == AF_INET6
                                  ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->address_ = HostPort{hp.host, bound_port}.ToString();
  s->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s->wake_fd_ < 0) return InternalError(fmt::format("eventfd: {}", std::strerror(errno)));
  s->tls_ = std::move(tls);
  s->options_ = options;
  s->accept_ = std::move(accept);
  s->thread_ = std::thread([srv = s.get()] { srv->Run(); });
  return s;
}

FrameServer::~FrameServer() {
  Stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void FrameServer::Stop() {
  stop_.store(true);
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  // Refuse new connections now: a listener left open would let the kernel
  // accept a dialler whose handshake nobody answers (it would wait out its
  // handshake timeout instead of failing at once).
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

void FrameServer::Run() {
  pthread_setname_np(pthread_self(), "frame-server");
  struct Entry {
    std::shared_ptr<FrameConn> conn;
    std::shared_ptr<FrameSession> session;  // once authenticated
  };
  std::vector<Entry> conns;
  std::vector<pollfd> fds;
  const int wake_fd = wake_fd_;
  auto wake = [wake_fd] {
    const uint64_t one = 1;
    (void)!::write(wake_fd, &one, sizeof(one));
  };
  while (!stop_.load()) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    const auto now = std::chrono::steady_clock::now();
    int timeout_ms = -1;
    for (const Entry& e : conns) {
      fds.push_back({e.conn->fd(), e.conn->Events(), 0});
      const auto due = e.session ? e.session->NextTimer() : e.conn->handshake_deadline();
      if (due != std::chrono::steady_clock::time_point::max()) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(due - now).count() + 1;
        timeout_ms = static_cast<int>(std::clamp<int64_t>(
            left, 0, timeout_ms < 0 ? int64_t{1} << 30 : int64_t{timeout_ms}));
      }
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      spdlog::error("frame server {}: poll: {}", address_, std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof(v));
    }
    if (stop_.load()) break;
    const size_t polled = conns.size();
    const auto after = std::chrono::steady_clock::now();
    for (size_t i = 0; i < polled; ++i) {
      Entry& e = conns[i];
      const short revents = fds[i + 2].revents;
      Status st = Status::Ok();
      if (e.session && e.session->NextTimer() <= after) st = e.session->OnTimer(after);
      if (!st.ok()) {
        e.conn->Close(st);
      } else if (!e.session && after >= e.conn->handshake_deadline()) {
        st = DeadlineExceededError(
            fmt::format("{} did not complete the TLS handshake within {} ms", e.conn->peer(),
                        options_.handshake_timeout.count()));
        e.conn->Close(st);
      } else if (revents != 0) {
        st = e.conn->Progress(revents, [&](std::string_view frame) {
          if (!e.session) {
            e.session = accept_(e.conn);
            accepted_.fetch_add(1);
            if (!e.session) return UnavailableError("connection refused by the server");
          }
          return e.session->OnFrame(frame);
        });
        if (st.ok() && !e.session && e.conn->open()) {
          e.session = accept_(e.conn);
          accepted_.fetch_add(1);
          if (!e.session) {
            st = UnavailableError("connection refused by the server");
            e.conn->Close(st);
          }
        }
      }
      if (st.ok()) continue;
      if (e.session) {
        e.session->OnClosed(st);
      } else {
        {
          std::lock_guard lock(refused_mu_);
          refused_.fetch_add(1);
        }
        refused_cv_.notify_all();
        spdlog::warn("frame server {}: refused {}: {}", address_, e.conn->peer(), st.message());
      }
      e.conn.reset();
    }
    std::erase_if(conns, [](const Entry& e) { return !e.conn; });
    if ((fds[1].revents & POLLIN) != 0) {
      for (;;) {
        sockaddr_storage ss{};
        socklen_t len = sizeof(ss);
        const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;  // EAGAIN, or an error on that one connection
        auto conn = FrameConn::Accepted(fd, tls_.get(), options_, PeerName(ss));
        conn->SetWake(wake);
        conns.push_back({std::move(conn), nullptr});
      }
    }
  }
  const Status why = UnavailableError(fmt::format("the server on {} is stopping", address_));
  for (Entry& e : conns) {
    e.conn->Close(why);
    if (e.session) e.session->OnClosed(why);
  }
}

bool FrameServer::WaitForRefused(uint64_t n, std::chrono::milliseconds limit) {
  std::unique_lock lock(refused_mu_);
  return refused_cv_.wait_for(lock, limit, [&] { return refused_.load() >= n; });
}

}  // namespace tandem
