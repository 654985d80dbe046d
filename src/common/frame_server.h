// The listener of framed connections (common/frame_conn.h; issue 23,
// docs/decode-stream.md "Transport"): one I/O thread accepts, runs each
// connection's TLS handshake (mutual TLS: a client without a certificate of
// the fleet CA is refused), reads every connection's frames and flushes the
// output its senders left (the senders write inline from their own thread).
//
// A connection gets its FrameSession once it is authenticated; the session
// sees its frames in order on the I/O thread and OnClosed exactly once
// (the peer went away, a bad frame, Send closed it for a slow peer, or Stop).
//
// Threads: Start/Stop from the owner; accepted()/refused() from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "common/frame_conn.h"

namespace tandem {

class FrameSession {
 public:
  virtual ~FrameSession() = default;
  // A frame of this connection; non-OK closes the connection with it.
  virtual Status OnFrame(std::string_view payload) = 0;
  // The connection is over (once, last).
  virtual void OnClosed(const Status& why) = 0;
  // Optional timers on the I/O thread (the prefill listener's call
  // deadlines): the earliest time OnTimer is wanted (max(): none), asked
  // before each wait; OnTimer runs once it has passed, non-OK closes the
  // connection. Asked again after every frame and timer, so a session
  // whose timers change only there (or before a Send that this thread
  // flushes) needs no wake-up of its own.
  virtual std::chrono::steady_clock::time_point NextTimer() {
    return std::chrono::steady_clock::time_point::max();
  }
  virtual Status OnTimer(std::chrono::steady_clock::time_point /*now*/) { return Status::Ok(); }
};

// The options every framed listener takes (the decode stream's, Prefill's
// and Watch's: decoder/decode_mux_tcp.h, prefiller/prefill_tcp.h,
// worker/watch_tcp.h).
struct FrameListenOptions {
  std::string address;             // "host:port"; port 0 = any free port
  std::shared_ptr<FrameTls> tls;   // null: plaintext (security.internal_tls off)
  FrameOptions frame;
  std::function<void()> on_connection;  // an authenticated connection (metrics)
};

class FrameServer {
 public:
  using Accept = std::function<std::shared_ptr<FrameSession>(const std::shared_ptr<FrameConn>&)>;

  // Start with `options`: runs its on_connection for each authenticated
  // connection, then `accept` makes its session.
  static Result<std::unique_ptr<FrameServer>> Serve(FrameListenOptions options, Accept accept);

  // Listens on `address` ("host:port", port 0 = any free port); `tls` null
  // = plaintext. `accept` makes the session of each authenticated connection.
  static Result<std::unique_ptr<FrameServer>> Start(const std::string& address,
                                                    std::shared_ptr<FrameTls> tls,
                                                    FrameOptions options, Accept accept);
  ~FrameServer();  // Stop()
  FrameServer(const FrameServer&) = delete;
  FrameServer& operator=(const FrameServer&) = delete;

  // The bound "host:port".
  const std::string& address() const { return address_; }
  // Closes every connection (their sessions' OnClosed run), joins the
  // thread, then closes the listening socket, so that a later dial is
  // refused at once (ECONNREFUSED). Idempotent.
  void Stop();

  uint64_t accepted() const { return accepted_.load(); }  // authenticated connections
  uint64_t refused() const { return refused_.load(); }    // failed handshakes
  // Until refused() >= n (a refusal is counted just after its connection
  // is closed); false when `limit` passes first.
  bool WaitForRefused(uint64_t n, std::chrono::milliseconds limit);

 private:
  FrameServer() = default;
  void Run();

  std::string address_;
  std::shared_ptr<FrameTls> tls_;
  FrameOptions options_;
  Accept accept_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: Stop, and output left for POLLOUT
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::mutex refused_mu_;  // with refused_cv_: WaitForRefused
  std::condition_variable refused_cv_;
  std::thread thread_;
};

}  // namespace tandem
