#include "proxy/h2/h2_tls.h"

#include <fmt/format.h>
#include <openssl/err.h>
#include <openssl/x509.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <cstring>

#include "common/tls_pem.h"

namespace tandem::proxy::h2 {
namespace {

// gRPC's default TLS 1.2 cipher suites (GRPC_SSL_CIPHER_SUITES); TLS 1.3
// keeps OpenSSL's (AES-GCM, ChaCha20-Poly1305).
constexpr char kTls12Ciphers[] =
    "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:"
    "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-AES256-GCM-SHA384";

std::string SslErrors() {
  std::string out = DrainOpenSslErrors();
  return out.empty() ? "no OpenSSL error queued" : out;
}

// ALPN: "h2" or nothing (the handshake then fails with
// no_application_protocol, which gRPC clients report as such).
int SelectAlpn(SSL*, const unsigned char** out, unsigned char* outlen, const unsigned char* in,
               unsigned int inlen, void*) {
  for (unsigned int i = 0; i < inlen;) {
    const unsigned int n = in[i];
    if (i + 1 + n > inlen) break;
    if (n == 2 && std::memcmp(in + i + 1, "h2", 2) == 0) {
      *out = in + i + 1;
      *outlen = 2;
      return SSL_TLSEXT_ERR_OK;
    }
    i += 1 + n;
  }
  return SSL_TLSEXT_ERR_ALERT_FATAL;
}

// Every certificate of `pem` in order (common/tls_pem.h), with `fn` (1 = OK).
template <class Fn>
Status EachCert(const std::string& pem, const std::string& file, Fn fn) {
  TANDEM_ASSIGN_OR_RETURN(std::vector<X509Ptr> certs, ParsePemCertificates(pem));
  if (certs.empty()) {
    ERR_clear_error();
    return InvalidArgumentError(fmt::format("{} holds no certificate", file));
  }
  for (size_t i = 0; i < certs.size(); ++i) {
    if (fn(certs[i].get(), i == 0) != 1) {
      return InvalidArgumentError(fmt::format("{}: {}", file, SslErrors()));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<SslCtxPtr> NewPublicServerContext(const TlsFiles& files) {
  if (files.cert_file.empty() || files.key_file.empty()) {
    return InvalidArgumentError("server TLS needs a certificate file and a key file");
  }
  TANDEM_ASSIGN_OR_RETURN(TlsPem pem, ReadTlsFiles(files));
  ERR_clear_error();
  SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()));
  if (!ctx) return InternalError("SSL_CTX_new failed: " + SslErrors());
  SSL_CTX* c = ctx.get();
  if (SSL_CTX_set_min_proto_version(c, TLS1_2_VERSION) != 1 ||
      SSL_CTX_set_max_proto_version(c, TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_cipher_list(c, kTls12Ciphers) != 1 || SSL_CTX_set_num_tickets(c, 0) != 1) {
    return InternalError("TLS context settings: " + SslErrors());
  }
  SSL_CTX_set_options(c, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE |
                             SSL_OP_NO_COMPRESSION | SSL_OP_NO_TICKET);
  SSL_CTX_set_session_cache_mode(c, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_alpn_select_cb(c, &SelectAlpn, nullptr);
  TANDEM_RETURN_IF_ERROR(EachCert(pem.cert, files.cert_file, [&](X509* x, bool first) {
    return first ? SSL_CTX_use_certificate(c, x) : SSL_CTX_add1_chain_cert(c, x);
  }));
  EvpKeyPtr key = ParsePemPrivateKey(pem.key);
  if (!key) {
    return InvalidArgumentError(
        fmt::format("{} holds no readable (unencrypted) private key: {}", files.key_file, SslErrors()));
  }
  if (SSL_CTX_use_PrivateKey(c, key.get()) != 1 || SSL_CTX_check_private_key(c) != 1) {
    return InvalidArgumentError(fmt::format("the key in {} does not belong to the certificate in {}: {}",
                                            files.key_file, files.cert_file, SslErrors()));
  }
  if (!pem.ca.empty()) {
    // A client certificate chaining to this CA is required.
    X509_STORE* store = SSL_CTX_get_cert_store(c);
    STACK_OF(X509_NAME)* names = sk_X509_NAME_new_null();
    if (store == nullptr || names == nullptr) return InternalError("TLS CA store: " + SslErrors());
    Status st = EachCert(pem.ca, files.ca_file, [&](X509* x, bool) {
      X509_NAME* n = X509_NAME_dup(X509_get_subject_name(x));
      if (n == nullptr || sk_X509_NAME_push(names, n) <= 0) {
        X509_NAME_free(n);
        return 0;
      }
      return X509_STORE_add_cert(store, x);
    });
    if (!st.ok()) {
      sk_X509_NAME_pop_free(names, X509_NAME_free);
      return st;
    }
    SSL_CTX_set_client_CA_list(c, names);  // takes `names`
    SSL_CTX_set_verify(c, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  } else {
    SSL_CTX_set_verify(c, SSL_VERIFY_NONE, nullptr);
  }
  return ctx;
}

Result<std::unique_ptr<H2TlsContext>> H2TlsContext::Create(const TlsFiles& files) {
  std::unique_ptr<H2TlsContext> t(new H2TlsContext(files));
  const std::string fp = t->Fingerprint();
  TANDEM_ASSIGN_OR_RETURN(t->ctx_, NewPublicServerContext(files));
  t->loaded_ = fp;
  t->checked_ = std::chrono::steady_clock::now();
  return t;
}

SSL* H2TlsContext::NewSsl() {
  std::lock_guard lock(mu_);
  return SSL_new(ctx_.get());  // holds a reference: a reload leaves it alone
}

std::string H2TlsContext::Fingerprint() const {
  std::string out;
  for (const std::string* f : {&files_.cert_file, &files_.key_file, &files_.ca_file}) {
    struct stat st {};
    if (f->empty() || stat(f->c_str(), &st) != 0) {
      out += "-;";
      continue;
    }
    out += fmt::format("{}:{}:{}.{}:{};", st.st_ino, st.st_size, st.st_mtim.tv_sec,
                       st.st_mtim.tv_nsec, st.st_dev);
  }
  return out;
}

Status H2TlsContext::Reload() {
  const std::string fp = Fingerprint();
  auto ctx = NewPublicServerContext(files_);
  std::lock_guard lock(mu_);
  checked_ = std::chrono::steady_clock::now();
  if (!ctx.ok()) {
    failed_ = fp;
    return ctx.status();
  }
  ctx_ = std::move(ctx).value();
  loaded_ = fp;
  failed_.clear();
  return Status::Ok();
}

void H2TlsContext::MaybeReload(std::chrono::steady_clock::time_point now) {
  std::string fp;
  {
    std::lock_guard lock(mu_);
    if (now - checked_ < std::chrono::seconds(kCheckSeconds)) return;
    checked_ = now;
    fp = Fingerprint();
    // Unchanged, or the same files that failed already (logged once).
    if (fp == loaded_ || fp == failed_) return;
  }
  if (Status st = Reload(); st.ok()) {
    spdlog::info("gRPC (native): the public TLS certificate files changed; new connections get "
                 "the new certificate");
  } else {
    spdlog::error("gRPC (native): the public TLS certificate files changed but do not load "
                  "(the old certificate stays): {}",
                  st.message());
  }
}

}  // namespace tandem::proxy::h2
