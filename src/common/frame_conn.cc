#include "common/frame_conn.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <google/protobuf/message_lite.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/net.h"
#include "common/tls_pem.h"

namespace tandem {
namespace {

constexpr size_t kHeaderBytes = 4;
constexpr size_t kReadChunkBytes = 64 << 10;

// Room for one read chunk at the end of `in` (bytes in use from `off` to
// `len`; a buffer read to its end starts over): where the read goes. Grown
// (and zero-filled) only when too small, not once per read.
size_t MakeReadRoom(std::string& in, size_t& off, size_t& len) {
  if (off > 0 && off == len) {
    len = 0;
    off = 0;
  }
  if (in.size() < len + kReadChunkBytes) in.resize(len + kReadChunkBytes);
  return len;
}
// Plaintext sealed per round of a flush (16 records of 2^14 bytes).
constexpr size_t kSealChunkBytes = 256 << 10;

std::string OpenSslErrors() {
  std::string out = DrainOpenSslErrors();
  return out.empty() ? "no OpenSSL error queued" : out;
}

bool IsIpAddress(const std::string& host) {
  in6_addr a6;
  in_addr a4;
  return inet_pton(AF_INET, host.c_str(), &a4) == 1 || inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

// Every certificate in `pem`, in order (common/tls_pem.h).
Status ForEachCert(const std::string& pem, const char* what,
                   const std::function<Status(X509*)>& fn) {
  TANDEM_ASSIGN_OR_RETURN(std::vector<X509Ptr> certs, ParsePemCertificates(pem));
  ERR_clear_error();
  if (certs.empty()) return InvalidArgumentError(fmt::format("the {} holds no certificate", what));
  for (const X509Ptr& x : certs) TANDEM_RETURN_IF_ERROR(fn(x.get()));
  return Status::Ok();
}

Status SetupContext(SSL_CTX* ctx, const TlsPem& pem) {
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  bool first = true;
  TANDEM_RETURN_IF_ERROR(ForEachCert(pem.cert, "certificate", [&](X509* x) {
    const int ok = first ? SSL_CTX_use_certificate(ctx, x) : SSL_CTX_add1_chain_cert(ctx, x);
    first = false;
    return ok == 1 ? Status::Ok() : InternalError("loading the certificate: " + OpenSslErrors());
  }));
  EvpKeyPtr key = ParsePemPrivateKey(pem.key);
  if (!key) return InvalidArgumentError("no readable private key: " + OpenSslErrors());
  const int key_ok = SSL_CTX_use_PrivateKey(ctx, key.get());
  if (key_ok != 1 || SSL_CTX_check_private_key(ctx) != 1) {
    return InvalidArgumentError("the private key does not fit the certificate: " + OpenSslErrors());
  }
  X509_STORE* store = SSL_CTX_get_cert_store(ctx);
  return ForEachCert(pem.ca, "CA file", [&](X509* x) {
    return X509_STORE_add_cert(store, x) == 1
               ? Status::Ok()
               : InternalError("loading the CA certificate: " + OpenSslErrors());
  });
}

}  // namespace

// ---------------------------------------------------------------- FrameTls

Result<std::shared_ptr<FrameTls>> FrameTls::Create(const TlsPem& pem) {
  std::shared_ptr<FrameTls> t(new FrameTls());
  t->server_ = SSL_CTX_new(TLS_server_method());
  t->client_ = SSL_CTX_new(TLS_client_method());
  if (t->server_ == nullptr || t->client_ == nullptr) {
    return InternalError("SSL_CTX_new failed: " + OpenSslErrors());
  }
  TANDEM_RETURN_IF_ERROR(SetupContext(t->server_, pem));
  TANDEM_RETURN_IF_ERROR(SetupContext(t->client_, pem));
  // Mutual TLS: a peer without a certificate of the fleet CA is refused.
  SSL_CTX_set_verify(t->server_, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  SSL_CTX_set_verify(t->client_, SSL_VERIFY_PEER, nullptr);
  // Connections are long-lived: no session tickets to write after the
  // handshake (nor any post-handshake message the record layer here would
  // have to carry: common/frame_tls_records.h).
  SSL_CTX_set_num_tickets(t->server_, 0);
  TANDEM_RETURN_IF_ERROR(SetupFrameTlsRecords(t->server_));
  TANDEM_RETURN_IF_ERROR(SetupFrameTlsRecords(t->client_));
  return t;
}

FrameTls::~FrameTls() {
  SSL_CTX_free(server_);
  SSL_CTX_free(client_);
}

// Read-ahead: a record (header and body) comes in one read() instead of
// two; ReadSslLocked reads while SSL_has_pending, so nothing stays buffered
// behind a poll() that would not report it. (AttachSecrets turns it off
// for the handshake; a connection that stays on OpenSSL gets it back.)
SSL* FrameTls::NewServer() const {
  SSL* ssl = SSL_new(server_);
  if (ssl != nullptr) SSL_set_read_ahead(ssl, 1);
  return ssl;
}

SSL* FrameTls::NewClient(const std::string& host) const {
  SSL* ssl = SSL_new(client_);
  if (ssl == nullptr) return nullptr;
  SSL_set_read_ahead(ssl, 1);
  // As gRPC does: the server's certificate must name the dialled host.
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  const bool ok = IsIpAddress(host) ? X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str()) == 1
                                    : (SSL_set1_host(ssl, host.c_str()) == 1 &&
                                       SSL_set_tlsext_host_name(ssl, host.c_str()) == 1);
  if (!ok) {
    SSL_free(ssl);
    return nullptr;
  }
  return ssl;
}

Result<std::shared_ptr<FrameTls>> InternalFrameTls(const RpcCredentials& credentials) {
  if (!credentials.secure()) return std::shared_ptr<FrameTls>();
  const TlsPem* pem = credentials.mutual_pem();
  if (pem == nullptr) {
    return FailedPreconditionError("framed internal connections need mutual TLS credentials");
  }
  return FrameTls::Create(*pem);
}

// ---------------------------------------------------------------- FrameConn

std::shared_ptr<FrameConn> FrameConn::Accepted(int fd, const FrameTls* tls, FrameOptions options,
                                               std::string peer) {
  std::shared_ptr<FrameConn> c(new FrameConn(options, std::move(peer)));
  c->fd_ = fd;
  c->server_tls_ = tls;
  c->deadline_ = std::chrono::steady_clock::now() + options.handshake_timeout;
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (tls != nullptr) {
    c->ssl_ = tls->NewServer();
    if (c->ssl_ == nullptr || SSL_set_fd(c->ssl_, fd) != 1) {
      c->CloseLocked(InternalError("SSL_new failed: " + OpenSslErrors()));
      return c;
    }
    c->secrets_ = std::make_unique<FrameTlsSecrets>();
    AttachSecrets(c->ssl_, c->secrets_.get());
    SSL_set_accept_state(c->ssl_);
    c->state_ = State::kHandshake;
  } else {
    c->state_ = State::kOpen;
  }
  return c;
}

std::shared_ptr<FrameConn> FrameConn::Client(std::string address, std::shared_ptr<FrameTls> tls,
                                             FrameOptions options) {
  std::shared_ptr<FrameConn> c(new FrameConn(options, std::move(address)));
  c->tls_ = std::move(tls);
  c->deadline_ = std::chrono::steady_clock::now() + options.handshake_timeout;
  return c;
}

FrameConn::~FrameConn() {
  if (ssl_ != nullptr) SSL_free(ssl_);
  if (fd_ >= 0) ::close(fd_);
}

void FrameConn::Lookup() {
  {
    std::lock_guard lock(mu_);
    if (looked_up_) return;
  }
  Status error;
  std::vector<PeerAddr> addrs;
  bool named = false;
  if (auto hp = ParseHostPort(peer_); !hp.ok()) {
    error = hp.status();
  } else {
    named = !IsIpAddress(hp->host);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string port = std::to_string(hp->port);
    auto* lookup = options_.lookup != nullptr ? options_.lookup : &getaddrinfo;
    if (int rc = lookup(hp->host.c_str(), port.c_str(), &hints, &res); rc != 0) {
      error = UnavailableError(fmt::format("cannot resolve {}: {}", peer_, gai_strerror(rc)));
    } else {
      for (const addrinfo* ai = res; ai != nullptr && addrs.size() < kMaxAddresses; ai = ai->ai_next) {
        PeerAddr& a = addrs.emplace_back();
        a.len = static_cast<socklen_t>(std::min<size_t>(ai->ai_addrlen, sizeof(a.addr)));
        std::memcpy(&a.addr, ai->ai_addr, a.len);
      }
      freeaddrinfo(res);
      if (addrs.empty()) error = UnavailableError(fmt::format("cannot resolve {}: no address", peer_));
    }
  }
  std::lock_guard lock(mu_);
  if (looked_up_) return;
  looked_up_ = true;
  named_ = named;
  peer_addrs_ = std::move(addrs);
  lookup_error_ = std::move(error);
}

bool FrameConn::NeedsLookup() const {
  {
    std::lock_guard lock(mu_);
    if (looked_up_) return false;
  }
  auto hp = ParseHostPort(peer_);
  if (!hp.ok()) return false;  // Connect fails at once, without a lookup
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, hp->host.c_str(), buf) != 1 && inet_pton(AF_INET6, hp->host.c_str(), buf) != 1;
}

Status FrameConn::Connect() {
  Lookup();
  std::lock_guard lock(mu_);
  if (state_ == State::kClosed) return closed_why_;
  if (!lookup_error_.ok()) {
    CloseLocked(lookup_error_);
    return closed_why_;
  }
  return DialLocked();
}

Status FrameConn::DialLocked() {
  while (next_addr_ < peer_addrs_.size()) {
    const PeerAddr& a = peer_addrs_[next_addr_++];
    if (ssl_ != nullptr) {  // bound to the socket of the address that failed
      SSL_free(ssl_);
      ssl_ = nullptr;
      secrets_.reset();
    }
    if (fd_ >= 0) ::close(fd_);
    ++dials_;
    fd_ = socket(a.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    const int rc = fd_ < 0 ? -1 : ::connect(fd_, reinterpret_cast<const sockaddr*>(&a.addr), a.len);
    const int err = errno;
    if (fd_ < 0 || (rc != 0 && err != EINPROGRESS)) {
      NoteDialFailedLocked(err);
      continue;
    }
    const int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (tls_) {
      ssl_ = tls_->NewClient(ParseHostPort(peer_)->host);  // parsed by Lookup
      if (ssl_ == nullptr || SSL_set_fd(ssl_, fd_) != 1) {
        CloseLocked(InternalError("SSL_new failed: " + OpenSslErrors()));
        return closed_why_;
      }
      secrets_ = std::make_unique<FrameTlsSecrets>();
      AttachSecrets(ssl_, secrets_.get());
      SSL_set_connect_state(ssl_);
    }
    // Its share of the time left (the addresses after it may need theirs);
    // the last one has it all.
    const auto now = std::chrono::steady_clock::now();
    const size_t addrs_left = peer_addrs_.size() - next_addr_ + 1;  // this one and those after
    attempt_deadline_ = deadline_;
    if (addrs_left > 1) {
      const auto share = std::max(deadline_ - now, std::chrono::steady_clock::duration::zero()) /
                         static_cast<int64_t>(addrs_left);
      attempt_deadline_ = now + std::min<std::chrono::steady_clock::duration>(
                                    options_.connect_attempt_timeout, share);
    }
    state_ = State::kConnecting;
    return Status::Ok();
  }
  CloseLocked(UnavailableError(fmt::format("cannot connect to {}: {}", peer_, dial_errors_)));
  return closed_why_;
}

Status FrameConn::Expire() {
  std::lock_guard lock(mu_);
  if (state_ == State::kClosed) return closed_why_;
  if (state_ != State::kConnecting) {
    CloseLocked(UnavailableError(
        fmt::format("no authenticated connection to {} within the timeout", peer_)));
    return closed_why_;
  }
  // The pending connect timed out; no address is left to try.
  NoteDialFailedLocked(ETIMEDOUT);
  next_addr_ = peer_addrs_.size();
  return DialLocked();
}

void FrameConn::NoteDialFailedLocked(int err) {
  if (!dial_errors_.empty()) dial_errors_ += "; ";
  // An IP literal: its one address is the peer's own.
  if (!named_) {
    dial_errors_ += std::strerror(err);
    return;
  }
  const PeerAddr& a = peer_addrs_[next_addr_ - 1];
  char host[INET6_ADDRSTRLEN] = "?";
  if (a.addr.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a.addr);
    inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
    dial_errors_ += fmt::format("[{}]:{} {}", host, ntohs(v6->sin6_port), std::strerror(err));
  } else {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a.addr);
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    dial_errors_ += fmt::format("{}:{} {}", host, ntohs(v4->sin_port), std::strerror(err));
  }
}

bool FrameConn::closed() const { return state_ == State::kClosed; }

bool FrameConn::open() const { return state_ == State::kOpen; }

bool FrameConn::sealing_records() const {
  std::lock_guard lock(mu_);
  return records_ != nullptr;
}

void FrameConn::Close(const Status& why) {
  std::lock_guard lock(mu_);
  CloseLocked(why);
}

void FrameConn::CloseLocked(const Status& why) {
  if (state_ == State::kClosed) return;
  state_ = State::kClosed;
  closed_why_ = why.ok() ? UnavailableError("connection closed") : why;
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);  // wakes the I/O thread's poll
  out_.clear();
  out_off_ = 0;
}

std::string FrameConn::PeerCommonName() const {
  std::lock_guard lock(mu_);
  if (ssl_ == nullptr || state_ != State::kOpen) return "";
  X509* cert = SSL_get1_peer_certificate(ssl_);
  if (cert == nullptr) return "";
  char cn[256] = "";
  const int n = X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn,
                                          sizeof(cn));
  X509_free(cert);
  return n > 0 ? std::string(cn, static_cast<size_t>(n)) : std::string();
}

template <typename Io>
int FrameConn::SslIoLocked(const char* what, Io io, Status* first) {
  int r = io();
  if (r <= 0 && ERR_peek_error() != 0) {
    *first = TlsError(what, r);  // (takes the queue's entries)
    ERR_clear_error();
    r = io();
  }
  return r;
}

Status FrameConn::SslIoError(const char* what, int ret, const Status& first) {
  // A connection that failed answers the second call with nothing queued:
  // then the first answer says why.
  const bool bare = SSL_get_error(ssl_, ret) == SSL_ERROR_SYSCALL && ERR_peek_error() == 0;
  return !first.ok() && bare ? first : TlsError(what, ret);
}

Status FrameConn::TlsError(const char* what, int ret) {
  const int e = SSL_get_error(ssl_, ret);
  std::string detail;
  if (e == SSL_ERROR_SYSCALL) {
    detail = errno != 0 ? std::strerror(errno) : "the peer closed the connection";
  } else if (e == SSL_ERROR_ZERO_RETURN) {
    detail = "the peer closed the connection";
  } else {
    detail = OpenSslErrors();
  }
  const long verify = SSL_get_verify_result(ssl_);
  if (verify != X509_V_OK) {
    detail += fmt::format(" (certificate verification: {})", X509_verify_cert_error_string(verify));
  }
  return UnavailableError(fmt::format("{} with {} failed: {}", what, peer_, detail));
}

template <typename Write>
Status FrameConn::SendFrame(size_t size, const Write& write) {
  if (size > options_.max_frame_bytes) {
    return InvalidArgumentError(fmt::format("a frame of {} bytes exceeds the limit of {} bytes",
                                            size, options_.max_frame_bytes));
  }
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    if (state_ == State::kClosed) return closed_why_;
    const uint64_t backlog = out_.size() - out_off_;
    if (backlog + kHeaderBytes + size > options_.max_buffered_bytes) {
      CloseLocked(UnavailableError(fmt::format(
          "{} does not read fast enough: {} bytes unsent would exceed the bound of {} bytes",
          peer_, backlog + kHeaderBytes + size, options_.max_buffered_bytes)));
      return closed_why_;
    }
    if (out_off_ > 0 && out_off_ == out_.size()) {
      out_.clear();
      out_off_ = 0;
    }
    const size_t at = out_.size();
    out_.resize(at + kHeaderBytes + size);
    auto* p = reinterpret_cast<uint8_t*>(out_.data() + at);
    const auto n = static_cast<uint32_t>(size);
    p[0] = static_cast<uint8_t>(n);
    p[1] = static_cast<uint8_t>(n >> 8);
    p[2] = static_cast<uint8_t>(n >> 16);
    p[3] = static_cast<uint8_t>(n >> 24);
    write(p + kHeaderBytes);
    if (state_ == State::kOpen && !write_blocked_) {
      FlushLocked();
      wake = write_blocked_;
      if (state_ == State::kClosed) return closed_why_;
    }
  }
  if (wake && wake_) wake_();
  return Status::Ok();
}

Status FrameConn::Send(const google::protobuf::MessageLite& msg) {
  return SendFrame(msg.ByteSizeLong(),
                   [&](uint8_t* p) { msg.SerializeWithCachedSizesToArray(p); });
}

Status FrameConn::SendParts(std::initializer_list<std::string_view> parts) {
  size_t size = 0;
  for (std::string_view part : parts) size += part.size();
  return SendFrame(size, [&](uint8_t* p) {
    for (std::string_view part : parts) {
      if (part.empty()) continue;
      std::memcpy(p, part.data(), part.size());
      p += part.size();
    }
  });
}

ssize_t FrameConn::SendLocked(const void* p, size_t bytes) {
  for (;;) {
    const ssize_t n = ::send(fd_, p, bytes, MSG_NOSIGNAL);
    if (n > 0) return n;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      write_blocked_ = true;
      return 0;
    }
    CloseLocked(UnavailableError(fmt::format("writing to {} failed: {}", peer_, std::strerror(errno))));
    return -1;
  }
}

void FrameConn::FlushRecordsLocked() {
  for (;;) {
    while (sealed_off_ < sealed_len_) {
      const ssize_t n = SendLocked(sealed_.data() + sealed_off_, sealed_len_ - sealed_off_);
      if (n <= 0) return;  // blocked (for POLLOUT) or closed
      sealed_off_ += static_cast<size_t>(n);
    }
    sealed_off_ = sealed_len_ = 0;
    if (out_off_ == out_.size()) break;
    const size_t take = std::min(out_.size() - out_off_, kSealChunkBytes);
    Status st = records_->Seal(reinterpret_cast<const uint8_t*>(out_.data() + out_off_), take,
                               &sealed_, &sealed_len_);
    if (!st.ok()) {
      CloseLocked(st);
      return;
    }
    out_off_ += take;
  }
  out_.clear();
  out_off_ = 0;
  write_blocked_ = false;
}

void FrameConn::FlushLocked() {
  if (records_ != nullptr) {
    FlushRecordsLocked();
    return;
  }
  while (out_off_ < out_.size()) {
    const char* p = out_.data() + out_off_;
    const size_t left = out_.size() - out_off_;
    if (ssl_ != nullptr) {
      const int len = ssl_retry_len_ > 0 ? ssl_retry_len_
                                          : static_cast<int>(std::min<size_t>(left, 1u << 30));
      // Not ERR_clear_error first (SslIoLocked): the decoder writes one
      // record per decode step, cache-cold after the step's sleep, and
      // ERR_clear_error with the OPENSSL_init_crypto it runs was ~3.8 % of
      // the decoder's CPU (issue 23).
      Status first;
      const int n = SslIoLocked("writing", [&] { return SSL_write(ssl_, p, len); }, &first);
      if (n > 0) {
        ssl_retry_len_ = 0;
        out_off_ += static_cast<size_t>(n);
        continue;
      }
      const int e = SSL_get_error(ssl_, n);
      if (e == SSL_ERROR_WANT_WRITE || e == SSL_ERROR_WANT_READ) {
        ssl_retry_len_ = len;  // OpenSSL wants the same write repeated
        write_blocked_ = true;
        return;
      }
      CloseLocked(SslIoError("writing", n, first));
      return;
    }
    const ssize_t n = SendLocked(p, left);
    if (n <= 0) return;  // blocked (for POLLOUT) or closed
    out_off_ += static_cast<size_t>(n);
  }
  out_.clear();
  out_off_ = 0;
  write_blocked_ = false;
}

void FrameConn::StartRecordsLocked() {
  if (ssl_ == nullptr || secrets_ == nullptr) return;
  auto records = FrameTlsRecords::Start(ssl_, server_tls_ != nullptr, secrets_.get(), peer_);
  secrets_.reset();
  if (!records.ok()) {
    CloseLocked(records.status());
    return;
  }
  records_ = std::move(*records);
}

short FrameConn::Events() const {
  // Without the lock: the I/O thread's own state, and write_blocked_, which
  // a Send that sets it follows with a wake (SetWake).
  switch (state_.load()) {
    case State::kConnecting: return POLLOUT;
    case State::kHandshake: return static_cast<short>(POLLIN | (handshake_wants_write_ ? POLLOUT : 0));
    case State::kOpen: return static_cast<short>(POLLIN | (write_blocked_ ? POLLOUT : 0));
    default: return POLLIN;
  }
}

ssize_t FrameConn::RecvSome(void* p, size_t bytes) {
  for (;;) {
    const ssize_t n = ::recv(fd_, p, bytes, 0);
    if (n > 0) return n;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    Close(UnavailableError(
        n == 0 ? fmt::format("{} closed the connection", peer_)
               : fmt::format("reading from {} failed: {}", peer_, std::strerror(errno))));
    return -1;
  }
}

bool FrameConn::ReadRecords() {
  for (;;) {
    if (in_off_ > 0 && in_off_ == in_len_) {
      in_len_ = 0;
      in_off_ = 0;
    }
    if (raw_off_ > 0) {  // a partial record (or nothing) left: to the front
      std::memmove(raw_.data(), raw_.data() + raw_off_, raw_len_ - raw_off_);
      raw_len_ -= raw_off_;
      raw_off_ = 0;
    }
    if (raw_.size() < raw_len_ + kReadChunkBytes) raw_.resize(raw_len_ + kReadChunkBytes);
    const ssize_t n = RecvSome(raw_.data() + raw_len_, kReadChunkBytes);
    if (n <= 0) return n == 0;
    raw_len_ += static_cast<size_t>(n);
    // Opening is the I/O thread's alone (a sender seals with the other
    // key, under mu_: common/frame_tls_records.h).
    Status st = records_->Open(raw_.data(), &raw_off_, raw_len_, &in_, &in_len_);
    if (!st.ok()) {
      Close(st);
      return false;
    }
    if (static_cast<size_t>(n) < kReadChunkBytes) return true;  // drained
  }
}

bool FrameConn::ReadPlain() {
  for (;;) {
    const size_t at = MakeReadRoom(in_, in_off_, in_len_);
    const ssize_t n = RecvSome(in_.data() + at, kReadChunkBytes);
    if (n <= 0) return n == 0;
    in_len_ = at + static_cast<size_t>(n);
    if (static_cast<size_t>(n) < kReadChunkBytes) return true;  // drained
  }
}

bool FrameConn::ReadSslLocked() {
  for (;;) {
    const size_t at = MakeReadRoom(in_, in_off_, in_len_);
    // Not ERR_clear_error first (SslIoLocked): cold per step, it cost ~2 %
    // of the decode stream's reader.
    Status first;
    const int r = SslIoLocked(
        "reading",
        [&] { return SSL_read(ssl_, in_.data() + at, static_cast<int>(kReadChunkBytes)); },
        &first);
    if (r <= 0) {
      const int e = SSL_get_error(ssl_, r);
      if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) return true;
      CloseLocked(SslIoError("reading", r, first));
      return false;
    }
    in_len_ = at + static_cast<size_t>(r);
    if (static_cast<size_t>(r) < kReadChunkBytes && SSL_has_pending(ssl_) == 0) {
      return true;  // drained (the next read would say EAGAIN)
    }
  }
}

Status FrameConn::Progress(short revents, const OnFrame& on_frame) {
  bool closed_after = false;  // EOF/error after the bytes read: frames first
  Status end;
  constexpr short kReadable = POLLIN | POLLHUP | POLLERR;
  // Reading needs no lock (ReadRecords, ReadPlain) unless the connection
  // is on OpenSSL; the lock is taken only to connect, handshake or flush.
  const bool unlocked_reads = records_ != nullptr || ssl_ == nullptr;
  bool read = false;
  if (unlocked_reads && (revents & POLLOUT) == 0 && state_ == State::kOpen) {
    read = (revents & kReadable) != 0;
  } else {
    std::lock_guard lock(mu_);
    if (state_ == State::kClosed) return closed_why_;
    if (state_ == State::kConnecting) {
      constexpr short kDialDone = POLLOUT | POLLERR | POLLHUP;
      if ((revents & kDialDone) == 0) {
        if (std::chrono::steady_clock::now() < attempt_deadline_) return Status::Ok();
        // The address's share of the deadline is over: unless it connected
        // just now (its event and the timer at once), the next address.
        pollfd p{fd_, POLLOUT, 0};
        if (poll(&p, 1, 0) <= 0 || (p.revents & kDialDone) == 0) {
          NoteDialFailedLocked(ETIMEDOUT);
          return DialLocked();
        }
        revents = p.revents;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        // Not connected: the peer's next address, if it has one.
        NoteDialFailedLocked(err);
        return DialLocked();
      }
      state_ = ssl_ != nullptr ? State::kHandshake : State::kOpen;
      // Try the handshake now; once open, flush what was sent meanwhile.
      revents = POLLIN | POLLOUT;
      write_blocked_ = true;
    }
    if (state_ == State::kHandshake) {
      ERR_clear_error();
      const int r = SSL_do_handshake(ssl_);
      if (r != 1) {
        const int e = SSL_get_error(ssl_, r);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
          handshake_wants_write_ = e == SSL_ERROR_WANT_WRITE;
          return Status::Ok();
        }
        CloseLocked(TlsError("TLS handshake", r));
        return closed_why_;
      }
      state_ = State::kOpen;
      StartRecordsLocked();
      if (state_ == State::kClosed) return closed_why_;
      revents |= POLLIN | POLLOUT;  // data may have come with the handshake; flush what waits
      write_blocked_ = true;
    }
    if (state_ == State::kOpen) {
      read = (revents & kReadable) != 0;
      if (read && records_ == nullptr && ssl_ != nullptr) {  // OpenSSL's: under the lock
        read = false;
        if (!ReadSslLocked()) {
          closed_after = true;
          end = closed_why_;
        }
      }
      if (!closed_after && (revents & POLLOUT) != 0 && write_blocked_) {
        write_blocked_ = false;
        FlushLocked();
        if (state_ == State::kClosed) return closed_why_;
      }
    }
  }
  if (read && !(records_ != nullptr ? ReadRecords() : ReadPlain())) {
    closed_after = true;
    std::lock_guard lock(mu_);
    end = closed_why_;
  }
  // Frames, outside the lock (a handler may Send on this connection).
  while (in_len_ - in_off_ >= kHeaderBytes) {
    const auto* h = reinterpret_cast<const uint8_t*>(in_.data() + in_off_);
    const uint32_t n = uint32_t{h[0]} | uint32_t{h[1]} << 8 | uint32_t{h[2]} << 16 |
                       uint32_t{h[3]} << 24;
    if (n > options_.max_frame_bytes) {
      Status st = InvalidArgumentError(fmt::format(
          "{} sent a frame of {} bytes; the limit is {} bytes", peer_, n, options_.max_frame_bytes));
      Close(st);
      return st;
    }
    if (in_len_ - in_off_ < kHeaderBytes + n) break;
    Status st = on_frame(std::string_view(in_.data() + in_off_ + kHeaderBytes, n));
    in_off_ += kHeaderBytes + n;
    if (!st.ok()) {
      Close(st);
      return st;
    }
  }
  if (in_off_ > 0 && in_off_ == in_len_) {
    in_len_ = 0;
    in_off_ = 0;
  } else if (in_off_ > (1u << 20)) {
    in_.erase(0, in_off_);
    in_len_ -= in_off_;
    in_off_ = 0;
  }
  if (closed_after) return end;
  if (state_ != State::kClosed) return Status::Ok();
  std::lock_guard lock(mu_);
  return closed_why_;
}

}  // namespace tandem
