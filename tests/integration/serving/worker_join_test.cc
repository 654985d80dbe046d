// `--join`: a worker registers with the proxy's Registry before it reports
// ready, and exits 1 with the proxy's reason when refused. This test serves
// a Registry itself (the proxy's own tests cover the real one).
#include <fmt/format.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>

#include "common/block_hash.h"
#include "common/config.h"
#include "common/rpc_server.h"
#include "serving_harness.h"

namespace tandem::serving_test {
namespace {

class FakeRegistry final : public pb::Registry::Service {
 public:
  explicit FakeRegistry(std::string refuse) : refuse_(std::move(refuse)) {}
  grpc::Status Register(grpc::ServerContext* ctx, const pb::RegisterRequest* req,
                        pb::RegisterResponse* resp) override {
    {
      std::lock_guard lock(mu_);
      seen_.push_back(req->worker());
      identities_.push_back(PeerIdentity(*ctx));
    }
    if (!refuse_.empty()) {
      resp->mutable_error()->set_code(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
      resp->mutable_error()->set_message(refuse_);
    }
    return grpc::Status::OK;
  }
  std::vector<pb::WorkerInfo> seen() {
    std::lock_guard lock(mu_);
    return seen_;
  }
  std::vector<std::string> identities() {
    std::lock_guard lock(mu_);
    return identities_;
  }

 private:
  const std::string refuse_;
  std::mutex mu_;
  std::vector<pb::WorkerInfo> seen_;
  std::vector<std::string> identities_;
};

class WorkerJoinTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tandem-join-" + std::to_string(getpid()));
    fleet_ = WriteFleetFile(dir_);
    // The test plays the proxy's gRPC Registry (register_transport: grpc);
    // the framed registration has its own test (register_tcp_test).
    std::ofstream(fleet_, std::ios::app) << "proxy:\n  register_transport: grpc\n";
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  Result<cli::Child*> StartJoining(cli::Supervisor& sup, const std::string& registry,
                                   const std::vector<std::string>& extra = {}) {
    cli::ChildSpec spec;
    spec.name = "decode-join";
    spec.role = "decode";
    spec.argv = {std::string(TANDEM_BINARY_DIR) + "/tandem", "--log-level", "warn", "decode",
                 "--config", fleet_, "--name", "decode-join", "--join", registry, "--grpc",
                 "127.0.0.1:0", "--metrics", "127.0.0.1:0"};
    spec.argv.insert(spec.argv.end(), extra.begin(), extra.end());
    for (auto& a : TlsArgs(IssueIdentity(fleet_, "decode-join"))) spec.argv.push_back(std::move(a));
    return sup.Start(std::move(spec), 60s);
  }
  // The Registry's listener, with mutual TLS as the proxy's internal one.
  Result<std::unique_ptr<RpcServer>> Serve(grpc::Service* registry) {
    auto creds = RpcCredentials::MutualTls(IssueIdentity(fleet_, "test-proxy"));
    if (!creds.ok()) return creds.status();
    return RpcServer::Start("127.0.0.1:0", {registry}, *creds);
  }
  fs::path dir_;
  std::string fleet_;
};

TEST_F(WorkerJoinTest, RegistersItsRealAddressesAndGeometryBeforeReady) {
  FakeRegistry registry("");
  auto server = Serve(&registry);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  cli::Supervisor sup;
  auto child = StartJoining(sup, (*server)->address());
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  const auto seen = registry.seen();
  ASSERT_EQ(seen.size(), 1u);
  const pb::WorkerInfo& w = seen[0];
  EXPECT_EQ(w.name(), "decode-join");
  EXPECT_EQ(registry.identities(), std::vector<std::string>{"decode-join"});  // its certificate
  EXPECT_EQ(w.role(), pb::WORKER_ROLE_DECODE);
  EXPECT_EQ(w.grpc_address(), (*child)->grpc);
  EXPECT_EQ(w.metrics_address(), (*child)->metrics);
  EXPECT_EQ(w.block_size(), kBlockSize);
  EXPECT_EQ(w.num_blocks(), kDecoderBlocks);
  EXPECT_EQ(w.kv_dtype(), "f32");
  // The rest of the hash context, from the one builder the proxy uses too.
  auto fleet = LoadFleetConfig(fleet_);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  EXPECT_EQ(w.fleet_salt_fingerprint(), FleetSaltFingerprint(fleet->cache.salt));
  EXPECT_EQ(w.hash_root(), RootHash(HashContextFromFleet(*fleet)));
  EXPECT_EQ(w.decode_seats(), fleet->scheduler.max_num_seqs);  // docs/router.md, "Decode seats"
  EXPECT_EQ(w.transport_backend(), "ucx");
  EXPECT_EQ(w.protocol_version(), 1u);
  EXPECT_NE(w.epoch(), 0u);
  EXPECT_TRUE(w.labels().empty());  // no --node/--zone and none in the role section
  EXPECT_EQ(sup.StopAll(10s), 0);
}

// A worker started alone on another host names its node and zone; the
// proxy's router uses them for the pair's link estimate (docs/router.md).
TEST_F(WorkerJoinTest, SendsItsNodeAndZoneLabels) {
  FakeRegistry registry("");
  auto server = Serve(&registry);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  cli::Supervisor sup;
  auto child = StartJoining(sup, (*server)->address(), {"--node", "host-b", "--zone", "rack-2"});
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  const auto seen = registry.seen();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].labels().size(), 2u);
  EXPECT_EQ(seen[0].labels().at("node"), "host-b");
  EXPECT_EQ(seen[0].labels().at("zone"), "rack-2");
  EXPECT_EQ(sup.StopAll(10s), 0);
}

TEST_F(WorkerJoinTest, BadNodeLabelExitsOneNamingTheFlag) {
  const fs::path err = dir_ / "stderr.txt";
  const std::string cmd = std::string(TANDEM_BINARY_DIR) + "/tandem decode --config " + fleet_ +
                          " --grpc 127.0.0.1:0 --metrics 127.0.0.1:0 --node 'host b' 2> " + err.string();
  const int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 1);
  std::ifstream in(err);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("--node must be at most 63 characters of A-Z a-z 0-9 . _ -, got 'host b'"),
            std::string::npos)
      << text;
}

TEST_F(WorkerJoinTest, RefusalIsPrintedAndExitsOne) {
  FakeRegistry registry("block_size 16 differs from the fleet's 32");
  auto server = Serve(&registry);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  cli::Supervisor sup;
  auto child = StartJoining(sup, (*server)->address());
  ASSERT_FALSE(child.ok());
  EXPECT_NE(child.status().message().find("exited with status 1"), std::string::npos)
      << child.status().message();
  ASSERT_EQ(sup.children().size(), 1u);
  EXPECT_EQ(WEXITSTATUS(sup.children().front().exit_status), 1);
}

// --advertise (docs/kubernetes.md): the registered addresses carry the
// advertised host (a pod's IP, a DNS name) instead of the bound one. While
// it registers, the worker's health is NOT_SERVING (a pod's readiness);
// `tandem health` dials the ADVERTISED address from inside Register, so the
// address the proxy would use reaches the worker (mutual TLS, SAN localhost).
class ProbingRegistry final : public pb::Registry::Service {
 public:
  ProbingRegistry(std::string probe_cmd) : probe_cmd_(std::move(probe_cmd)) {}
  grpc::Status Register(grpc::ServerContext*, const pb::RegisterRequest* req,
                        pb::RegisterResponse*) override {
    const std::string cmd = probe_cmd_ + " --addr " + req->worker().grpc_address() + " > " +
                            out_ + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::lock_guard lock(mu_);
    seen_.push_back(req->worker());
    probe_exit_ = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    return grpc::Status::OK;
  }
  std::vector<pb::WorkerInfo> seen() {
    std::lock_guard lock(mu_);
    return seen_;
  }
  int probe_exit() {
    std::lock_guard lock(mu_);
    return probe_exit_;
  }
  std::string out_;

 private:
  const std::string probe_cmd_;
  std::mutex mu_;
  std::vector<pb::WorkerInfo> seen_;
  int probe_exit_ = -2;
};

std::string ReadText(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string HealthCommand(const TlsFiles& probe) {
  return std::string(TANDEM_BINARY_DIR) + "/tandem health --tls-ca " + probe.ca_file +
         " --tls-cert " + probe.cert_file + " --tls-key " + probe.key_file;
}

TEST_F(WorkerJoinTest, AdvertisedHostIsRegisteredAndNotServingUntilRegistered) {
  const TlsFiles probe = IssueIdentity(fleet_, "probe");
  ProbingRegistry registry(HealthCommand(probe));
  registry.out_ = (dir_ / "probe-during-register.txt").string();
  auto server = Serve(&registry);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  cli::Supervisor sup;
  auto child = StartJoining(sup, (*server)->address(), {"--advertise", "localhost"});
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  const auto seen = registry.seen();
  ASSERT_EQ(seen.size(), 1u);
  const auto grpc_bound = ParseHostPort((*child)->grpc);
  const auto metrics_bound = ParseHostPort((*child)->metrics);
  ASSERT_TRUE(grpc_bound.ok() && metrics_bound.ok());
  EXPECT_EQ(seen[0].grpc_address(), fmt::format("localhost:{}", grpc_bound->port));
  EXPECT_EQ(seen[0].metrics_address(), fmt::format("localhost:{}", metrics_bound->port));
  // Reached through the advertised name while registering: NOT_SERVING.
  EXPECT_EQ(registry.probe_exit(), 1) << ReadText(registry.out_);
  EXPECT_NE(ReadText(registry.out_).find("NOT_SERVING"), std::string::npos) << ReadText(registry.out_);
  // Registered (it reported ready): SERVING, through the advertised name too.
  const fs::path after = dir_ / "probe-after.txt";
  const int rc = std::system((HealthCommand(probe) + " --addr " + seen[0].grpc_address() + " > " +
                              after.string() + " 2>&1").c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 0) << ReadText(after);
  EXPECT_EQ(ReadText(after), "SERVING\n");
  EXPECT_EQ(sup.StopAll(10s), 0);
}

TEST_F(WorkerJoinTest, AdvertisedPortReplacesTheGrpcPortOnly) {
  FakeRegistry registry("");
  auto server = Serve(&registry);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  cli::Supervisor sup;
  auto child = StartJoining(sup, (*server)->address(), {"--advertise", "127.0.0.1:40999"});
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  const auto seen = registry.seen();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].grpc_address(), "127.0.0.1:40999");
  EXPECT_EQ(seen[0].metrics_address(), (*child)->metrics);  // bound on 127.0.0.1 already
  EXPECT_EQ(sup.StopAll(10s), 0);
}

TEST_F(WorkerJoinTest, WildcardOrMalformedAdvertiseExitsOneNamingTheFlag) {
  for (const std::string bad : {"0.0.0.0", "[::]:5", "host:0", "host:70000", "fd00::1"}) {
    const fs::path err = dir_ / "stderr.txt";
    const std::string cmd = std::string(TANDEM_BINARY_DIR) + "/tandem decode --config " + fleet_ +
                            " --grpc 127.0.0.1:0 --metrics 127.0.0.1:0 --advertise '" + bad +
                            "' 2> " + err.string();
    const int rc = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(rc));
    EXPECT_EQ(WEXITSTATUS(rc), 1) << bad;
    EXPECT_NE(ReadText(err).find("--advertise must be HOST or HOST:PORT"), std::string::npos)
        << bad << ": " << ReadText(err);
    EXPECT_NE(ReadText(err).find("got '" + bad + "'"), std::string::npos) << ReadText(err);
  }
}

}  // namespace
}  // namespace tandem::serving_test
