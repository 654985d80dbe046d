#include "common/frame_loop.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_set>

#include "common/delivery_scope.h"
#include "common/frame_reader.h"
#include "common/status.h"

namespace tandem {

using SteadyClock = std::chrono::steady_clock;

FrameLoop& FrameLoop::Shared() {
  // Never destroyed: connections may end during static destruction.
  static FrameLoop* loop = new FrameLoop("frame-loop");
  return *loop;
}

FrameLoop::FrameLoop(const char* name)
    : epoll_fd_(epoll_create1(EPOLL_CLOEXEC)), wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (epoll_fd_ >= 0 && wake_fd_ >= 0) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;  // the wake fd
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
    // Without a timer, WakeBy wakes the loop as Wake does.
    timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    ev.data.ptr = &timer_fd_;
    if (timer_fd_ >= 0 && epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, timer_fd_, &ev) != 0) {
      ::close(timer_fd_);
      timer_fd_ = -1;
    }
  }
  thread_ = std::thread([this, name] { Run(name); });
}

FrameLoop::~FrameLoop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  Signal();
  if (thread_.joinable()) thread_.join();
  if (timer_fd_ >= 0) ::close(timer_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
}

bool FrameLoop::SetTimer(SteadyClock::time_point at) {
  if (timer_fd_ < 0) return false;
  itimerspec spec{};  // all zero: off
  if (at != SteadyClock::time_point::max()) {
    // Absolute on CLOCK_MONOTONIC, which steady_clock reads; never zero
    // (that would turn it off): a time already past fires at once.
    const int64_t ns = std::max<int64_t>(
        1, std::chrono::duration_cast<std::chrono::nanoseconds>(at.time_since_epoch()).count());
    spec.it_value.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
    spec.it_value.tv_nsec = static_cast<long>(ns % 1'000'000'000);
  }
  return timerfd_settime(timer_fd_, TFD_TIMER_ABSTIME, &spec, nullptr) == 0;
}

void FrameLoop::Signal() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void FrameLoop::Add(FrameReader* r) {
  {
    std::lock_guard lock(mu_);
    added_.push_back(r);
  }
  Signal();
}

void FrameLoop::Wake(FrameReader* r) {
  {
    std::lock_guard lock(mu_);
    woken_.push_back(r);
  }
  Signal();
}

void FrameLoop::WakeBy(FrameReader* r, SteadyClock::time_point at) {
  {
    std::lock_guard lock(mu_);
    wake_by_.emplace_back(at, r);
    if (at >= timer_at_) return;  // the timer goes off earlier already
    if (SetTimer(at)) {
      timer_at_ = at;
      return;
    }
  }
  Signal();  // no timer: the loop takes it now
}

void FrameLoop::Forget(FrameReader* r) {
  std::lock_guard lock(mu_);
  std::erase(added_, r);
  std::erase(woken_, r);
  std::erase_if(wake_by_, [r](const auto& w) { return w.second == r; });
}

void FrameLoop::Run(const char* name) {
  pthread_setname_np(pthread_self(), name);
  // The connections served now. Pointers are only compared until found
  // here: a reader is destroyed only after it left this set.
  std::unordered_set<FrameReader*> readers;
  std::vector<FrameReader*> added, woken, due;
  std::vector<std::pair<SteadyClock::time_point, FrameReader*>> wake_by;
  const Status setup =
      epoll_fd_ < 0 || wake_fd_ < 0
          ? InternalError(std::string("frame loop: epoll/eventfd: ") + std::strerror(errno))
          : Status::Ok();
  const auto finish = [&](FrameReader* r, const Status& st) {
    if (r->loop_registered_) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, r->conn_->fd(), nullptr);
    r->loop_registered_ = false;
    readers.erase(r);
    // The owner may go with its reference (then r too): r is not used after.
    std::shared_ptr<void> keep = r->Finish(st);
  };
  // Its next deadline and the events it waits for now; false when it ended.
  const auto arm = [&](FrameReader* r) {
    r->loop_until_ = r->Until();
    const uint32_t events = static_cast<uint16_t>(r->conn_->Events());
    // A connect that fell back to the peer's next address is on a new
    // socket: the old one's registration went with it, the new one is added.
    const bool same_socket = r->loop_registered_ && r->conn_->dials() == r->loop_dials_;
    if (same_socket && events == r->loop_events_) return;
    epoll_event ev{};
    ev.events = events;
    ev.data.ptr = r;
    const int op = same_socket ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
    if (epoll_ctl(epoll_fd_, op, r->conn_->fd(), &ev) != 0) {
      finish(r, InternalError(std::string("frame loop: epoll_ctl: ") + std::strerror(errno)));
      return;
    }
    r->loop_registered_ = true;
    r->loop_events_ = events;
    r->loop_dials_ = r->conn_->dials();
  };
  const auto step = [&](FrameReader* r, short revents) {
    if (Status st = r->Step(revents); !st.ok()) {
      finish(r, st);
    } else {
      arm(r);
    }
  };
  epoll_event evs[64];
  for (;;) {
    bool stop;
    {
      std::lock_guard lock(mu_);
      stop = stop_;
      added.swap(added_);
      woken.swap(woken_);
      wake_by.swap(wake_by_);
      // Its requests are the loop's from here (its wait below honours
      // them): the timer is no longer needed for them.
      if (timer_at_ != SteadyClock::time_point::max() && SetTimer(SteadyClock::time_point::max())) {
        timer_at_ = SteadyClock::time_point::max();
      }
    }
    if (stop || !setup.ok()) break;
    {
      // The native front end flushes once for all the connections' deliveries.
      DeliveryScope scope;
      for (FrameReader* r : added) {
        readers.insert(r);
        if (Status st = r->Begin(); !st.ok()) {
          finish(r, st);
        } else {
          arm(r);
        }
      }
      added.clear();
      for (FrameReader* r : woken) {
        if (readers.count(r) != 0) step(r, 0);
      }
      woken.clear();
    }
    // Until the reader is next served, which asks its owner again.
    for (const auto& [at, r] : wake_by) {
      if (readers.count(r) != 0) r->loop_until_ = std::min(r->loop_until_, at);
    }
    wake_by.clear();
    auto until = SteadyClock::time_point::max();
    for (FrameReader* r : readers) until = std::min(until, r->loop_until_);
    int timeout_ms = -1;
    if (until != SteadyClock::time_point::max()) {
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(until - SteadyClock::now()).count() + 1,
          0, int64_t{1} << 30));
    }
    int n = epoll_wait(epoll_fd_, evs, 64, timeout_ms);
    // Interrupted (a signal; after SIGSTOP and SIGCONT every time, signal(7))
    // the wait says nothing of what is ready, and the deadlines served below
    // would run before the frames that came meanwhile were read (a Reserve
    // reply sitting in its socket ended as DEADLINE_EXCEEDED): ask again
    // without waiting.
    if (n < 0 && errno == EINTR) n = epoll_wait(epoll_fd_, evs, 64, 0);
    DeliveryScope scope;
    for (int i = 0; i < n; ++i) {
      auto* r = static_cast<FrameReader*>(evs[i].data.ptr);
      if (r == nullptr || evs[i].data.ptr == &timer_fd_) {  // the wake fd or the timer
        uint64_t v;
        (void)!::read(r == nullptr ? wake_fd_ : timer_fd_, &v, sizeof(v));
        continue;
      }
      if (readers.count(r) != 0) step(r, static_cast<short>(evs[i].events & 0xffff));
    }
    const auto now = SteadyClock::now();
    for (FrameReader* r : readers) {
      if (r->loop_until_ <= now) due.push_back(r);
    }
    for (FrameReader* r : due) {
      if (readers.count(r) != 0) step(r, 0);
    }
    due.clear();
  }
  // Stopped (or no epoll): every connection still served ends.
  const Status why = setup.ok() ? UnavailableError("the frame loop stopped") : setup;
  for (FrameReader* r : added) readers.insert(r);
  {
    std::lock_guard lock(mu_);
    for (FrameReader* r : added_) readers.insert(r);
    added_.clear();
    woken_.clear();
    wake_by_.clear();
  }
  while (!readers.empty()) finish(*readers.begin(), why);
}

}  // namespace tandem
