// The internal plane of a real fleet (`tandem launch`, default
// security.internal_tls auto; docs/security.md):
//   - worker ports and proxy.internal refuse plaintext, accept the state
//     file's operator identity (its certificate names 127.0.0.1);
//   - the public port does not serve the Registry;
//   - a worker with a certificate of another CA, or with none, cannot
//     register and exits 1 with a clear error while the fleet keeps serving;
//   - a worker name is bound to the identity that first registered it.
#include <fcntl.h>
#include <grpc/health/v1/health.grpc.pb.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "common/tls.h"
#include "common/tls_certs.h"
#include "fleet_harness.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/worker_service.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace pb = ::tandem::v1;
using namespace std::chrono_literals;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `tandem ARGS...` with stdout+stderr to `log` and waits (bounded) for
// it to exit; nullopt (after SIGKILL) if it did not. `cache_salt`: the
// fleet's (TANDEM_CACHE_SALT), so that only the identity differs.
std::optional<int> RunToExit(const std::vector<std::string>& args, const std::string& log,
                             std::chrono::seconds timeout, const std::string& cache_salt) {
  std::vector<std::string> all = {std::string(TANDEM_BINARY_DIR) + "/tandem"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    if (!cache_salt.empty()) setenv("TANDEM_CACHE_SALT", cache_salt.c_str(), 1);
    execv(argv[0], argv.data());
    _exit(127);
  }
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < give_up) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) return st;
    std::this_thread::sleep_for(50ms);
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return std::nullopt;
}

grpc::Status Health(const std::string& address, const RpcCredentials& creds) {
  auto stub = grpc::health::v1::Health::NewStub(creds.Dial(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status st = stub->Check(&ctx, req, &resp);
  if (st.ok() && resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return grpc::Status(grpc::StatusCode::UNKNOWN, "not SERVING");
  }
  return st;
}

grpc::Status Register(const std::string& address, const RpcCredentials& creds) {
  auto stub = pb::Registry::NewStub(creds.Dial(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  pb::RegisterRequest req;
  req.mutable_worker()->set_name("intruder");
  pb::RegisterResponse resp;
  return stub->Register(&ctx, req, &resp);
}

// The fleet still answers on its public API.
void ExpectServes(const Fleet& fleet) {
  GenerateArgs a;
  a.prompt = "And God said";
  a.max_tokens = 4;
  auto r = Generate(fleet.proxy_grpc(), a);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->completion_tokens, 4u);
}

std::vector<std::string> JoiningDecoder(const Fleet& fleet, const std::string& config,
                                        const std::string& name) {
  return {"decode", "--config", config, "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
          "--name", name, "--join", fleet.proxy_internal()};
}

// proxy.internal as the fleet file has it: the framed Register (the
// default, proxy.register_transport tcp) or gRPC's Registry.
void ExpectInternalPortRefusesPlaintextAndAcceptsTheFleetIdentity(bool grpc_registry) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions o;
  if (grpc_registry) o.proxy_yaml = "  register_transport: grpc\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const Fleet& f = **fleet;
  ASSERT_FALSE(f.tls_ca().empty()) << "the state file has no tls entry";
  ASSERT_FALSE(f.proxy_internal().empty());
  EXPECT_NE(f.proxy_internal(), f.proxy_grpc());

  // Keys and their folder are private to the fleet's user.
  struct stat st {};
  ASSERT_EQ(stat(f.tls_key().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat(fs::path(f.tls_key()).parent_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  auto op = RpcCredentials::MutualTls({f.tls_ca(), f.tls_cert(), f.tls_key()});
  ASSERT_TRUE(op.ok()) << op.status().ToString();
  const RpcCredentials plain;
  ASSERT_EQ(f.workers().size(), 2u);
  for (const auto& w : f.workers()) {
    EXPECT_EQ(Health(w.grpc, plain).error_code(), grpc::StatusCode::UNAVAILABLE) << w.name;
    // A standard gRPC client verifies the worker's certificate for 127.0.0.1.
    const grpc::Status ok = Health(w.grpc, *op);
    EXPECT_TRUE(ok.ok()) << w.name << ": " << ok.error_message();
  }
  EXPECT_EQ(Register(f.proxy_internal(), plain).error_code(), grpc::StatusCode::UNAVAILABLE);
  if (grpc_registry) {
    const grpc::Status internal_ok = Health(f.proxy_internal(), *op);
    EXPECT_TRUE(internal_ok.ok()) << internal_ok.error_message();
  } else {
    // The framed Register: plaintext is refused in the handshake; the fleet
    // identity gets the proxy's answer (a refusal: "intruder" is no worker
    // of this model).
    worker::WorkerIdentity id;
    id.name = "intruder";
    id.role = "decode";
    id.grpc_address = "127.0.0.1:1";
    const Status refused =
        worker::ProxyChannels(plain, true).Register(f.proxy_internal(), id, 5s);
    EXPECT_EQ(refused.code(), StatusCode::kUnauthenticated) << refused.ToString();
    const Status answered = worker::ProxyChannels(*op, true).Register(f.proxy_internal(), id, 0s);
    EXPECT_EQ(answered.code(), StatusCode::kFailedPrecondition) << answered.ToString();
    EXPECT_NE(answered.message().find("refused this worker"), std::string::npos)
        << answered.message();
  }
  // The public port serves no Registry at all.
  EXPECT_EQ(Register(f.proxy_grpc(), plain).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  ExpectServes(f);
}

TEST(Security, InternalPortsRefusePlaintextAndAcceptTheFleetIdentity) {
  ExpectInternalPortRefusesPlaintextAndAcceptsTheFleetIdentity(false);
}

TEST(Security, InternalPortsRefusePlaintextAndAcceptTheFleetIdentityOverGrpcRegister) {
  ExpectInternalPortRefusesPlaintextAndAcceptsTheFleetIdentity(true);
}

TEST(Security, WorkerOfAnotherCaOrWithoutCertificateCannotJoin) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const Fleet& f = **fleet;
  const std::string dir = fs::path(f.config_path()).parent_path();

  // A certificate of another CA (it trusts the fleet's CA, so it is the
  // proxy that refuses it).
  auto other = FleetCa::OpenOrCreate(dir + "/other-ca", "someone else's CA");
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto stranger = other->Issue("decode-9", {"127.0.0.1"});
  ASSERT_TRUE(stranger.ok()) << stranger.status().ToString();
  {
    auto args = JoiningDecoder(f, f.config_path(), "decode-9");
    args.insert(args.end(), {"--tls-ca", f.tls_ca(), "--tls-cert", stranger->cert_file,
                             "--tls-key", stranger->key_file});
    const std::string log = dir + "/stranger.log";
    auto st = RunToExit(args, log, 90s, f.cache_salt());
    ASSERT_TRUE(st.has_value()) << "a worker of another CA did not exit: " << ReadFile(log);
    EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 1) << *st;
    const std::string out = ReadFile(log);
    EXPECT_NE(out.find("TLS handshake failed"), std::string::npos) << out;
    EXPECT_NE(out.find("fleet's CA"), std::string::npos) << out;
  }
  ExpectServes(f);

  // No certificate at all: the same fleet file with the internal plane off.
  {
    const std::string plain_cfg = dir + "/plain.yaml";
    std::ofstream(plain_cfg) << ReadFile(f.config_path()) << "security:\n  internal_tls: off\n";
    const std::string log = dir + "/plain.log";
    auto st = RunToExit(JoiningDecoder(f, plain_cfg, "decode-8"), log, 90s, f.cache_salt());
    ASSERT_TRUE(st.has_value()) << "a plaintext worker did not exit: " << ReadFile(log);
    EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 1) << *st;
    const std::string out = ReadFile(log);
    EXPECT_NE(out.find("registering with the proxy"), std::string::npos) << out;
    EXPECT_NE(out.find("plaintext"), std::string::npos) << out;
  }
  ExpectServes(f);
}

TEST(Security, WorkerNameIsBoundToTheIdentityThatRegisteredIt) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const Fleet& f = **fleet;
  const std::string dir = fs::path(f.config_path()).parent_path();
  // A valid fleet certificate ("operator"), but the name is decode-0's.
  auto args = JoiningDecoder(f, f.config_path(), "decode-0");
  args.insert(args.end(), {"--tls-ca", f.tls_ca(), "--tls-cert", f.tls_cert(), "--tls-key",
                           f.tls_key()});
  const std::string log = dir + "/impostor.log";
  auto st = RunToExit(args, log, 90s, f.cache_salt());
  ASSERT_TRUE(st.has_value()) << "the impostor did not exit: " << ReadFile(log);
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 1) << *st;
  const std::string out = ReadFile(log);
  EXPECT_NE(out.find("worker name 'decode-0' belongs to the certificate identity 'decode-0'"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("presents 'operator'"), std::string::npos) << out;
  ExpectServes(f);
}

}  // namespace
}  // namespace tandem::testing
