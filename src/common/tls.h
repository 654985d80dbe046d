// TLS for tandem's gRPC planes (docs/security.md): the one place that turns
// PEM files into gRPC credentials and reads the peer's identity.
//
//   internal plane (proxy <-> workers, prefiller -> decoder): mutual TLS.
//     Servers require and verify a client certificate of the fleet CA;
//     clients verify the server's certificate (CA and subjectAltName
//     against the dialled host) and present their own.
//   public plane (clients -> proxy): server TLS; a client certificate is
//     required only when a client CA is given.
//
// Certificate and key generation (tandem launch) is in common/tls_certs.h.
//
// Thread-safety: RpcCredentials is immutable once built; share it freely.
// Its gRPC credential objects are made on first use (server(), channel(),
// Dial()), not when it is built: making one initialises gRPC, whose timer
// thread then wakes about once a second for the life of the process, and
// a default fleet's proxy uses only the PEM identity (mutual_pem(), for its
// framed connections; issue 23, docs/security.md).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "common/config.h"
#include "common/status.h"

namespace tandem {

// One TLS identity as PEM files.
struct TlsFiles {
  std::string ca_file;    // the CA the peers' certificates must chain to
  std::string cert_file;  // this process's certificate
  std::string key_file;   // its private key
  bool empty() const { return ca_file.empty() && cert_file.empty() && key_file.empty(); }
};

// The same identity, read: PEM text.
struct TlsPem {
  std::string ca, cert, key;
};

// Reads the files of `files` that are set; NotFound naming the file that
// cannot be read, InvalidArgument when one does not hold PEM, or when the
// key does not belong to the certificate.
Result<TlsPem> ReadTlsFiles(const TlsFiles& files);

class RpcCredentials {
 public:
  // Plaintext (security.internal_tls / public_tls off).
  RpcCredentials();

  // Mutual TLS with `files` (all three required).
  static Result<RpcCredentials> MutualTls(const TlsFiles& files);
  // Server TLS for the public plane: cert_file/key_file; ca_file (may be
  // empty) is the CA client certificates must chain to. Clients built from
  // it verify the server against ca_file. The server re-reads the files
  // every kReloadSeconds (replace them by rename), so renewed certificates
  // take effect without a restart and without dropping open streams.
  static Result<RpcCredentials> ServerTls(const TlsFiles& files);
  static constexpr unsigned kReloadSeconds = 1;

  bool secure() const { return secure_; }
  // Made on the first call of either (or of Dial) by any copy.
  std::shared_ptr<grpc::ServerCredentials> server() const { return Made().server; }
  std::shared_ptr<grpc::ChannelCredentials> channel() const { return Made().channel; }
  // A channel to "host:port" with these credentials and `args`.
  std::shared_ptr<grpc::Channel> Dial(const std::string& address,
                                      const grpc::ChannelArguments& args = {}) const;
  // The PEM identity of mutual TLS (MutualTls); null otherwise. The framed
  // internal connections (common/frame_conn.h) use the same identity.
  const TlsPem* mutual_pem() const { return mutual_pem_.get(); }
  // Whether the gRPC credential objects have been made (tests: a default
  // proxy never makes them).
  bool grpc_made() const;

 private:
  // What the gRPC credentials are made from, and, once made, them; shared
  // by the copies.
  struct Grpc {
    enum class Kind { kPlaintext, kMutual, kServer } kind = Kind::kPlaintext;
    TlsPem pem;      // kMutual, kServer: the identity read at start-up
    TlsFiles files;  // kServer: the files its provider watches
    std::once_flag once;
    std::atomic<bool> made{false};  // set once server and channel are
    std::shared_ptr<grpc::ServerCredentials> server;
    std::shared_ptr<grpc::ChannelCredentials> channel;
  };
  const Grpc& Made() const;

  bool secure_ = false;
  std::shared_ptr<const TlsPem> mutual_pem_;
  std::shared_ptr<Grpc> grpc_;
};

// The internal plane's credentials of one process: the command line's
// --tls-ca/--tls-cert/--tls-key when given (all three), else the config's
// security.internal_tls (off: plaintext; files: those). `auto` without
// flags is an error that says how to get certificates: `tandem launch`
// passes them to its children; a process started by hand needs them.
Result<RpcCredentials> InternalCredentials(const SecurityConfig& security, const TlsFiles& flags);

// The public listeners' TLS files (gRPC and HTTP): --public-tls-cert/
// --public-tls-key when given (tandem launch with public_tls auto), else the
// config's security.public_tls (off: empty files = plaintext; files:
// cert_file, key_file); ca_file is security.public_tls.client_ca_file
// (empty: no client certificate asked for). `auto` without flags is an
// error. The files are checked (readable PEM, key matches).
Result<TlsFiles> PublicTlsFiles(const SecurityConfig& security, const TlsFiles& flags);

// The verified identity of the peer of a call: the common name of its
// client certificate; "" on a plaintext connection or without one.
std::string PeerIdentity(const grpc::ServerContextBase& ctx);

}  // namespace tandem
