// The byte stream under one H2Connection (docs/grpc-frontend.md "TLS"): a
// plain non-blocking socket, or TLS (OpenSSL) over it.
//
// TLS runs on memory BIOs: the connection does its own recv()/send(), so a
// flush is still ONE send() of every record that is ready and a read one
// recv() of what the socket holds, as in plaintext; OpenSSL only encrypts
// and decrypts. The handshake is non-blocking and driven by Read (the
// event thread reads every connection; bytes it must answer wait in the
// outgoing buffer: pending()). After the handshake ALPN must have selected
// "h2"; a client that offered no ALPN is refused with a log line.
//
// Thread-safety: none. The connection calls every method under its mutex
// (an SSL must not see SSL_read and SSL_write at once).
#pragma once

#include <openssl/ssl.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace tandem::proxy::h2 {

// "host:port" of the socket's peer, for log lines ("?" if unknown).
std::string PeerAddress(int fd);

class H2Io {
 public:
  // `ssl` null: plaintext. Otherwise TLS, taking `ssl` (from
  // H2TlsContext::NewSsl) in the accept state.
  H2Io(int fd, SSL* ssl);
  ~H2Io();
  H2Io(const H2Io&) = delete;
  H2Io& operator=(const H2Io&) = delete;

  bool tls() const { return ssl_ != nullptr; }
  // Application bytes may flow (plaintext: always; TLS: after the handshake).
  bool ready() const { return ready_; }

  struct Got {
    size_t n = 0;         // application bytes read
    bool closed = false;  // the peer closed, or the connection failed (logged when worth it)
  };
  // Reads application bytes into `buf` without blocking (TLS: the raw
  // bytes pass through `buf` first); n == 0 and !closed: nothing
  // now. Drives the TLS handshake. In plaintext a short read means the
  // socket is drained; with TLS, call until n == 0 (decrypted bytes may be
  // buffered where epoll does not see them).
  Got Read(uint8_t* buf, size_t cap);

  // Writes application bytes without blocking (TLS: first the records not
  // yet sent). Returns how many were taken (may be 0), or -1 when the
  // socket failed. *blocked: the socket is full (wait for EPOLLOUT).
  ssize_t Write(const uint8_t* data, size_t len, bool* blocked);
  // TLS records not yet handed to the socket (handshake replies included).
  bool pending() const;
  // Before the socket closes. TLS: after the handshake, queues close_notify
  // (RFC 8446 6.1: each side sends it before closing its write side, unless
  // it sent an error alert; a client reading to the end then tells a
  // complete stream from a cut one), then hands every record still waiting
  // (it, or the fatal alert OpenSSL queued on a bad record) to the socket
  // in one send that does not block: what a full socket does not take is
  // dropped with the connection. Plaintext: nothing.
  void CloseNotify();

  // Bytes one TLS record adds to what it carries (the quiet-reading
  // low-water mark counts a client write as one record); 0 in plaintext.
  int record_overhead() const;

 private:
  enum class Fill { kData, kAgain, kClosed };
  // One recv() (into `scratch`, then the read BIO).
  Fill FillFromSocket(uint8_t* scratch, size_t cap);
  bool SendRecords(bool* blocked);  // false: the socket failed
  bool Handshake(uint8_t* scratch, size_t cap, Got* got);  // false: stop (got says why)
  void LogFailure(const char* what);

  const int fd_;
  SSL* const ssl_;
  BIO* rbio_ = nullptr;  // owned by ssl_
  BIO* wbio_ = nullptr;  // owned by ssl_
  bool ready_;
  bool socket_drained_ = false;  // the last recv() was short: nothing more there
  std::string out_;              // records the socket did not take yet
  size_t out_off_ = 0;
};

}  // namespace tandem::proxy::h2
