// A fork-join thread pool for the CPU kernels, built for many small
// parallel regions per step (a batch-1 decode step of a Llama runs ~10
// regions per layer, each a few microseconds to a few hundred).
//
// ThreadPool(threads) starts threads - 1 workers; the calling thread takes
// part in every ParallelFor, so ThreadPool(1) starts nothing and runs
// everything inline.
//
// Cost model. Between steps the workers sleep on a condition variable (no
// CPU used). The owner opens a step (BeginStep / StepScope: one wake-up per
// step, not per region); while it is open the workers spin on one atomic
// word (pause, then sched_yield so an oversubscribed machine still makes
// progress), so a ParallelFor is one atomic store to publish and one load
// per part to join: well under a microsecond. After a step closes the
// workers keep spinning for a short linger (back-to-back decode steps do
// not pay a wake-up) and then sleep. A ParallelFor outside a step opens an
// implicit one around itself (correct, but pays the wake-up each time).
//
// Work split. ParallelFor splits [0, n) into `parts` contiguous ranges
// fixed by n, grain and threads() only (never by timing); the threads then
// claim ranges from a shared counter, so a worker that is late (asleep,
// descheduled) does not stall the caller, which simply runs more ranges.
// ParallelForStealing gives each thread a home range of whole units that it
// walks front to back (one contiguous stream, as a DRAM-bound GEMM wants)
// and lets a thread whose home range is done take units from the back of
// another's, so threads that got unequal memory bandwidth, or a late
// worker, even out at the end to within one unit.
// Kernels keep their results independent of the split (no reduction is
// ever divided between ranges), so the bits never depend on the thread
// count — see kernels/cpu/ops.h.
//
// Pinning (Options::pin): when the creating thread's affinity mask holds
// exactly threads() CPUs, worker i is pinned to the i-th of them (the owner
// thread is not touched and so keeps the first to itself); otherwise
// nothing is pinned (the kernel balances the threads with whatever else
// runs). pinned() tells which happened.
//
// Threading: one thread at a time drives a pool (the engine thread that owns
// it); ParallelFor is not reentrant (a task must not call ParallelFor on the
// same pool). Construction, BeginStep/EndStep and destruction happen on the
// owning thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace tandem::kernels::cpu {

class ThreadPool {
 public:
  struct Options {
    bool pin = true;
    // Spin this long after a step closes before sleeping.
    int64_t linger_ns = 200'000;
  };
  explicit ThreadPool(int threads) : ThreadPool(threads, Options{}) {}
  ThreadPool(int threads, Options options);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }
  // Workers asleep between steps right now (for tests and diagnostics).
  int sleeping_workers();
  bool pinned() const { return pinned_.load(); }

  // Opens / closes a step: workers spin (ready within nanoseconds) while one
  // is open. Nested calls count; only the outermost pair acts.
  void BeginStep();
  void EndStep();

  class StepScope {
   public:
    explicit StepScope(ThreadPool* pool) : pool_(pool) {
      if (pool_ != nullptr) pool_->BeginStep();
    }
    ~StepScope() {
      if (pool_ != nullptr) pool_->EndStep();
    }
    StepScope(const StepScope&) = delete;
    StepScope& operator=(const StepScope&) = delete;

   private:
    ThreadPool* pool_;
  };

  // Number of ranges ParallelFor(n, grain, ...) uses: min(threads(),
  // n / grain), at least 1.
  int Parts(int64_t n, int64_t grain) const;

  // Splits [0, n) into Parts(n, grain) ranges, range r = [r * n / parts,
  // (r + 1) * n / parts), calls fn(begin, end) once per range (on any of the
  // pool's threads) and returns when all are done.
  template <class F>
  void ParallelFor(int64_t n, int64_t grain, F&& fn) {
    Run(n, Parts(n, grain), Thunk<F>, const_cast<void*>(static_cast<const void*>(&fn)));
  }

  // For work of uneven cost per index (causal attention rows): ceil(n /
  // chunk) ranges (at most kMaxParts), same range formula, claimed one at a
  // time so the threads balance. Use only where no result depends on how
  // [0, n) is cut (the part count here does not depend on threads()).
  static constexpr int kMaxParts = 32767;
  static int ChunkedParts(int64_t n, int64_t chunk);
  template <class F>
  void ParallelForChunked(int64_t n, int64_t chunk, F&& fn) {
    Run(n, ChunkedParts(n, chunk), Thunk<F>, const_cast<void*>(static_cast<const void*>(&fn)));
  }

  // For work of even cost per index that each thread should stream in
  // order (a GEMM's weight panels): [0, n) is cut into units of `unit`
  // indices (the last may be shorter; `unit` grows so that there are at
  // most kMaxUnits), unit u = [u * unit, min(n, (u + 1) * unit)), and fn is
  // called once per unit. With U units and parts = min(threads(), U),
  // thread t (the caller is 0, worker i is i) owns the home range of units
  // [t * U / parts, (t + 1) * U / parts) and runs it in ascending order;
  // once its own is empty it takes the highest unit left in another's, one
  // at a time. Cost: one CAS per unit on a cache line that only the range's
  // thread touches until another comes to take from its back, and one add
  // per thread to join. Which thread runs a unit depends on timing, the cut
  // into units does not: use only where no result depends on which thread
  // runs what.
  static constexpr int64_t kMaxUnits = 65535;
  static int64_t StealingUnit(int64_t n, int64_t unit);   // the unit used
  static int64_t StealingUnits(int64_t n, int64_t unit);  // how many there are
  template <class F>
  void ParallelForStealing(int64_t n, int64_t unit, F&& fn) {
    RunStealing(n, unit, Thunk<F>, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using ThunkFn = void (*)(void* ctx, int64_t begin, int64_t end);
  template <class F>
  static void Thunk(void* ctx, int64_t b, int64_t e) {
    (*static_cast<std::remove_reference_t<F>*>(ctx))(b, e);
  }
  // The owner's part of publishing a job: its fields, a zeroed done_ and
  // the next tag (published by the caller's release store of claim_).
  void Prepare(int64_t n, ThunkFn thunk, void* ctx);
  void Run(int64_t n, int parts, ThunkFn thunk, void* ctx);
  void RunStealing(int64_t n, int64_t unit, ThunkFn thunk, void* ctx);
  // Claims and runs ranges of the job tagged `tag` until none is left;
  // `home` is the calling thread's index (owner 0, worker i).
  void Work(uint32_t tag, int home);
  void WorkStealing(uint32_t tag, int home, int parts);
  void WorkerLoop(int index);
  void PinCurrentThread(int index);

  const int threads_;
  const Options options_;
  std::vector<int> cpus_;  // the affinity mask's CPUs, in order
  std::atomic<bool> pinned_{false};
  int step_depth_ = 0;  // owner thread only

  // Published job: (tag << 32) | stealing (bit 31) | parts (30..16) | next
  // range to claim (15..0). A new tag publishes a job whose fields below
  // were written first (release); claiming a range is a CAS that keeps the
  // tag, so a late worker never claims from a job other than the one it
  // saw. A stealing job claims from home_ instead.
  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<int64_t> done_{0};  // ranges (units) finished in the current job
  alignas(64) ThunkFn thunk_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  int64_t unit_ = 0;  // stealing jobs
  uint32_t tag_ = 0;  // owner thread only

  // A stealing job's home ranges, one cache line each: (tag << 32) | front
  // unit (31..16) | end unit (15..0). The owner of a range claims its front
  // (front + 1), any thread its back (end - 1), both by a CAS that keeps the
  // tag.
  struct alignas(64) HomeRange {
    std::atomic<uint64_t> word{0};
  };
  std::unique_ptr<HomeRange[]> home_;

  alignas(64) std::atomic<bool> step_open_{false};
  std::atomic<int64_t> step_closed_ns_{0};  // steady clock at the last EndStep
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable wake_cv_;
  int sleeping_ = 0;  // guarded by mu_
  std::vector<std::thread> workers_;
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

// ParallelForChunked on `pool`, or inline over the whole range.
template <class F>
void ParallelForChunked(ThreadPool* pool, int64_t n, int64_t chunk, F&& fn) {
  if (n <= 0) return;
  if (pool == nullptr || pool->threads() == 1) {
    fn(int64_t{0}, n);
    return;
  }
  pool->ParallelForChunked(n, chunk, std::forward<F>(fn));
}

}  // namespace tandem::kernels::cpu
