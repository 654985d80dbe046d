// A few threads that run submitted jobs; with one thread, in order. The
// proxy runs the CPU work of a request before it is routed (JSON parsing,
// the chat template, tokenization) on one, so that it runs neither on
// gRPC's callback threads nor on the HTTP I/O threads, where one large
// prompt would stall every other connection (docs/security.md, "Hostile
// input"); its queue holds admitted requests only (proxy.max_inflight
// bounds it). The prefiller releases lost KV endpoints on one
// (prefiller/push_targets.h).
//
// Thread-safety: Submit from any thread. The destructor runs what is queued,
// then joins.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem {

class WorkPool {
 public:
  explicit WorkPool(size_t threads);
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  void Submit(std::function<void()> job);
  size_t threads() const { return threads_.size(); }

  // The proxy's default: half the cores, 1..8.
  static size_t DefaultThreads();

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;  // guarded by mu_
  bool stopping_ = false;                   // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace tandem
