#include "proxy/h2/h2_io.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "common/tls_pem.h"

namespace tandem::proxy::h2 {

std::string PeerAddress(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
  inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
  return std::string(host) + ":" + std::to_string(ntohs(a->sin_port));
}

H2Io::H2Io(int fd, SSL* ssl) : fd_(fd), ssl_(ssl), ready_(ssl == nullptr) {
  if (ssl_ == nullptr) return;
  rbio_ = BIO_new(BIO_s_mem());
  wbio_ = BIO_new(BIO_s_mem());
  if (rbio_ == nullptr || wbio_ == nullptr) {
    BIO_free(rbio_);
    BIO_free(wbio_);
    rbio_ = wbio_ = nullptr;
    return;  // Read reports the failure
  }
  // An empty read BIO means "more to come", not end of stream.
  BIO_set_mem_eof_return(rbio_, -1);
  SSL_set_bio(ssl_, rbio_, wbio_);  // ssl_ owns both now
  SSL_set_accept_state(ssl_);
}

H2Io::~H2Io() {
  if (ssl_ != nullptr) SSL_free(ssl_);
}

void H2Io::LogFailure(const char* what) {
  const std::string errors = DrainOpenSslErrors();
  spdlog::warn("gRPC (native): TLS {} with {} failed{}{}", what, PeerAddress(fd_),
               errors.empty() ? "" : ": ", errors);
}

H2Io::Fill H2Io::FillFromSocket(uint8_t* scratch, size_t cap) {
  if (socket_drained_) {  // the last recv() was short: the socket is empty
    socket_drained_ = false;
    return Fill::kAgain;
  }
  // Into the caller's buffer, which the read BIO copies from (no buffer of
  // our own: a thread_local one would grow every thread's static TLS).
  for (;;) {
    const ssize_t n = recv(fd_, scratch, cap, MSG_DONTWAIT);
    if (n > 0) {
      if (BIO_write(rbio_, scratch, static_cast<int>(n)) != static_cast<int>(n)) {
        LogFailure("buffering");
        return Fill::kClosed;
      }
      socket_drained_ = static_cast<size_t>(n) < cap;
      return Fill::kData;
    }
    if (n == 0) return Fill::kClosed;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK ? Fill::kAgain : Fill::kClosed;
  }
}

bool H2Io::Handshake(uint8_t* scratch, size_t cap, Got* got) {
  for (;;) {
    ERR_clear_error();
    const int r = SSL_do_handshake(ssl_);
    if (r == 1) break;
    const int e = SSL_get_error(ssl_, r);
    if (e == SSL_ERROR_WANT_READ) {
      const Fill f = FillFromSocket(scratch, cap);
      if (f == Fill::kData) continue;
      got->closed = f == Fill::kClosed;
      return false;  // the rest of the client's flight later (replies are pending())
    }
    LogFailure("handshake");
    bool blocked = false;
    SendRecords(&blocked);  // the alert, best effort, so the client learns why
    got->closed = true;
    return false;
  }
  const unsigned char* proto = nullptr;
  unsigned int len = 0;
  SSL_get0_alpn_selected(ssl_, &proto, &len);
  if (len != 2 || std::memcmp(proto, "h2", 2) != 0) {
    // (A client offering ALPN without "h2" failed the handshake already.)
    spdlog::warn("gRPC (native): refused the TLS client {}: it did not offer ALPN \"h2\" "
                 "(gRPC over TLS negotiates HTTP/2 with ALPN)",
                 PeerAddress(fd_));
    got->closed = true;
    return false;
  }
  ready_ = true;
  return true;
}

H2Io::Got H2Io::Read(uint8_t* buf, size_t cap) {
  Got got;
  if (ssl_ == nullptr) {
    for (;;) {
      const ssize_t n = recv(fd_, buf, cap, MSG_DONTWAIT);
      if (n > 0) {
        got.n = static_cast<size_t>(n);
      } else if (n == 0) {
        got.closed = true;  // the client closed
      } else if (errno == EINTR) {
        continue;
      } else {
        got.closed = errno != EAGAIN && errno != EWOULDBLOCK;
      }
      return got;
    }
  }
  if (rbio_ == nullptr) {
    spdlog::warn("gRPC (native): TLS: BIO_new failed");
    got.closed = true;
    return got;
  }
  if (!ready_ && !Handshake(buf, cap, &got)) return got;
  for (;;) {
    ERR_clear_error();
    size_t n = 0;
    const int r = SSL_read_ex(ssl_, buf, cap, &n);
    if (r == 1) {
      got.n = n;
      return got;
    }
    const int e = SSL_get_error(ssl_, r);
    if (e == SSL_ERROR_WANT_READ) {
      const Fill f = FillFromSocket(buf, cap);
      if (f == Fill::kData) continue;
      got.closed = f == Fill::kClosed;
      return got;
    }
    if (e == SSL_ERROR_ZERO_RETURN) {  // close_notify
      got.closed = true;
      return got;
    }
    // A bad record, an unexpected message: the connection is over.
    LogFailure("read");
    got.closed = true;
    return got;
  }
}

void H2Io::CloseNotify() {
  if (ssl_ == nullptr || wbio_ == nullptr) return;
  ERR_clear_error();
  // After a fatal alert (sent or received) SSL_shutdown sends nothing.
  if (SSL_is_init_finished(ssl_) && (SSL_get_shutdown(ssl_) & SSL_SENT_SHUTDOWN) == 0) {
    SSL_shutdown(ssl_);
  }
  ERR_clear_error();
  bool blocked = false;
  SendRecords(&blocked);
}

bool H2Io::pending() const {
  return out_off_ < out_.size() || (wbio_ != nullptr && BIO_ctrl_pending(wbio_) > 0);
}

int H2Io::record_overhead() const {
  if (ssl_ == nullptr) return 0;
  // TLS 1.3: header 5 + content type 1 + tag 16; TLS 1.2 GCM: 5 + nonce 8 + tag 16.
  return SSL_version(ssl_) == TLS1_3_VERSION ? 22 : 29;
}

bool H2Io::SendRecords(bool* blocked) {
  *blocked = false;
  if (out_off_ == out_.size() && BIO_ctrl_pending(wbio_) > 0) {
    // Straight from the write BIO (no copy) when nothing older waits.
    char* data = nullptr;
    const long len = BIO_get_mem_data(wbio_, &data);
    size_t off = 0;
    while (off < static_cast<size_t>(len)) {
      const ssize_t w = send(fd_, data + off, static_cast<size_t>(len) - off,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
        break;
      }
      off += static_cast<size_t>(w);
      if (off < static_cast<size_t>(len)) break;  // partial: the socket is full
    }
    if (off < static_cast<size_t>(len)) {
      out_.clear();
      out_off_ = 0;
      out_.assign(data + off, static_cast<size_t>(len) - off);
      *blocked = true;
    }
    if (BIO_reset(wbio_) != 1) {
      LogFailure("buffer reset");
      return false;
    }
    return true;
  }
  if (BIO_ctrl_pending(wbio_) > 0) {
    // Behind older records: append.
    const size_t n = BIO_ctrl_pending(wbio_);
    const size_t at = out_.size();
    out_.resize(at + n);
    if (BIO_read(wbio_, out_.data() + at, static_cast<int>(n)) != static_cast<int>(n)) {
      LogFailure("buffer read");
      return false;
    }
  }
  while (out_off_ < out_.size()) {
    const ssize_t w =
        send(fd_, out_.data() + out_off_, out_.size() - out_off_, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
      *blocked = true;
      return true;
    }
    out_off_ += static_cast<size_t>(w);
    if (out_off_ < out_.size()) {
      *blocked = true;
      return true;
    }
  }
  out_.clear();
  out_off_ = 0;
  return true;
}

ssize_t H2Io::Write(const uint8_t* data, size_t len, bool* blocked) {
  *blocked = false;
  if (ssl_ == nullptr) {
    for (;;) {
      const ssize_t w = send(fd_, data, len, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
        *blocked = true;
        return 0;
      }
      *blocked = static_cast<size_t>(w) < len;
      return w;
    }
  }
  if (wbio_ == nullptr) return -1;
  if (!SendRecords(blocked)) return -1;
  if (*blocked || len == 0 || !ready_) return 0;
  ERR_clear_error();
  size_t took = 0;
  if (const int r = SSL_write_ex(ssl_, data, len, &took); r != 1) {
    const int e = SSL_get_error(ssl_, r);
    // Renegotiation is off, so no write waits for a read; the write BIO
    // (memory) never refuses. Anything else ends the connection.
    if (e == SSL_ERROR_WANT_READ) return 0;  // retried after the next read
    LogFailure("write");
    return -1;
  }
  if (!SendRecords(blocked)) return -1;
  return static_cast<ssize_t>(took);
}

}  // namespace tandem::proxy::h2
