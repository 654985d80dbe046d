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
// Threads: the scope is per thread (thread_local); scopes nest, the
// outermost one runs the deferred flushes. A Flushable may be deferred by
// several threads' scopes; each flush must be safe then (flushing what is
// pending, possibly nothing).
#pragma once

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
    for (auto& f : run) f->FlushDeferred();
    // The list's storage serves the next scope (no allocation per batch).
    run.clear();
    if (s.deferred.empty()) s.deferred.swap(run);
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

 private:
  struct ThreadState {
    int depth = 0;
    std::vector<std::shared_ptr<Flushable>> deferred;
  };
  static ThreadState& State() {
    thread_local ThreadState state;
    return state;
  }
};

}  // namespace tandem
