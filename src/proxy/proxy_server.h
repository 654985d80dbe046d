// The proxy process: public gRPC API, worker registry, router, metrics.
// The OpenAI HTTP API lives in src/http (it links this library), so the
// proxy starts it through an HttpFactory that `tandem proxy` passes in.
//
// Thread-safety: Start, Drain and Shutdown from the owning thread.
#pragma once

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
#include "proxy/proxy_metrics.h"
#include "proxy/registry_service.h"
#include "proxy/worker_client_grpc.h"

namespace tandem::proxy {

struct ProxyAddresses {
  std::string grpc;
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
};

// What the HTTP front end shares with the gRPC one: `config` is read during
// the factory call only; the other pointers outlive the HTTP front end.
struct HttpContext {
  const FleetConfig* config = nullptr;
  Frontend* frontend = nullptr;
  Fleet* fleet = nullptr;
  MetricsRegistry* metrics = nullptr;
};
using HttpFactory = std::function<Result<std::unique_ptr<HttpFrontEnd>>(
    const std::string& address, const HttpContext& context)>;

class ProxyServer {
 public:
  // Loads the tokenizer and model shape from the fleet's model directory,
  // then serves on the fleet's proxy addresses (`grpc`/`metrics`/`http`
  // override them when non-empty). Without `http_factory` no HTTP API runs.
  static Result<std::unique_ptr<ProxyServer>> Start(const FleetConfig& fleet,
                                                    const std::string& grpc_address = "",
                                                    const std::string& metrics_address = "",
                                                    const std::string& http_address = "",
                                                    const HttpFactory& http_factory = nullptr);
  ~ProxyServer();

  const ProxyAddresses& addresses() const { return addresses_; }
  // New requests get UNAVAILABLE; in-flight ones go on. Health: NOT_SERVING.
  void Drain();
  // Waits up to `grace_ms` for in-flight requests, then stops.
  void Shutdown(int grace_ms);
  uint32_t inflight() const { return frontend_->inflight(); }

 private:
  ProxyServer() = default;

  std::unique_ptr<model::Tokenizer> tokenizer_;
  std::unique_ptr<MetricsRegistry> metrics_registry_;
  std::unique_ptr<ProxyMetrics> metrics_;
  std::unique_ptr<RouterMetrics> router_metrics_;  // outlives fleet_, which counts into it
  std::unique_ptr<Fleet> fleet_;
  std::unique_ptr<GrpcWorkerClient> client_;
  std::unique_ptr<Frontend> frontend_;
  std::unique_ptr<GenerationService> generation_;
  std::unique_ptr<RegistryService> registry_;
  std::unique_ptr<RpcServer> server_;
  std::unique_ptr<HttpFrontEnd> http_;  // last: stopped before what it uses
  ProxyAddresses addresses_;
};

}  // namespace tandem::proxy
