#include "proxy/watch_tcp_client.h"

#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace tandem::proxy {

namespace pb = ::tandem::v1;

WatchTcpClient::WatchTcpClient(std::shared_ptr<FrameConn> conn, pb::WatchRequest request)
    : conn_(std::move(conn)), request_(std::move(request)),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  conn_->SetWake([this] { Wake(); });
}

WatchTcpClient::~WatchTcpClient() {
  if (reader_.joinable()) {
    if (reader_.get_id() == std::this_thread::get_id()) {
      reader_.detach();  // the reader dropped the last reference on its way out
    } else {
      reader_.join();
    }
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

std::shared_ptr<WatchTcpClient> WatchTcpClient::Create(const std::string& address,
                                                       std::shared_ptr<FrameTls> tls,
                                                       pb::WatchRequest request,
                                                       FrameOptions options) {
  return std::make_shared<WatchTcpClient>(FrameConn::Client(address, std::move(tls), options),
                                          std::move(request));
}

void WatchTcpClient::Start(Callbacks callbacks) {
  if (reader_.joinable()) return;
  callbacks_ = std::move(callbacks);
  // The reader keeps this object alive until it ends: a handle's owner may
  // drop its reference from on_end.
  self_ = shared_from_this();
  reader_ = std::thread([this] { Run(); });
}

void WatchTcpClient::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void WatchTcpClient::Stop(const Status& why) {
  stopped_.store(true);
  conn_->Close(why);
  Wake();
}

void WatchTcpClient::Run() {
  pthread_setname_np(pthread_self(), "watch-tcp-read");
  const std::string& peer = conn_->peer();
  bool graceful = false;
  Status st = wake_fd_ < 0 ? InternalError(fmt::format("eventfd: {}", std::strerror(errno)))
                           : conn_->Connect();
  // Queued until the connection is authenticated, then flushed.
  if (st.ok()) st = conn_->Send(request_);
  const auto on_frame = [this, &graceful](std::string_view payload) {
    if (stopped_.load()) return CancelledError("watch stopped");
    if (!update_.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("a Watch frame does not hold a WorkerUpdate");
    }
    if (update_.watch_ended()) {
      graceful = true;
      return UnavailableError("the worker ended the watch");
    }
    callbacks_.on_update(update_);
    return Status::Ok();
  };
  while (st.ok()) {
    pollfd fds[2] = {{conn_->fd(), conn_->Events(), 0}, {wake_fd_, POLLIN, 0}};
    int timeout_ms = -1;
    if (!conn_->open()) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(conn_->handshake_deadline() -
                                                                   std::chrono::steady_clock::now())
                     .count() + 1));
    }
    if (poll(fds, 2, timeout_ms) < 0 && errno != EINTR) {
      st = InternalError(fmt::format("poll: {}", std::strerror(errno)));
      break;
    }
    if (fds[1].revents != 0) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof(v));
    }
    st = conn_->Progress(fds[0].revents, on_frame);
    if (st.ok() && !conn_->open() && std::chrono::steady_clock::now() >= conn_->handshake_deadline()) {
      st = UnavailableError(fmt::format("no authenticated connection to {} within the timeout", peer));
    }
  }
  conn_->Close(st);
  callbacks_.on_end(graceful && !stopped_.load(),
                    graceful ? st
                             : UnavailableError(fmt::format("watch connection to {}: {}", peer,
                                                            st.message())));
  callbacks_ = {};
  // The last reference may be this one (then the destructor detaches).
  std::shared_ptr<WatchTcpClient> self = std::move(self_);
}

}  // namespace tandem::proxy
