// Certificates for `tandem launch` (docs/security.md), with OpenSSL's C API:
// a fleet CA and one certificate per process, signed by it. Keys are ECDSA
// P-256; certificates carry the process name as common name (the identity
// the proxy binds worker names to) and the hosts of its listeners as
// subjectAltName (IP or DNS), so standard clients verify them without
// overrides. Every certificate allows both serverAuth and clientAuth: each
// process is a server and a client of the internal plane.
//
// Files are written mode 0600 into a 0700 directory.
//
// Thread-safety: free functions; FleetCa is used from one thread.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "common/tls.h"

namespace tandem {

struct CertKeyPem {
  std::string cert;  // PEM certificate
  std::string key;   // PEM private key (unencrypted PKCS#8)
};

// A self-signed CA certificate valid for `valid_days`.
Result<CertKeyPem> CreateCaCertificate(const std::string& common_name, int valid_days);

// A certificate for `common_name` with subjectAltName `hosts` (each an IPv4
// or IPv6 address or a DNS name), signed by `ca`.
Result<CertKeyPem> IssueCertificate(const CertKeyPem& ca, const std::string& common_name,
                                    const std::vector<std::string>& hosts, int valid_days);

// The names under which clients reach a listener on `address` ("host:port"):
// its host; for a wildcard host (0.0.0.0, ::) every local interface address,
// localhost and the machine's host name.
std::vector<std::string> SubjectAltNamesFor(const std::string& address);

// Creates `dir` (and parents) and sets it to mode 0700.
Status MakePrivateDirectory(const std::string& dir);
// Writes `contents` to `path` with mode 0600 (created so, never wider).
Status WritePrivateFile(const std::string& path, const std::string& contents);

// A CA kept in a directory: ca.pem (the certificate) and ca.key.
class FleetCa {
 public:
  // Reuses ca.pem/ca.key in `dir` when both exist, else creates them.
  static Result<FleetCa> OpenOrCreate(const std::string& dir, const std::string& common_name);

  // Issues NAME.pem / NAME.key in the directory (replacing older ones);
  // returns the three files of that identity.
  Result<TlsFiles> Issue(const std::string& name, const std::vector<std::string>& hosts);

  const std::string& dir() const { return dir_; }
  std::string ca_file() const { return dir_ + "/ca.pem"; }

  static constexpr int kValidDays = 365;

 private:
  std::string dir_;
  CertKeyPem ca_;
};

}  // namespace tandem
