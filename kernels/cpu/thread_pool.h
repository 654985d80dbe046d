// A tiny fork-join thread pool for the CPU kernels.
//
// ThreadPool(threads) starts threads - 1 workers; the calling thread does the
// first share of every ParallelFor, so ThreadPool(1) starts nothing and runs
// everything inline. Fleets share the cores, so a worker process uses one
// thread unless configured otherwise.
//
// Threading: one thread at a time drives a pool (the engine thread that owns
// it); ParallelFor is not reentrant (a task must not call ParallelFor on the
// same pool). Construction and destruction happen on the owning thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace tandem::kernels::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }

  // Splits [0, n) into at most threads() contiguous ranges of at least `grain`
  // items (the last ranges may be empty and are then skipped), calls
  // fn(begin, end) once per range, and returns when all are done. Range r is
  // always [r * n / parts, (r + 1) * n / parts) for parts chosen from n, grain
  // and threads() only.
  template <class F>
  void ParallelFor(int64_t n, int64_t grain, F&& fn) {
    auto thunk = [](void* ctx, int64_t b, int64_t e) { (*static_cast<F*>(ctx))(b, e); };
    Run(n, grain, thunk, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using Thunk = void (*)(void* ctx, int64_t begin, int64_t end);
  void Run(int64_t n, int64_t grain, Thunk thunk, void* ctx);
  void WorkerLoop(int index);

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;  // guarded by mu_
  int pending_ = 0;          // guarded by mu_
  bool stop_ = false;        // guarded by mu_
  // The current job (written under mu_ before generation_ changes).
  Thunk thunk_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  int parts_ = 0;
};

// ParallelFor on `pool`, or inline over the whole range when pool is null.
template <class F>
void ParallelFor(ThreadPool* pool, int64_t n, int64_t grain, F&& fn) {
  if (n <= 0) return;
  if (pool == nullptr || pool->threads() == 1) {
    fn(int64_t{0}, n);
    return;
  }
  pool->ParallelFor(n, grain, std::forward<F>(fn));
}

}  // namespace tandem::kernels::cpu
