// DeliveryScope: "the outputs of one step are being handed out on this
// thread". The engine opens one around each batch of deliveries (the
// output callbacks of a step, of an Abort, of an AddPrefilled); a consumer
// that would rather send one message per batch than one per callback (the
// decoder's multiplexed stream, issue 23) defers its flush to the end of
// the scope instead of sending at each callback.
//
// Nothing waits for a batch: the flush runs as soon as the last callback of
// the batch returned, on the same thread. Outside any scope, Defer returns
// false and the caller flushes at once.
//
// Now(): one clock reading per batch. The outputs of one batch arrived
// together (one step, one frame read), so the consumers that stamp each
// output (the proxy's TTFT/ITL samples, one per token) share the time the
// batch's first stamp read, instead of reading the clock per output.
// That reading is the thread's BatchClock: the steady clock, extrapolated
// from the CPU's time-stamp counter between readings of it (below).
//
// Threads: the scope is per thread (thread_local); scopes nest, the
// outermost one runs the deferred flushes. A Flushable may be deferred by
// several threads' scopes; each flush must be safe then (flushing what is
// pending, possibly nothing).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace tandem {

// A steady_clock reading for a thread that reads the clock once per batch
// after sleeping (issue 23: the decode stream's reader, once per decode
// step). The first clock_gettime after a wake-up costs ~1-1.6 us on the
// project's VMs (the vDSO's code and data are cold; measured: 2,000-4,000
// cycles, then ~120), a cold RDTSC ~75 cycles. So between readings of the
// steady clock (at most every kReanchorNs) the time is the last reading
// plus the time-stamp counter's ticks since, at the rate measured between
// the last two readings. Only where the kernel itself keeps time with the
// TSC (its clocksource is "tsc": invariant, synchronized across CPUs);
// elsewhere, and until a rate is known, Now() is steady_clock::now().
// Never earlier than its previous answer; off the steady clock by at most
// the rate's error over kReanchorNs (microseconds: docs/decode-stream.md).
// One per thread (not thread-safe).
class BatchClock {
 public:
  static constexpr int64_t kReanchorNs = 100'000'000;  // 100 ms
  // Inline: the caller's code is in cache already, a function of its own
  // would be one more cold code line (and page) per batch.
  std::chrono::steady_clock::time_point Now() {
    if (!uses_tsc_) return std::chrono::steady_clock::now();
    const uint64_t tsc = ReadTsc();
    // (A counter behind the anchor wraps to a huge difference: a reading.)
    const uint64_t ticks = tsc - anchor_tsc_;
    if (ns_per_tick_ == 0 || ticks >= reanchor_ticks_) return Reanchor(tsc);
    auto t = anchor_ + std::chrono::nanoseconds(
                           static_cast<int64_t>(static_cast<double>(ticks) * ns_per_tick_));
    if (t < last_) t = last_;
    last_ = t;
    return t;
  }
  // Whether this process extrapolates from the TSC (else: the steady clock).
  static bool UsesTsc();
  // Readings of the steady clock so far (tests).
  uint64_t readings() const { return readings_; }

 private:
  static uint64_t ReadTsc() {
#if defined(__x86_64__)
    return __rdtsc();
#else
    return 0;
#endif
  }
  std::chrono::steady_clock::time_point Reanchor(uint64_t before);
  // UsesTsc(), kept here: the thread's state is in cache when a batch asks
  // (a global would be one more cold line, ~1 us on these VMs).
  const bool uses_tsc_ = UsesTsc();
  uint64_t anchor_tsc_ = 0;  // 0: no reading yet
  std::chrono::steady_clock::time_point anchor_{};
  double ns_per_tick_ = 0;   // 0: no rate yet
  uint64_t reanchor_ticks_ = 0;
  std::chrono::steady_clock::time_point last_{};
  uint64_t readings_ = 0;
};

class Flushable {
 public:
  virtual ~Flushable() = default;
  // Sends what was queued during the scope. Called once per Defer, after
  // the scope's callbacks, with no lock of the deliverer held.
  virtual void FlushDeferred() = 0;
};

class DeliveryScope {
 public:
  DeliveryScope() { ++State().depth; }
  ~DeliveryScope() {
    auto& s = State();
    if (--s.depth > 0) return;
    // The scope is over while they run: a Defer from inside a flush is
    // refused (that caller flushes at once).
    std::vector<std::shared_ptr<Flushable>> run;
    run.swap(s.deferred);
    s.flushing = true;
    for (auto& f : run) f->FlushDeferred();
    s.flushing = false;
    // The list's storage serves the next scope (no allocation per batch).
    run.clear();
    if (s.deferred.empty()) s.deferred.swap(run);
    s.now = {};
  }
  DeliveryScope(const DeliveryScope&) = delete;
  DeliveryScope& operator=(const DeliveryScope&) = delete;

  // Runs f->FlushDeferred() when this thread's outermost scope ends and
  // returns true; false (nothing kept) when no scope is open here.
  static bool Defer(std::shared_ptr<Flushable> f) {
    auto& s = State();
    if (s.depth == 0) return false;
    s.deferred.push_back(std::move(f));
    return true;
  }

  // This thread's batch clock (tests).
  static const BatchClock& ThreadClock() { return State().clock; }

  // Inside a scope: the time this thread's outermost scope first asked for
  // (the same for every call until it ends, its deferred flushes included).
  // Outside any scope: the clock.
  static std::chrono::steady_clock::time_point Now() {
    auto& s = State();
    if (s.depth == 0 && !s.flushing) return std::chrono::steady_clock::now();
    if (s.now == std::chrono::steady_clock::time_point{}) s.now = s.clock.Now();
    return s.now;
  }

 private:
  struct ThreadState {
    int depth = 0;
    std::vector<std::shared_ptr<Flushable>> deferred;
    bool flushing = false;  // the outermost scope's end runs the deferred flushes
    std::chrono::steady_clock::time_point now{};  // Now()'s reading in this scope, or none
    BatchClock clock;
  };
  static ThreadState& State() {
    thread_local ThreadState state;
    return state;
  }
};

}  // namespace tandem
