#include "prefiller/prefill_tcp.h"

#include <fmt/format.h>

#include <chrono>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "prefiller/prefiller_service.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::prefiller {
namespace {

namespace pb = ::tandem::v1;
using SteadyClock = std::chrono::steady_clock;

class PrefillTcpSession final : public FrameSession,
                                public std::enable_shared_from_this<PrefillTcpSession> {
 public:
  PrefillTcpSession(Prefiller& prefiller, std::shared_ptr<FrameConn> conn,
                    std::function<void(const std::string&, const Status&)> on_closed)
      : prefiller_(prefiller), conn_(std::move(conn)), on_closed_(std::move(on_closed)) {}

  Status OnFrame(std::string_view payload) override {
    if (!in_.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("a prefill frame does not hold a PrefillFrame");
    }
    const uint64_t id = in_.call_id();
    switch (in_.kind_case()) {
      case pb::PrefillFrame::kRequest: return Start(id);
      case pb::PrefillFrame::kCancel: {
        // The caller has ended the call itself: nothing is replied to it.
        std::string key;
        {
          std::lock_guard lock(mu_);
          auto it = calls_.find(id);
          if (it == calls_.end()) return Status::Ok();  // already over
          key = std::move(it->second.key);
          EraseLocked(it);
        }
        prefiller_.Cancel(key);
        return Status::Ok();
      }
      default:
        return InvalidArgumentError(
            fmt::format("prefill frame of call {}: neither a request nor a cancel", id));
    }
  }

  void OnClosed(const Status& why) override {
    // As a broken gRPC call: every call's work is cancelled (its blocks and
    // the decoder's reservation freed); no reply can reach the caller.
    std::vector<std::string> keys;
    {
      std::lock_guard lock(mu_);
      for (auto& [id, c] : calls_) keys.push_back(std::move(c.key));
      calls_.clear();
      deadlines_.clear();
    }
    for (const std::string& k : keys) prefiller_.Cancel(k);
    if (on_closed_) on_closed_(conn_->peer(), why);
  }

  SteadyClock::time_point NextTimer() override {
    std::lock_guard lock(mu_);
    return deadlines_.empty() ? SteadyClock::time_point::max() : deadlines_.begin()->first;
  }

  Status OnTimer(SteadyClock::time_point now) override {
    // As gRPC's server: the call ends with DEADLINE_EXCEEDED and its work
    // is cancelled.
    std::vector<std::pair<uint64_t, std::string>> expired;
    {
      std::lock_guard lock(mu_);
      while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
        const uint64_t id = deadlines_.begin()->second;
        auto it = calls_.find(id);
        expired.emplace_back(id, std::move(it->second.key));
        EraseLocked(it);
      }
    }
    for (auto& [id, key] : expired) {
      prefiller_.Cancel(key);
      Reply(id, DeadlineExceededError("Deadline Exceeded"));
    }
    return Status::Ok();
  }

 private:
  struct CallState {
    std::string key;  // the prefiller's job id (the attempt key)
    SteadyClock::time_point deadline = SteadyClock::time_point::max();
  };
  using Calls = std::unordered_map<uint64_t, CallState>;

  void EraseLocked(Calls::iterator it) {
    if (it->second.deadline != SteadyClock::time_point::max()) {
      deadlines_.erase({it->second.deadline, it->first});
    }
    calls_.erase(it);
  }

  Status Start(uint64_t id) {
    const pb::PrefillRequest& req = in_.request();
    PrefillJob job = ToPrefillJob(req, in_.traceparent());
    CallState call{job.request_id, SteadyClock::time_point::max()};
    if (in_.timeout_us() > 0) {
      call.deadline = SteadyClock::now() + std::chrono::microseconds(in_.timeout_us());
    }
    {
      std::lock_guard lock(mu_);
      if (id == 0 || calls_.count(id) > 0) {
        return InvalidArgumentError(fmt::format("prefill frame: call id {} is {}", id,
                                                id == 0 ? "reserved" : "already in flight"));
      }
      if (call.deadline != SteadyClock::time_point::max()) deadlines_.emplace(call.deadline, id);
      calls_.emplace(id, call);
    }
    const std::string request_id = req.request_id();
    Status s = prefiller_.Submit(
        std::move(job), [self = shared_from_this(), id, request_id](Result<PrefillResult> r) {
          self->Done(id, request_id, std::move(r));
        });
    if (!s.ok()) Done(id, request_id, std::move(s));
    return Status::Ok();
  }

  // The prefill ended (any thread): the reply goes out from here, unless
  // the call is already over (cancelled, expired, connection closed).
  void Done(uint64_t id, const std::string& request_id, Result<PrefillResult> r) {
    {
      std::lock_guard lock(mu_);
      auto it = calls_.find(id);
      if (it == calls_.end()) return;
      EraseLocked(it);
    }
    if (!r.ok()) {
      Reply(id, r.status());
      return;
    }
    pb::PrefillFrame out;
    out.set_call_id(id);
    ToPrefillResponse(request_id, *r, out.mutable_response());
    Send(out);
  }

  void Reply(uint64_t id, const Status& error) {
    pb::PrefillFrame out;
    out.set_call_id(id);
    out.mutable_error()->set_code(static_cast<int>(error.code()));
    out.mutable_error()->set_message(error.message());
    Send(out);
  }

  void Send(const pb::PrefillFrame& out) {
    // Never blocks; a failure (the proxy too slow, a broken connection)
    // closes the connection, and the I/O thread then ends every call.
    if (Status st = conn_->Send(out); !st.ok()) conn_->Close(st);
  }

  Prefiller& prefiller_;
  const std::shared_ptr<FrameConn> conn_;
  const std::function<void(const std::string&, const Status&)> on_closed_;
  pb::PrefillFrame in_;  // reused: the I/O thread only
  std::mutex mu_;
  Calls calls_;                                                // guarded by mu_
  std::set<std::pair<SteadyClock::time_point, uint64_t>> deadlines_;  // guarded by mu_
};

}  // namespace

Result<std::unique_ptr<FrameServer>> ServePrefillTcp(Prefiller& prefiller, PrefillTcpOptions options) {
  auto on_closed = std::move(options.on_closed);
  return FrameServer::Serve(
      std::move(options), [&prefiller, on_closed](const std::shared_ptr<FrameConn>& conn) {
        return std::make_shared<PrefillTcpSession>(prefiller, conn, on_closed);
      });
}

}  // namespace tandem::prefiller
