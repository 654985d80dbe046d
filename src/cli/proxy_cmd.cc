// `tandem proxy --config FILE`: the proxy alone (tandem launch starts it
// first, then the workers join it).
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <iostream>

#include "cli/commands.h"
#include "cli/ready.h"
#include "common/config.h"
#include "common/logging.h"
#include "http/http_server.h"
#include "proxy/proxy_server.h"

namespace tandem::cli {
namespace {

int RunProxy(const std::string& config_path, const std::string& grpc, const std::string& metrics,
             const std::string& http, int ready_fd, const GlobalOptions& g) {
  auto cfg = LoadFleetConfig(config_path);
  if (!cfg.ok()) {
    std::cerr << cfg.status().message() << "\n";
    return 1;
  }
  if (auto s = SetupLogging("proxy", g.log_level.empty() ? cfg->logging.level : g.log_level,
                            g.log_format.empty() ? cfg->logging.format : g.log_format);
      !s.ok()) {
    std::cerr << s.message() << "\n";
    return 1;
  }
  BlockTerminationSignals();  // before gRPC starts its threads
  auto server = proxy::ProxyServer::Start(*cfg, grpc, metrics, http, http::Factory());
  if (!server.ok()) {
    spdlog::error("proxy not started: {}", server.status().ToString());
    return 1;
  }
  const auto& a = (*server)->addresses();
  WriteReadyLine(ready_fd, a.grpc, a.metrics, a.http);
  const int sig = WaitForTermination();
  spdlog::info("signal {}: draining ({} requests in flight)", sig, (*server)->inflight());
  (*server)->Shutdown(static_cast<int>(cfg->proxy.drain_seconds * 1000));  // proxy.drain_seconds
  return 0;
}

}  // namespace

void RegisterProxy(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("proxy", "Run the proxy (public gRPC front end) alone");
  auto config = std::make_shared<std::string>();
  auto grpc = std::make_shared<std::string>();
  auto metrics = std::make_shared<std::string>();
  auto http = std::make_shared<std::string>();
  auto ready_fd = std::make_shared<int>(-1);
  cmd->add_option("--config", *config, "fleet YAML file")->required();
  cmd->add_option("--grpc", *grpc, "host:port of the public gRPC API (default: proxy.grpc)");
  cmd->add_option("--metrics", *metrics, "host:port of /metrics (default: proxy.metrics)");
  cmd->add_option("--http", *http,
                  "host:port of the OpenAI-compatible HTTP API (default: proxy.http)");
  cmd->add_option("--ready-fd", *ready_fd, "(tandem launch) write the real addresses here")
      ->group("");
  cmd->callback([&g, config, grpc, metrics, http, ready_fd] {
    g.exit_code = RunProxy(*config, *grpc, *metrics, *http, *ready_fd, g);
  });
}

}  // namespace tandem::cli
