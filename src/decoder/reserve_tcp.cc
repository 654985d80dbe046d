#include "decoder/reserve_tcp.h"

#include <fmt/format.h>

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
    // decode seat; a call still waiting when the connection closes is
    // answered into the closed connection (its target released below).
    ServeReserve(decoder_, in_.request(), trace,
                 [&decoder = decoder_, conn = conn_, id](const Result<KvTargetInfo>& target) {
                   Reply(decoder, *conn, id, target);
                 });
    return Status::Ok();
  }

  void OnClosed(const Status&) override {}

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

  Decoder& decoder_;
  const std::shared_ptr<FrameConn> conn_;
  pb::ReserveFrame in_;  // reused: the I/O thread only
};

}  // namespace

Result<std::unique_ptr<FrameServer>> ServeReserveTcp(Decoder& decoder, ReserveTcpOptions options) {
  return FrameServer::Serve(std::move(options), [&decoder](const std::shared_ptr<FrameConn>& conn) {
    return std::make_shared<ReserveTcpSession>(decoder, conn);
  });
}

}  // namespace tandem::decoder
