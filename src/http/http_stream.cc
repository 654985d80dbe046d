#include "http/http_stream.h"

#include <fmt/format.h>

namespace tandem::http {

namespace ssl = boost::asio::ssl;

Result<std::shared_ptr<ssl::context>> MakeServerTlsContext(const TlsFiles& files) {
  if (files.cert_file.empty() || files.key_file.empty()) {
    return InvalidArgumentError("HTTP TLS needs a certificate file and a key file");
  }
  TANDEM_ASSIGN_OR_RETURN(TlsPem pem, ReadTlsFiles(files));
  auto ctx = std::make_shared<ssl::context>(ssl::context::tls_server);
  boost::system::error_code ec;
  ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                       ssl::context::no_sslv3 | ssl::context::no_tlsv1 |
                       ssl::context::no_tlsv1_1 | ssl::context::single_dh_use,
                   ec);
  if (ec) return InternalError(fmt::format("TLS context options: {}", ec.message()));
  ctx->use_certificate_chain(boost::asio::buffer(pem.cert), ec);
  if (ec) return InvalidArgumentError(fmt::format("{}: {}", files.cert_file, ec.message()));
  ctx->use_private_key(boost::asio::buffer(pem.key), ssl::context::pem, ec);
  if (ec) return InvalidArgumentError(fmt::format("{}: {}", files.key_file, ec.message()));
  if (!pem.ca.empty()) {
    ctx->add_certificate_authority(boost::asio::buffer(pem.ca), ec);
    if (ec) return InvalidArgumentError(fmt::format("{}: {}", files.ca_file, ec.message()));
    ctx->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert, ec);
    if (ec) return InternalError(fmt::format("TLS verify mode: {}", ec.message()));
  }
  return ctx;
}

}  // namespace tandem::http
