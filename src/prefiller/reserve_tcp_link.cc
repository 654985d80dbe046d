#include "prefiller/reserve_tcp_link.h"

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/frame_loop.h"
#include "common/frame_reader.h"
#include "common/tracing.h"
#include "kvtransfer/callback_slot.h"
#include "prefiller/prefiller_service.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::prefiller {
namespace {

namespace pb = ::tandem::v1;
using SteadyClock = std::chrono::steady_clock;
using ReserveDone = DecoderLink::ReserveDone;

// While no call is open the loop still looks at this connection this often,
// so that a call started meanwhile, whose deadline is later than that, needs
// no wake-up of its own (its reply wakes the loop anyway).
constexpr std::chrono::seconds kIdleLook{5};

// Where a target that came after its call ended goes (the prefiller's
// DecoderLink::LateTarget), shared by the link's connections.
using LateTargets = kvtransfer::CallbackSlot<DecoderLink::LateTarget>;
// Where a call's seat wait goes (DecoderLink::SeatWait), likewise.
using SeatWaits = kvtransfer::CallbackSlot<DecoderLink::SeatWait>;

// One framed connection to one decoder's reserve listener.
class ReserveConn final : public std::enable_shared_from_this<ReserveConn> {
 public:
  ReserveConn(std::shared_ptr<FrameConn> conn, std::shared_ptr<LateTargets> late,
              std::shared_ptr<SeatWaits> seat_waits)
      : conn_(std::move(conn)), late_(std::move(late)), seat_waits_(std::move(seat_waits)),
        reader_(conn_, &FrameLoop::Shared()) {}

  static std::shared_ptr<ReserveConn> Open(const std::string& address, std::shared_ptr<FrameTls> tls,
                                           const FrameOptions& options,
                                           std::shared_ptr<LateTargets> late,
                                           std::shared_ptr<SeatWaits> seat_waits) {
    auto c = std::make_shared<ReserveConn>(FrameConn::Client(address, std::move(tls), options),
                                           std::move(late), std::move(seat_waits));
    ReserveConn* p = c.get();
    FrameReader::Hooks hooks;
    hooks.on_frame = [p](std::string_view payload) { return p->OnFrame(payload); };
    hooks.before_wait = [p] { return p->BeforeWait(); };
    hooks.after_progress = [p] { p->Run(); };
    hooks.on_end = [p](const Status& why) { p->OnEnd(why); };
    p->reader_.Start("reserve-tcp-rd", std::move(hooks), c);
    return c;
  }

  // Sends `frame` (its call id set here) for `request_id`; `done` runs
  // later on the loop. False (nothing sent, `done` kept) when the
  // connection has ended.
  bool Start(pb::ReserveFrame& frame, const std::string& request_id,
             SteadyClock::time_point deadline, ReserveDone& done) {
    bool wake = false;
    {
      std::lock_guard lock(mu_);
      if (ended_) return false;
      const uint64_t id = next_id_++;
      frame.set_call_id(id);
      Status st = conn_->Send(frame);
      if (st.code() == StatusCode::kInvalidArgument) {
        posted_.emplace_back(std::move(done), std::move(st));  // over the frame limit
        wake = true;
      } else {
        if (!st.ok()) {
          conn_->Close(st);  // the loop ends every call, this one too
          wake = true;
        }
        calls_.emplace(id, Pending{std::move(done), deadline, request_id});
        deadlines_.emplace(deadline, id);
        if (deadline < reader_until_) wake = true;
      }
    }
    if (wake) reader_.Wake();
    return true;
  }

  // True once the connection has ended (no call can start on it).
  bool ended() {
    std::lock_guard lock(mu_);
    return ended_;
  }

  // Ends the connection (its calls get UNAVAILABLE) and waits for the end.
  void Stop() {
    conn_->Close(UnavailableError("the prefiller is stopping"));
    reader_.Wake();
    reader_.Join();
  }

 private:
  struct Pending {
    ReserveDone done;
    SteadyClock::time_point deadline;
    std::string request_id;
    bool seat_wait_told = false;  // its ReserveFrame.seat_wait went to the handler
  };
  using Completion = std::pair<ReserveDone, Result<ReserveTarget>>;

  // Takes call `id` out of calls_ (a null `done` when it is over already).
  ReserveDone TakeLocked(uint64_t id) {
    auto it = calls_.find(id);
    if (it == calls_.end()) return nullptr;
    ReserveDone done = std::move(it->second.done);
    deadlines_.erase({it->second.deadline, id});
    calls_.erase(it);
    return done;
  }

  Status OnFrame(std::string_view payload) {
    if (!in_.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("a reserve frame does not hold a ReserveFrame");
    }
    if (in_.kind_case() == pb::ReserveFrame::kSeatWait) {
      // The call waits for a decode seat; its reply comes later. (One that
      // is over here already, e.g. past its deadline, is not told.)
      std::lock_guard lock(mu_);
      auto it = calls_.find(in_.call_id());
      if (it != calls_.end() && !it->second.seat_wait_told) {
        it->second.seat_wait_told = true;
        seat_waits_done_.push_back(it->second.request_id);
      }
      return Status::Ok();
    }
    ReserveDone done;
    {
      std::lock_guard lock(mu_);
      done = TakeLocked(in_.call_id());
    }
    if (!done) {
      // Expired here first (the call's deadline passed, e.g. while this
      // process was stopped: after SIGCONT the loop ends the call before it
      // reads the reply waiting in the socket). A target is a reservation
      // the decoder holds for us: its lease only quarantines it, so tell
      // the decoder, or the blocks wait for this process's death.
      if (in_.kind_case() == pb::ReserveFrame::kResponse && in_.response().has_target()) {
        auto target = FromReserveResponse(in_.response());
        if (target.ok()) late_done_.emplace_back(in_.response().target().request_id(), *target);
      }
      return Status::Ok();
    }
    if (in_.kind_case() != pb::ReserveFrame::kResponse) {
      Status st = InvalidArgumentError(
          fmt::format("reserve frame of call {}: not a response", in_.call_id()));
      done_.emplace_back(std::move(done), UnavailableError(st.message()));
      return st;
    }
    done_.emplace_back(std::move(done), FromReserveResponse(in_.response()));
    return Status::Ok();
  }

  // Runs the completions gathered on the loop thread: a call's seat wait
  // before its reply, which may have come in the same read.
  void Run() {
    for (const std::string& request_id : seat_waits_done_) seat_waits_->Call([] {}, request_id);
    seat_waits_done_.clear();
    for (auto& [done, result] : done_) done(std::move(result));
    done_.clear();
    for (auto& [request_id, target] : late_done_) {
      late_->Call([] {}, request_id, std::move(target));
    }
    late_done_.clear();
  }

  SteadyClock::time_point BeforeWait() {
    for (;;) {
      SteadyClock::time_point until;
      {
        std::lock_guard lock(mu_);
        const auto now = SteadyClock::now();
        // As the gRPC client: a call past its deadline ends at once; its
        // late reply, if any, is ignored.
        while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
          ReserveDone done = TakeLocked(deadlines_.begin()->second);
          done_.emplace_back(std::move(done), DeadlineExceededError("Deadline Exceeded"));
        }
        for (auto& c : posted_) done_.push_back(std::move(c));
        posted_.clear();
        until = deadlines_.empty() ? now + kIdleLook : deadlines_.begin()->first;
        reader_until_ = done_.empty() ? until : SteadyClock::time_point::min();
      }
      if (done_.empty()) return until;
      Run();
    }
  }

  void OnEnd(const Status& why) {
    const Status broken = UnavailableError(
        fmt::format("reserve connection to decoder {} broken: {}", conn_->peer(), why.message()));
    {
      std::lock_guard lock(mu_);
      ended_ = true;
      for (auto& c : posted_) done_.push_back(std::move(c));
      posted_.clear();
      for (auto& [id, call] : calls_) done_.emplace_back(std::move(call.done), broken);
      calls_.clear();
      deadlines_.clear();
    }
    Run();
  }

  const std::shared_ptr<FrameConn> conn_;
  const std::shared_ptr<LateTargets> late_;
  const std::shared_ptr<SeatWaits> seat_waits_;
  std::mutex mu_;
  bool ended_ = false;                                     // guarded by mu_
  uint64_t next_id_ = 1;                                   // guarded by mu_
  std::unordered_map<uint64_t, Pending> calls_;               // guarded by mu_
  std::set<std::pair<SteadyClock::time_point, uint64_t>> deadlines_;  // guarded by mu_
  // When the loop's current wait ends; a call due earlier wakes it.
  SteadyClock::time_point reader_until_ = SteadyClock::time_point::min();  // guarded by mu_
  std::vector<Completion> posted_;  // guarded by mu_: completions for the loop to run
  std::vector<Completion> done_;    // the loop thread only
  std::vector<std::pair<std::string, ReserveTarget>> late_done_;  // the loop thread only
  std::vector<std::string> seat_waits_done_;  // the loop thread only: request ids
  pb::ReserveFrame in_;             // the loop thread only
  FrameReader reader_;              // last: it ends before the members above go
};

class TcpDecoderLink final : public DecoderLink {
 public:
  TcpDecoderLink(std::unique_ptr<DecoderLink> grpc, std::shared_ptr<FrameTls> tls,
                 std::string prefiller_descriptor, parallel::ParallelLayout layout,
                 FrameOptions options)
      : grpc_(std::move(grpc)), tls_(std::move(tls)),
        prefiller_descriptor_(std::move(prefiller_descriptor)), layout_(layout),
        options_(options) {}

  ~TcpDecoderLink() override {
    std::map<std::string, std::shared_ptr<ReserveConn>> conns;
    {
      std::lock_guard lock(mu_);
      conns.swap(conns_);
    }
    for (auto& [address, c] : conns) c->Stop();
  }

  void Reserve(const PrefillJob& job, const std::string& prefiller_name, ReserveDone done) override {
    if (job.decoder_reserve_address.empty()) {
      grpc_->Reserve(job, prefiller_name, std::move(done));  // a decoder without the listener
      return;
    }
    pb::ReserveFrame frame;
    FillReserveRequest(job, prefiller_name, prefiller_descriptor_, layout_, frame.mutable_request());
    frame.mutable_request()->set_tell_seat_wait(true);  // read in ReserveConn::OnFrame
    if (job.trace.sampled) frame.set_traceparent(tracing::FormatTraceparent(job.trace));
    // On the steady clock: the time left to the system-clock deadline.
    const auto deadline = SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(
                                                   ReserveDeadline(job) - std::chrono::system_clock::now());
    for (;;) {
      std::shared_ptr<ReserveConn> conn;
      std::vector<std::shared_ptr<ReserveConn>> gone;  // destroyed after the lock
      {
        std::lock_guard lock(mu_);
        auto it = conns_.find(job.decoder_reserve_address);
        if (it == conns_.end()) {
          // A new connection: first drop the entries whose connection has
          // ended (decoders that went away), so that a fleet whose decoders
          // come and go keeps one entry per live connection, not one per
          // address ever dialled.
          std::erase_if(conns_, [&gone](auto& entry) {
            if (!entry.second->ended()) return false;
            gone.push_back(std::move(entry.second));
            return true;
          });
          it = conns_.emplace(job.decoder_reserve_address,
                              ReserveConn::Open(job.decoder_reserve_address, tls_, options_,
                                                late_, seat_waits_))
                   .first;
        }
        conn = it->second;
      }
      gone.clear();
      if (conn->Start(frame, job.request_id, deadline, done)) return;
      // That connection has ended: a new one (once per ended connection).
      std::lock_guard lock(mu_);
      auto it = conns_.find(job.decoder_reserve_address);
      if (it != conns_.end() && it->second == conn) conns_.erase(it);
    }
  }

  std::string EncodeNotice(const NoticeSpec& n) override { return grpc_->EncodeNotice(n); }

  void SetLateTargetHandler(LateTarget handler) override {
    grpc_->SetLateTargetHandler(handler);
    late_->Set(std::move(handler));
  }

  void SetSeatWaitHandler(SeatWait handler) override { seat_waits_->Set(std::move(handler)); }

  ReserveLinkEntries Entries() {
    std::lock_guard lock(mu_);
    ReserveLinkEntries e;
    e.total = conns_.size();
    for (auto& [address, c] : conns_) e.ended += c->ended() ? 1 : 0;
    return e;
  }

 private:
  const std::unique_ptr<DecoderLink> grpc_;
  const std::shared_ptr<FrameTls> tls_;
  const std::string prefiller_descriptor_;
  const parallel::ParallelLayout layout_;
  const FrameOptions options_;
  const std::shared_ptr<LateTargets> late_ = std::make_shared<LateTargets>();
  const std::shared_ptr<SeatWaits> seat_waits_ = std::make_shared<SeatWaits>();
  std::mutex mu_;
  // One per decoder's reserve address; an ended one is replaced on its next use.
  std::map<std::string, std::shared_ptr<ReserveConn>> conns_;  // guarded by mu_
};

}  // namespace

ReserveLinkEntries TcpDecoderLinkEntries(DecoderLink& link) {
  auto* tcp = dynamic_cast<TcpDecoderLink*>(&link);
  return tcp != nullptr ? tcp->Entries() : ReserveLinkEntries{};
}

std::unique_ptr<DecoderLink> MakeTcpDecoderLink(std::unique_ptr<DecoderLink> grpc,
                                                std::shared_ptr<FrameTls> tls,
                                                std::string prefiller_descriptor,
                                                parallel::ParallelLayout layout,
                                                FrameOptions options) {
  return std::make_unique<TcpDecoderLink>(std::move(grpc), std::move(tls),
                                          std::move(prefiller_descriptor), layout, options);
}

}  // namespace tandem::prefiller
