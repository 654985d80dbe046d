// TLS on real gRPC servers on loopback (common/tls.h, common/tls_certs.h):
// certificates issued by a fleet CA pass mutual TLS and name their peer;
// a client of another CA, a client without a certificate and a plaintext
// client are refused; files are private; bad files are errors naming them.
#include "common/tls.h"

#include <grpc/health/v1/health.grpc.pb.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/rpc_server.h"
#include "common/tls_certs.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using grpc::health::v1::Health;

// Registry that answers with the caller's certificate identity.
class EchoIdentity final : public tandem::v1::Registry::Service {
 public:
  grpc::Status Register(grpc::ServerContext* ctx, const tandem::v1::RegisterRequest*,
                        tandem::v1::RegisterResponse* resp) override {
    resp->mutable_error()->set_message(PeerIdentity(*ctx));
    return grpc::Status::OK;
  }
};

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tandem-tls-test-" + std::to_string(getpid()));
    auto ca = FleetCa::OpenOrCreate((dir_ / "fleet").string(), "test fleet CA");
    ASSERT_TRUE(ca.ok()) << ca.status().ToString();
    ca_.emplace(std::move(ca).value());
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  grpc::Status Health(const std::string& address, const RpcCredentials& creds) {
    auto stub = Health::NewStub(creds.Dial(address));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    return stub->Check(&ctx, req, &resp);
  }
  fs::path dir_;
  std::optional<FleetCa> ca_;
};

TEST_F(TlsTest, MutualTlsAcceptsFleetCertificatesAndNamesThePeer) {
  auto server_files = ca_->Issue("proxy", {"127.0.0.1", "localhost"});
  auto client_files = ca_->Issue("decode-0", {"127.0.0.1"});
  ASSERT_TRUE(server_files.ok() && client_files.ok());
  auto server_creds = RpcCredentials::MutualTls(*server_files);
  auto client_creds = RpcCredentials::MutualTls(*client_files);
  ASSERT_TRUE(server_creds.ok()) << server_creds.status().ToString();
  ASSERT_TRUE(client_creds.ok()) << client_creds.status().ToString();
  EchoIdentity echo;
  auto server = RpcServer::Start("127.0.0.1:0", {&echo}, *server_creds);
  ASSERT_TRUE(server.ok()) << server.status().ToString();

  // The server's certificate verifies against the dialled IP (subjectAltName).
  auto stub = tandem::v1::Registry::NewStub(client_creds->Dial((*server)->address()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  tandem::v1::RegisterRequest req;
  tandem::v1::RegisterResponse resp;
  const grpc::Status st = stub->Register(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.error().message(), "decode-0");
}

// Issue 23 (reserve-tcp): building credentials makes no gRPC object (that
// would initialise gRPC, whose timer thread then wakes an idle proxy about
// once a second); the first use makes them, once, for every copy.
TEST_F(TlsTest, GrpcCredentialsAreMadeOnFirstUseOnly) {
  auto files = ca_->Issue("proxy", {"127.0.0.1"});
  ASSERT_TRUE(files.ok());
  auto creds = RpcCredentials::MutualTls(*files);
  ASSERT_TRUE(creds.ok()) << creds.status().ToString();
  const RpcCredentials copy = *creds;
  EXPECT_TRUE(creds->secure());
  ASSERT_NE(creds->mutual_pem(), nullptr);  // the framed connections' identity
  EXPECT_FALSE(creds->grpc_made());
  EXPECT_FALSE(copy.grpc_made());
  const auto channel = copy.channel();
  ASSERT_NE(channel, nullptr);
  EXPECT_TRUE(creds->grpc_made());
  EXPECT_EQ(creds->channel(), channel);  // made once
  EXPECT_NE(creds->server(), nullptr);

  RpcCredentials plain;
  EXPECT_FALSE(plain.grpc_made());
  EXPECT_NE(plain.server(), nullptr);
  EXPECT_TRUE(plain.grpc_made());
  auto server_tls = RpcCredentials::ServerTls(*files);
  ASSERT_TRUE(server_tls.ok()) << server_tls.status().ToString();
  EXPECT_FALSE(server_tls->grpc_made());
  EXPECT_NE(server_tls->server(), nullptr);
}

TEST_F(TlsTest, MutualTlsRefusesOtherCaNoCertificateAndPlaintext) {
  auto server_files = ca_->Issue("proxy", {"127.0.0.1"});
  ASSERT_TRUE(server_files.ok());
  auto server_creds = RpcCredentials::MutualTls(*server_files);
  ASSERT_TRUE(server_creds.ok());
  auto server = RpcServer::Start("127.0.0.1:0", {}, *server_creds);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const std::string addr = (*server)->address();

  auto other = FleetCa::OpenOrCreate((dir_ / "other").string(), "other CA");
  ASSERT_TRUE(other.ok());
  auto stranger = other->Issue("stranger", {"127.0.0.1"});
  ASSERT_TRUE(stranger.ok());
  // The stranger trusts our CA (it verifies the server) but its own
  // certificate is of another CA: the server refuses it.
  auto stranger_creds = RpcCredentials::MutualTls({server_files->ca_file, stranger->cert_file,
                                                   stranger->key_file});
  ASSERT_TRUE(stranger_creds.ok());
  EXPECT_EQ(Health(addr, *stranger_creds).error_code(), grpc::StatusCode::UNAVAILABLE);

  // Verifying the server but presenting no certificate.
  auto anonymous = RpcCredentials::ServerTls({server_files->ca_file, server_files->cert_file,
                                              server_files->key_file});
  ASSERT_TRUE(anonymous.ok());
  EXPECT_EQ(Health(addr, *anonymous).error_code(), grpc::StatusCode::UNAVAILABLE);

  EXPECT_EQ(Health(addr, RpcCredentials()).error_code(), grpc::StatusCode::UNAVAILABLE);

  // And a fleet certificate works on the same server.
  auto member = ca_->Issue("prefill-0", {"127.0.0.1"});
  ASSERT_TRUE(member.ok());
  auto member_creds = RpcCredentials::MutualTls(*member);
  ASSERT_TRUE(member_creds.ok());
  const grpc::Status ok = Health(addr, *member_creds);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
}

TEST_F(TlsTest, ServerCertificateMustNameTheDialledHost) {
  // A certificate for 10.1.2.3 only: a client dialling 127.0.0.1 refuses it.
  auto server_files = ca_->Issue("proxy", {"10.1.2.3"});
  auto client_files = ca_->Issue("decode-0", {"127.0.0.1"});
  ASSERT_TRUE(server_files.ok() && client_files.ok());
  auto server = RpcServer::Start("127.0.0.1:0", {}, *RpcCredentials::MutualTls(*server_files));
  ASSERT_TRUE(server.ok());
  EXPECT_EQ(Health((*server)->address(), *RpcCredentials::MutualTls(*client_files)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, FilesArePrivateAndTheCaIsReused) {
  struct stat st {};
  ASSERT_EQ(stat((dir_ / "fleet").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  auto f = ca_->Issue("decode-1", {"127.0.0.1"});
  ASSERT_TRUE(f.ok());
  for (const std::string& p : {f->ca_file, f->cert_file, f->key_file, ca_->dir() + "/ca.key"}) {
    ASSERT_EQ(stat(p.c_str(), &st), 0) << p;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << p;
  }
  std::ifstream in(f->ca_file);
  const std::string before((std::istreambuf_iterator<char>(in)), {});
  auto again = FleetCa::OpenOrCreate(ca_->dir(), "ignored");
  ASSERT_TRUE(again.ok());
  std::ifstream in2(again->ca_file());
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in2)), {}), before);
}

TEST_F(TlsTest, BadFilesNameTheFile) {
  auto a = ca_->Issue("a", {"127.0.0.1"});
  auto b = ca_->Issue("b", {"127.0.0.1"});
  ASSERT_TRUE(a.ok() && b.ok());
  auto mismatch = RpcCredentials::MutualTls({a->ca_file, a->cert_file, b->key_file});
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find(b->key_file), std::string::npos)
      << mismatch.status().message();
  auto missing = RpcCredentials::MutualTls({a->ca_file, (dir_ / "nope.pem").string(), a->key_file});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope.pem"), std::string::npos);

  SecurityConfig sec;  // internal_tls auto without flags: refused, saying how
  auto none = InternalCredentials(sec, {});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("--tls-ca"), std::string::npos);
  sec.internal_tls = "off";
  auto plain = InternalCredentials(sec, {});
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->secure());
}

TEST(TlsNames, WildcardListenersGetEveryLocalName) {
  EXPECT_EQ(SubjectAltNamesFor("10.0.0.7:9000"), std::vector<std::string>{"10.0.0.7"});
  const auto any = SubjectAltNamesFor("0.0.0.0:0");
  EXPECT_NE(std::find(any.begin(), any.end(), "127.0.0.1"), any.end());
  EXPECT_NE(std::find(any.begin(), any.end(), "localhost"), any.end());
}

}  // namespace
}  // namespace tandem
