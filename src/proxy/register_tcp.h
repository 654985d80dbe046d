// The proxy's Registry over framed TCP (issue 23, proxy.register_transport
// tcp, the default; docs/serving-workers.md "Register transport"): the
// workers' registrations arrive on the proxy's internal listener
// (proxy.internal) as one RegisterRequest frame each and get one
// RegisterResponse frame back, on a connection the worker keeps for its
// refreshes (worker/proxy_channels.cc). The same mutual TLS as the gRPC
// Registry (common/frame_conn.h: a client without a certificate of the
// fleet CA is refused in the handshake), and the same identity binding: the
// handler gets the verified certificate's common name ("" over plaintext).
// With it a default fleet's proxy runs no gRPC server at all: gRPC C++'s
// callback machinery woke the idle proxy ~8 times a second (its nexting and
// timer threads) for a Register every 10 s per worker.
//
// Threads: Start/Stop from the owner; the handler runs on the listener's
// I/O thread, one registration at a time.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "common/frame_server.h"
#include "common/status.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {

class RegisterTcpServer {
 public:
  using Handler = std::function<void(const tandem::v1::RegisterRequest& request,
                                     const std::string& identity,
                                     tandem::v1::RegisterResponse* response)>;

  // Listens on `address` ("host:port", port 0 = any free port); `tls` null
  // = plaintext (security.internal_tls off).
  static Result<std::unique_ptr<RegisterTcpServer>> Start(const std::string& address,
                                                          std::shared_ptr<FrameTls> tls,
                                                          Handler handler);
  ~RegisterTcpServer();  // Stop()

  const std::string& address() const { return server_->address(); }
  // Closes the listener and every kept connection. Idempotent.
  void Stop();
  uint64_t accepted() const { return server_->accepted(); }  // authenticated connections
  uint64_t refused() const { return server_->refused(); }    // failed handshakes
  FrameServer& frame_server() { return *server_; }

 private:
  RegisterTcpServer() = default;
  std::unique_ptr<FrameServer> server_;
};

}  // namespace tandem::proxy
