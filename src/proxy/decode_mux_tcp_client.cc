#include "proxy/decode_mux_tcp_client.h"

#include <fmt/format.h>

namespace tandem::proxy {

namespace pb = ::tandem::v1;

DecodeMuxTcpClient::DecodeMuxTcpClient(std::shared_ptr<FrameConn> conn, bool deliver_on_grpc_thread)
    : conn_(std::move(conn)), deliver_on_grpc_thread_(deliver_on_grpc_thread), reader_(conn_) {}

DecodeMuxTcpClient::~DecodeMuxTcpClient() = default;

std::shared_ptr<DecodeMuxTcpClient> DecodeMuxTcpClient::Open(const std::string& address,
                                                             std::shared_ptr<FrameTls> tls,
                                                             bool deliver_on_grpc_thread,
                                                             FrameOptions options) {
  auto mux = std::make_shared<DecodeMuxTcpClient>(
      FrameConn::Client(address, std::move(tls), options), deliver_on_grpc_thread);
  DecodeMuxTcpClient* m = mux.get();
  FrameReader::Hooks hooks;
  hooks.on_frame = [m](std::string_view payload) { return m->OnFrame(payload); };
  hooks.on_end = [m](const Status& why) { m->OnEnd(why); };
  m->reader_.Start("mux-tcp-read", std::move(hooks), mux);
  return mux;
}

void DecodeMuxTcpClient::Stop() {
  conn_->Close(UnavailableError("the proxy is stopping"));
  reader_.Wake();
  if (reader_.Join()) {
    std::unique_lock lock(post_mu_);
    drained_.wait_for(lock, std::chrono::seconds(5), [this] { return !draining_; });
  }
}

void DecodeMuxTcpClient::CancelRpc() {
  conn_->Close(UnavailableError("decode stream abandoned"));
  reader_.Wake();
}

// mu_ is released first: a batch the reader takes meanwhile does not wait
// behind this send (the start's prompt sealed and written: tens of
// microseconds for 8k tokens, issue 23 session 36). FrameConn writes each
// frame whole, whichever thread sends.
void DecodeMuxTcpClient::SendLocked(std::unique_lock<std::mutex>& lock,
                                    pb::DecodeStreamRequest msg) {
  lock.unlock();
  Sent(conn_->Send(msg));
}

void DecodeMuxTcpClient::SendPartsLocked(std::unique_lock<std::mutex>& lock,
                                         std::initializer_list<std::string_view> parts) {
  lock.unlock();
  Sent(conn_->SendParts(parts));
}

void DecodeMuxTcpClient::Sent(const Status& st) {
  if (st.ok()) return;
  conn_->Close(st);
  reader_.Wake();
}

Status DecodeMuxTcpClient::OnFrame(std::string_view payload) {
  if (!deliver_on_grpc_thread_) {  // here, in order: this is the only reader
    // What the decoder writes every step is read without a protobuf
    // message (decode_mux_wire.h); anything else goes to protobuf.
    if (ParseDecodeBatch(payload, &wire_items_, &wire_ids_)) {
      Deliver(wire_items_);
      return Status::Ok();
    }
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
}

void DecodeMuxTcpClient::OnEnd(const Status& why) {
  // After the batches read before it.
  Posted end;
  end.end = UnavailableError(fmt::format("decode stream to {} broken: {}", conn_->peer(), why.message()));
  Post(std::move(end));
  alarm_.reset();  // a set alarm still fires (it holds its own reference)
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
