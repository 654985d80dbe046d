// Counts the gRPC callback reactors an owner started and lets it wait until
// the last one is destroyed, so that the owner, not a reactor, drops the
// last reference to their channel.
//
// Why (session 51): with gRPC 1.51 on epoll1 a client's callbacks run on the
// process-wide "callback alternative" completion queue's threads
// (nexting_thread), which live while any grpc::Channel that made a callback
// call lives. When the process's last such channel is destroyed on one of
// those threads (a reactor's OnDone, or a unary callback's functor, holding
// the last stub or ClientContext), its release shuts the queue down, joins
// every nexting thread (the calling one among them) and deletes the queue
// while that thread still runs on it (as gRPC's CallbackAlternativeCQ::Unref
// reads; seen as `ref_counted.h:183 assertion failed: prior > 0` and an
// abort, tests/integration/failure/client_teardown_test.cc).
// A reactor holds a Token as its first member, so that the token goes last,
// after the stub and the context that hold the channel.
//
// Not common/lifeline.h: a Lifeline's Pass must not outlive its component
// and its End waits without a bound; here the owner waits a bounded time
// and a reactor still in flight then may outlive it (the tokens share the
// count's state).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>

namespace tandem::proxy {

class ReactorDrain {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    size_t live = 0;  // guarded by mu
  };

 public:
  // One live reactor; default-constructed: none (Arm it before the call).
  class Token {
   public:
    Token() = default;
    Token(const Token&) = delete;
    Token& operator=(const Token&) = delete;
    ~Token() {
      if (!state_) return;
      std::lock_guard lock(state_->mu);
      if (--state_->live == 0) state_->cv.notify_all();
    }

   private:
    friend class ReactorDrain;
    std::shared_ptr<State> state_;
  };

  // Counts the reactor holding `token` until the token is destroyed.
  void Arm(Token& token) {
    if (token.state_) return;
    std::lock_guard lock(state_->mu);
    ++state_->live;
    token.state_ = state_;
  }

  // Waits until every armed token is gone, at most `bound`. The reactors'
  // number when it gives up (0: all gone).
  size_t WaitForNone(std::chrono::milliseconds bound) {
    std::unique_lock lock(state_->mu);
    state_->cv.wait_for(lock, bound, [this] { return state_->live == 0; });
    return state_->live;
  }

  size_t live() const {
    std::lock_guard lock(state_->mu);
    return state_->live;
  }

 private:
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace tandem::proxy
