// PEM text to OpenSSL objects: the one parser of the TLS code
// (common/tls.cc, tls_certs.cc, frame_conn.cc, proxy/h2/h2_tls.cc;
// docs/security.md).
//
// Thread-safety: free functions. OpenSSL's error queue is per thread.
#pragma once

#include <openssl/evp.h>
#include <openssl/x509.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem {

struct OpenSslFree {
  void operator()(X509* p) const { X509_free(p); }
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
using X509Ptr = std::unique_ptr<X509, OpenSslFree>;
using EvpKeyPtr = std::unique_ptr<EVP_PKEY, OpenSslFree>;

// Every certificate of `pem`, in order, up to the first block that is not
// one (empty when the first is not: OpenSSL's reason stays queued; after
// one or more, the queue is cleared of the read that ended the list).
// InternalError only when OpenSSL cannot allocate.
Result<std::vector<X509Ptr>> ParsePemCertificates(std::string_view pem);

// The first private key of `pem` (unencrypted PEM); null when none can be
// read (OpenSSL's reason stays queued).
EvpKeyPtr ParsePemPrivateKey(std::string_view pem);

// This thread's queued OpenSSL errors, "; "-joined, the queue emptied;
// "" when none was queued.
std::string DrainOpenSslErrors();

}  // namespace tandem
