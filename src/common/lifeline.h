// The end of a component's callbacks. A component that hands callbacks to
// other components' threads (a transport's completions, an engine's
// outputs, a link's replies) wraps each in its Lifeline's Guard; its Stop
// calls End, which waits for the guarded callbacks that are running and
// makes every later one a no-op. Without it, a callback the transport
// runs as late as its own shutdown (the transport outlives the component)
// would run on a destroyed object.
//
// A component's own entry points (methods other components call, which
// may race with its Stop) take a Pass instead: held, it counts as a
// guarded callback running; empty (End began), the method does nothing.
//
// Guarded callbacks and Passes may nest (one calling another inline). End
// must not be called from either (it would wait for itself).
//
// Thread-safety: Guard's wrappers, Enter and End from any thread.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

namespace tandem {

class Lifeline {
  struct State;

 public:
  // Entry into the component while it lives: End waits until every held
  // Pass is gone. False (and nothing held) once End began.
  class Pass {
   public:
    explicit operator bool() const { return state_ != nullptr; }
    ~Pass() {
      if (state_ != nullptr) state_->Leave();
    }
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;

   private:
    friend class Lifeline;
    explicit Pass(State* state) : state_(state->Enter() ? state : nullptr) {}
    State* const state_;
  };
  // For the component's own methods; the component outlives the Pass (its
  // Stop ends the Lifeline, and End waits for the Pass).
  Pass Enter() const { return Pass(state_.get()); }

  // `fn` wrapped: it runs only until End (after it, the wrapper returns a
  // value-initialized result), and End waits for it.
  template <typename F>
  auto Guard(F fn) const {
    return [state = state_, fn = std::move(fn)](auto&&... args) mutable {
      using R = decltype(fn(std::forward<decltype(args)>(args)...));
      const Pass pass(state.get());
      if (!pass) return R();
      return fn(std::forward<decltype(args)>(args)...);
    };
  }

  // Waits for the guarded callbacks that are running; none runs after.
  // Idempotent.
  void End() { state_->End(); }
  bool ended() const { return state_->ended(); }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool alive = true;  // guarded by mu
    int running = 0;    // guarded by mu: guarded callbacks inside fn, Passes held

    bool Enter() {
      std::lock_guard lock(mu);
      if (!alive) return false;
      ++running;
      return true;
    }
    void Leave() {
      std::lock_guard lock(mu);
      if (--running == 0) cv.notify_all();
    }
    void End() {
      std::unique_lock lock(mu);
      alive = false;
      cv.wait(lock, [this] { return running == 0; });
    }
    bool ended() {
      std::lock_guard lock(mu);
      return !alive;
    }
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace tandem
