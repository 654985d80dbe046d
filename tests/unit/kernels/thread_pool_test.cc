#include "kernels/cpu/thread_pool.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>
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

// The cut into units depends on n and unit only; every unit runs once;
// the caller's home range (range 0) is the units it ran from the front, in
// order, followed by the units other threads took from its back.
TEST(ThreadPoolTest, StealingRunsEveryUnitOnceAndTheHomeRangeFromTheFront) {
  for (int threads : {1, 2, 3, 4}) {
    ThreadPool pool(threads);
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100}, int64_t{1000}, int64_t{200'000}}) {
      for (int64_t unit : {int64_t{1}, int64_t{3}, int64_t{16}}) {
        const int64_t u = ThreadPool::StealingUnit(n, unit);
        const int64_t units = ThreadPool::StealingUnits(n, unit);
        ASSERT_LE(units, ThreadPool::kMaxUnits);
        ASSERT_EQ(units, (n + u - 1) / u);
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::mutex mu;
        Ranges seen;
        std::vector<int64_t> mine;  // the caller's units, in the order it ran them
        const auto caller = std::this_thread::get_id();
        pool.ParallelForStealing(n, unit, [&](int64_t b, int64_t e) {
          {
            std::lock_guard<std::mutex> lock(mu);
            seen.insert({b, e});
            if (std::this_thread::get_id() == caller) mine.push_back(b / u);
          }
          for (int64_t i = b; i < e; ++i) ++hits[static_cast<size_t>(i)];
        });
        const std::string where = "threads " + std::to_string(threads) + " n " + std::to_string(n) +
                                  " unit " + std::to_string(unit);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << where;
        Ranges want;
        for (int64_t b = 0; b < n; b += u) want.insert({b, std::min(n, b + u)});
        EXPECT_EQ(seen, want) << where;
        const int64_t parts = std::min<int64_t>(units, threads);
        const int64_t home_end = units / parts;  // range 0 = units [0, units / parts)
        std::vector<int64_t> front;
        for (int64_t x : mine) {
          if (x < home_end) front.push_back(x);
        }
        for (size_t i = 0; i < front.size(); ++i) {
          EXPECT_EQ(front[i], static_cast<int64_t>(i)) << where;
        }
      }
    }
  }
}

// Two threads, eight units: the worker's home range is units 4..7. If the
// worker runs unit 4 it holds it until unit 7 has run, which only a thread
// taking from the back of the worker's range can do (bounded wait: 10 s).
// However the two interleave, a home range is run from the front in
// ascending order by its own thread and from the back in descending order
// by the other.
TEST(ThreadPoolTest, AThreadDoneWithItsRangeTakesTheBackOfAnother) {
  for (int round = 0; round < 20; ++round) {
    ThreadPool pool(2);
    ThreadPool::StepScope step(&pool);
    ASSERT_TRUE(AllThreadsTakePart(pool));  // the worker is awake and spinning
    const auto caller = std::this_thread::get_id();
    std::mutex mu;
    std::vector<int64_t> by_caller, by_worker;
    std::atomic<bool> seven_done{false}, timed_out{false};
    pool.ParallelForStealing(8, 1, [&](int64_t b, int64_t) {
      const bool is_caller = std::this_thread::get_id() == caller;
      if (b == 4 && !is_caller) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!seven_done.load()) {
          if (std::chrono::steady_clock::now() > deadline) {
            timed_out = true;
            break;
          }
          sched_yield();
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        (is_caller ? by_caller : by_worker).push_back(b);
      }
      if (b == 7) seven_done = true;
    });
    ASSERT_FALSE(timed_out.load()) << "nobody took unit 7 from the back of the worker's range";
    // The units of [lo, hi) that `ran` holds, in the order it ran them.
    auto within = [](const std::vector<int64_t>& ran, int64_t lo, int64_t hi) {
      std::vector<int64_t> out;
      for (int64_t u : ran) {
        if (u >= lo && u < hi) out.push_back(u);
      }
      return out;
    };
    auto counting = [](int64_t from, int64_t step, size_t n) {
      std::vector<int64_t> out;
      for (size_t i = 0; i < n; ++i) out.push_back(from + step * static_cast<int64_t>(i));
      return out;
    };
    const auto caller_home = within(by_caller, 0, 4), caller_stolen = within(by_caller, 4, 8);
    const auto worker_home = within(by_worker, 4, 8), worker_stolen = within(by_worker, 0, 4);
    EXPECT_EQ(caller_home, counting(0, 1, caller_home.size())) << "round " << round;
    EXPECT_EQ(worker_home, counting(4, 1, worker_home.size())) << "round " << round;
    EXPECT_EQ(caller_stolen, counting(7, -1, caller_stolen.size())) << "round " << round;
    EXPECT_EQ(worker_stolen, counting(3, -1, worker_stolen.size())) << "round " << round;
    EXPECT_EQ(caller_home.size() + worker_stolen.size(), 4u) << "round " << round;
    EXPECT_EQ(worker_home.size() + caller_stolen.size(), 4u) << "round " << round;
    // Unit 7 ran before unit 4 finished whenever the worker ran unit 4.
    if (!worker_home.empty()) {
      EXPECT_FALSE(caller_stolen.empty()) << "round " << round;
    }
  }
}

// Stealing and claimed-range jobs back to back reuse one published word:
// a worker late from one kind must never run a unit of the other.
TEST(ThreadPoolTest, StealingAndRangeJobsAlternate) {
  for (int threads : {2, 3}) {
    ThreadPool pool(threads);
    int64_t total = 0;
    for (int round = 0; round < 3000; ++round) {
      ThreadPool::StepScope step(round % 3 == 0 ? nullptr : &pool);
      std::atomic<int64_t> sum{0};
      auto add = [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) sum += i;
      };
      if (round % 2 == 0) {
        pool.ParallelForStealing(100, 1 + round % 7, add);
      } else {
        pool.ParallelFor(100, 1, add);
      }
      total += sum.load();
    }
    EXPECT_EQ(total, 3000 * 4950) << "threads " << threads;
  }
  int calls = 0;
  ThreadPool one(1);
  one.ParallelForStealing(10, 4, [&](int64_t b, int64_t e) {
    EXPECT_EQ(b, calls * 4);
    EXPECT_EQ(e, std::min<int64_t>(10, b + 4));
    ++calls;
  });
  EXPECT_EQ(calls, 3);  // one thread: the units in order, inline
}

}  // namespace
}  // namespace tandem::kernels::cpu
