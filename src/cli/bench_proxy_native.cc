#include "cli/bench_proxy_native.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace tandem::cli {

Result<std::unique_ptr<GrpcServerConfig>> GrpcServerConfig::Make(const std::string& config,
                                                                  const std::string& grpc_server) {
  std::unique_ptr<GrpcServerConfig> c(new GrpcServerConfig());
  c->path_ = config;
  if (grpc_server.empty()) return c;
  if (grpc_server != "grpc" && grpc_server != "native") {
    return InvalidArgumentError(
        fmt::format("--grpc-server must be grpc or native, got '{}'", grpc_server));
  }
  std::ifstream in(config);
  if (!in) return NotFoundError(fmt::format("--config '{}' does not exist", config));
  // Line by line, comments kept: the key goes first in the top-level
  // `proxy:` mapping (a `proxy:` line is added when there is none); a
  // grpc_server line already there is dropped.
  std::ostringstream out;
  bool in_proxy = false, placed = false;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] != ' ' && line[0] != '#') in_proxy = line.rfind("proxy:", 0) == 0;
    if (in_proxy && line.find_first_not_of(' ') != std::string::npos &&
        line.compare(line.find_first_not_of(' '), 12, "grpc_server:") == 0) {
      continue;
    }
    out << line << "\n";
    if (in_proxy && line.rfind("proxy:", 0) == 0 && !placed) {
      out << "  grpc_server: " << grpc_server << "\n";
      placed = true;
    }
  }
  if (!placed) out << "proxy:\n  grpc_server: " << grpc_server << "\n";
  const std::filesystem::path p(config);
  c->path_ = (p.parent_path() / fmt::format(".{}.{}-{}.yaml", p.stem().string(), grpc_server,
                                            getpid()))
                 .string();
  std::ofstream o(c->path_);
  o << out.str();
  if (!o.good()) {
    return InternalError(fmt::format("cannot write '{}' (the fleet file with "
                                     "proxy.grpc_server: {})",
                                     c->path_, grpc_server));
  }
  c->copy_ = true;
  return c;
}

GrpcServerConfig::~GrpcServerConfig() {
  std::error_code ec;
  if (copy_) std::filesystem::remove(path_, ec);
}

}  // namespace tandem::cli
