#include "kernels/cpu/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>

namespace tandem::kernels::cpu {
namespace {

// claim_ word: tag (bits 63..32) | stealing (31) | parts (30..16) | next
// range (15..0).
constexpr int kMaxThreads = 1024;
constexpr uint64_t kStealing = uint64_t{1} << 31;
inline uint32_t TagOf(uint64_t c) { return static_cast<uint32_t>(c >> 32); }
inline int PartsOf(uint64_t c) { return static_cast<int>((c >> 16) & 0x7FFF); }
inline int NextOf(uint64_t c) { return static_cast<int>(c & 0xFFFF); }

// home_ word: tag (bits 63..32) | front unit (31..16) | end unit (15..0).
inline int64_t FrontOf(uint64_t h) { return static_cast<int64_t>((h >> 16) & 0xFFFF); }
inline int64_t EndOf(uint64_t h) { return static_cast<int64_t>(h & 0xFFFF); }

// About 2,000 pauses (tens of microseconds) before a spinning thread starts
// yielding its core on every round.
constexpr int kPauseSpins = 2000;

inline void Backoff(int& spins) {
  if (spins < kPauseSpins) {
    ++spins;
    __builtin_ia32_pause();
  } else {
    sched_yield();
  }
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

ThreadPool::ThreadPool(int threads, Options options)
    : threads_(std::clamp(threads, 1, kMaxThreads)), options_(options) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus_.push_back(c);
    }
  }
  // Pin only when the pool covers every CPU it may run on: then pinning
  // cannot leave a core idle that the kernel would otherwise have used.
  // Worker i takes the i-th CPU; the owner thread is left alone (its
  // affinity belongs to the process), which leaves it the first CPU.
  pinned_ = options_.pin && threads_ > 1 && static_cast<int>(cpus_.size()) == threads_;
  home_ = std::make_unique<HomeRange[]>(static_cast<size_t>(threads_));
  workers_.reserve(static_cast<size_t>(threads_ - 1));
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lock(mu_);
  }
  wake_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::PinCurrentThread(int index) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpus_[static_cast<size_t>(index)], &set);
  // A failure leaves the thread unpinned: slower at worst, never wrong.
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) pinned_ = false;
}

int ThreadPool::sleeping_workers() {
  std::lock_guard<std::mutex> lock(mu_);
  return sleeping_;
}

int ThreadPool::Parts(int64_t n, int64_t grain) const {
  grain = std::max<int64_t>(1, grain);
  return static_cast<int>(std::clamp<int64_t>(n / grain, 1, threads_));
}

void ThreadPool::BeginStep() {
  if (step_depth_++ > 0) return;
  step_open_.store(true);
  int sleeping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sleeping = sleeping_;
  }
  if (sleeping > 0) wake_cv_.notify_all();
}

void ThreadPool::EndStep() {
  if (step_depth_ == 0 || --step_depth_ > 0) return;
  step_closed_ns_.store(NowNs(), std::memory_order_relaxed);
  step_open_.store(false);
}

int ThreadPool::ChunkedParts(int64_t n, int64_t chunk) {
  chunk = std::max<int64_t>(1, chunk);
  return static_cast<int>(std::clamp<int64_t>((n + chunk - 1) / chunk, 1, kMaxParts));
}

void ThreadPool::Prepare(int64_t n, ThunkFn thunk, void* ctx) {
  thunk_ = thunk;
  ctx_ = ctx;
  n_ = n;
  done_.store(0, std::memory_order_relaxed);
  if (++tag_ == 0) ++tag_;  // workers start having seen tag 0
}

void ThreadPool::Run(int64_t n, int parts, ThunkFn thunk, void* ctx) {
  if (n <= 0) return;
  if (parts == 1 || threads_ == 1) {
    thunk(ctx, 0, n);
    return;
  }
  StepScope implicit(step_depth_ == 0 ? this : nullptr);
  Prepare(n, thunk, ctx);
  claim_.store((uint64_t{tag_} << 32) | (static_cast<uint64_t>(parts) << 16),
               std::memory_order_release);
  Work(tag_, 0);
  int spins = 0;
  while (done_.load(std::memory_order_acquire) < parts) Backoff(spins);
}

int64_t ThreadPool::StealingUnit(int64_t n, int64_t unit) {
  return std::max<int64_t>({1, unit, (n + kMaxUnits - 1) / kMaxUnits});
}

int64_t ThreadPool::StealingUnits(int64_t n, int64_t unit) {
  if (n <= 0) return 0;
  unit = StealingUnit(n, unit);
  return (n + unit - 1) / unit;
}

void ThreadPool::RunStealing(int64_t n, int64_t unit, ThunkFn thunk, void* ctx) {
  if (n <= 0) return;
  unit = StealingUnit(n, unit);
  const int64_t units = (n + unit - 1) / unit;
  const int parts = static_cast<int>(std::min<int64_t>(units, threads_));
  if (parts == 1) {
    for (int64_t b = 0; b < n; b += unit) thunk(ctx, b, std::min(n, b + unit));
    return;
  }
  StepScope implicit(step_depth_ == 0 ? this : nullptr);
  Prepare(n, thunk, ctx);
  unit_ = unit;
  for (int r = 0; r < parts; ++r) {
    const auto front = static_cast<uint64_t>(units * r / parts);
    const auto end = static_cast<uint64_t>(units * (r + 1) / parts);
    home_[r].word.store((uint64_t{tag_} << 32) | (front << 16) | end, std::memory_order_relaxed);
  }
  claim_.store((uint64_t{tag_} << 32) | kStealing | (static_cast<uint64_t>(parts) << 16),
               std::memory_order_release);
  WorkStealing(tag_, 0, parts);
  int spins = 0;
  while (done_.load(std::memory_order_acquire) < units) Backoff(spins);
}

void ThreadPool::WorkStealing(uint32_t tag, int home, int parts) {
  // The units this thread ran, counted into done_ once at the end: done_ is
  // shared by every thread, one add per unit would move its cache line
  // between the cores as often. The job cannot end before the add.
  int64_t ran = 0;
  auto run = [&](int64_t u) {
    const int64_t b = u * unit_;
    thunk_(ctx_, b, std::min(n_, b + unit_));
    ++ran;
  };
  // Takes units from one home range until it is empty (or a newer job's):
  // from its front, in order, or from its back.
  auto drain = [&](std::atomic<uint64_t>& w, bool from_front) {
    uint64_t h = w.load(std::memory_order_acquire);
    while (TagOf(h) == tag && FrontOf(h) < EndOf(h)) {
      const uint64_t taken = from_front ? h + (uint64_t{1} << 16) : h - 1;
      if (w.compare_exchange_weak(h, taken, std::memory_order_acq_rel, std::memory_order_acquire)) {
        run(from_front ? FrontOf(h) : EndOf(h) - 1);
        h = w.load(std::memory_order_acquire);
      }
    }
  };
  if (home < parts) drain(home_[home].word, true);
  for (int i = 1; i <= parts; ++i) drain(home_[(home + i) % parts].word, false);
  if (ran > 0) done_.fetch_add(ran, std::memory_order_acq_rel);
}

void ThreadPool::Work(uint32_t tag, int home) {
  uint64_t c = claim_.load(std::memory_order_acquire);
  if (TagOf(c) == tag && (c & kStealing) != 0) {
    WorkStealing(tag, home, PartsOf(c));
    return;
  }
  for (;;) {
    if (TagOf(c) != tag || NextOf(c) >= PartsOf(c)) return;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
      continue;  // c holds the current word
    }
    // Range r of this job is ours; the job cannot change until done_
    // counts it, so its fields are stable.
    const int parts = PartsOf(c);
    const int64_t r = NextOf(c);
    const int64_t b = n_ * r / parts, e = n_ * (r + 1) / parts;
    if (b < e) thunk_(ctx_, b, e);
    done_.fetch_add(1, std::memory_order_acq_rel);
    c = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::WorkerLoop(int index) {
  if (pinned_) PinCurrentThread(index);
  uint32_t seen = 0;
  int spins = 0;
  for (;;) {
    const uint64_t c = claim_.load(std::memory_order_acquire);
    if (TagOf(c) != seen) {
      seen = TagOf(c);
      Work(seen, index);
      spins = 0;
      continue;
    }
    if (stop_.load(std::memory_order_relaxed)) return;
    if (step_open_.load(std::memory_order_relaxed) ||
        NowNs() - step_closed_ns_.load(std::memory_order_relaxed) < options_.linger_ns) {
      Backoff(spins);
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    ++sleeping_;
    wake_cv_.wait(lock, [&] {
      return stop_.load() || step_open_.load() ||
             TagOf(claim_.load(std::memory_order_acquire)) != seen;
    });
    --sleeping_;
    spins = 0;
  }
}

}  // namespace tandem::kernels::cpu
