#include "common/rpc_server.h"

#include <fmt/format.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>

#include "common/net.h"

namespace tandem {

Result<std::unique_ptr<RpcServer>> RpcServer::Start(const std::string& address,
                                                    const std::vector<grpc::Service*>& services,
                                                    const RpcCredentials& credentials) {
  TANDEM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  int selected_port = 0;
  builder.AddListeningPort(hp.ToString(), credentials.server(), &selected_port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(64 << 20);
  for (grpc::Service* s : services) builder.RegisterService(s);

  std::unique_ptr<RpcServer> out(new RpcServer());
  out->server_ = builder.BuildAndStart();
  if (!out->server_ || selected_port == 0) {
    return UnavailableError(
        fmt::format("gRPC server cannot listen on {} (address in use or not local?{})", address,
                    credentials.secure() ? " or its TLS certificate was refused" : ""));
  }
  out->port_ = selected_port;
  hp.port = static_cast<uint16_t>(selected_port);
  out->address_ = hp.ToString();
  out->SetServing(true);
  return out;
}

RpcServer::~RpcServer() { Shutdown(0); }

void RpcServer::SetServing(bool serving) {
  if (!server_) return;
  if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(serving);
}

void RpcServer::Shutdown(int grace_ms) {
  if (!server_ || shut_down_) return;
  shut_down_ = true;
  SetServing(false);
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  server_->Wait();
}

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(status.code())),
                      status.message());
}

Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return Status::Ok();
  const int code = static_cast<int>(status.error_code());
  const auto mapped = (code >= 0 && code <= 16) ? static_cast<StatusCode>(code)
                                                : StatusCode::kUnknown;
  return Status(mapped, status.error_message());
}

}  // namespace tandem
