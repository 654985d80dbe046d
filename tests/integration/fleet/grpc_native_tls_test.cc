// Issue 23: TLS on the proxy's native HTTP/2 gRPC front end
// (docs/grpc-frontend.md "TLS", docs/security.md) on a real CPU 1P1D fleet
// with security.public_tls {cert_file, key_file, client_ca_file} and
// proxy.grpc_server auto (which picks the native front end with TLS too):
//   - a gRPC C++ client (grpc::SslCredentials: the public CA and a client
//     certificate of the client CA) streams the tokens of tandem generate;
//   - a plaintext client, a TLS client without a client certificate, one
//     with a certificate of another CA, and TLS clients that do not offer
//     ALPN "h2" are refused (with a log line);
//   - renewed certificate files reach new connections (the once-a-second
//     re-read without SIGHUP, and SIGHUP) while an open stream runs to its
//     end on the old one; files that do not load leave the old certificate.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "common/net.h"
#include "common/tls_certs.h"
#include "fleet_harness.h"
#include "shared_fleet_test.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace pb = ::tandem::v1;
constexpr uint32_t kVocab = 4096;
constexpr auto kWait = std::chrono::seconds(60);

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The certificates of the test: the proxy's (server CA), a client's (client
// CA), a stranger's (a CA the proxy does not know).
struct Pki {
  std::string dir;
  std::unique_ptr<FleetCa> server_ca, client_ca, stranger_ca;
  TlsFiles server, client, stranger;
};

Result<Pki> MakePki() {
  Pki p;
  char tmpl[] = "/tmp/tandem-h2tls-XXXXXX";
  if (!mkdtemp(tmpl)) return InternalError("mkdtemp failed");
  p.dir = tmpl;
  auto open = [&](const char* sub, const char* cn) -> Result<std::unique_ptr<FleetCa>> {
    TANDEM_ASSIGN_OR_RETURN(FleetCa ca, FleetCa::OpenOrCreate(p.dir + "/" + sub, cn));
    return std::make_unique<FleetCa>(std::move(ca));
  };
  TANDEM_ASSIGN_OR_RETURN(p.server_ca, open("server", "test public CA"));
  TANDEM_ASSIGN_OR_RETURN(p.client_ca, open("clients", "test client CA"));
  TANDEM_ASSIGN_OR_RETURN(p.stranger_ca, open("stranger", "test stranger CA"));
  TANDEM_ASSIGN_OR_RETURN(p.server, p.server_ca->Issue("proxy", {"127.0.0.1"}));
  TANDEM_ASSIGN_OR_RETURN(p.client, p.client_ca->Issue("alice", {"127.0.0.1"}));
  TANDEM_ASSIGN_OR_RETURN(p.stranger, p.stranger_ca->Issue("mallory", {"127.0.0.1"}));
  return p;
}

// A gRPC channel to the proxy: the public CA; `id` (may be empty) the
// client certificate presented.
std::shared_ptr<grpc::Channel> TlsChannel(const std::string& address, const std::string& server_ca,
                                          const TlsFiles* id, int tag = 0) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = Slurp(server_ca);
  if (id != nullptr) {
    o.pem_cert_chain = Slurp(id->cert_file);
    o.pem_private_key = Slurp(id->key_file);
  }
  grpc::ChannelArguments args;
  args.SetInt("tandem.test.channel", tag);  // a connection of its own
  return grpc::CreateCustomChannel(address, grpc::SslCredentials(o), args);
}

Result<Completion> GenerateOn(const std::shared_ptr<grpc::Channel>& ch,
                              const std::vector<uint32_t>& prompt, uint32_t max_tokens) {
  auto stub = pb::Generation::NewStub(ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kWait);
  pb::GenerateRequest req;
  for (uint32_t t : prompt) req.add_prompt_token_ids(t);
  req.set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  auto reader = stub->Generate(&ctx, req);
  Completion c;
  pb::GenerateResponse resp;
  while (reader->Read(&resp)) {
    c.token_ids.insert(c.token_ids.end(), resp.token_ids().begin(), resp.token_ids().end());
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok()) return UnavailableError(fmt::format("{}: {}", static_cast<int>(st.error_code()), st.error_message()));
  return c;
}

// One raw TLS connection made with OpenSSL (blocking, bounded by a socket
// timeout): what the server presented and answered.
struct RawTls {
  bool handshake = false;       // the client's SSL_connect succeeded
  std::string alpn;             // what the server selected
  std::string peer_cert_pem;    // the server's certificate
  bool got_settings = false;    // an HTTP/2 SETTINGS frame arrived after our preface
  bool closed_by_server = false;  // reading ended without any byte
};

RawTls RawConnect(const std::string& address, const std::string& server_ca, const TlsFiles* id,
                  const std::vector<std::string>& alpn) {
  RawTls out;
  auto hp = ParseHostPort(address);
  if (!hp.ok()) return out;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(hp->port);
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL* ssl = nullptr;
  if (fd >= 0 && ctx != nullptr &&
      connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
      SSL_CTX_load_verify_locations(ctx, server_ca.c_str(), nullptr) == 1 &&
      (id == nullptr || (SSL_CTX_use_certificate_chain_file(ctx, id->cert_file.c_str()) == 1 &&
                         SSL_CTX_use_PrivateKey_file(ctx, id->key_file.c_str(), SSL_FILETYPE_PEM) == 1))) {
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
    std::string wire;
    for (const auto& p : alpn) wire += static_cast<char>(p.size()) + p;
    if (!wire.empty()) {
      SSL_CTX_set_alpn_protos(ctx, reinterpret_cast<const unsigned char*>(wire.data()),
                              static_cast<unsigned>(wire.size()));
    }
    ssl = SSL_new(ctx);
  }
  if (ssl != nullptr && SSL_set_fd(ssl, fd) == 1 && SSL_connect(ssl) == 1) {
    out.handshake = true;
    const unsigned char* p = nullptr;
    unsigned len = 0;
    SSL_get0_alpn_selected(ssl, &p, &len);
    out.alpn.assign(reinterpret_cast<const char*>(p), len);
    if (X509* cert = SSL_get1_peer_certificate(ssl)) {
      BIO* b = BIO_new(BIO_s_mem());
      PEM_write_bio_X509(b, cert);
      char* data = nullptr;
      const long n = BIO_get_mem_data(b, &data);
      out.peer_cert_pem.assign(data, static_cast<size_t>(n));
      BIO_free(b);
      X509_free(cert);
    }
    // The client preface and an empty SETTINGS; the server's SETTINGS back.
    const std::string preface = std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") +
                                std::string("\0\0\0\x04\0\0\0\0\0", 9);
    SSL_write(ssl, preface.data(), static_cast<int>(preface.size()));
    unsigned char hdr[9];
    size_t got = 0;
    while (got < sizeof hdr) {
      const int n = SSL_read(ssl, hdr + got, static_cast<int>(sizeof hdr - got));
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    out.got_settings = got == sizeof hdr && hdr[3] == 0x04;
    out.closed_by_server = got == 0;
  }
  ERR_clear_error();
  if (ssl != nullptr) SSL_free(ssl);
  if (ctx != nullptr) SSL_CTX_free(ctx);
  if (fd >= 0) close(fd);
  return out;
}

class GrpcNativeTls : public SharedFleetTest<GrpcNativeTls> {
 public:
  static Result<FleetOptions> SuiteOptions() {
    signal(SIGPIPE, SIG_IGN);  // RawConnect writes to connections the server refused
    TANDEM_ASSIGN_OR_RETURN(Pki pki, MakePki());
    pki_ = new Pki(std::move(pki));
    FleetOptions o;  // 1P1D, CPU; proxy.grpc_server auto
    o.log_level = "info";  // the proxy's TLS lines are asserted
    o.extra_yaml = fmt::format(
        "security:\n  public_tls:\n    cert_file: {}\n    key_file: {}\n    client_ca_file: {}\n",
        pki_->server.cert_file, pki_->server.key_file, pki_->client_ca->ca_file());
    return o;
  }
  static void TearDownTestSuite() {
    SharedFleetTest::TearDownTestSuite();
    if (pki_ != nullptr) {
      std::error_code ec;
      fs::remove_all(pki_->dir, ec);
      delete pki_;
      pki_ = nullptr;
    }
  }

 protected:
  static std::string ServerCa() { return pki_->server_ca->ca_file(); }
  static inline Pki* pki_ = nullptr;
};

std::vector<uint32_t> Prompt(uint32_t i) { return PromptIds(700 + i, 12 + (i * 5) % 30, kVocab); }

TEST_F(GrpcNativeTls, CertifiedGrpcClientsGetTheTokensOfTandemGenerateOthersAreRefused) {
  // `auto` served this TLS port natively (unless the environment chose gRPC C++).
  const char* env = getenv("TANDEM_TEST_GRPC_SERVER");
  const bool native = env == nullptr || std::string(env) != "grpc";
  if (native) {
    ASSERT_TRUE(WaitForLogLine(fleet_->log_path(), "(gRPC, native HTTP/2, TLS)", kWait).has_value())
        << ReadText(fleet_->log_path());
  }
  static constexpr uint32_t kStreams = 6, kMaxTokens = 16;
  auto ch = TlsChannel(fleet_->proxy_grpc(), ServerCa(), &pki_->client);
  std::vector<std::future<Result<Completion>>> futures;
  for (uint32_t i = 0; i < kStreams; ++i) {
    futures.push_back(std::async(std::launch::async, [&ch, i] { return GenerateOn(ch, Prompt(i), kMaxTokens); }));
  }
  for (uint32_t i = 0; i < kStreams; ++i) {
    auto got = futures[i].get();
    ASSERT_TRUE(got.ok()) << "stream " << i << ": " << got.status().ToString();
    auto ref = ReferenceGenerate(Prompt(i), kMaxTokens);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    EXPECT_EQ(got->token_ids, *ref) << "stream " << i;
  }

  // Plaintext, no client certificate, a certificate of another CA: refused.
  {
    auto plain = grpc::CreateChannel(fleet_->proxy_grpc(), grpc::InsecureChannelCredentials());
    auto r = GenerateOn(plain, Prompt(0), 2);
    EXPECT_FALSE(r.ok()) << "plaintext was served";
  }
  {
    auto r = GenerateOn(TlsChannel(fleet_->proxy_grpc(), ServerCa(), nullptr, 1), Prompt(0), 2);
    EXPECT_FALSE(r.ok()) << "a client without a certificate was served";
  }
  {
    auto r = GenerateOn(TlsChannel(fleet_->proxy_grpc(), ServerCa(), &pki_->stranger, 2), Prompt(0), 2);
    EXPECT_FALSE(r.ok()) << "a client certificate of an unknown CA was accepted";
  }
  if (!native) return;  // what follows is the native front end's own refusals and log lines
  EXPECT_TRUE(WaitForLogLine(fleet_->log_path(), "TLS handshake with", kWait).has_value());

  // ALPN: offering h2 gets HTTP/2; no ALPN, or only http/1.1, is refused.
  const RawTls h2 = RawConnect(fleet_->proxy_grpc(), ServerCa(), &pki_->client, {"h2"});
  EXPECT_TRUE(h2.handshake);
  EXPECT_EQ(h2.alpn, "h2");
  EXPECT_TRUE(h2.got_settings);
  const RawTls none = RawConnect(fleet_->proxy_grpc(), ServerCa(), &pki_->client, {});
  EXPECT_FALSE(none.got_settings);
  EXPECT_TRUE(WaitForLogLine(fleet_->log_path(), "did not offer ALPN \"h2\"", kWait).has_value());
  const RawTls http1 = RawConnect(fleet_->proxy_grpc(), ServerCa(), &pki_->client, {"http/1.1"});
  EXPECT_FALSE(http1.handshake);
  EXPECT_FALSE(http1.got_settings);
}

TEST_F(GrpcNativeTls, RenewedCertificateReachesNewConnectionsWhileAnOpenStreamRuns) {
  const char* env = getenv("TANDEM_TEST_GRPC_SERVER");
  const bool native = env == nullptr || std::string(env) != "grpc";
  const std::string first = Slurp(pki_->server.cert_file);
  ASSERT_EQ(RawConnect(fleet_->proxy_grpc(), ServerCa(), &pki_->client, {"h2"}).peer_cert_pem, first);

  // A stream opened on the first certificate.
  auto old_ch = TlsChannel(fleet_->proxy_grpc(), ServerCa(), &pki_->client, 10);
  auto stub = pb::Generation::NewStub(old_ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kWait);
  pb::GenerateRequest req;
  for (uint32_t t : Prompt(3)) req.add_prompt_token_ids(t);
  static constexpr uint32_t kLong = 500;
  req.set_max_tokens(kLong);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  auto reader = stub->Generate(&ctx, req);
  pb::GenerateResponse resp;
  std::vector<uint32_t> tokens;
  ASSERT_TRUE(reader->Read(&resp));
  tokens.insert(tokens.end(), resp.token_ids().begin(), resp.token_ids().end());

  // Renewed files without a signal: re-read on their own (at most 1 s old).
  auto second_files = pki_->server_ca->Issue("proxy", {"127.0.0.1"});
  ASSERT_TRUE(second_files.ok()) << second_files.status().ToString();
  const std::string second = Slurp(pki_->server.cert_file);
  ASSERT_NE(second, first);
  EXPECT_TRUE(WaitUntil(
      [&] { return RawConnect(fleet_->proxy_grpc(), ServerCa(), &pki_->client, {"h2"}).peer_cert_pem == second; },
      kWait))
      << "the renewed certificate was not served";

  // Files that do not load (a key of another certificate): the old
  // certificate stays, on SIGHUP and on the re-read.
  ASSERT_TRUE(WritePrivateFile(pki_->server.key_file, Slurp(pki_->stranger.key_file)).ok());
  ASSERT_EQ(kill(fleet_->proxy_pid(), SIGHUP), 0);
  EXPECT_TRUE(WaitForLogLine(fleet_->log_path(), "not reloaded (the old ones stay)", kWait).has_value())
      << ReadText(fleet_->log_path());
  EXPECT_EQ(RawConnect(fleet_->proxy_grpc(), ServerCa(), &pki_->client, {"h2"}).peer_cert_pem, second);

  // SIGHUP with good files: served to new connections.
  auto third_files = pki_->server_ca->Issue("proxy", {"127.0.0.1"});
  ASSERT_TRUE(third_files.ok()) << third_files.status().ToString();
  const std::string third = Slurp(pki_->server.cert_file);
  ASSERT_EQ(kill(fleet_->proxy_pid(), SIGHUP), 0);
  EXPECT_TRUE(WaitUntil(
      [&] { return RawConnect(fleet_->proxy_grpc(), ServerCa(), &pki_->client, {"h2"}).peer_cert_pem == third; },
      kWait))
      << "the certificate of the SIGHUP was not served";
  if (native) {
    EXPECT_TRUE(WaitForLogLine(fleet_->log_path(), "public TLS certificates reloaded", kWait).has_value());
  }

  // The stream opened on the first certificate ran to its end, and equals
  // tandem generate; its connection (the first certificate's) takes a new
  // call; a new channel works on the new certificate.
  while (reader->Read(&resp)) {
    tokens.insert(tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
  }
  ASSERT_TRUE(reader->Finish().ok());
  auto ref = ReferenceGenerate(Prompt(3), kLong);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(tokens, *ref);
  auto again = GenerateOn(old_ch, Prompt(5), 3);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->token_ids.size(), 3u);
  auto fresh = GenerateOn(TlsChannel(fleet_->proxy_grpc(), ServerCa(), &pki_->client, 11), Prompt(4), 3);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(fresh->token_ids.size(), 3u);
}

}  // namespace
}  // namespace tandem::testing
