// The reader of one framed client connection (common/frame_conn.h; issue
// 23): the proxy's decode stream, Prefill and Watch clients each own one
// (proxy/decode_mux_tcp_client.h, prefill_tcp_client.h,
// watch_tcp_client.h) and keep only their frame handling.
//
// It dials the connection, then waits on its socket (and on a wake-up) and
// hands each frame read to the owner's on_frame, in order. The wait ends at
// the handshake deadline while the connection is not yet authenticated
// (past it, the connection ends UNAVAILABLE naming the peer: FrameConn::
// Expire), sooner at a pending TCP connect's attempt deadline (the next
// address is dialled then: FrameConn::progress_deadline), and at the
// owner's own deadline (before_wait). Once the connection is over (an
// error, the peer closed it, a frame the owner refused, or Close from any
// thread followed by Wake) it is closed with that status and on_end runs,
// once and last.
//
// Where it waits: on a thread of its own (the decode stream: the token
// path), or, given a FrameLoop, on that loop's one thread together with
// the loop's other connections (the Watch and Prefill connections:
// common/frame_loop.h). The hooks run there.
//
// Lifetime: the reader holds the owner's `keep_alive` reference until the
// end, so that an owner dropped by everyone else lives until on_end ran.
// The destructor joins its own thread, or detaches it when the thread itself
// dropped the last reference (the owner is then destroyed on it, after its
// last use of the reader).
//
// Threads: Wake from any thread; Start (once) and started() from the
// owner; Join from any thread but the one the hooks run on (there it is a
// no-op).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/frame_conn.h"

namespace tandem {

class FrameLoop;

class FrameReader {
 public:
  struct Hooks {
    // A frame arrived; non-OK ends the connection with that status.
    FrameConn::OnFrame on_frame;
    // Optional, before each wait: runs the owner's due work and returns
    // when the wait must end (max(): no deadline of its own).
    std::function<std::chrono::steady_clock::time_point()> before_wait;
    // Optional, after each read round (the frames it handed to on_frame).
    std::function<void()> after_progress;
    // The connection is over and closed with `why` (never OK).
    std::function<void(const Status& why)> on_end;
  };

  // Sets `conn`'s wake (output left for POLLOUT) to this reader's. `loop`
  // null: a thread of its own; else that loop serves it (it must outlive
  // the connection).
  explicit FrameReader(std::shared_ptr<FrameConn> conn, FrameLoop* loop = nullptr);
  ~FrameReader();
  FrameReader(const FrameReader&) = delete;
  FrameReader& operator=(const FrameReader&) = delete;

  // Starts serving the connection (its own thread is named `name`, at most
  // 15 characters); false when it was started already.
  bool Start(const char* name, Hooks hooks, std::shared_ptr<void> keep_alive);
  bool started() const { return started_; }
  // Wakes the wait: a Close, an earlier deadline, work to run.
  void Wake();
  // The owner has a new deadline at `at`: the wait ends by then. Served by
  // a loop, nothing is woken now (FrameLoop::WakeBy); on a thread of its
  // own, as Wake.
  void WakeBy(std::chrono::steady_clock::time_point at);
  // Waits until the connection ended (on_end ran); false (nothing waited)
  // when it was never started, was joined already, or when called from
  // the thread that runs the hooks.
  bool Join();

 private:
  friend class FrameLoop;
  // The steps of serving the connection, on the thread that serves it.
  Status Begin();  // dials
  // When the next wait must end (the owner's deadline, the connection's
  // while not open: FrameConn::progress_deadline).
  std::chrono::steady_clock::time_point Until();
  // After a wait: reads, flushes, hands frames on. Non-OK: it is over.
  Status Step(short revents);
  // Closes the connection with `why` and runs on_end; returns keep_alive
  // for the caller to drop last.
  std::shared_ptr<void> Finish(const Status& why);
  void Run(const char* name);  // its own thread

  const std::shared_ptr<FrameConn> conn_;
  FrameLoop* const loop_;
  int wake_fd_ = -1;    // eventfd (its own thread only)
  int wake_errno_ = 0;  // why eventfd failed
  Hooks hooks_;
  std::shared_ptr<void> keep_alive_;  // until the end
  bool started_ = false;
  std::thread thread_;
  // Served by a loop: the end, for Join.
  std::mutex end_mu_;
  std::condition_variable end_cv_;
  bool ended_ = false;  // guarded by end_mu_
  bool joined_ = false;  // the owner's thread only
  // The loop's view of it (the loop thread only).
  bool loop_registered_ = false;
  uint32_t loop_events_ = 0;
  uint32_t loop_dials_ = 0;  // the connection's socket registered (FrameConn::dials)
  std::chrono::steady_clock::time_point loop_until_;
};

}  // namespace tandem
