// Fork-join cost of kernels/cpu's ThreadPool: one ParallelFor of `threads`
// empty ranges, i.e. publish + every thread runs its range + join.
//
//   build/bench/kernels/bench_thread_pool [--benchmark_filter=...]
//
// - BM_ForkJoin/T: inside an open step (workers spinning): the cost a
//   kernel pays per parallel region during a forward pass.
// - BM_ForkJoinWork/T: every range busy-waits 2 us; overhead_ns = step
//   time - 2 us, worker_share = ranges the workers ran (the caller runs a
//   late worker's range itself, so a low share means workers were late).
// - BM_ForkJoinImplicitStep/T: ParallelFor outside any step (opens and
//   closes one around itself; workers linger, then sleep).
// - BM_StepWake/T: a step after the workers went to sleep (wake-up + one
//   fork-join): the per-step cost when steps are far apart.
// - BM_CondvarForkJoin/T: the same fork-join over a mutex + condition
//   variable per region (the design this pool replaced), as the yardstick.
// Counters: ns per fork-join (real time). Note the machine load with every
// number kept; with more threads than free cores the figures measure the
// scheduler, not the pool.
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/cpu/thread_pool.h"

namespace tandem::kernels::cpu {
namespace {

const auto Empty = [](int64_t b, int64_t e) { benchmark::DoNotOptimize(b + e); };

void BM_ForkJoin(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  ThreadPool pool(threads);
  ThreadPool::StepScope step(&pool);
  for (auto _ : state) pool.ParallelFor(threads, 1, Empty);
  state.counters["ns_per_fork_join"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 1e-9,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["pinned"] = pool.pinned() ? 1 : 0;
}

// Every range busy-waits 2 us: the ideal step is 2 us when the threads run
// their ranges side by side; overhead_ns is what the pool adds to that, and
// worker_share the fraction of ranges the workers (not the caller) ran.
void BM_ForkJoinWork(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  constexpr int64_t kWorkNs = 2000;
  ThreadPool pool(threads);
  ThreadPool::StepScope step(&pool);
  const auto caller = std::this_thread::get_id();
  std::atomic<int64_t> by_workers{0};
  auto work = [&](int64_t, int64_t) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kWorkNs);
    while (std::chrono::steady_clock::now() < end) {
    }
    if (std::this_thread::get_id() != caller) ++by_workers;
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) pool.ParallelFor(threads, 1, work);
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  const double iters = static_cast<double>(state.iterations());
  state.counters["overhead_ns"] = ns / iters - kWorkNs;
  state.counters["worker_share"] = static_cast<double>(by_workers.load()) / (iters * threads);
}

void BM_ForkJoinImplicitStep(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  ThreadPool pool(threads);
  for (auto _ : state) pool.ParallelFor(threads, 1, Empty);
  state.counters["ns_per_fork_join"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 1e-9,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_StepWake(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  ThreadPool::Options o;
  o.linger_ns = 0;
  ThreadPool pool(threads, o);
  for (auto _ : state) {
    state.PauseTiming();
    while (pool.sleeping_workers() < threads - 1) std::this_thread::yield();
    state.ResumeTiming();
    ThreadPool::StepScope step(&pool);
    pool.ParallelFor(threads, 1, Empty);
  }
}

// The replaced design: a mutex + two condition variables per region.
class CondvarPool {
 public:
  explicit CondvarPool(int threads) : threads_(threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { Loop(i); });
  }
  ~CondvarPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto& w : workers_) w.join();
  }
  void Run() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_ = threads_ - 1;
      ++gen_;
    }
    start_.notify_all();
    Empty(0, 1);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void Loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen_;
      }
      Empty(index, index + 1);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_, done_;
  uint64_t gen_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

void BM_CondvarForkJoin(benchmark::State& state) {
  CondvarPool pool(static_cast<int>(state.range(0)));
  for (auto _ : state) pool.Run();
  state.counters["ns_per_fork_join"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 1e-9,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

BENCHMARK(BM_ForkJoin)->Arg(2)->Arg(4)->UseRealTime()->MinTime(0.2);
BENCHMARK(BM_ForkJoinWork)->Arg(2)->UseRealTime()->MinTime(0.2);
BENCHMARK(BM_ForkJoinImplicitStep)->Arg(2)->UseRealTime()->MinTime(0.2);
BENCHMARK(BM_StepWake)->Arg(2)->UseRealTime()->Iterations(200);
BENCHMARK(BM_CondvarForkJoin)->Arg(2)->Arg(4)->UseRealTime()->MinTime(0.2);

}  // namespace
}  // namespace tandem::kernels::cpu

BENCHMARK_MAIN();
