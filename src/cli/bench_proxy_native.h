// `tandem bench proxy --grpc-server grpc|native` (issue 23,
// docs/grpc-frontend.md): the fleet the bench launches serves its public
// gRPC port with that front end (proxy.grpc_server), so both front ends are
// measured with the same command.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"

namespace tandem::cli {

// A copy of a fleet file with proxy.grpc_server set, written beside it (so
// that its relative paths still hold) and removed by the destructor.
class GrpcServerConfig {
 public:
  // `grpc_server` empty: `config` itself, no copy.
  static Result<std::unique_ptr<GrpcServerConfig>> Make(const std::string& config,
                                                        const std::string& grpc_server);
  ~GrpcServerConfig();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool copy_ = false;
};

}  // namespace tandem::cli
