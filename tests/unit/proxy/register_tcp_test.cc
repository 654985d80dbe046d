// The framed Register (issue 23, proxy.register_transport tcp;
// proxy/register_tcp.h and worker/proxy_channels.cc): the worker's
// ProxyChannels against the proxy's RegisterTcpServer over mutual TLS on
// 127.0.0.1. One kept connection carries every refresh; the handler sees
// the certificate's common name; a refusal, a restarted proxy, a
// certificate of another CA and plaintext to a TLS proxy end as with the
// gRPC Registry; a proxy that never answers ends each attempt at its
// deadline. The whole path with real fleets is the security, join, failure
// and replica suites (the default transport).
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "common/rpc_server.h"
#include "common/tls_certs.h"
#include "proxy/register_tcp.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/worker_service.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
namespace pb = ::tandem::v1;
using std::chrono::milliseconds;

// What the proxy's side saw, and what it answers.
struct Recorder {
  std::mutex mu;
  std::vector<std::string> names, identities;
  std::string refuse;  // non-empty: the refusal's message

  proxy::RegisterTcpServer::Handler Handler() {
    return [this](const pb::RegisterRequest& req, const std::string& identity,
                  pb::RegisterResponse* resp) {
      std::lock_guard lock(mu);
      names.push_back(req.worker().name());
      identities.push_back(identity);
      if (!refuse.empty()) {
        resp->mutable_error()->set_code(static_cast<int>(StatusCode::kFailedPrecondition));
        resp->mutable_error()->set_message(refuse);
      } else {
        resp->set_heartbeat_interval_ms(500);
      }
    };
  }
  size_t count() {
    std::lock_guard lock(mu);
    return names.size();
  }
};

worker::WorkerIdentity Worker() {
  worker::WorkerIdentity id;
  id.name = "decode-7";
  id.role = "decode";
  id.grpc_address = "127.0.0.1:1";
  return id;
}

class RegisterTcpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/register-tcp-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    auto ca = CreateCaCertificate("fleet-ca", 1);
    ASSERT_TRUE(ca.ok()) << ca.status().ToString();
    ca_ = *ca;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // PEM files of `name`'s identity, issued by `ca`.
  TlsFiles Files(const CertKeyPem& ca, const std::string& name) {
    auto cert = IssueCertificate(ca, name, {"127.0.0.1", "localhost"}, 1);
    EXPECT_TRUE(cert.ok()) << cert.status().ToString();
    TlsFiles f{dir_ + "/" + name + "-ca.pem", dir_ + "/" + name + ".pem",
               dir_ + "/" + name + ".key"};
    std::ofstream(f.ca_file) << ca_.cert;  // every side trusts the fleet CA
    std::ofstream(f.cert_file) << cert->cert;
    std::ofstream(f.key_file) << cert->key;
    return f;
  }
  RpcCredentials Creds(const TlsFiles& f) {
    auto c = RpcCredentials::MutualTls(f);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : RpcCredentials();
  }
  std::unique_ptr<proxy::RegisterTcpServer> Serve(Recorder& r,
                                                  const std::string& address = "127.0.0.1:0") {
    auto tls = InternalFrameTls(Creds(Files(ca_, "proxy")));
    EXPECT_TRUE(tls.ok()) << tls.status().ToString();
    auto s = proxy::RegisterTcpServer::Start(address, *tls, r.Handler());
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  // Registers once (keeping the connection), then the proxy goes away.
  void RegisterThenStop(worker::ProxyChannels& channels, std::unique_ptr<proxy::RegisterTcpServer>& server) {
    Status s = channels.Register(server->address(), Worker(), milliseconds(0));
    ASSERT_TRUE(s.ok()) << s.ToString();
    server.reset();
  }

  std::string dir_;
  CertKeyPem ca_;
};

TEST_F(RegisterTcpTest, RefreshesGoOverOneKeptConnectionWithTheCertificateIdentity) {
  Recorder rec;
  auto server = Serve(rec);
  ASSERT_NE(server, nullptr);
  worker::ProxyChannels channels(Creds(Files(ca_, "decode-7")), /*tcp=*/true);
  for (int i = 0; i < 4; ++i) {
    milliseconds heartbeat{0};
    Status s = channels.Register(server->address(), Worker(), milliseconds(0), &heartbeat);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(heartbeat, milliseconds(500));
  }
  EXPECT_EQ(channels.dials(), 1u);
  EXPECT_EQ(server->accepted(), 1u) << "a refresh opened a new connection";
  std::lock_guard lock(rec.mu);
  EXPECT_EQ(rec.names, std::vector<std::string>(4, "decode-7"));
  EXPECT_EQ(rec.identities, std::vector<std::string>(4, "decode-7"));
}

TEST_F(RegisterTcpTest, ARefusalCarriesTheProxysReason) {
  Recorder rec;
  rec.refuse = "block_size 32 differs from the fleet's 16";
  auto server = Serve(rec);
  ASSERT_NE(server, nullptr);
  worker::ProxyChannels channels(Creds(Files(ca_, "decode-7")), /*tcp=*/true);
  Status s = channels.Register(server->address(), Worker(), milliseconds(2000));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("block_size 32 differs"), std::string::npos) << s.message();
  EXPECT_EQ(rec.count(), 1u);  // not retried
}

TEST_F(RegisterTcpTest, ARestartedProxyGetsTheRegistrationOnANewConnection) {
  Recorder first;
  auto server = Serve(first);
  ASSERT_NE(server, nullptr);
  const std::string address = server->address();
  worker::ProxyChannels channels(Creds(Files(ca_, "decode-7")), /*tcp=*/true);
  RegisterThenStop(channels, server);

  // Nobody listens now.
  Status down = channels.Register(address, Worker(), milliseconds(0));
  EXPECT_EQ(down.code(), StatusCode::kUnavailable) << down.ToString();

  // A proxy at the same address again: registered at once, on a new connection.
  Recorder second;
  auto again = Serve(second, address);
  ASSERT_NE(again, nullptr);
  Status s = channels.Register(address, Worker(), milliseconds(5000));
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(second.count(), 1u);
  EXPECT_EQ(again->accepted(), 1u);
}

TEST_F(RegisterTcpTest, AKeptConnectionTheProxyClosedIsReplacedWithoutWaiting) {
  Recorder first;
  auto server = Serve(first);
  ASSERT_NE(server, nullptr);
  const std::string address = server->address();
  worker::ProxyChannels channels(Creds(Files(ca_, "decode-7")), /*tcp=*/true);
  RegisterThenStop(channels, server);
  // A restart between two refreshes: the refresh (no retry time) still
  // succeeds, on a new connection.
  Recorder second;
  auto again = Serve(second, address);
  ASSERT_NE(again, nullptr);
  Status s = channels.Register(address, Worker(), milliseconds(0));
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(second.count(), 1u);
  EXPECT_EQ(channels.dials(), 2u);
}

TEST_F(RegisterTcpTest, ACertificateOfAnotherCaOrPlaintextIsRefusedAndSaysSo) {
  Recorder rec;
  auto server = Serve(rec);
  ASSERT_NE(server, nullptr);
  auto other = CreateCaCertificate("other-ca", 1);
  ASSERT_TRUE(other.ok());
  {
    worker::ProxyChannels stranger(Creds(Files(*other, "decode-9")), /*tcp=*/true);
    Status s = stranger.Register(server->address(), Worker(), milliseconds(5000));
    EXPECT_EQ(s.code(), StatusCode::kUnauthenticated) << s.ToString();
    EXPECT_NE(s.message().find("fleet's CA"), std::string::npos) << s.message();
  }
  {
    worker::ProxyChannels plain(RpcCredentials(), /*tcp=*/true);
    Status s = plain.Register(server->address(), Worker(), milliseconds(5000));
    EXPECT_EQ(s.code(), StatusCode::kUnauthenticated) << s.ToString();
    EXPECT_NE(s.message().find("plaintext"), std::string::npos) << s.message();
  }
  EXPECT_EQ(rec.count(), 0u);
  EXPECT_EQ(server->accepted(), 0u);
  EXPECT_GE(server->refused(), 2u);
}

// A proxy address that takes the connection but never answers (a hung
// process, a black hole behind a load balancer): each attempt ends at its
// own deadline (the TLS handshake's, then the Register exchange's, 5 s
// each) with an error naming the address, so the registrar goes on to its
// other proxies and tries this one again later instead of hanging on it.
TEST_F(RegisterTcpTest, AProxyThatNeverAnswersEndsTheAttemptAtItsDeadline) {
  // The kernel completes the TCP handshake for a listening socket nobody
  // accepts on: the TLS handshake never gets an answer.
  const int silent = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(silent, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(silent, 8), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(getsockname(silent, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  worker::ProxyChannels channels(Creds(Files(ca_, "decode-7")), /*tcp=*/true);
  Status s = channels.Register(address, Worker(), milliseconds(0));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("registering with the proxy at " + address + ": no authenticated "
                             "connection to " + address + " within the timeout"),
            std::string::npos)
      << s.ToString();
  close(silent);

  // A proxy that completes the handshake and reads the request but never
  // answers it: the exchange's own deadline.
  Recorder rec;
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  auto tls = InternalFrameTls(Creds(Files(ca_, "proxy")));
  ASSERT_TRUE(tls.ok()) << tls.status().ToString();
  auto server = proxy::RegisterTcpServer::Start(
      "127.0.0.1:0", *tls,
      [&](const pb::RegisterRequest&, const std::string&, pb::RegisterResponse* resp) {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return release; });
        resp->set_heartbeat_interval_ms(500);
      });
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  Status hung = channels.Register((*server)->address(), Worker(), milliseconds(0));
  EXPECT_EQ(hung.code(), StatusCode::kDeadlineExceeded) << hung.ToString();
  EXPECT_NE(hung.message().find("the proxy at " + (*server)->address() +
                                " did not answer the registration in time"),
            std::string::npos)
      << hung.ToString();
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  EXPECT_EQ((*server)->accepted(), 1u);
}

// A worker with the framed Register against a proxy that serves gRPC's
// Registry (proxy.register_transport differs): an error naming the key.
class GrpcRegistry final : public pb::Registry::Service {
  grpc::Status Register(grpc::ServerContext*, const pb::RegisterRequest*,
                        pb::RegisterResponse*) override {
    return grpc::Status::OK;
  }
};

TEST_F(RegisterTcpTest, AgainstAGrpcRegistryTheErrorNamesTheKey) {
  GrpcRegistry registry;
  auto server = RpcServer::Start("127.0.0.1:0", {&registry}, RpcCredentials());
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  worker::ProxyChannels channels(RpcCredentials(), /*tcp=*/true);
  Status s = channels.Register((*server)->address(), Worker(), milliseconds(2000));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("proxy.register_transport"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace tandem
