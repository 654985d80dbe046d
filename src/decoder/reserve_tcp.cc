#include "decoder/reserve_tcp.h"

#include <fmt/format.h>

#include <map>
#include <mutex>
#include <vector>

#include "decoder/decoder_service.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::decoder {
namespace {

namespace pb = ::tandem::v1;

class ReserveTcpSession final : public FrameSession {
 public:
  ReserveTcpSession(Decoder& decoder, std::shared_ptr<FrameConn> conn)
      : decoder_(decoder), conn_(std::move(conn)) {}

  Status OnFrame(std::string_view payload) override {
    if (!in_.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("a reserve frame does not hold a ReserveFrame");
    }
    const uint64_t id = in_.call_id();
    if (id == 0 || in_.kind_case() != pb::ReserveFrame::kRequest) {
      return InvalidArgumentError(
          fmt::format("reserve frame of call {}: {}", id, id == 0 ? "call id 0 is reserved" : "not a request"));
    }
    tracing::SpanContext trace;
    if (!in_.traceparent().empty() && tracing::Tracer::Get().enabled()) {
      trace = tracing::Tracer::Get().ContinueFrom(in_.traceparent());
    }
    // Answered here, or on the decoder's lease thread after a wait for a
    // decode seat (such a call is kept in waiting_ until then, so that the
    // connection's end takes it out of the decoder's queue).
    waiting_->Begin(id);
    bool for_registration = false;
    const uint64_t ticket = ServeReserve(
        decoder_, in_.request(), trace,
        [&decoder = decoder_, conn = conn_, waiting = waiting_,
         id](const Result<KvTargetInfo>& target) {
          waiting->Answered(id);
          Reply(decoder, *conn, id, target);
        },
        &for_registration);
    // A call that waits for a seat: a prefiller that asked is told so before
    // the reply (it stops counting the call in its admission budget). Not
    // one that waits for its request's registration (milliseconds, as a
    // rule: the start left the proxy before the Prefill).
    waiting_->End(id, ticket,
                  in_.request().tell_seat_wait() && !for_registration ? conn_.get() : nullptr);
    return Status::Ok();
  }

  // The prefiller will read no reply now: its calls still waiting for a
  // decode seat leave the decoder's queue (nothing was reserved for them).
  void OnClosed(const Status&) override {
    for (uint64_t ticket : waiting_->TakeAll()) decoder_.AbandonReserve(ticket);
  }

 private:
  static void Reply(Decoder& decoder, FrameConn& conn, uint64_t id,
                    const Result<KvTargetInfo>& target) {
    thread_local pb::ReserveFrame out;  // reused: Send copies it out
    out.Clear();
    out.set_call_id(id);
    FillReserveResponse(target, out.mutable_response());
    if (Status st = conn.Send(out); !st.ok()) {
      conn.Close(st);
      // The reply did not leave this process.
      if (out.response().has_target()) {
        ReleaseUnreceivedTarget(
            decoder, out.response().target(),
            UnavailableError(fmt::format("the reserve reply to {} was not sent: {}", conn.peer(),
                                         st.message())));
      }
    }
  }

  // This connection's calls waiting for a decode seat: call id -> the
  // decoder's ticket. Begin/End bracket ServeReserve on the I/O thread; a
  // call answered within it (inline, or at once on the lease thread) is
  // never kept. Any thread.
  class Waiting {
   public:
    void Begin(uint64_t id) {
      std::lock_guard lock(mu_);
      serving_ = id;
      serving_answered_ = false;
    }
    // `tell`: where to send the call's ReserveFrame.seat_wait when it waits
    // (null: not asked for). Sent under mu_, so that it leaves before the
    // reply (Answered takes mu_ first).
    void End(uint64_t id, uint64_t ticket, FrameConn* tell) {
      std::lock_guard lock(mu_);
      serving_ = 0;
      if (ticket == 0 || serving_answered_) return;
      tickets_.emplace(id, ticket);
      if (tell == nullptr) return;
      pb::ReserveFrame out;
      out.set_call_id(id);
      out.mutable_seat_wait();
      // A connection that cannot take it is closed: OnClosed then takes the
      // call out of the decoder's queue.
      if (Status st = tell->Send(out); !st.ok()) tell->Close(st);
    }
    void Answered(uint64_t id) {
      std::lock_guard lock(mu_);
      if (id == serving_) {
        serving_answered_ = true;
      } else {
        tickets_.erase(id);
      }
    }
    std::vector<uint64_t> TakeAll() {
      std::lock_guard lock(mu_);
      std::vector<uint64_t> out;
      for (const auto& [id, ticket] : tickets_) out.push_back(ticket);
      tickets_.clear();
      return out;
    }

   private:
    std::mutex mu_;
    std::map<uint64_t, uint64_t> tickets_;  // guarded by mu_
    uint64_t serving_ = 0;                  // guarded by mu_: the call in ServeReserve
    bool serving_answered_ = false;         // guarded by mu_
  };

  Decoder& decoder_;
  const std::shared_ptr<FrameConn> conn_;
  const std::shared_ptr<Waiting> waiting_ = std::make_shared<Waiting>();
  pb::ReserveFrame in_;  // reused: the I/O thread only
};

}  // namespace

Result<std::unique_ptr<FrameServer>> ServeReserveTcp(Decoder& decoder, ReserveTcpOptions options) {
  return FrameServer::Serve(std::move(options), [&decoder](const std::shared_ptr<FrameConn>& conn) {
    return std::make_shared<ReserveTcpSession>(decoder, conn);
  });
}

}  // namespace tandem::decoder
