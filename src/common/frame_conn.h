// A framed TCP connection (issue 23, docs/decode-stream.md "Transport"):
// length-prefixed protobuf messages over one TCP socket, with OpenSSL mutual
// TLS when the internal plane is TLS (docs/security.md). It carries the
// decoder <-> proxy decode stream without gRPC's per-message machinery.
//
// Frame: u32 little-endian payload length, then the serialized message. A
// frame over `max_frame_bytes` is refused: the sender gets an error for it
// (the connection stays), a receiver that reads such a header closes the
// connection with an error naming the length and the limit.
//
// Sends never block the caller: Send writes what the socket takes at once
// (one write per frame, or per backlog of frames) and keeps the rest in a
// per-connection buffer that the connection's I/O thread flushes when the
// socket is writable. A backlog over `max_buffered_bytes` means the peer
// does not read fast enough: the connection is closed (the peer then sees
// the stream break).
//
// TLS: one SSL object is never used by two threads at once: every SSL call
// happens under the connection's mutex; the I/O thread waits for readiness
// (poll) outside it. After a TLS 1.3 handshake the connection seals and
// opens its records itself (common/frame_tls_records.h), on the same wire;
// OpenSSL keeps only the handshake's results (the peer's certificate).
//
// Locking (issue 23): the mutex guards the state and the output side (the
// frames queued, the records sealed, their sequence numbers, the socket's
// writes), so two senders never interleave bytes of a frame or of a record.
// The input side is the I/O thread's own: with records sealed here, or over
// plaintext, it reads the socket and opens records without the mutex, so a
// Send from another thread never waits for the reader's read (nor the
// reader for a Send of a 32 kB prompt); only a connection left on OpenSSL's
// SSL_read / SSL_write reads under it (one SSL object).
//
// Threads: Send and Close from any thread. Connect, Events and Progress
// from the one I/O thread that owns the connection (FrameServer's, or the
// client's reader).
#pragma once

#include <netdb.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/frame_tls_records.h"
#include "common/status.h"
#include "common/tls.h"

namespace google::protobuf {
class MessageLite;
}

namespace tandem {

struct FrameOptions {
  uint32_t max_frame_bytes = 64u << 20;      // one message, either way
  uint64_t max_buffered_bytes = 64u << 20;   // unsent output before the peer counts as too slow
  std::chrono::milliseconds handshake_timeout{10000};  // connect + TLS handshake
  // A client's TCP connect to one of its peer's addresses that is still
  // pending after this (at most: after its share of the time left, that
  // time over the addresses not yet tried) is abandoned for the next
  // address; the last address has all the time left. An address that
  // drops SYNs silently then costs this much, not the whole deadline.
  std::chrono::milliseconds connect_attempt_timeout{1000};
  // How a client resolves its peer's name (getaddrinfo; a test may put a
  // slow one here).
  int (*lookup)(const char* host, const char* port, const addrinfo* hints, addrinfo** res) = nullptr;
};

// The TLS side of framed connections: SSL contexts built from the process's
// internal-plane PEM identity (the same files as its gRPC credentials).
// Servers require and verify a client certificate of the fleet CA; clients
// verify the server's certificate against the CA and the dialled host.
class FrameTls {
 public:
  static Result<std::shared_ptr<FrameTls>> Create(const TlsPem& pem);
  ~FrameTls();
  FrameTls(const FrameTls&) = delete;
  FrameTls& operator=(const FrameTls&) = delete;

  SSL* NewServer() const;
  // Verifies the server against `host` (an IP address or a DNS name).
  SSL* NewClient(const std::string& host) const;

 private:
  FrameTls() = default;
  SSL_CTX* server_ = nullptr;
  SSL_CTX* client_ = nullptr;
};

// The framed-connection TLS of a process's internal plane: null when it is
// plaintext (security.internal_tls off).
Result<std::shared_ptr<FrameTls>> InternalFrameTls(const RpcCredentials& credentials);

class FrameConn {
 public:
  // A frame read; a non-OK status closes the connection with it.
  using OnFrame = std::function<Status(std::string_view payload)>;

  // An accepted socket (non-blocking); `tls` null = plaintext.
  static std::shared_ptr<FrameConn> Accepted(int fd, const FrameTls* tls, FrameOptions options,
                                             std::string peer);
  // A connection to `address` ("host:port"), dialled by Connect().
  static std::shared_ptr<FrameConn> Client(std::string address, std::shared_ptr<FrameTls> tls,
                                           FrameOptions options);
  ~FrameConn();
  FrameConn(const FrameConn&) = delete;
  FrameConn& operator=(const FrameConn&) = delete;

  // ---- any thread ----
  // Queues `msg` as one frame and writes what the socket takes now. Errors:
  // INVALID_ARGUMENT for a frame over the limit (nothing sent, connection
  // kept); UNAVAILABLE when the connection is closed, or closes it because
  // the backlog went over the bound.
  Status Send(const google::protobuf::MessageLite& msg);
  // The same for a frame whose payload is the concatenation of `parts`,
  // already encoded by the caller (e.g. a message's small fields, then a
  // packed field's bytes straight from where the caller keeps them): each
  // part is copied once, into the connection's output.
  Status SendParts(std::initializer_list<std::string_view> parts);
  // Ends the connection (idempotent): later Sends fail with `why`, the I/O
  // thread's next Progress returns it. The socket is shut down (which wakes
  // a poll on it) and closed with the object.
  void Close(const Status& why);
  bool closed() const;
  // Called (from Send's thread, outside the lock) when output is left for
  // the I/O thread to flush, so that it polls for POLLOUT; set before use.
  void SetWake(std::function<void()> wake) { wake_ = std::move(wake); }
  const std::string& peer() const { return peer_; }
  // True once connected and (with TLS) authenticated.
  bool open() const;
  // True when the connection seals and opens its TLS records itself
  // (common/frame_tls_records.h), false over plaintext, before the
  // handshake, or when it stays on OpenSSL's SSL_read / SSL_write.
  bool sealing_records() const;
  // The common name of the peer's verified certificate; "" over plaintext,
  // before the handshake or once closed (the proxy's framed Register binds
  // a worker name to it, as gRPC's x509_common_name; docs/security.md).
  std::string PeerCommonName() const;

  // ---- any thread, before Connect ----
  // Client: resolves the peer's host (getaddrinfo, which may wait on DNS)
  // and keeps its addresses (the first kMaxAddresses, in getaddrinfo's
  // order), or the error, for Connect. Idempotent. Where one
  // thread serves many connections (common/frame_loop.h), the name is
  // resolved on another thread first (NeedsLookup), so that a slow DNS
  // answer holds up no other connection.
  void Lookup();
  // True when Connect would have to resolve a name: the host is not an IP
  // literal and Lookup has not run.
  bool NeedsLookup() const;

  // ---- the I/O thread ----
  // Client: resolves the address unless Lookup did, and starts a
  // non-blocking connect to the first address. When the TCP connect to an
  // address fails (refused, unreachable, reset: at once or when Progress
  // sees it complete), or is still pending at its attempt deadline
  // (FrameOptions::connect_attempt_timeout: Progress, run then without an
  // event, abandons it as timed out), the next one is dialled on a new
  // socket, without a new lookup; after the last, the connection closes
  // with an error naming the peer and each address tried with its error.
  // A TLS handshake that fails after TCP connected moves on to no other
  // address.
  Status Connect();
  // The socket: a fallback to the next address replaces it (dials() counts
  // the sockets opened, so that an epoll registration can be redone).
  int fd() const { return fd_; }
  uint32_t dials() const { return dials_; }
  static constexpr size_t kMaxAddresses = 8;
  // The poll events to wait for now.
  short Events() const;
  // After poll: connects, handshakes, reads frames (each handed to
  // `on_frame` outside the lock, in order) and flushes output. Non-OK once
  // the connection is over (error, the peer closed it, or Close).
  Status Progress(short revents, const OnFrame& on_frame);
  // When the connect + handshake must be done by (steady clock).
  std::chrono::steady_clock::time_point handshake_deadline() const { return deadline_; }
  // While not open: when Progress must run even without an event (steady
  // clock): the pending TCP connect's attempt deadline, which is at most
  // handshake_deadline() (that, for the last address and the handshake).
  std::chrono::steady_clock::time_point progress_deadline() const {
    return state_ == State::kConnecting ? attempt_deadline_ : deadline_;
  }
  // Past handshake_deadline() and not open: closes the connection and
  // returns why (UNAVAILABLE): each address's error, the pending one as
  // timed out, while the TCP connect is pending; else that no
  // authenticated connection came within the timeout.
  Status Expire();

 private:
  enum class State { kIdle, kConnecting, kHandshake, kOpen, kClosed };
  FrameConn(FrameOptions options, std::string peer) : options_(options), peer_(std::move(peer)) {}
  void CloseLocked(const Status& why);
  // Client: starts a non-blocking connect to the next address not tried
  // (a TCP connect that fails at once counts as tried); closes the
  // connection with every address's error when none is left.
  Status DialLocked();
  // A TCP connect to the address dialled last failed with `err`.
  void NoteDialFailedLocked(int err);
  void FlushLocked();
  // Queues a frame of `size` payload bytes that `write` writes (to the
  // pointer it is given) and flushes: Send and SendParts.
  template <typename Write>
  Status SendFrame(size_t size, const Write& write);
  // The I/O thread, once open: reads what the socket has into in_; false
  // once the connection is closed (EOF/error; closed_why_ says why).
  // Plaintext and records without the mutex (the input side is the I/O
  // thread's), OpenSSL's SSL_read under it.
  bool ReadPlain();
  bool ReadRecords();
  bool ReadSslLocked();
  // One recv into `p`: the count; 0 when the socket has nothing now; -1
  // when the connection ended (closed, naming the EOF or the error).
  ssize_t RecvSome(void* p, size_t bytes);
  // Writes from `p` what the socket takes now: the count; 0 when it takes
  // nothing (write_blocked_ set, for POLLOUT); -1 when it failed (closed).
  ssize_t SendLocked(const void* p, size_t bytes);
  // FlushLocked once records_ seals and opens the records.
  void FlushRecordsLocked();
  // After the handshake: the record layer, or stays on OpenSSL.
  void StartRecordsLocked();
  Status TlsError(const char* what, int ret);
  // One SSL_read / SSL_write (`io`) without clearing the thread's OpenSSL
  // error queue first (ERR_clear_error per call is a cost per decode step,
  // issue 23): an answer with bytes never looks at the queue. A failed
  // answer is believed only with the queue cleared first (an entry some
  // earlier TLS call on this thread left behind turns any answer into
  // SSL_ERROR_SSL): then `io` runs again on an empty queue (OpenSSL wants a
  // failed call repeated with the same arguments anyway), and `first`
  // keeps the first answer's reason.
  template <typename Io>
  int SslIoLocked(const char* what, Io io, Status* first);
  // The status that a failed SslIoLocked (answer `ret`) closes with.
  Status SslIoError(const char* what, int ret, const Status& first);

  const FrameOptions options_;
  const std::string peer_;  // "host:port"
  std::shared_ptr<FrameTls> tls_;  // client: kept for NewClient
  const FrameTls* server_tls_ = nullptr;
  std::function<void()> wake_;
  std::chrono::steady_clock::time_point deadline_;

  mutable std::mutex mu_;
  int fd_ = -1;
  struct PeerAddr {
    sockaddr_storage addr{};
    socklen_t len = 0;
  };
  bool looked_up_ = false;             // guarded by mu_: Lookup ran; then peer_addrs_ or lookup_error_
  bool named_ = false;                 // guarded by mu_: the host is a name, not an IP literal
  std::vector<PeerAddr> peer_addrs_;   // guarded by mu_: in getaddrinfo's order
  Status lookup_error_;                // guarded by mu_
  size_t next_addr_ = 0;               // guarded by mu_: the next of peer_addrs_ to dial
  std::string dial_errors_;            // guarded by mu_: "ADDR ERROR; ..." for each address tried
  uint32_t dials_ = 0;                 // guarded by mu_ (the I/O thread reads it without)
  // guarded by mu_ (the I/O thread reads it without): when the pending TCP
  // connect is abandoned for the next address.
  std::chrono::steady_clock::time_point attempt_deadline_;
  // Set before the connection is shared or by the I/O thread (under mu_,
  // which the I/O thread may skip to read them); SSL calls under mu_.
  SSL* ssl_ = nullptr;
  // guarded by mu_: the handshake's secrets (until it is done), then the
  // records sealed and opened here (null: OpenSSL's, or plaintext), set as
  // ssl_; sealing under mu_, opening by the I/O thread alone.
  std::unique_ptr<FrameTlsSecrets> secrets_;
  std::unique_ptr<FrameTlsRecords> records_;
  std::vector<uint8_t> sealed_;        // guarded by mu_: records not yet written, [sealed_off_, sealed_len_)
  size_t sealed_len_ = 0;              // guarded by mu_
  size_t sealed_off_ = 0;              // guarded by mu_
  std::vector<uint8_t> raw_;           // I/O thread only: records read, [raw_off_, raw_len_)
  size_t raw_len_ = 0;                 // I/O thread only
  size_t raw_off_ = 0;                 // I/O thread only
  std::atomic<State> state_{State::kIdle};  // written under mu_; read without it for a glance
  Status closed_why_;                  // guarded by mu_
  std::string out_;                    // guarded by mu_: frames not yet written, from out_off_
  size_t out_off_ = 0;                 // guarded by mu_
  int ssl_retry_len_ = 0;              // guarded by mu_: an SSL_write to repeat with this length
  // Written under mu_: output waits for POLLOUT (Events reads it without
  // the lock: a Send that sets it wakes the I/O thread).
  std::atomic<bool> write_blocked_{false};
  bool handshake_wants_write_ = false;  // I/O thread only
  std::string in_;                     // I/O thread only: bytes read, from in_off_ to in_len_
  size_t in_len_ = 0;                  // I/O thread only: in_'s bytes in use (in_ may be longer)
  size_t in_off_ = 0;                  // I/O thread only
};

}  // namespace tandem
