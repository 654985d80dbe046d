#include "kernels/cpu/thread_pool.h"

#include <gtest/gtest.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace tandem::kernels::cpu {
namespace {

using Ranges = std::set<std::pair<int64_t, int64_t>>;

// The documented split: range r = [r * n / parts, (r + 1) * n / parts).
Ranges Expected(int64_t n, int parts) {
  Ranges out;
  for (int r = 0; r < parts; ++r) {
    const int64_t b = n * r / parts, e = n * (r + 1) / parts;
    if (b < e) out.insert({b, e});
  }
  return out;
}

// Waits (bounded: 10 s) until every thread of `pool` but the caller has
// started one of the ranges, each range spinning (yielding) until then: the
// call only returns if `threads` ranges ran at the same time, i.e. on
// distinct threads. Returns false on timeout.
bool AllThreadsTakePart(ThreadPool& pool) {
  const int threads = pool.threads();
  std::atomic<int> started{0};
  std::atomic<bool> timed_out{false};
  std::mutex mu;
  std::set<std::thread::id> ids;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  pool.ParallelFor(threads, 1, [&](int64_t, int64_t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(std::this_thread::get_id());
    }
    ++started;
    while (started.load() < threads) {
      if (std::chrono::steady_clock::now() > deadline) {
        timed_out = true;
        return;
      }
      sched_yield();
    }
  });
  return !timed_out.load() && static_cast<int>(ids.size()) == threads;
}

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnceWithTheDocumentedRanges) {
  for (int threads : {1, 2, 3, 4}) {
    ThreadPool pool(threads);
    for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{1000}}) {
      for (int64_t grain : {int64_t{1}, int64_t{3}, int64_t{5000}}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::mutex mu;
        Ranges seen;
        pool.ParallelFor(n, grain, [&](int64_t b, int64_t e) {
          {
            std::lock_guard<std::mutex> lock(mu);
            seen.insert({b, e});
          }
          for (int64_t i = b; i < e; ++i) ++hits[static_cast<size_t>(i)];
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1);
        const int parts = pool.Parts(n, grain);
        EXPECT_EQ(parts, std::clamp<int64_t>(n / grain, 1, threads));
        // With one thread the whole range runs inline as one call.
        const Ranges want = threads == 1 ? Ranges{{0, n}} : Expected(n, parts);
        EXPECT_EQ(seen, want)
            << "threads " << threads << " n " << n << " grain " << grain;
      }
    }
  }
}

TEST(ThreadPoolTest, ChunkedSplitDependsOnNAndChunkOnly) {
  for (int threads : {2, 3, 4}) {
    ThreadPool pool(threads);
    std::mutex mu;
    Ranges seen;
    std::vector<std::atomic<int>> hits(1000);
    pool.ParallelForChunked(1000, 7, [&](int64_t b, int64_t e) {
      {
        std::lock_guard<std::mutex> lock(mu);
        seen.insert({b, e});
      }
      for (int64_t i = b; i < e; ++i) ++hits[static_cast<size_t>(i)];
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
    EXPECT_EQ(ThreadPool::ChunkedParts(1000, 7), 143);
    EXPECT_EQ(seen, Expected(1000, 143)) << "threads " << threads;
  }
  EXPECT_EQ(ThreadPool::ChunkedParts(int64_t{1} << 40, 1), ThreadPool::kMaxParts);
}

TEST(ThreadPoolTest, ManyRoundsInsideAndOutsideSteps) {
  ThreadPool pool(2);
  int64_t total = 0;
  for (int round = 0; round < 4000; ++round) {
    // Half the rounds inside an explicit step, half with the implicit one.
    ThreadPool::StepScope step(round % 2 == 0 ? &pool : nullptr);
    std::atomic<int64_t> sum{0};
    pool.ParallelFor(100, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sum += i;
    });
    total += sum.load();
  }
  EXPECT_EQ(total, 4000 * 4950);
  int calls = 0;
  ParallelFor(nullptr, 10, 1, [&](int64_t b, int64_t e) {
    ++calls;
    EXPECT_EQ(b, 0);
    EXPECT_EQ(e, 10);
  });
  EXPECT_EQ(calls, 1);
}

TEST(ThreadPoolTest, WorkersSleepBetweenStepsAndWakeForTheNext) {
  ThreadPool::Options o;
  o.linger_ns = 0;  // sleep as soon as a step closes
  ThreadPool pool(3, o);
  for (int round = 0; round < 3; ++round) {
    // Every worker goes to sleep once no step is open (bounded wait).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (pool.sleeping_workers() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(pool.sleeping_workers(), 2) << "round " << round;
    // A step wakes them: all three threads run a range at the same time.
    ThreadPool::StepScope step(&pool);
    EXPECT_TRUE(AllThreadsTakePart(pool)) << "round " << round;
    EXPECT_EQ(pool.sleeping_workers(), 0);
  }
}

TEST(ThreadPoolTest, MoreThreadsThanCoresAllTakePart) {
  // On a 2-core machine four threads only make progress together because
  // waiting threads yield their core.
  ThreadPool pool(4);
  ThreadPool::StepScope step(&pool);
  for (int round = 0; round < 20; ++round) ASSERT_TRUE(AllThreadsTakePart(pool)) << round;
}

TEST(ThreadPoolTest, NestedStepsAndDestructionWhileSpinning) {
  auto pool = std::make_unique<ThreadPool>(2);
  pool->BeginStep();
  pool->BeginStep();
  std::atomic<int> n{0};
  pool->ParallelFor(2, 1, [&](int64_t b, int64_t e) { n += static_cast<int>(e - b); });
  pool->EndStep();
  pool->ParallelFor(2, 1, [&](int64_t b, int64_t e) { n += static_cast<int>(e - b); });
  pool->EndStep();
  pool->EndStep();  // unbalanced extra: ignored
  EXPECT_EQ(n.load(), 4);
  pool->BeginStep();
  pool.reset();  // workers spinning in an open step stop and join
}

}  // namespace
}  // namespace tandem::kernels::cpu
