#include "proxy/decode_mux_tcp_client.h"

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

DecodeMuxTcpClient::DecodeMuxTcpClient(std::shared_ptr<FrameConn> conn, bool deliver_on_grpc_thread)
    : conn_(std::move(conn)),
      deliver_on_grpc_thread_(deliver_on_grpc_thread),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  conn_->SetWake([this] { Wake(); });
}

DecodeMuxTcpClient::~DecodeMuxTcpClient() {
  if (reader_.joinable()) {
    if (reader_.get_id() == std::this_thread::get_id()) {
      reader_.detach();  // the reader dropped the last reference on its way out
    } else {
      reader_.join();
    }
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

std::shared_ptr<DecodeMuxTcpClient> DecodeMuxTcpClient::Open(const std::string& address,
                                                             std::shared_ptr<FrameTls> tls,
                                                             bool deliver_on_grpc_thread,
                                                             FrameOptions options) {
  auto mux = std::make_shared<DecodeMuxTcpClient>(
      FrameConn::Client(address, std::move(tls), options), deliver_on_grpc_thread);
  mux->self_ = mux;
  mux->reader_ = std::thread([m = mux.get()] { m->Run(); });
  return mux;
}

void DecodeMuxTcpClient::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void DecodeMuxTcpClient::Stop() {
  conn_->Close(UnavailableError("the proxy is stopping"));
  Wake();
  if (reader_.joinable() && reader_.get_id() != std::this_thread::get_id()) {
    reader_.join();
    std::unique_lock lock(post_mu_);
    drained_.wait_for(lock, std::chrono::seconds(5), [this] { return !draining_; });
  }
}

void DecodeMuxTcpClient::CancelRpc() {
  conn_->Close(UnavailableError("decode stream abandoned"));
  Wake();
}

void DecodeMuxTcpClient::SendLocked(std::unique_lock<std::mutex>&, pb::DecodeStreamRequest msg) {
  // Under mu_: starts and cancels go out in the order they were made. A
  // failure closes the connection; the reader then ends every request.
  if (Status st = conn_->Send(msg); !st.ok()) {
    conn_->Close(st);
    Wake();
  }
}

void DecodeMuxTcpClient::Run() {
  pthread_setname_np(pthread_self(), "mux-tcp-read");
  const std::string& peer = conn_->peer();
  Status st = wake_fd_ < 0 ? InternalError(fmt::format("eventfd: {}", std::strerror(errno)))
                           : conn_->Connect();
  const auto on_frame = [this](std::string_view payload) {
    if (!deliver_on_grpc_thread_) {  // here, in order: this is the only reader
      // Clear() keeps the items' storage for the next step's parse.
      inline_batch_.Clear();
      if (!inline_batch_.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
        return InvalidArgumentError("a decode stream frame does not hold a DecodeStreamResponse");
      }
      Deliver(inline_batch_);
      return Status::Ok();
    }
    Posted p;
    if (!p.batch.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("a decode stream frame does not hold a DecodeStreamResponse");
    }
    Post(std::move(p));
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
  // After the batches read before it.
  Posted end;
  end.end = UnavailableError(fmt::format("decode stream to {} broken: {}", peer, st.message()));
  Post(std::move(end));
  alarm_.reset();  // a set alarm still fires (it holds its own reference)
  // The last reference may be this one (then the destructor detaches).
  std::shared_ptr<DecodeMuxTcpClient> self = std::move(self_);
}

// Why a gRPC thread: the batch's items become writes on the proxy's public
// gRPC streams (the lifecycle's sinks). Started on a thread of gRPC's own
// (here the executor that runs a due alarm), a step's writes for all its
// streams leave in one flush at the end of the callback; started from this
// reader thread, each would be flushed (a sendmsg) and completed on its own.
// Measured: bench/results/proxy_cost.md, "Session 5, raw-mux".
void DecodeMuxTcpClient::Post(Posted p) {
  if (!deliver_on_grpc_thread_) {  // here, in order: this is the only reader
    if (p.end) {
      EndAll(*p.end);
    } else {
      Deliver(p.batch);
    }
    return;
  }
  bool arm = false;
  {
    std::lock_guard lock(post_mu_);
    posted_.push_back(std::move(p));
    if (!draining_) draining_ = arm = true;
  }
  if (!arm) return;  // the drain in progress takes it
  alarm_ = std::make_unique<grpc::Alarm>();
  // Due at once (a deadline in the past: no timer thread involved).
  alarm_->Set(gpr_inf_past(GPR_CLOCK_MONOTONIC),
              [self = std::static_pointer_cast<DecodeMuxTcpClient>(shared_from_this())](bool) {
                self->DrainPosted();
              });
}

void DecodeMuxTcpClient::DrainPosted() {
  std::deque<Posted> batches;
  for (;;) {
    {
      std::lock_guard lock(post_mu_);
      if (posted_.empty()) {
        draining_ = false;
        drained_.notify_all();
        return;
      }
      batches.swap(posted_);
    }
    for (Posted& p : batches) {
      if (p.end) {
        EndAll(*p.end);
      } else {
        Deliver(p.batch);
      }
    }
    batches.clear();
  }
}

}  // namespace tandem::proxy
