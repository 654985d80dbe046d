// The proxy process: public gRPC API, worker registry, router, metrics.
// The OpenAI HTTP API lives in src/http (it links this library), so the
// proxy starts it through an HttpFactory that `tandem proxy` passes in.
//
// Thread-safety: Start, Drain and Shutdown from the owning thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "common/config.h"
#include "common/metrics.h"
#include "common/rpc_server.h"
#include "common/status.h"
#include "model/tokenizer.h"
#include "proxy/fleet.h"
#include "proxy/generation_service.h"
#include "proxy/h2/h2_server.h"
#include "proxy/planner.h"
#include "proxy/proxy_metrics.h"
#include "proxy/register_tcp.h"
#include "proxy/registry_service.h"
#include "proxy/ttft_calibration.h"
#include "proxy/worker_client_grpc.h"

namespace tandem::proxy {

struct ProxyAddresses {
  std::string grpc;
  std::string internal;  // the Registry workers join through (internal plane)
  std::string http;  // empty when started without an HttpFactory
  std::string metrics;
};

// The HTTP front end as the proxy sees it (implemented in src/http).
class HttpFrontEnd {
 public:
  virtual ~HttpFrontEnd() = default;
  virtual const std::string& address() const = 0;  // the real "host:port"
  // Stops accepting, cancels open requests, joins the I/O threads.
  virtual void Shutdown() = 0;
  // Re-reads the public TLS files (SIGHUP): new connections get them, open
  // ones keep theirs. No-op without TLS.
  virtual Status ReloadTls() = 0;
};

// What the HTTP front end shares with the gRPC one: `config` is read during
// the factory call only; the other pointers outlive the HTTP front end.
struct HttpContext {
  const FleetConfig* config = nullptr;
  Frontend* frontend = nullptr;
  Fleet* fleet = nullptr;
  MetricsRegistry* metrics = nullptr;
  TlsFiles public_tls;  // security.public_tls; empty: plaintext
};
using HttpFactory = std::function<Result<std::unique_ptr<HttpFrontEnd>>(
    const std::string& address, const HttpContext& context)>;

// How one proxy process listens; empty addresses take the fleet file's.
struct ProxyStartOptions {
  std::string grpc;      // public gRPC API (proxy.grpc)
  std::string metrics;   // /metrics (proxy.metrics)
  std::string http;      // OpenAI-compatible HTTP API (proxy.http)
  std::string internal;  // Registry for workers (proxy.internal; proxy.register_transport)
  HttpFactory http_factory;  // null: no HTTP API
  // The internal plane: the Registry listener and every call to a worker.
  RpcCredentials internal_credentials;
  // The public gRPC and HTTP listeners' TLS (PublicTlsFiles); empty: plaintext.
  TlsFiles public_tls;
};

class ProxyServer {
 public:
  // Loads the tokenizer and model shape from the fleet's model directory,
  // then serves the public API on one listener and the Registry on another
  // (workers never register on the public port).
  static Result<std::unique_ptr<ProxyServer>> Start(const FleetConfig& fleet,
                                                    const ProxyStartOptions& options);
  ~ProxyServer();

  const ProxyAddresses& addresses() const { return addresses_; }
  // New requests get UNAVAILABLE; in-flight ones go on. Health: NOT_SERVING.
  void Drain();
  // Waits up to `grace_ms` for in-flight requests, then stops.
  void Shutdown(int grace_ms);
  uint32_t inflight() const { return frontend_->inflight(); }
  // A restarted replica (issue 21): gRPC health NOT_SERVING until `n`
  // workers' snapshots rebuilt the prefix index or `limit` passed; returns
  // how many did.
  size_t WaitForWarmIndex(size_t n, std::chrono::milliseconds limit);
  // SIGHUP: the HTTP API and the native gRPC front end re-read their TLS
  // files now (the native one also when they change, h2/h2_tls.h; gRPC C++
  // watches them on its own: RpcCredentials::ServerTls).
  Status ReloadPublicTls();

 private:
  ProxyServer() = default;
  void SetServing(bool serving);  // the public gRPC port's health

  std::unique_ptr<model::Tokenizer> tokenizer_;
  std::unique_ptr<MetricsRegistry> metrics_registry_;
  std::unique_ptr<ProxyMetrics> metrics_;
  std::unique_ptr<RouterMetrics> router_metrics_;  // outlives fleet_, which counts into it
  std::unique_ptr<Fleet> fleet_;
  std::unique_ptr<TtftCalibration> ttft_calibration_;  // SLO admission's margin; outlives frontend_
  std::unique_ptr<Planner> planner_;  // autoscale (planner.h); stopped before fleet_ goes
  std::unique_ptr<GrpcWorkerClient> client_;
  std::unique_ptr<Frontend> frontend_;
  std::unique_ptr<GenerationService> generation_;
  std::unique_ptr<RegistryService> registry_;
  std::unique_ptr<RpcServer> server_;           // public (proxy.grpc_server: grpc)
  std::unique_ptr<h2::H2Server> native_;        // public (proxy.grpc_server: native)
  std::unique_ptr<RpcServer> internal_server_;  // Registry (proxy.register_transport: grpc)
  std::unique_ptr<RegisterTcpServer> register_tcp_;  // Registry (proxy.register_transport: tcp)
  std::unique_ptr<HttpFrontEnd> http_;  // last: stopped before what it uses
  ProxyAddresses addresses_;
};

}  // namespace tandem::proxy
