#include "proxy/proxy_server.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <thread>

#include "common/block_hash.h"
#include "model/model_config.h"

namespace tandem::proxy {

Result<std::unique_ptr<ProxyServer>> ProxyServer::Start(const FleetConfig& fleet,
                                                        const ProxyStartOptions& options) {
  auto pick = [](const std::string& given, const std::string& configured) {
    return given.empty() ? configured : given;
  };
  std::unique_ptr<ProxyServer> p(new ProxyServer());
  TANDEM_ASSIGN_OR_RETURN(p->tokenizer_, model::Tokenizer::Load(fleet.model.path));
  TANDEM_ASSIGN_OR_RETURN(model::ModelConfig mc, model::LoadModelConfig(fleet.model.path));

  p->metrics_registry_ =
      std::make_unique<MetricsRegistry>(MetricLabels{fleet.model.name, "proxy", "proxy"});
  p->metrics_ = std::make_unique<ProxyMetrics>(*p->metrics_registry_);
  TANDEM_RETURN_IF_ERROR(p->metrics_registry_->Serve(
      pick(options.metrics, fleet.proxy.metrics)));

  FleetRequirements req;
  req.model = fleet.model.name;
  req.revision = fleet.model.revision;
  req.block_size = fleet.cache.block_size;
  const HashContext hash_context = HashContextFromFleet(fleet);
  req.kv_dtype = hash_context.kv_dtype;
  req.fleet_salt_fingerprint = FleetSaltFingerprint(hash_context.fleet_salt);
  req.hash_root = RootHash(hash_context);
  req.role_labels = {FleetRequirements::Labels{fleet.prefill.node, fleet.prefill.zone},
                     FleetRequirements::Labels{fleet.decode.node, fleet.decode.zone},
                     FleetRequirements::Labels{fleet.both.node, fleet.both.zone}};
  TANDEM_ASSIGN_OR_RETURN(
      auto router, router::Router::Create(fleet.router, router::RouterOptionsFromConfig(
                                                            fleet.router, fleet.cache.block_size)));
  p->fleet_ = std::make_unique<Fleet>(req, std::move(router));
  p->router_metrics_ = std::make_unique<RouterMetrics>(*p->metrics_registry_, fleet.cache.block_size);
  p->fleet_->SetMetrics(p->router_metrics_.get());
  p->planner_ = std::make_unique<Planner>(fleet, p->fleet_.get(), &p->metrics_->ttft,
                                          &p->metrics_->itl, *p->metrics_registry_);
  p->planner_->Start();
  // proxy.grpc_server (docs/grpc-frontend.md): `auto` is the native front
  // end, with or without public TLS; `grpc` keeps gRPC C++.
  const bool native = fleet.proxy.grpc_server != "grpc";
  p->client_ = std::make_unique<GrpcWorkerClient>(options.internal_credentials,
                                                  fleet.proxy.decode_stream,
                                                  fleet.proxy.decode_transport == "tcp",
                                                  /*tcp_deliver_on_grpc_thread=*/
                                                  !native);
  p->client_->SetPrefillTransport(fleet.proxy.prefill_transport == "tcp");  // issue 23, prefill-tcp
  p->client_->SetTokenTable(p->tokenizer_->token_table());  // issue 23, tok-chain

  ServingLimits limits;
  limits.model = fleet.model.name;
  limits.vocab_size = mc.vocab_size;
  limits.max_model_len = fleet.model.max_model_len ? fleet.model.max_model_len
                                                   : mc.max_position_embeddings;
  limits.default_max_tokens = fleet.proxy.default_max_tokens;
  limits.max_tokens_limit = fleet.proxy.max_tokens_limit;
  const ProxyLimitsConfig& pl = fleet.proxy.limits;
  limits.max_request_bytes = pl.max_request_bytes;
  limits.max_prompt_tokens = pl.max_prompt_tokens;
  limits.max_stop_strings = pl.max_stop_strings;
  limits.max_stop_string_bytes = pl.max_stop_string_bytes;
  limits.max_stop_token_ids = pl.max_stop_token_ids;
  {
    TtftCalibration::Options co;
    if (fleet.proxy.admission == "slo") co.attainment = fleet.proxy.slo_attainment;
    p->ttft_calibration_ = std::make_unique<TtftCalibration>(co, p->metrics_registry_.get());
  }
  LifecycleDeps deps;
  deps.fleet = p->fleet_.get();
  deps.calibration = p->ttft_calibration_.get();
  deps.client = p->client_.get();
  deps.tokenizer = p->tokenizer_.get();
  deps.metrics = p->metrics_.get();
  deps.hash_context = hash_context;
  deps.root_hash = req.hash_root;
  deps.block_size = fleet.cache.block_size;
  deps.max_migrations = fleet.proxy.max_migrations;
  deps.eos_token_ids = mc.eos_token_ids;
  TANDEM_ASSIGN_OR_RETURN(auto tenants,
                          Tenants::Load(fleet.proxy.api_key, fleet.security.api_keys_file));
  if (tenants->required()) {
    spdlog::info("API keys required: {} tenant(s)", tenants->num_tenants());
  }
  p->frontend_ = std::make_unique<Frontend>(limits, deps, fleet.proxy.max_inflight,
                                            std::move(tenants));
  {
    SloAdmissionOptions so;
    TANDEM_ASSIGN_OR_RETURN(so.mode, ParseAdmissionMode(fleet.proxy.admission));
    so.default_ttft_ms = fleet.proxy.slo_ttft_ms;
    so.default_tpot_ms = fleet.proxy.slo_tpot_ms;
    so.hash_context = hash_context;
    so.block_size = fleet.cache.block_size;
    so.calibration = p->ttft_calibration_.get();
    p->frontend_->SetSloAdmission(
        std::make_unique<SloAdmission>(std::move(so), p->fleet_.get(), p->metrics_.get()));
  }
  p->generation_ = std::make_unique<GenerationService>(p->frontend_.get());
  p->registry_ = std::make_unique<RegistryService>(
      p->fleet_.get(), p->client_.get(),
      std::chrono::milliseconds(static_cast<int64_t>(fleet.proxy.liveness_timeout_seconds * 1000)),
      fleet.proxy.watch_transport == "tcp", options.internal_credentials);

  // proxy.register_transport (issue 23, docs/serving-workers.md "Register
  // transport"): tcp serves Register as frames on proxy.internal, so that
  // the proxy runs no gRPC server; grpc keeps Registry.Register there.
  const std::string internal = pick(options.internal, fleet.proxy.internal);
  if (fleet.proxy.register_transport == "grpc") {
    TANDEM_ASSIGN_OR_RETURN(p->internal_server_,
                            RpcServer::Start(internal, {p->registry_.get()},
                                             options.internal_credentials));
    p->addresses_.internal = p->internal_server_->address();
  } else {
    TANDEM_ASSIGN_OR_RETURN(auto tls, InternalFrameTls(options.internal_credentials));
    auto reg = RegisterTcpServer::Start(
        internal, std::move(tls),
        [registry = p->registry_.get()](const tandem::v1::RegisterRequest& request,
                                        const std::string& identity,
                                        tandem::v1::RegisterResponse* response) {
          registry->HandleRegister(request, identity, response);
        });
    if (!reg.ok()) return reg.status().WithContext("proxy.internal (proxy.register_transport tcp)");
    p->register_tcp_ = std::move(reg).value();
    p->addresses_.internal = p->register_tcp_->address();
  }
  if (native) {
    h2::H2ServerLimits limits;
    limits.max_connections = fleet.proxy.limits.max_connections;
    limits.handshake_timeout = std::chrono::milliseconds(
        static_cast<int64_t>(fleet.proxy.limits.handshake_timeout_seconds * 1000));
    auto native_server = h2::H2Server::Start(pick(options.grpc, fleet.proxy.grpc),
                                             p->frontend_.get(), options.public_tls, limits);
    if (!native_server.ok()) {
      return native_server.status().WithContext(
          options.public_tls.empty() ? "proxy.grpc" : "proxy.grpc with security.public_tls");
    }
    p->native_ = std::move(native_server).value();
    p->addresses_.grpc = p->native_->address();
  } else {
    RpcCredentials public_credentials;
    if (!options.public_tls.empty()) {
      TANDEM_ASSIGN_OR_RETURN(public_credentials, RpcCredentials::ServerTls(options.public_tls));
    }
    TANDEM_ASSIGN_OR_RETURN(p->server_, RpcServer::Start(pick(options.grpc, fleet.proxy.grpc),
                                                         {p->generation_.get()},
                                                         public_credentials));
    p->addresses_.grpc = p->server_->address();
  }
  p->addresses_.metrics = p->metrics_registry_->bound_address();
  if (options.http_factory) {
    HttpContext hc{&fleet, p->frontend_.get(), p->fleet_.get(), p->metrics_registry_.get(),
                   options.public_tls};
    TANDEM_ASSIGN_OR_RETURN(p->http_, options.http_factory(pick(options.http, fleet.proxy.http), hc));
    p->addresses_.http = p->http_->address();
  }
  spdlog::info("proxy serving {} on {} (gRPC{}{}), {} (HTTP), metrics on {}; workers register on {} "
               "({}, {})",
               fleet.model.name, p->addresses_.grpc, p->native_ ? ", native HTTP/2" : "",
               options.public_tls.empty() ? "" : ", TLS",
               p->addresses_.http.empty() ? "-" : p->addresses_.http, p->addresses_.metrics,
               p->addresses_.internal, p->register_tcp_ ? "framed TCP" : "gRPC",
               options.internal_credentials.secure() ? "mutual TLS" : "plaintext");
  return p;
}

ProxyServer::~ProxyServer() {
  if (planner_) planner_->Stop();
  Shutdown(0);
}

Status ProxyServer::ReloadPublicTls() {
  // Both listeners try; the first error is reported (each keeps its old
  // certificate on error).
  Status st = http_ ? http_->ReloadTls() : Status::Ok();
  if (native_) {
    if (Status n = native_->ReloadTls(); !n.ok() && st.ok()) st = n.WithContext("gRPC");
  }
  return st;
}

void ProxyServer::SetServing(bool serving) {
  if (server_) server_->SetServing(serving);
  if (native_) native_->SetServing(serving);
}

size_t ProxyServer::WaitForWarmIndex(size_t n, std::chrono::milliseconds limit) {
  if (n == 0) return 0;
  SetServing(false);
  const size_t got = registry_->WaitForSnapshots(n, limit);
  SetServing(true);
  return got;
}

void ProxyServer::Drain() {
  if (frontend_) frontend_->SetDraining(true);
  SetServing(false);
}

void ProxyServer::Shutdown(int grace_ms) {
  if (!server_ && !native_) return;
  Drain();
  for (int waited = 0; waited < grace_ms && frontend_->inflight() > 0; waited += 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (http_) http_->Shutdown();
  if (server_) server_->Shutdown(0);
  if (native_) native_->Shutdown();
  if (internal_server_) internal_server_->Shutdown(0);
  if (register_tcp_) register_tcp_->Stop();
  registry_->Shutdown();
  server_.reset();
  native_.reset();
  internal_server_.reset();
  register_tcp_.reset();
}

}  // namespace tandem::proxy
