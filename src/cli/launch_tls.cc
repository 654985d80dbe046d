#include "cli/launch_tls.h"

#include <fmt/format.h>
#include <stdlib.h>

#include <filesystem>

namespace tandem::cli {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> HostsOf(const std::vector<std::string>& addresses) {
  std::vector<std::string> hosts;
  for (const auto& a : addresses) {
    for (auto& h : SubjectAltNamesFor(a)) {
      if (std::find(hosts.begin(), hosts.end(), h) == hosts.end()) hosts.push_back(std::move(h));
    }
  }
  return hosts;
}

}  // namespace

Result<LaunchCertificates> LaunchCertificates::Prepare(const SecurityConfig& security,
                                                       const std::string& state_file) {
  LaunchCertificates c;
  c.security_ = security;
  const bool internal_auto = security.internal_tls == "auto";
  const bool public_auto = security.public_tls == "auto";
  if (internal_auto || public_auto) {
    if (!security.dir.empty()) {
      c.dir_ = security.dir;
    } else if (!state_file.empty()) {
      const fs::path p = fs::absolute(state_file);
      c.dir_ = (p.parent_path() / (p.stem().string() + "-tls")).string();
    } else {
      std::string tmpl = (fs::temp_directory_path() / "tandem-tls-XXXXXX").string();
      if (mkdtemp(tmpl.data()) == nullptr) {
        return InternalError(fmt::format("cannot create a temporary directory {}", tmpl));
      }
      c.dir_ = tmpl;
      c.temporary_ = true;
    }
    TANDEM_RETURN_IF_ERROR(MakePrivateDirectory(c.dir_));
  }
  if (internal_auto) {
    TANDEM_ASSIGN_OR_RETURN(c.internal_ca_,
                            FleetCa::OpenOrCreate(c.dir_ + "/internal", "tandem fleet CA"));
    TANDEM_ASSIGN_OR_RETURN(c.operator_, c.internal_ca_->Issue("operator", {"127.0.0.1", "localhost"}));
  } else if (security.internal_tls == "files") {
    c.operator_ = {security.internal_ca_file, security.internal_cert_file, security.internal_key_file};
  }
  if (public_auto) {
    TANDEM_ASSIGN_OR_RETURN(c.public_ca_,
                            FleetCa::OpenOrCreate(c.dir_ + "/public", "tandem public CA"));
  }
  return c;
}

LaunchCertificates::LaunchCertificates(LaunchCertificates&& o) noexcept
    : security_(std::move(o.security_)), dir_(std::move(o.dir_)), temporary_(o.temporary_),
      internal_ca_(std::move(o.internal_ca_)), public_ca_(std::move(o.public_ca_)),
      operator_(std::move(o.operator_)) {
  o.temporary_ = false;
}

LaunchCertificates::~LaunchCertificates() {
  if (!temporary_) return;
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

Result<std::vector<std::string>> LaunchCertificates::InternalArgs(
    const std::string& name, const std::vector<std::string>& addresses) {
  if (!internal_ca_) return std::vector<std::string>{};
  TANDEM_ASSIGN_OR_RETURN(TlsFiles f, internal_ca_->Issue(name, HostsOf(addresses)));
  return std::vector<std::string>{"--tls-ca", f.ca_file, "--tls-cert", f.cert_file, "--tls-key",
                                  f.key_file};
}

Result<std::vector<std::string>> LaunchCertificates::PublicArgs(
    const std::vector<std::string>& addresses) {
  if (!public_ca_) return std::vector<std::string>{};
  TANDEM_ASSIGN_OR_RETURN(TlsFiles f, public_ca_->Issue("proxy", HostsOf(addresses)));
  return std::vector<std::string>{"--public-tls-cert", f.cert_file, "--public-tls-key",
                                  f.key_file};
}

void LaunchCertificates::AddToState(nlohmann::json& state) const {
  if (!operator_.empty()) {
    state["tls"] = {{"ca_file", operator_.ca_file},
                    {"cert_file", operator_.cert_file},
                    {"key_file", operator_.key_file}};
  }
  if (public_ca_) state["public_ca_file"] = public_ca_->ca_file();
  if (!dir_.empty()) state["security_dir"] = dir_;
}

}  // namespace tandem::cli
