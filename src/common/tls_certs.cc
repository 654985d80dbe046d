#include "common/tls_certs.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "common/net.h"
#include "common/tls_pem.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

struct Free {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
  void operator()(X509* p) const { X509_free(p); }
  void operator()(BIO* p) const { BIO_free(p); }
  void operator()(BIGNUM* p) const { BN_free(p); }
  void operator()(X509_EXTENSION* p) const { X509_EXTENSION_free(p); }
};
template <class T>
using Ptr = std::unique_ptr<T, Free>;

// The last OpenSSL error, for messages.
std::string SslError(const char* what) {
  const unsigned long e = ERR_get_error();
  char buf[256] = {0};
  if (e != 0) ERR_error_string_n(e, buf, sizeof(buf));
  ERR_clear_error();
  return fmt::format("OpenSSL: {} failed{}{}", what, e ? ": " : "", buf);
}

Result<Ptr<EVP_PKEY>> NewKey() {
  Ptr<EVP_PKEY> key(EVP_EC_gen("P-256"));
  if (!key) return InternalError(SslError("EVP_EC_gen(P-256)"));
  return key;
}

Result<std::string> ToPem(X509* cert) {
  Ptr<BIO> bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509(bio.get(), cert) != 1) {
    return InternalError(SslError("PEM_write_bio_X509"));
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

Result<std::string> ToPem(EVP_PKEY* key) {
  Ptr<BIO> bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return InternalError(SslError("PEM_write_bio_PrivateKey"));
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// The first certificate of `pem` (common/tls_pem.h).
Result<Ptr<X509>> ParseCert(const std::string& pem) {
  TANDEM_ASSIGN_OR_RETURN(std::vector<X509Ptr> certs, ParsePemCertificates(pem));
  if (certs.empty()) return InvalidArgumentError(SslError("reading a PEM certificate"));
  return Ptr<X509>(certs.front().release());
}

Result<Ptr<EVP_PKEY>> ParseKey(const std::string& pem) {
  Ptr<EVP_PKEY> key(ParsePemPrivateKey(pem).release());
  if (!key) return InvalidArgumentError(SslError("reading a PEM private key"));
  return key;
}

Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  Ptr<X509_EXTENSION> ext(X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str()));
  if (!ext || X509_add_ext(cert, ext.get(), -1) != 1) {
    return InternalError(SslError(fmt::format("adding extension {}={}", OBJ_nid2sn(nid), value).c_str()));
  }
  return Status::Ok();
}

// A certificate for `key` named `cn`, valid now (minus an hour of clock
// skew) for `valid_days`, with a random 127-bit serial number.
Result<Ptr<X509>> NewCert(EVP_PKEY* key, const std::string& cn, int valid_days) {
  Ptr<X509> cert(X509_new());
  if (!cert) return InternalError(SslError("X509_new"));
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) return InternalError(SslError("RAND_bytes"));
  serial[0] &= 0x7f;  // positive
  Ptr<BIGNUM> bn(BN_bin2bn(serial, sizeof(serial), nullptr));
  if (!bn || !BN_to_ASN1_INTEGER(bn.get(), X509_get_serialNumber(cert.get())) ||
      X509_set_version(cert.get(), 2) != 1 ||  // v3
      !X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) ||
      !X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(valid_days) * 86400) ||
      X509_set_pubkey(cert.get(), key) != 1) {
    return InternalError(SslError("filling a certificate"));
  }
  X509_NAME* name = X509_get_subject_name(cert.get());
  if (X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8,
                                 reinterpret_cast<const unsigned char*>("tandem"), -1, -1, 0) != 1 ||
      X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                                 reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0) != 1) {
    return InternalError(SslError("setting the subject name"));
  }
  return cert;
}

bool IsIp(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, host.c_str(), buf) == 1 || inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

Result<std::string> ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("cannot read {}", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Result<CertKeyPem> CreateCaCertificate(const std::string& common_name, int valid_days) {
  TANDEM_ASSIGN_OR_RETURN(Ptr<EVP_PKEY> key, NewKey());
  TANDEM_ASSIGN_OR_RETURN(Ptr<X509> cert, NewCert(key.get(), common_name, valid_days));
  if (X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get())) != 1) {
    return InternalError(SslError("X509_set_issuer_name"));
  }
  TANDEM_RETURN_IF_ERROR(AddExtension(cert.get(), cert.get(), NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
  TANDEM_RETURN_IF_ERROR(AddExtension(cert.get(), cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign"));
  TANDEM_RETURN_IF_ERROR(AddExtension(cert.get(), cert.get(), NID_subject_key_identifier, "hash"));
  if (X509_sign(cert.get(), key.get(), EVP_sha256()) <= 0) return InternalError(SslError("X509_sign"));
  CertKeyPem out;
  TANDEM_ASSIGN_OR_RETURN(out.cert, ToPem(cert.get()));
  TANDEM_ASSIGN_OR_RETURN(out.key, ToPem(key.get()));
  return out;
}

Result<CertKeyPem> IssueCertificate(const CertKeyPem& ca, const std::string& common_name,
                                    const std::vector<std::string>& hosts, int valid_days) {
  if (common_name.empty() || common_name.size() > 64) {
    return InvalidArgumentError(fmt::format(
        "a certificate's common name must be 1..64 characters, got {}", common_name.size()));
  }
  TANDEM_ASSIGN_OR_RETURN(Ptr<X509> ca_cert, ParseCert(ca.cert));
  TANDEM_ASSIGN_OR_RETURN(Ptr<EVP_PKEY> ca_key, ParseKey(ca.key));
  TANDEM_ASSIGN_OR_RETURN(Ptr<EVP_PKEY> key, NewKey());
  TANDEM_ASSIGN_OR_RETURN(Ptr<X509> cert, NewCert(key.get(), common_name, valid_days));
  if (X509_set_issuer_name(cert.get(), X509_get_subject_name(ca_cert.get())) != 1) {
    return InternalError(SslError("X509_set_issuer_name"));
  }
  X509* c = cert.get();
  TANDEM_RETURN_IF_ERROR(AddExtension(c, ca_cert.get(), NID_basic_constraints, "critical,CA:FALSE"));
  TANDEM_RETURN_IF_ERROR(AddExtension(c, ca_cert.get(), NID_key_usage, "critical,digitalSignature,keyEncipherment"));
  TANDEM_RETURN_IF_ERROR(AddExtension(c, ca_cert.get(), NID_ext_key_usage, "serverAuth,clientAuth"));
  TANDEM_RETURN_IF_ERROR(AddExtension(c, ca_cert.get(), NID_subject_key_identifier, "hash"));
  TANDEM_RETURN_IF_ERROR(AddExtension(c, ca_cert.get(), NID_authority_key_identifier, "keyid:always"));
  std::string san;
  for (const std::string& h : hosts) {
    if (h.empty()) continue;
    if (h.find_first_of(",:") != std::string::npos && !IsIp(h)) {
      return InvalidArgumentError(fmt::format("'{}' is neither an IP address nor a DNS name", h));
    }
    if (!san.empty()) san += ',';
    san += (IsIp(h) ? "IP:" : "DNS:") + h;
  }
  if (!san.empty()) TANDEM_RETURN_IF_ERROR(AddExtension(c, ca_cert.get(), NID_subject_alt_name, san));
  if (X509_sign(c, ca_key.get(), EVP_sha256()) <= 0) return InternalError(SslError("X509_sign"));
  CertKeyPem out;
  TANDEM_ASSIGN_OR_RETURN(out.cert, ToPem(c));
  TANDEM_ASSIGN_OR_RETURN(out.key, ToPem(key.get()));
  return out;
}

std::vector<std::string> SubjectAltNamesFor(const std::string& address) {
  std::vector<std::string> out;
  auto hp = ParseHostPort(address);
  const std::string host = hp.ok() ? hp->host : address;
  if (host != "0.0.0.0" && host != "::" && !host.empty()) {
    out.push_back(host);
    if (host == "127.0.0.1" || host == "::1") out.push_back("localhost");
    return out;
  }
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr) continue;
      char buf[INET6_ADDRSTRLEN] = {0};
      if (i->ifa_addr->sa_family == AF_INET) {
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
      } else if (i->ifa_addr->sa_family == AF_INET6) {
        inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, buf, sizeof(buf));
        if (std::strncmp(buf, "fe80", 4) == 0) continue;  // link-local needs a zone id
      } else {
        continue;
      }
      out.emplace_back(buf);
    }
    freeifaddrs(ifs);
  }
  out.push_back("localhost");
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') out.emplace_back(name);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Status MakePrivateDirectory(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return InternalError(fmt::format("cannot create {}: {}", dir, ec.message()));
  if (chmod(dir.c_str(), 0700) != 0) {
    return InternalError(fmt::format("cannot set mode 0700 on {}: {}", dir, std::strerror(errno)));
  }
  return Status::Ok();
}

Status WritePrivateFile(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return InternalError(fmt::format("cannot create {}: {}", tmp, std::strerror(errno)));
  size_t off = 0;
  bool ok = fchmod(fd, 0600) == 0;  // an older file of that name may have been wider
  while (ok && off < contents.size()) {
    const ssize_t n = write(fd, contents.data() + off, contents.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ok = false;
    else off += static_cast<size_t>(n);
  }
  const int err = errno;
  if (close(fd) != 0) ok = false;
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    unlink(tmp.c_str());
    return InternalError(fmt::format("cannot write {}: {}", path, std::strerror(err)));
  }
  return Status::Ok();
}

Result<FleetCa> FleetCa::OpenOrCreate(const std::string& dir, const std::string& common_name) {
  TANDEM_RETURN_IF_ERROR(MakePrivateDirectory(dir));
  FleetCa ca;
  ca.dir_ = dir;
  const fs::path cert = fs::path(dir) / "ca.pem", key = fs::path(dir) / "ca.key";
  if (fs::exists(cert) && fs::exists(key)) {
    TANDEM_ASSIGN_OR_RETURN(ca.ca_.cert, ReadFile(cert));
    TANDEM_ASSIGN_OR_RETURN(ca.ca_.key, ReadFile(key));
    // Both must parse and match, or issuing fails later with less context.
    auto pem = ReadTlsFiles({"", cert.string(), key.string()});
    if (!pem.ok()) return pem.status().WithContext(fmt::format("the CA in {}", dir));
    return ca;
  }
  TANDEM_ASSIGN_OR_RETURN(ca.ca_, CreateCaCertificate(common_name, kValidDays));
  TANDEM_RETURN_IF_ERROR(WritePrivateFile(key.string(), ca.ca_.key));
  TANDEM_RETURN_IF_ERROR(WritePrivateFile(cert.string(), ca.ca_.cert));
  return ca;
}

Result<TlsFiles> FleetCa::Issue(const std::string& name, const std::vector<std::string>& hosts) {
  TANDEM_ASSIGN_OR_RETURN(CertKeyPem leaf, IssueCertificate(ca_, name, hosts, kValidDays));
  TlsFiles files{ca_file(), dir_ + "/" + name + ".pem", dir_ + "/" + name + ".key"};
  TANDEM_RETURN_IF_ERROR(WritePrivateFile(files.key_file, leaf.key));
  TANDEM_RETURN_IF_ERROR(WritePrivateFile(files.cert_file, leaf.cert));
  return files;
}

}  // namespace tandem
