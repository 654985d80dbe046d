// One HTTP connection's byte stream: a TCP socket, with TLS on top when the
// public plane has it (security.public_tls; docs/security.md). Beast reads
// and writes it like any AsyncStream; the session does not care which.
//
// The TLS context is shared: sessions keep the one they started with, so a
// certificate reload (SIGHUP) changes only new connections and drops none.
//
// Thread-safety: as tcp::socket (use from the connection's strand).
#pragma once

// <utility> before Asio: Boost 1.74's awaitable.hpp uses std::exchange
// without including it (an error under C++20).
#include <memory>
#include <optional>
#include <utility>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>

#include "common/status.h"
#include "common/tls.h"

namespace tandem::http {

class HttpStream {
 public:
  using tcp = boost::asio::ip::tcp;
  using executor_type = tcp::socket::executor_type;

  // `tls` null: plaintext.
  HttpStream(tcp::socket socket, std::shared_ptr<boost::asio::ssl::context> tls)
      : socket_(std::move(socket)), context_(std::move(tls)) {
    if (context_) tls_.emplace(socket_, *context_);
  }
  HttpStream(const HttpStream&) = delete;
  HttpStream& operator=(const HttpStream&) = delete;

  executor_type get_executor() { return socket_.get_executor(); }
  tcp::socket& socket() { return socket_; }
  bool tls() const { return tls_.has_value(); }

  // The server side of the TLS handshake; plaintext: completes at once.
  template <class Handler>
  void async_handshake(Handler&& handler) {
    if (tls_) {
      tls_->async_handshake(boost::asio::ssl::stream_base::server, std::forward<Handler>(handler));
    } else {
      boost::asio::post(socket_.get_executor(),
                        [h = std::forward<Handler>(handler)]() mutable {
                          h(boost::system::error_code());
                        });
    }
  }

  // Ends TLS on our side: sends close_notify (RFC 8446 6.1: each side sends
  // it before closing its write side) without waiting for the client's,
  // then runs `handler` (the alert written, or the write failed). The
  // client's close_notify is marked as received first, so the shutdown
  // only writes (as async_write_some: never beside another write) and
  // afterwards a TLS read ends at once; what the client still sends is
  // read from socket() if at all. Before the handshake is done, and in
  // plaintext, `handler` runs at once (posted).
  template <class Handler>
  void async_close_notify(Handler&& handler) {
    if (tls_ && SSL_is_init_finished(tls_->native_handle())) {
      SSL* ssl = tls_->native_handle();
      SSL_set_shutdown(ssl, SSL_get_shutdown(ssl) | SSL_RECEIVED_SHUTDOWN);
      tls_->async_shutdown(std::forward<Handler>(handler));
    } else {
      boost::asio::post(socket_.get_executor(), [h = std::forward<Handler>(handler)]() mutable {
        h(boost::system::error_code());
      });
    }
  }

  template <class Buffers, class Handler>
  void async_read_some(const Buffers& buffers, Handler&& handler) {
    if (tls_) {
      tls_->async_read_some(buffers, std::forward<Handler>(handler));
    } else {
      socket_.async_read_some(buffers, std::forward<Handler>(handler));
    }
  }

  template <class Buffers, class Handler>
  void async_write_some(const Buffers& buffers, Handler&& handler) {
    if (tls_) {
      tls_->async_write_some(buffers, std::forward<Handler>(handler));
    } else {
      socket_.async_write_some(buffers, std::forward<Handler>(handler));
    }
  }

 private:
  tcp::socket socket_;
  std::shared_ptr<boost::asio::ssl::context> context_;  // kept alive for tls_
  std::optional<boost::asio::ssl::stream<tcp::socket&>> tls_;
};

// A server TLS context from PEM files: files.cert_file/key_file, and with
// files.ca_file set, client certificates of that CA are required. TLS 1.2
// and 1.3 only. Errors name the file.
Result<std::shared_ptr<boost::asio::ssl::context>> MakeServerTlsContext(const TlsFiles& files);

}  // namespace tandem::http
