// The native HTTP/2 gRPC server of the proxy's public port
// (proxy.grpc_server: native; docs/grpc-frontend.md): nghttp2 sessions on
// non-blocking sockets, one event thread (epoll) for accepting, reading
// and timers; responses are flushed once per delivery batch by the thread
// that delivered them (h2_connection.h). Serves tandem.v1.Generation and
// grpc.health.v1.Health to unchanged gRPC clients, in plaintext or TLS
// (h2_tls.h: security.public_tls's files, policy and renewal).
//
// Thread-safety: Start/Shutdown from the owning thread; SetServing and
// serving from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "common/tls.h"
#include "proxy/frontend.h"

namespace tandem::proxy::h2 {

class H2Connection;
class H2TlsContext;
struct H2Stream;

// Quiet reading (h2_connection.h): a connection no delivery batch flushed
// for this long wakes the event thread for every byte again.
inline constexpr auto kQuietFor = std::chrono::milliseconds(50);

class H2Server {
 public:
  // Listens on `address` ("host:port", port 0 picks one). `frontend`
  // outlives the server. `tls` (security.public_tls's files) not empty:
  // every connection speaks TLS (h2_tls.h).
  static Result<std::unique_ptr<H2Server>> Start(const std::string& address, Frontend* frontend,
                                                 const TlsFiles& tls = {});
  ~H2Server();
  H2Server(const H2Server&) = delete;
  H2Server& operator=(const H2Server&) = delete;

  const std::string& address() const { return address_; }
  bool tls() const { return tls_ != nullptr; }
  // SIGHUP: re-reads the TLS files now; new connections get them, open ones
  // keep theirs; on error the old certificate stays. No-op in plaintext.
  // (The event thread also re-reads them when they change: h2_tls.h.)
  Status ReloadTls();
  Frontend* frontend() const { return frontend_; }

  // Health: SERVING / NOT_SERVING (draining, warming up); a change is sent
  // to every Health/Watch stream.
  void SetServing(bool serving);
  bool serving() const { return serving_; }
  // Any thread: `s` is a Health/Watch stream of `c`.
  void AddWatcher(const std::shared_ptr<H2Connection>& c, const std::shared_ptr<H2Stream>& s);

  // Stops accepting; open calls end with UNAVAILABLE, every connection
  // gets GOAWAY and is closed; joins the event thread.
  void Shutdown();

  // For connections. Any thread: flush `c` on the event thread.
  void Wake(const std::shared_ptr<H2Connection>& c);
  // Any thread (requests are also read by a batch's flush): end `s` when
  // its deadline passes.
  void AddDeadline(const std::shared_ptr<H2Connection>& c, const std::shared_ptr<H2Stream>& s);
  // Any thread: EPOLLOUT on or off for `fd`.
  void WantWrite(int fd, bool on);
  // True on a server's event thread.
  static bool OnEventThread();
  // Any thread: connections reading quietly (h2_connection.h), which the
  // event thread looks at every few ms.
  void ChangeQuiet(int delta) { quiet_ += delta; }

 private:
  H2Server() = default;
  void Loop();
  void Accept();
  void CloseConnection(int fd);
  int NextTimeoutMs();
  void ExpireDeadlines();

  Frontend* frontend_ = nullptr;
  std::unique_ptr<H2TlsContext> tls_;  // null: plaintext
  std::string address_;
  std::atomic<bool> serving_{true};
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd
  std::atomic<bool> stop_{false};
  std::atomic<int> quiet_{0};
  bool shut_down_ = false;
  std::thread thread_;

  // Event thread only.
  std::unordered_map<int, std::shared_ptr<H2Connection>> conns_;
  // When a quiet connection may have fallen quiet (min of CoolDown's).
  std::chrono::steady_clock::time_point next_cool_{};
  struct Deadline {
    std::chrono::steady_clock::time_point at;
    std::weak_ptr<H2Connection> conn;
    std::weak_ptr<H2Stream> stream;
    bool operator>(const Deadline& o) const { return at > o.at; }
  };
  std::mutex deadline_mu_;
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<>>
      deadlines_;  // guarded by deadline_mu_

  std::mutex watch_mu_;
  std::vector<std::pair<std::weak_ptr<H2Connection>, std::weak_ptr<H2Stream>>>
      watchers_;  // guarded by watch_mu_
  std::mutex wake_mu_;
  std::vector<std::weak_ptr<H2Connection>> woken_;  // guarded by wake_mu_
};

}  // namespace tandem::proxy::h2
