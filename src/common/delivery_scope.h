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
//
// Threads: the scope is per thread (thread_local); scopes nest, the
// outermost one runs the deferred flushes. A Flushable may be deferred by
// several threads' scopes; each flush must be safe then (flushing what is
// pending, possibly nothing).
#pragma once

#include <chrono>
#include <memory>
#include <vector>

namespace tandem {

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

  // Inside a scope: the time this thread's outermost scope first asked for
  // (the same for every call until it ends, its deferred flushes included).
  // Outside any scope: the clock.
  static std::chrono::steady_clock::time_point Now() {
    auto& s = State();
    if (s.depth == 0 && !s.flushing) return std::chrono::steady_clock::now();
    if (s.now == std::chrono::steady_clock::time_point{}) s.now = std::chrono::steady_clock::now();
    return s.now;
  }

 private:
  struct ThreadState {
    int depth = 0;
    std::vector<std::shared_ptr<Flushable>> deferred;
    bool flushing = false;  // the outermost scope's end runs the deferred flushes
    std::chrono::steady_clock::time_point now{};  // Now()'s reading in this scope, or none
  };
  static ThreadState& State() {
    thread_local ThreadState state;
    return state;
  }
};

}  // namespace tandem
