// The reader thread of one framed client connection (common/frame_conn.h;
// issue 23): the proxy's decode stream, Prefill and Watch clients each own
// one (proxy/decode_mux_tcp_client.h, prefill_tcp_client.h,
// watch_tcp_client.h) and keep only their frame handling.
//
// The thread dials the connection, then waits (poll) on its socket and on a
// wake-up eventfd, and hands each frame read to the owner's on_frame, in
// order. The wait ends at the handshake deadline while the connection is
// not yet authenticated (past it, the connection ends UNAVAILABLE naming
// the peer), and at the owner's own deadline (before_wait). Once the
// connection is over (an error, the peer closed it, a frame the owner
// refused, or Close from any thread followed by Wake) it is closed with
// that status and on_end runs, once and last.
//
// Lifetime: the thread holds the owner's `keep_alive` reference until it
// ends, so that an owner dropped by everyone else lives until on_end ran.
// The destructor joins the thread, or detaches it when the thread itself
// dropped the last reference (the owner is then destroyed on it, after its
// last use of the reader).
//
// Threads: Wake from any thread; Start (once) and started() from the
// owner; Join from any thread but the reader's own (there it is a no-op);
// the hooks run on the reader thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/frame_conn.h"

namespace tandem {

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

  // Sets `conn`'s wake (output left for POLLOUT) to this reader's.
  explicit FrameReader(std::shared_ptr<FrameConn> conn);
  ~FrameReader();
  FrameReader(const FrameReader&) = delete;
  FrameReader& operator=(const FrameReader&) = delete;

  // Starts the thread (named `name`, at most 15 characters); false when it
  // was started already.
  bool Start(const char* name, Hooks hooks, std::shared_ptr<void> keep_alive);
  bool started() const { return started_; }
  // Wakes the thread's wait: a Close, an earlier deadline, work to run.
  void Wake();
  // Waits for the thread to end; false (nothing waited) when it was never
  // started, was joined already, or when called from the thread itself.
  bool Join();

 private:
  void Run(const char* name);

  const std::shared_ptr<FrameConn> conn_;
  int wake_fd_ = -1;  // eventfd
  int wake_errno_ = 0;  // why eventfd failed
  Hooks hooks_;
  std::shared_ptr<void> keep_alive_;  // the thread's, until it ends
  bool started_ = false;
  std::thread thread_;
};

}  // namespace tandem
