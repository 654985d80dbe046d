#include "proxy/register_tcp.h"

#include <fmt/format.h>

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

// A worker's kept registration connection: every frame is one RegisterRequest.
class RegisterSession final : public FrameSession {
 public:
  RegisterSession(std::shared_ptr<FrameConn> conn, const RegisterTcpServer::Handler* handler)
      : conn_(std::move(conn)), identity_(conn_->PeerCommonName()), handler_(handler) {}

  Status OnFrame(std::string_view payload) override {
    pb::RegisterRequest req;
    if (!req.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return InvalidArgumentError(fmt::format(
          "{} sent a frame that is not a RegisterRequest ({} bytes); proxy.internal serves "
          "the framed Register (proxy.register_transport tcp)",
          conn_->peer(), payload.size()));
    }
    pb::RegisterResponse resp;
    (*handler_)(req, identity_, &resp);
    return conn_->Send(resp);
  }
  void OnClosed(const Status&) override {}

 private:
  const std::shared_ptr<FrameConn> conn_;
  const std::string identity_;  // the certificate's common name, read once authenticated
  const RegisterTcpServer::Handler* handler_;
};

}  // namespace

Result<std::unique_ptr<RegisterTcpServer>> RegisterTcpServer::Start(const std::string& address,
                                                                    std::shared_ptr<FrameTls> tls,
                                                                    Handler handler) {
  std::unique_ptr<RegisterTcpServer> s(new RegisterTcpServer());
  // The handler outlives the listener (Stop joins its thread first).
  auto h = std::make_shared<Handler>(std::move(handler));
  FrameOptions options;
  options.max_frame_bytes = 1u << 20;  // a WorkerInfo is a few hundred bytes
  TANDEM_ASSIGN_OR_RETURN(
      s->server_, FrameServer::Start(address, std::move(tls), options,
                                     [h](const std::shared_ptr<FrameConn>& conn) {
                                       return std::make_shared<RegisterSession>(conn, h.get());
                                     }));
  return s;
}

RegisterTcpServer::~RegisterTcpServer() { Stop(); }

void RegisterTcpServer::Stop() {
  if (server_) server_->Stop();
}

}  // namespace tandem::proxy
