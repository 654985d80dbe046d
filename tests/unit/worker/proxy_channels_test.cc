// ProxyChannels (issue 23): the registrar's refresh reuses one connection
// per proxy while it works and dials afresh after a failure. A real gRPC
// Registry server on 127.0.0.1 records the peer (client address and port)
// of every call: one peer means one TCP connection.
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "common/rpc_server.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/worker_service.h"

namespace tandem::worker {
namespace {

namespace pb = ::tandem::v1;

class RecordingRegistry final : public pb::Registry::Service {
 public:
  grpc::Status Register(grpc::ServerContext* ctx, const pb::RegisterRequest* req,
                        pb::RegisterResponse*) override {
    std::lock_guard lock(mu_);
    peers_.push_back(ctx->peer());
    names_.push_back(req->worker().name());
    return grpc::Status::OK;
  }
  std::vector<std::string> peers() {
    std::lock_guard lock(mu_);
    return peers_;
  }
  std::vector<std::string> names() {
    std::lock_guard lock(mu_);
    return names_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> peers_, names_;
};

WorkerIdentity Identity() {
  WorkerIdentity id;
  id.name = "decode-7";
  id.role = "decode";
  id.grpc_address = "127.0.0.1:1";
  return id;
}

TEST(ProxyChannels, RefreshReusesOneConnection) {
  RecordingRegistry registry;
  auto server = RpcServer::Start("127.0.0.1:0", {&registry}, RpcCredentials());
  ASSERT_TRUE(server.ok()) << server.status().message();
  ProxyChannels channels{RpcCredentials()};
  for (int i = 0; i < 4; ++i) {
    Status s = channels.Register((*server)->address(), Identity(), std::chrono::milliseconds(0));
    ASSERT_TRUE(s.ok()) << s.message();
  }
  EXPECT_EQ(channels.dials(), 1u);
  const auto peers = registry.peers();
  ASSERT_EQ(peers.size(), 4u);
  for (const auto& p : peers) EXPECT_EQ(p, peers[0]) << "a registration opened a new connection";
  EXPECT_EQ(registry.names(), std::vector<std::string>(4, "decode-7"));
}

TEST(ProxyChannels, FailureDialsAfreshNextTime) {
  RecordingRegistry first;
  auto server = RpcServer::Start("127.0.0.1:0", {&first}, RpcCredentials());
  ASSERT_TRUE(server.ok()) << server.status().message();
  const std::string address = (*server)->address();
  ProxyChannels channels{RpcCredentials()};
  ASSERT_TRUE(channels.Register(address, Identity(), std::chrono::milliseconds(0)).ok());
  EXPECT_EQ(channels.dials(), 1u);

  // The proxy goes away: the refresh fails (UNAVAILABLE) and its channel is dropped.
  server->reset();
  Status down = channels.Register(address, Identity(), std::chrono::milliseconds(0));
  EXPECT_EQ(down.code(), StatusCode::kUnavailable) << down.ToString();

  // A proxy at the same address again (a restart): registered over a new channel.
  RecordingRegistry second;
  auto again = RpcServer::Start(address, {&second}, RpcCredentials());
  ASSERT_TRUE(again.ok()) << again.status().message();
  Status s = channels.Register(address, Identity(), std::chrono::milliseconds(5000));
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(channels.dials(), 2u);  // the first connection, then a new one after the failure
  EXPECT_EQ(second.peers().size(), 1u);
}

// A registration error names the proxy's address; a proxy whose name
// reads like TLS ("tls-gw", "ssl-proxy") that is not up yet must be
// retried as unreachable, not refused as a TLS failure (before session 16
// the whole message was searched, the name included).
TEST(ProxyChannels, TheProxysOwnNameIsNoTlsFailure) {
  EXPECT_FALSE(IsTlsFailure("cannot connect to tls-gw:51000: 10.0.0.7:51000 Connection refused",
                            "tls-gw:51000"));
  EXPECT_FALSE(IsTlsFailure("failed to connect to all addresses; last error: UNKNOWN: "
                            "ipv4:10.0.0.9:443: Failed to connect to remote host: "
                            "Connection refused (ssl-proxy.example:443)",
                            "ssl-proxy.example:443"));
  // Real handshake failures still are, whatever the proxy is called.
  EXPECT_TRUE(IsTlsFailure("tls-gw:51000: the TLS handshake failed: certificate verify failed",
                           "tls-gw:51000"));
  EXPECT_TRUE(IsTlsFailure("SSL_ERROR_SSL: error:0A000086:SSL routines::certificate verify failed",
                           "10.0.0.7:51000"));
  EXPECT_TRUE(IsTlsFailure("no authenticated connection to 10.0.0.7:51000 within the timeout "
                           "(handshake)",
                           "10.0.0.7:51000"));
}

}  // namespace
}  // namespace tandem::worker
