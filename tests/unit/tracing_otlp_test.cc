// The OTLP/gRPC exporter (common/tracing_otlp.h) against a real collector
// stand-in: opentelemetry's TraceService served by gRPC on loopback, in
// plaintext, over TLS, and over TLS that requires a client certificate.
// The exporter's spans arrive when its credentials fit the collector and
// are refused when they do not (plaintext to TLS, another CA, no client
// certificate); unreadable files are errors naming them.
#include "common/tracing_otlp.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>

#include "common/tls_certs.h"
#include "otlp/trace_service.grpc.pb.h"

namespace tandem::tracing {
namespace {

namespace fs = std::filesystem;
namespace collector = ::opentelemetry::proto::collector::trace::v1;

// Keeps the names and service of every span exported to it.
class Collector final : public collector::TraceService::Service {
 public:
  grpc::Status Export(grpc::ServerContext*, const collector::ExportTraceServiceRequest* req,
                      collector::ExportTraceServiceResponse*) override {
    std::lock_guard lock(mu_);
    for (const auto& rs : req->resource_spans()) {
      std::string service;
      for (const auto& kv : rs.resource().attributes()) {
        if (kv.key() == "service.name") service = kv.value().string_value();
      }
      for (const auto& ss : rs.scope_spans()) {
        for (const auto& s : ss.spans()) names_.push_back(service + "/" + s.name());
      }
    }
    return grpc::Status::OK;
  }
  std::vector<std::string> names() const {
    std::lock_guard lock(mu_);
    return names_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> names_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class OtlpExporterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tandem-otlp-test-" + std::to_string(getpid()));
    auto ca = FleetCa::OpenOrCreate((dir_ / "ca").string(), "collector CA");
    ASSERT_TRUE(ca.ok()) << ca.status().ToString();
    ca_.emplace(std::move(ca).value());
    auto server = ca_->Issue("collector", {"127.0.0.1"});
    auto client = ca_->Issue("proxy-1", {"127.0.0.1"});
    ASSERT_TRUE(server.ok() && client.ok());
    server_files_ = *server;
    client_files_ = *client;
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // Serves the collector on 127.0.0.1 with `creds`; returns its address.
  std::string Serve(std::shared_ptr<grpc::ServerCredentials> creds) {
    int port = 0;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", std::move(creds), &port);
    b.RegisterService(&collector_);
    server_ = b.BuildAndStart();
    EXPECT_NE(server_, nullptr);
    EXPECT_GT(port, 0);
    return "127.0.0.1:" + std::to_string(port);
  }
  std::shared_ptr<grpc::ServerCredentials> ServerTls(bool require_client_cert) {
    grpc::SslServerCredentialsOptions o(
        require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                            : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    o.pem_root_certs = ReadFile(server_files_.ca_file);
    o.pem_key_cert_pairs.push_back(
        {ReadFile(server_files_.key_file), ReadFile(server_files_.cert_file)});
    return grpc::SslServerCredentials(o);
  }
  static Status ExportOne(const ExportFn& fn, const std::string& name) {
    TracerOptions opts;
    opts.service_name = "tandem-proxy";
    opts.instance_id = "proxy-1";
    SpanRecord s;
    s.name = name;
    s.ctx.trace_id[0] = 1;
    s.ctx.span_id[0] = 2;
    s.start_unix_ns = 1;
    s.end_unix_ns = 2;
    return fn(opts, {s});
  }

  fs::path dir_;
  std::optional<FleetCa> ca_;
  TlsFiles server_files_, client_files_;
  Collector collector_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(OtlpExporterTest, PlaintextByDefault) {
  const std::string addr = Serve(grpc::InsecureServerCredentials());
  auto fn = MakeOtlpGrpcExporter(addr);
  ASSERT_TRUE(fn.ok()) << fn.status().ToString();
  ASSERT_TRUE(ExportOne(*fn, "plain").ok());
  EXPECT_EQ(collector_.names(), std::vector<std::string>{"tandem-proxy/plain"});
}

TEST_F(OtlpExporterTest, TlsVerifiesTheCollectorAgainstTheCa) {
  const std::string addr = Serve(ServerTls(false));
  auto tls = MakeOtlpGrpcExporter(addr, {server_files_.ca_file, "", ""});
  ASSERT_TRUE(tls.ok()) << tls.status().ToString();
  ASSERT_TRUE(ExportOne(*tls, "over-tls").ok());

  // Plaintext to a TLS collector, and TLS trusting another CA: refused.
  auto plain = MakeOtlpGrpcExporter(addr);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(ExportOne(*plain, "plain-to-tls").ok());
  auto other = FleetCa::OpenOrCreate((dir_ / "other").string(), "other CA");
  ASSERT_TRUE(other.ok());
  auto stranger = MakeOtlpGrpcExporter(addr, {other->ca_file(), "", ""});
  ASSERT_TRUE(stranger.ok()) << stranger.status().ToString();
  const Status refused = ExportOne(*stranger, "other-ca");
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("OTLP export"), std::string::npos) << refused.ToString();

  EXPECT_EQ(collector_.names(), std::vector<std::string>{"tandem-proxy/over-tls"});
}

TEST_F(OtlpExporterTest, ClientCertificateForCollectorsThatRequireOne) {
  const std::string addr = Serve(ServerTls(true));
  auto anonymous = MakeOtlpGrpcExporter(addr, {server_files_.ca_file, "", ""});
  ASSERT_TRUE(anonymous.ok());
  EXPECT_FALSE(ExportOne(*anonymous, "no-client-cert").ok());
  auto mutual = MakeOtlpGrpcExporter(addr, client_files_);
  ASSERT_TRUE(mutual.ok()) << mutual.status().ToString();
  ASSERT_TRUE(ExportOne(*mutual, "mutual").ok());
  EXPECT_EQ(collector_.names(), std::vector<std::string>{"tandem-proxy/mutual"});
}

TEST_F(OtlpExporterTest, BadFilesAreErrorsNamingThem) {
  const std::string missing = (dir_ / "missing.pem").string();
  auto no_ca = MakeOtlpGrpcExporter("127.0.0.1:1", {missing, "", ""});
  ASSERT_FALSE(no_ca.ok());
  EXPECT_NE(no_ca.status().message().find(missing), std::string::npos) << no_ca.status().ToString();
  // A key that is not the certificate's.
  auto wrong_key = MakeOtlpGrpcExporter(
      "127.0.0.1:1", {server_files_.ca_file, client_files_.cert_file, server_files_.key_file});
  EXPECT_FALSE(wrong_key.ok());
  // A client certificate without a CA to verify the collector with.
  auto no_root = MakeOtlpGrpcExporter("127.0.0.1:1", {"", client_files_.cert_file,
                                                      client_files_.key_file});
  ASSERT_FALSE(no_root.ok());
  EXPECT_NE(no_root.status().message().find("CA"), std::string::npos) << no_root.status().ToString();

  ObservabilityConfig config;
  config.otlp_endpoint = "127.0.0.1:1";
  config.otlp_ca_file = missing;
  const Status st = StartTracing(config, "tandem-proxy", "proxy-1");
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("observability.otlp_tls"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find(missing), std::string::npos) << st.ToString();
}

}  // namespace
}  // namespace tandem::tracing
