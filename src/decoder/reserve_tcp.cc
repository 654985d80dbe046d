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
    out_.Clear();
    out_.set_call_id(id);
    ServeReserve(decoder_, in_.request(), trace, out_.mutable_response());
    if (Status st = conn_->Send(out_); !st.ok()) {
      conn_->Close(st);
      // The reply did not leave this process.
      if (out_.response().has_target()) {
        ReleaseUnreceivedTarget(
            decoder_, out_.response().target(),
            UnavailableError(fmt::format("the reserve reply to {} was not sent: {}", conn_->peer(),
                                         st.message())));
      }
    }
    return Status::Ok();
  }

  void OnClosed(const Status&) override {}

 private:
  Decoder& decoder_;
  const std::shared_ptr<FrameConn> conn_;
  pb::ReserveFrame in_;   // reused: the I/O thread only
  pb::ReserveFrame out_;  // reused: the I/O thread only
};

}  // namespace

Result<std::unique_ptr<FrameServer>> ServeReserveTcp(Decoder& decoder, ReserveTcpOptions options) {
  return FrameServer::Serve(std::move(options), [&decoder](const std::shared_ptr<FrameConn>& conn) {
    return std::make_shared<ReserveTcpSession>(decoder, conn);
  });
}

}  // namespace tandem::decoder
