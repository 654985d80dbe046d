// The certificates `tandem launch` issues (docs/security.md).
//
// security.internal_tls auto: a fleet CA (reused when the directory already
// holds one) and one certificate per process, named after it (CN) and
// valid for the hosts of its listeners (subjectAltName), plus an
// "operator" client identity for tools and tests (the state file's `tls`).
// security.public_tls auto: a second CA and the proxy's public certificate
// (the state file's `public_ca_file`).
//
// Where: security.dir, else "<state file minus .json>-tls/" next to the
// state file, else a temporary directory removed when the launcher exits.
// The directory is mode 0700, every file 0600.
//
// Thread-safety: the launcher's main thread only.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "common/tls_certs.h"

namespace tandem::cli {

class LaunchCertificates {
 public:
  static Result<LaunchCertificates> Prepare(const SecurityConfig& security,
                                            const std::string& state_file);
  LaunchCertificates(LaunchCertificates&&) noexcept;
  LaunchCertificates& operator=(LaunchCertificates&&) = delete;
  ~LaunchCertificates();  // removes a temporary directory

  // The flags that give process `name`, listening on `addresses`, its
  // internal identity (--tls-ca/--tls-cert/--tls-key); none unless
  // internal_tls is auto.
  Result<std::vector<std::string>> InternalArgs(const std::string& name,
                                                const std::vector<std::string>& addresses);
  // --public-tls-cert/--public-tls-key for the proxy's public listeners;
  // none unless public_tls is auto.
  Result<std::vector<std::string>> PublicArgs(const std::vector<std::string>& addresses);

  // What the state file says about TLS: "tls" {ca_file, cert_file,
  // key_file} (an operator client identity) unless internal_tls is off,
  // "public_ca_file" with public_tls auto, "security_dir".
  void AddToState(nlohmann::json& state) const;

 private:
  LaunchCertificates() = default;

  SecurityConfig security_;
  std::string dir_;
  bool temporary_ = false;
  std::optional<FleetCa> internal_ca_, public_ca_;
  TlsFiles operator_;
};

}  // namespace tandem::cli
