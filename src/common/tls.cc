#include "common/tls.h"

#include <fmt/format.h>
#include <grpcpp/security/auth_context.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/x509.h>

#include <atomic>
#include <fstream>
#include <sstream>

#include "common/tls_pem.h"

namespace tandem {
namespace {

Result<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("cannot read the {} file {}", what, path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.find("-----BEGIN ") == std::string::npos) {
    return InvalidArgumentError(fmt::format("the {} file {} holds no PEM data", what, path));
  }
  return text;
}

// The key must belong to the certificate: gRPC only logs a mismatch and
// then fails every handshake, so it is checked here, at start-up.
Status CheckKeyMatches(const TlsPem& pem, const TlsFiles& files) {
  auto certs = ParsePemCertificates(pem.cert);
  if (!certs.ok()) return certs.status();
  EvpKeyPtr key = ParsePemPrivateKey(pem.key);
  if (certs->empty()) {
    return InvalidArgumentError(fmt::format("{} holds no readable certificate", files.cert_file));
  }
  if (!key) {
    return InvalidArgumentError(
        fmt::format("{} holds no readable (unencrypted) private key", files.key_file));
  }
  if (X509_check_private_key(certs->front().get(), key.get()) != 1) {
    return InvalidArgumentError(fmt::format("the key in {} does not belong to the certificate in {}",
                                            files.key_file, files.cert_file));
  }
  return Status::Ok();
}

}  // namespace

Result<TlsPem> ReadTlsFiles(const TlsFiles& files) {
  TlsPem pem;
  if (!files.ca_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(pem.ca, ReadPem(files.ca_file, "CA certificate"));
  }
  if (!files.cert_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(pem.cert, ReadPem(files.cert_file, "certificate"));
  }
  if (!files.key_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(pem.key, ReadPem(files.key_file, "private key"));
  }
  if (!pem.cert.empty() && !pem.key.empty()) TANDEM_RETURN_IF_ERROR(CheckKeyMatches(pem, files));
  return pem;
}

RpcCredentials::RpcCredentials() : grpc_(std::make_shared<Grpc>()) {}

Result<RpcCredentials> RpcCredentials::MutualTls(const TlsFiles& files) {
  if (files.ca_file.empty() || files.cert_file.empty() || files.key_file.empty()) {
    return InvalidArgumentError(
        "mutual TLS needs a CA file, a certificate file and a key file; got " +
        fmt::format("ca '{}', cert '{}', key '{}'", files.ca_file, files.cert_file,
                    files.key_file));
  }
  TANDEM_ASSIGN_OR_RETURN(TlsPem pem, ReadTlsFiles(files));
  RpcCredentials c;
  c.secure_ = true;
  c.grpc_->kind = Grpc::Kind::kMutual;
  c.grpc_->pem = pem;
  c.mutual_pem_ = std::make_shared<const TlsPem>(std::move(pem));
  return c;
}

Result<RpcCredentials> RpcCredentials::ServerTls(const TlsFiles& files) {
  if (files.cert_file.empty() || files.key_file.empty()) {
    return InvalidArgumentError("server TLS needs a certificate file and a key file");
  }
  TANDEM_ASSIGN_OR_RETURN(TlsPem pem, ReadTlsFiles(files));
  RpcCredentials c;
  c.secure_ = true;
  c.grpc_->kind = Grpc::Kind::kServer;
  c.grpc_->pem = std::move(pem);
  c.grpc_->files = files;
  return c;
}

bool RpcCredentials::grpc_made() const {
  return grpc_->made.load(std::memory_order_acquire);
}

const RpcCredentials::Grpc& RpcCredentials::Made() const {
  Grpc& g = *grpc_;
  std::call_once(g.once, [&g] {
    std::shared_ptr<grpc::ServerCredentials> server;
    std::shared_ptr<grpc::ChannelCredentials> channel;
    switch (g.kind) {
      case Grpc::Kind::kPlaintext:
        server = grpc::InsecureServerCredentials();
        channel = grpc::InsecureChannelCredentials();
        break;
      case Grpc::Kind::kMutual: {
        grpc::SslServerCredentialsOptions so(
            GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
        so.pem_root_certs = g.pem.ca;
        so.pem_key_cert_pairs.push_back({g.pem.key, g.pem.cert});
        server = grpc::SslServerCredentials(so);
        grpc::SslCredentialsOptions co;
        co.pem_root_certs = g.pem.ca;
        co.pem_private_key = g.pem.key;
        co.pem_cert_chain = g.pem.cert;
        channel = grpc::SslCredentials(co);
        break;
      }
      case Grpc::Kind::kServer: {
        // A file-watching provider: renewed files are served without a restart.
        auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
            g.files.key_file, g.files.cert_file, g.files.ca_file, kReloadSeconds);
        grpc::experimental::TlsServerCredentialsOptions so(provider);
        so.watch_identity_key_cert_pairs();
        if (!g.files.ca_file.empty()) {
          so.watch_root_certs();
          so.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
        } else {
          so.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
        }
        server = grpc::experimental::TlsServerCredentials(so);
        grpc::SslCredentialsOptions co;
        co.pem_root_certs = g.pem.ca;
        channel = grpc::SslCredentials(co);
        break;
      }
    }
    g.server = std::move(server);
    g.channel = std::move(channel);
    g.made.store(true, std::memory_order_release);
  });
  return g;
}

std::shared_ptr<grpc::Channel> RpcCredentials::Dial(const std::string& address,
                                                    const grpc::ChannelArguments& args) const {
  return grpc::CreateCustomChannel(address, channel(), args);
}

Result<RpcCredentials> InternalCredentials(const SecurityConfig& security, const TlsFiles& flags) {
  if (!flags.empty()) {
    auto c = RpcCredentials::MutualTls(flags);
    if (!c.ok()) return c.status().WithContext("--tls-ca/--tls-cert/--tls-key");
    return c;
  }
  if (security.internal_tls == "off") return RpcCredentials();
  if (security.internal_tls == "files") {
    auto c = RpcCredentials::MutualTls(
        {security.internal_ca_file, security.internal_cert_file, security.internal_key_file});
    if (!c.ok()) return c.status().WithContext("security.internal_tls");
    return c;
  }
  return FailedPreconditionError(
      "security.internal_tls is 'auto': the internal plane requires mutual TLS with certificates "
      "that `tandem launch` issues to the processes it starts; a process started by hand needs "
      "--tls-ca/--tls-cert/--tls-key (e.g. from `tandem certs` or the state file's fleet CA), "
      "security.internal_tls: {ca_file, cert_file, key_file}, or security.internal_tls: off");
}

Result<TlsFiles> PublicTlsFiles(const SecurityConfig& security, const TlsFiles& flags) {
  TlsFiles files;
  std::string origin;
  if (!flags.cert_file.empty() || !flags.key_file.empty()) {
    files = {security.public_client_ca_file, flags.cert_file, flags.key_file};
    origin = "--public-tls-cert/--public-tls-key";
  } else if (security.public_tls == "off") {
    return TlsFiles{};
  } else if (security.public_tls == "files") {
    files = {security.public_client_ca_file, security.public_cert_file, security.public_key_file};
    origin = "security.public_tls";
  } else {
    return FailedPreconditionError(
        "security.public_tls is 'auto': `tandem launch` issues the proxy's certificate; a proxy "
        "started by hand needs --public-tls-cert/--public-tls-key, security.public_tls: "
        "{cert_file, key_file}, or security.public_tls: off");
  }
  if (files.cert_file.empty() || files.key_file.empty()) {
    return InvalidArgumentError(origin + ": needs a certificate file and a key file");
  }
  if (auto pem = ReadTlsFiles(files); !pem.ok()) return pem.status().WithContext(origin);
  return files;
}

std::string PeerIdentity(const grpc::ServerContextBase& ctx) {
  const auto auth = ctx.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return "";
  const auto cn = auth->FindPropertyValues("x509_common_name");
  if (cn.empty()) return "";
  return std::string(cn.front().data(), cn.front().size());
}

}  // namespace tandem
