// A gRPC server with what every tandem server needs: standard health
// checking (grpc.health.v1), server reflection, SO_REUSEPORT off (a leftover
// process must not silently share a port) and port 0 (pick a free port).
//
// Thread-safety: Start/Shutdown from the owning thread; SetServing from any.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tls.h"

namespace tandem {

class RpcServer {
 public:
  // Listens on `address` ("host:port", port 0 picks one) with `services`
  // (borrowed: they must outlive the server) and `credentials` (plaintext,
  // mutual TLS, ... : common/tls.h). Health starts as SERVING.
  static Result<std::unique_ptr<RpcServer>> Start(const std::string& address,
                                                  const std::vector<grpc::Service*>& services,
                                                  const RpcCredentials& credentials);
  ~RpcServer();

  // "host:port" with the real port.
  const std::string& address() const { return address_; }
  int port() const { return port_; }

  // Flips the overall health status (e.g. NOT_SERVING while draining).
  void SetServing(bool serving);

  // Stops accepting calls; in-flight calls get until `grace_ms` to finish.
  void Shutdown(int grace_ms = 0);

  grpc::Server* server() { return server_.get(); }

 private:
  RpcServer() = default;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
  bool shut_down_ = false;
};

// The one mapping from tandem's Status to gRPC's (and back).
grpc::Status ToGrpcStatus(const Status& status);
Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tandem
