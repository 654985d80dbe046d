#include "common/frame_reader.h"

#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/frame_loop.h"

namespace tandem {

using SteadyClock = std::chrono::steady_clock;

FrameReader::FrameReader(std::shared_ptr<FrameConn> conn, FrameLoop* loop)
    : conn_(std::move(conn)), loop_(loop) {
  if (loop_ == nullptr) {
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) wake_errno_ = errno;
  }
  conn_->SetWake([this] { Wake(); });
}

FrameReader::~FrameReader() {
  if (loop_ != nullptr) loop_->Forget(this);
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the reader dropped the last reference on its way out
    } else {
      thread_.join();
    }
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

bool FrameReader::Start(const char* name, Hooks hooks, std::shared_ptr<void> keep_alive) {
  if (started_) return false;
  started_ = true;
  hooks_ = std::move(hooks);
  keep_alive_ = std::move(keep_alive);
  if (loop_ != nullptr && conn_->NeedsLookup() && keep_alive_ != nullptr) {
    // The loop's one thread serves every connection on it: a name is
    // resolved (getaddrinfo may wait on DNS) on a thread of its own, which
    // holds the owner (and so this reader) until the loop has it.
    std::thread([this, keep = keep_alive_] {
      pthread_setname_np(pthread_self(), "frame-lookup");
      conn_->Lookup();
      loop_->Add(this);
    }).detach();
  } else if (loop_ != nullptr) {
    loop_->Add(this);
  } else {
    thread_ = std::thread([this, name] { Run(name); });
  }
  return true;
}

void FrameReader::Wake() {
  if (loop_ != nullptr) {
    loop_->Wake(this);
    return;
  }
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void FrameReader::WakeBy(SteadyClock::time_point at) {
  if (loop_ != nullptr) {
    loop_->WakeBy(this, at);
  } else {
    Wake();
  }
}

bool FrameReader::Join() {
  if (loop_ == nullptr) {
    if (!thread_.joinable() || thread_.get_id() == std::this_thread::get_id()) return false;
    thread_.join();
    return true;
  }
  if (!started_ || joined_ || loop_->on_loop_thread()) return false;
  std::unique_lock lock(end_mu_);
  end_cv_.wait(lock, [this] { return ended_; });
  joined_ = true;
  return true;
}

Status FrameReader::Begin() {
  if (loop_ == nullptr && wake_fd_ < 0) {
    return InternalError(fmt::format("eventfd: {}", std::strerror(wake_errno_)));
  }
  return conn_->Connect();
}

SteadyClock::time_point FrameReader::Until() {
  auto until = hooks_.before_wait ? hooks_.before_wait() : SteadyClock::time_point::max();
  if (!conn_->open()) until = std::min(until, conn_->progress_deadline());
  return until;
}

Status FrameReader::Step(short revents) {
  Status st = conn_->Progress(revents, hooks_.on_frame);
  if (hooks_.after_progress) hooks_.after_progress();
  if (st.ok() && !conn_->open() && SteadyClock::now() >= conn_->handshake_deadline()) {
    st = conn_->Expire();
  }
  return st;
}

std::shared_ptr<void> FrameReader::Finish(const Status& why) {
  std::shared_ptr<void> keep = std::move(keep_alive_);
  conn_->Close(why);
  hooks_.on_end(why);
  hooks_ = {};
  if (loop_ != nullptr) {
    // Under the lock: a Join that returns may let the owner go (not before
    // `keep` is dropped, by the caller).
    std::lock_guard lock(end_mu_);
    ended_ = true;
    end_cv_.notify_all();
  }
  return keep;
}

void FrameReader::Run(const char* name) {
  pthread_setname_np(pthread_self(), name);
  Status st = Begin();
  while (st.ok()) {
    const auto until = Until();
    int timeout_ms = -1;
    if (until != SteadyClock::time_point::max()) {
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(until - SteadyClock::now()).count() + 1,
          0, int64_t{1} << 30));
    }
    pollfd fds[2] = {{conn_->fd(), conn_->Events(), 0}, {wake_fd_, POLLIN, 0}};
    int n = poll(fds, 2, timeout_ms);
    // Interrupted (after SIGSTOP and SIGCONT every time, signal(7)), poll
    // says nothing of what is ready: ask again without waiting, so that a
    // frame that came meanwhile is read before the owner's deadlines run.
    if (n < 0 && errno == EINTR) n = poll(fds, 2, 0);
    if (n < 0 && errno != EINTR) {
      st = InternalError(fmt::format("poll: {}", std::strerror(errno)));
      break;
    }
    if (fds[1].revents != 0) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof(v));
    }
    st = Step(fds[0].revents);
  }
  // The last reference may be `keep` (then the owner's destructor, and
  // this reader's, run here and detach): nothing of `this` is used after.
  std::shared_ptr<void> keep = Finish(st);
}

}  // namespace tandem
