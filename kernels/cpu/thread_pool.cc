#include "kernels/cpu/thread_pool.h"

#include <algorithm>

namespace tandem::kernels::cpu {

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {
  workers_.reserve(static_cast<size_t>(threads_ - 1));
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

namespace {
inline void Range(int64_t n, int parts, int r, int64_t* b, int64_t* e) {
  *b = n * r / parts;
  *e = n * (r + 1) / parts;
}
}  // namespace

void ThreadPool::Run(int64_t n, int64_t grain, Thunk thunk, void* ctx) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int parts = static_cast<int>(std::min<int64_t>(threads_, std::max<int64_t>(1, n / grain)));
  if (parts == 1) {
    thunk(ctx, 0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    thunk_ = thunk;
    ctx_ = ctx;
    n_ = n;
    parts_ = parts;
    pending_ = parts - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  int64_t b, e;
  Range(n, parts, 0, &b, &e);
  thunk(ctx, b, e);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    Thunk thunk;
    void* ctx;
    int64_t n;
    int parts;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      thunk = thunk_;
      ctx = ctx_;
      n = n_;
      parts = parts_;
    }
    if (index < parts) {
      int64_t b, e;
      Range(n, parts, index, &b, &e);
      if (b < e) thunk(ctx, b, e);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace tandem::kernels::cpu
