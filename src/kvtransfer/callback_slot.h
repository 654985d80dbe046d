// A transport's registered callback (notices, peer failures) whose setter
// returns only once no call of the callback it replaces is running
// (Transport::SetNotificationCallback): a component that unsets its
// callback in its Stop is not called afterwards, whichever thread delivers.
// A setter called from inside a call of the same slot does not wait (a
// callback may replace itself).
//
// Thread-safety: every method from any thread.
#pragma once

#include <condition_variable>
#include <mutex>
#include <utility>

namespace tandem::kvtransfer {

template <typename Fn>
class CallbackSlot {
 public:
  void Set(Fn fn) {
    std::unique_lock lock(mu_);
    fn_ = std::move(fn);
    if (inside_ == this) return;
    idle_.wait(lock, [this] { return running_ == 0; });
  }

  // Runs the callback with `args` and returns true; when none is set, runs
  // `unset()` instead (under the slot's lock, so a Set cannot come between
  // the check and it) and returns false.
  template <typename Unset, typename... Args>
  bool Call(Unset&& unset, Args&&... args) {
    Fn fn;
    {
      std::lock_guard lock(mu_);
      if (!fn_) {
        unset();
        return false;
      }
      fn = fn_;
      ++running_;
    }
    const void* outer = inside_;
    inside_ = this;
    fn(std::forward<Args>(args)...);
    inside_ = outer;
    std::lock_guard lock(mu_);
    if (--running_ == 0) idle_.notify_all();
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable idle_;
  Fn fn_;            // guarded by mu_
  int running_ = 0;  // guarded by mu_: calls of a copy of fn_ in progress
  // The slot whose callback this thread is running (nested: the innermost).
  static inline thread_local const void* inside_ = nullptr;
};

}  // namespace tandem::kvtransfer
