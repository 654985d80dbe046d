// `tandem health --addr HOST:PORT [--service S] [--tls-ca/--tls-cert/--tls-key]`:
// one grpc.health.v1 Check; exit 0 when SERVING, 1 otherwise (the status or
// the error on stderr). The probe of a worker pod (docs/kubernetes.md): a
// worker's gRPC port speaks mutual TLS, which the kubelet's own gRPC probe
// cannot, so the pod runs this with its own certificate.
#include <fmt/format.h>
#include <grpc/health/v1/health.grpc.pb.h>

#include <chrono>
#include <iostream>

#include "cli/commands.h"
#include "common/tls.h"

namespace tandem::cli {
namespace {

struct HealthArgs {
  std::string addr;
  std::string service;
  double timeout_seconds = 5;
  std::string tls_ca, tls_cert, tls_key;
};

int RunHealth(const HealthArgs& a) {
  RpcCredentials creds;
  if (!a.tls_ca.empty()) {
    auto tls = RpcCredentials::MutualTls({a.tls_ca, a.tls_cert, a.tls_key});
    if (!tls.ok()) {
      std::cerr << "tandem health: " << tls.status().message() << "\n";
      return 1;
    }
    creds = std::move(tls).value();
  }
  auto stub = grpc::health::v1::Health::NewStub(creds.Dial(a.addr));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(a.timeout_seconds * 1000)));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(a.service);
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status st = stub->Check(&ctx, req, &resp);
  if (!st.ok()) {
    std::cerr << fmt::format("tandem health: {}: error {}: {}\n", a.addr,
                             static_cast<int>(st.error_code()), st.error_message());
    return 1;
  }
  const std::string status = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  std::cout << status << "\n";
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace

void RegisterHealth(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand(
      "health", "One gRPC health check (grpc.health.v1); exit 0 when SERVING (pod probes)");
  auto a = std::make_shared<HealthArgs>();
  cmd->add_option("--addr", a->addr, "host:port of the gRPC server")->required();
  cmd->add_option("--service", a->service, "service name to check (default \"\": the server)");
  cmd->add_option("--timeout", a->timeout_seconds, "seconds to wait for the answer (default 5)")
      ->check(CLI::Range(0.001, 3600.0));
  AddTlsOptions(*cmd, a->tls_ca, a->tls_cert, a->tls_key);
  cmd->callback([&g, a] { g.exit_code = RunHealth(*a); });
}

}  // namespace tandem::cli
