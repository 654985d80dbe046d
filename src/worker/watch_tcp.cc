#include "worker/watch_tcp.h"

#include <atomic>

#include "tandem/v1/worker.pb.h"

namespace tandem::worker {
namespace {

namespace pb = ::tandem::v1;

class TcpWatchSink final : public WatchSink {
 public:
  explicit TcpWatchSink(std::shared_ptr<FrameConn> conn) : conn_(std::move(conn)) {}

  bool open() const override { return !conn_->closed(); }
  void Write(const pb::WorkerUpdate& update) override {
    // Never blocks. A failed send (the proxy too slow, a broken connection)
    // closes the connection: the watch is over.
    if (Status st = conn_->Send(update); !st.ok()) conn_->Close(st);
  }
  void End(bool graceful) override {
    ended_.store(true);
    if (graceful) {
      pb::WorkerUpdate last;
      last.set_watch_ended(true);
      (void)conn_->Send(last);  // a failure: the proxy sees a broken watch
    }
    conn_->Close(UnavailableError("the watch ended"));
  }
  // End was called: the worker closed it, not the proxy.
  bool ended() const { return ended_.load(); }
  void Closed() { conn_->Close(UnavailableError("the watch connection closed")); }

 private:
  const std::shared_ptr<FrameConn> conn_;
  std::atomic<bool> ended_{false};
};

class TcpWatchSession final : public FrameSession {
 public:
  TcpWatchSession(WorkerService& service, std::shared_ptr<FrameConn> conn)
      : service_(service), conn_(std::move(conn)) {}

  Status OnFrame(std::string_view payload) override {
    if (sink_) return InvalidArgumentError("a Watch connection carries one WatchRequest");
    pb::WatchRequest req;
    if (!req.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("a Watch frame does not hold a WatchRequest");
    }
    sink_ = std::make_shared<TcpWatchSink>(conn_);
    if (!service_.AddWatch(sink_, req.batched(), req.fixed64_hashes())) {
      refused_ = true;
      return UnavailableError("worker stopping");
    }
    return Status::Ok();
  }

  void OnClosed(const Status&) override {
    if (!sink_) return;
    sink_->Closed();  // the monitor drops it at its next round
    // The proxy closed it, or it broke: as a cancelled gRPC Watch.
    if (!refused_ && !sink_->ended()) service_.WatchBroken();
  }

 private:
  WorkerService& service_;
  const std::shared_ptr<FrameConn> conn_;
  std::shared_ptr<TcpWatchSink> sink_;  // the listener's thread only
  bool refused_ = false;
};

}  // namespace

Result<std::unique_ptr<FrameServer>> ServeWatchTcp(WorkerService& service, WatchTcpOptions options) {
  return FrameServer::Serve(std::move(options), [&service](const std::shared_ptr<FrameConn>& conn) {
    return std::make_shared<TcpWatchSession>(service, conn);
  });
}

}  // namespace tandem::worker
