// One thread serving many framed client connections (common/frame_reader.h
// in its shared mode; issue 23): the proxy's Watch and Prefill connections
// to every worker are read by one epoll loop, so that messages that arrive
// together (a prefiller's Prefill reply and its KV batch on its Watch) cost
// one wake-up, and the proxy has one thread for them instead of one per
// connection. The decode stream keeps a thread of its own (the token path).
//
// Each connection is served exactly as by a reader thread of its own: it is
// dialled, handshaken within its deadline, its frames handed to its owner
// in order, its owner's deadlines (before_wait) honoured, and it ends alone:
// a broken connection ends only its own calls or watch. Nothing waits on a
// socket (non-blocking I/O; a peer that does not read is disconnected at
// its bound by FrameConn), so a slow or dead worker never holds up another
// worker's messages. The owners' hooks run on the loop thread and must not
// block (they did not on a thread of their own either: that stalled their
// connection; here it would stall all of them).
//
// Threads: Add, Wake and Forget from any thread; everything else is the
// loop thread's.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace tandem {

class FrameReader;

class FrameLoop {
 public:
  // The process's loop for the proxy's Watch and Prefill connections:
  // started on first use, never stopped (its thread sleeps when there is
  // nothing to read).
  static FrameLoop& Shared();

  // Starts the loop thread, named `name` (at most 15 characters).
  explicit FrameLoop(const char* name);
  // Stops the thread. Every connection must have ended first (the owners
  // hold their readers, which hold the owners, until the end).
  ~FrameLoop();
  FrameLoop(const FrameLoop&) = delete;
  FrameLoop& operator=(const FrameLoop&) = delete;

  // Serves `r` (started) until its connection ends.
  void Add(FrameReader* r);
  // `r` has work (a Close, output left, an earlier deadline).
  void Wake(FrameReader* r);
  // `r`'s owner has a deadline at `at` that the loop may not know yet (a
  // new call's: issue 23, dec-parts): `r` is served (its before_wait asked
  // again) by `at` at the latest, without waking the loop now. The loop
  // takes `at` into its wait at its next wake-up, whatever wakes it, and a
  // timer (a timerfd in its epoll set, set here when `at` is earlier than
  // what it holds) wakes it at `at` when nothing else has by then. Before,
  // every new call's deadline woke the loop only to shorten its wait (a
  // wake-up per Prefill call: 15-29 us of CPU on the VMs issue 23 measures).
  void WakeBy(FrameReader* r, std::chrono::steady_clock::time_point at);
  // `r` goes away: drops any pending Add or Wake of it.
  void Forget(FrameReader* r);
  bool on_loop_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  struct Entry;
  void Run(const char* name);
  void Signal();
  // Sets the timer to `at` (max(): off); false when it cannot be set.
  bool SetTimer(std::chrono::steady_clock::time_point at);

  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd
  int timer_fd_ = -1;  // timerfd (CLOCK_MONOTONIC: the steady clock's)
  std::mutex mu_;
  bool stop_ = false;                 // guarded by mu_
  std::vector<FrameReader*> added_;   // guarded by mu_
  std::vector<FrameReader*> woken_;   // guarded by mu_
  // WakeBy's requests the loop has not taken yet, and the timer's setting.
  std::vector<std::pair<std::chrono::steady_clock::time_point, FrameReader*>> wake_by_;  // guarded by mu_
  std::chrono::steady_clock::time_point timer_at_ = std::chrono::steady_clock::time_point::max();  // guarded by mu_
  std::thread thread_;
};

}  // namespace tandem
