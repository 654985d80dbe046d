// `tandem proxy --config FILE`: the proxy alone (tandem launch starts it
// first, then the workers join it on its internal listener).
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <iostream>

#include "cli/commands.h"
#include "cli/ready.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/net.h"
#include "common/tls.h"
#include "common/tracing_otlp.h"
#include "http/http_server.h"
#include "proxy/proxy_server.h"

namespace tandem::cli {
namespace {

struct ProxyArgs {
  std::string config, grpc, metrics, http, internal;
  std::string tls_ca, tls_cert, tls_key;  // internal plane
  std::string public_cert, public_key;    // public listeners
  int ready_fd = -1;
  uint32_t warm_workers = 0;  // issue 21: wait for this many workers' snapshots
  double warm_timeout_s = 10.0;
};

int RunProxy(const ProxyArgs& a, const GlobalOptions& g) {
  auto cfg = LoadFleetConfig(a.config);
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
  proxy::ProxyStartOptions o;
  o.grpc = a.grpc;
  o.metrics = a.metrics;
  o.http = a.http;
  o.internal = a.internal;
  o.http_factory = http::Factory();
  auto internal = InternalCredentials(cfg->security, {a.tls_ca, a.tls_cert, a.tls_key});
  if (!internal.ok()) {
    spdlog::error("proxy not started: {}", internal.status().message());
    std::cerr << "tandem proxy: " << internal.status().message() << "\n";
    return 1;
  }
  o.internal_credentials = std::move(internal).value();
  auto pub = PublicTlsFiles(cfg->security, {"", a.public_cert, a.public_key});
  if (!pub.ok()) {
    spdlog::error("proxy not started: {}", pub.status().message());
    std::cerr << "tandem proxy: " << pub.status().message() << "\n";
    return 1;
  }
  o.public_tls = std::move(pub).value();
  BlockTerminationSignals();  // before gRPC starts its threads (SIGHUP too: reload)
  auto server = proxy::ProxyServer::Start(*cfg, o);
  if (!server.ok()) {
    spdlog::error("proxy not started: {}", server.status().ToString());
    return 1;
  }
  if (a.warm_workers > 0) {
    // A restarted replica: take traffic once the workers (which register
    // again within about a second) rebuilt the index from their snapshots.
    const auto t0 = std::chrono::steady_clock::now();
    const size_t got = (*server)->WaitForWarmIndex(
        a.warm_workers, std::chrono::milliseconds(static_cast<int64_t>(a.warm_timeout_s * 1000)));
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - t0).count();
    if (got >= a.warm_workers) {
      spdlog::info("index warm: rebuilt from {} workers' snapshots in {:.0f} ms", got, ms);
    } else {
      spdlog::warn("index not warm after {:.0f} ms: {} of {} workers' snapshots arrived; serving "
                   "anyway",
                   ms, got, a.warm_workers);
    }
  }
  const auto& addr = (*server)->addresses();
  {
    auto hp = ParseHostPort(addr.grpc);
    const std::string instance =
        hp.ok() ? fmt::format("proxy-{}", hp->port) : fmt::format("proxy-{}", getpid());
    if (Status s = tracing::StartTracing(cfg->observability, "tandem-proxy", instance); !s.ok()) {
      spdlog::error("proxy not started: {}", s.ToString());
      (*server)->Shutdown(0);
      return 1;
    }
  }
  WriteReadyLine(a.ready_fd, addr.grpc, addr.metrics, addr.http, addr.internal);
  int sig = 0;
  while ((sig = WaitForTermination()) == SIGHUP) {
    const Status s = (*server)->ReloadPublicTls();
    if (s.ok()) {
      spdlog::info("SIGHUP: public TLS certificates reloaded{}",
                   o.public_tls.empty() ? " (none: public_tls is off)" : "");
    } else {
      spdlog::error("SIGHUP: public TLS certificates not reloaded (the old ones stay): {}",
                    s.message());
    }
  }
  spdlog::info("signal {}: draining ({} requests in flight)", sig, (*server)->inflight());
  (*server)->Shutdown(static_cast<int>(cfg->proxy.drain_seconds * 1000));  // proxy.drain_seconds
  tracing::Tracer::Get().Stop();  // exports the spans still queued
  return 0;
}

}  // namespace

void RegisterProxy(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("proxy", "Run the proxy (public gRPC front end) alone");
  auto a = std::make_shared<ProxyArgs>();
  cmd->add_option("--config", a->config, "fleet YAML file")->required();
  cmd->add_option("--grpc", a->grpc, "host:port of the public gRPC API (default: proxy.grpc)");
  cmd->add_option("--metrics", a->metrics, "host:port of /metrics (default: proxy.metrics)");
  cmd->add_option("--http", a->http,
                  "host:port of the OpenAI-compatible HTTP API (default: proxy.http)");
  cmd->add_option("--internal", a->internal,
                  "host:port workers register on (default: proxy.internal)");
  AddTlsOptions(*cmd, a->tls_ca, a->tls_cert, a->tls_key);
  auto* pc = cmd->add_option("--public-tls-cert", a->public_cert,
                             "public gRPC/HTTP: the proxy's certificate (PEM)");
  auto* pk = cmd->add_option("--public-tls-key", a->public_key, "public gRPC/HTTP: its key (PEM)");
  pc->needs(pk);
  pk->needs(pc);
  for (auto* o : {pc, pk}) o->group("Public TLS (default: security.public_tls)");
  cmd->add_option("--warm-workers", a->warm_workers,
                  "before taking traffic (ready line, gRPC health SERVING), wait until this many "
                  "workers' snapshots rebuilt the prefix index (tandem launch restarting a proxy)");
  cmd->add_option("--warm-timeout", a->warm_timeout_s,
                  "seconds --warm-workers may wait; then it serves anyway, with a warning")
      ->check(CLI::Range(0.0, 3600.0));
  cmd->add_option("--ready-fd", a->ready_fd, "(tandem launch) write the real addresses here")
      ->group("");
  cmd->callback([&g, a] { g.exit_code = RunProxy(*a, g); });
}

}  // namespace tandem::cli
