#include "decoder/decode_mux_tcp.h"

#include "decoder/decode_mux.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::decoder {
namespace {

namespace pb = ::tandem::v1;

class TcpMuxOutput final : public MuxOutput {
 public:
  explicit TcpMuxOutput(std::shared_ptr<FrameConn> conn) : conn_(std::move(conn)) {}

  bool Write(const pb::DecodeStreamResponse& batch) override {
    // Never blocks. A failed send (the proxy too slow, a broken connection)
    // closes the connection: the listener's thread then ends the stream.
    if (Status st = conn_->Send(batch); !st.ok()) conn_->Close(st);
    return true;
  }
  void EndStream() override { conn_->Close(UnavailableError("the decode stream ended")); }

 private:
  const std::shared_ptr<FrameConn> conn_;
};

class TcpMuxSession final : public FrameSession {
 public:
  TcpMuxSession(Decoder& decoder, std::shared_ptr<FrameConn> conn)
      : out_(std::make_shared<TcpMuxOutput>(std::move(conn))), mux_(decoder, out_.get(), out_) {}

  Status OnFrame(std::string_view payload) override {
    if (!req_.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError("a decode stream frame does not hold a DecodeStreamRequest");
    }
    mux_.OnRequest(req_);
    return Status::Ok();
  }
  void OnClosed(const Status&) override { mux_.Close(); }

 private:
  std::shared_ptr<TcpMuxOutput> out_;
  MuxSession mux_;
  pb::DecodeStreamRequest req_;  // reused: the listener's thread only
};

}  // namespace

Result<std::unique_ptr<FrameServer>> ServeDecodeMuxTcp(Decoder& decoder, DecodeMuxTcpOptions options) {
  return FrameServer::Serve(std::move(options), [&decoder](const std::shared_ptr<FrameConn>& conn) {
    return std::make_shared<TcpMuxSession>(decoder, conn);
  });
}

}  // namespace tandem::decoder
