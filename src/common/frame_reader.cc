#include "common/frame_reader.h"

#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace tandem {

using SteadyClock = std::chrono::steady_clock;

FrameReader::FrameReader(std::shared_ptr<FrameConn> conn)
    : conn_(std::move(conn)), wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (wake_fd_ < 0) wake_errno_ = errno;
  conn_->SetWake([this] { Wake(); });
}

FrameReader::~FrameReader() {
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
  thread_ = std::thread([this, name] { Run(name); });
  return true;
}

void FrameReader::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

bool FrameReader::Join() {
  if (!thread_.joinable() || thread_.get_id() == std::this_thread::get_id()) return false;
  thread_.join();
  return true;
}

void FrameReader::Run(const char* name) {
  pthread_setname_np(pthread_self(), name);
  const std::string& peer = conn_->peer();
  Status st = wake_fd_ < 0 ? InternalError(fmt::format("eventfd: {}", std::strerror(wake_errno_)))
                           : conn_->Connect();
  while (st.ok()) {
    auto until = hooks_.before_wait ? hooks_.before_wait() : SteadyClock::time_point::max();
    if (!conn_->open()) until = std::min(until, conn_->handshake_deadline());
    int timeout_ms = -1;
    if (until != SteadyClock::time_point::max()) {
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(until - SteadyClock::now()).count() + 1,
          0, int64_t{1} << 30));
    }
    pollfd fds[2] = {{conn_->fd(), conn_->Events(), 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, timeout_ms) < 0 && errno != EINTR) {
      st = InternalError(fmt::format("poll: {}", std::strerror(errno)));
      break;
    }
    if (fds[1].revents != 0) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof(v));
    }
    st = conn_->Progress(fds[0].revents, hooks_.on_frame);
    if (hooks_.after_progress) hooks_.after_progress();
    if (st.ok() && !conn_->open() && SteadyClock::now() >= conn_->handshake_deadline()) {
      st = UnavailableError(fmt::format("no authenticated connection to {} within the timeout", peer));
    }
  }
  conn_->Close(st);
  hooks_.on_end(st);
  hooks_ = {};
  // The last reference may be this one (then the owner's destructor, and
  // this reader's, run here and detach): nothing of `this` is used after.
  std::shared_ptr<void> keep = std::move(keep_alive_);
}

}  // namespace tandem
