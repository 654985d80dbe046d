#include "common/tls_pem.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>

namespace tandem {
namespace {

struct BioFree {
  void operator()(BIO* p) const { BIO_free(p); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;

BioPtr ReadOnlyBio(std::string_view pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

}  // namespace

Result<std::vector<X509Ptr>> ParsePemCertificates(std::string_view pem) {
  BioPtr bio = ReadOnlyBio(pem);
  if (!bio) return InternalError("BIO_new_mem_buf failed");
  std::vector<X509Ptr> certs;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certs.emplace_back(x);
  }
  if (!certs.empty()) ERR_clear_error();  // the read that ends the list queues "no start line"
  return certs;
}

EvpKeyPtr ParsePemPrivateKey(std::string_view pem) {
  BioPtr bio = ReadOnlyBio(pem);
  if (!bio) return nullptr;
  return EvpKeyPtr(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
}

std::string DrainOpenSslErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out;
}

}  // namespace tandem
