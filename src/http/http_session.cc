// The connection itself: reading and queueing requests, writing answers in
// order, the idle timeout and closing (http_session.h).
#include "http/http_session.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cmath>

namespace tandem::http::detail {

const char* Reason(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 409:
      return "Conflict";
    case 413:
      return "Payload Too Large";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 499:
      return "Client Closed Request";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Internal Server Error";
  }
}

Session::Session(tcp::socket socket, Shared* sh, std::shared_ptr<net::ssl::context> tls)
    : socket_(std::move(socket), std::move(tls)), sh_(sh), idle_timer_(socket_.get_executor()) {}

Session::~Session() {
  if (outbox_) outbox_->Close();  // before the socket closes (a sink may hold the Outbox)
  {
    std::lock_guard lock(sh_->mu);
    sh_->sessions.erase(this);
    sh_->sessions_changed.notify_all();  // under mu: Shutdown's wait may end the server
  }
  CancelLifecycle();
  if (admitted_) sh_->fe->Release();
}

void Session::Start() {
  // The strand's side of the Outbox: a flush, and a send that failed.
  std::weak_ptr<Session> w = weak_from_this();
  auto ex = socket_.get_executor();
  outbox_ = std::make_shared<Outbox>(
      socket_.tls() ? -1 : socket_.socket().native_handle(),
      [w, ex] {
        net::post(ex, [w] {
          if (auto s = w.lock()) s->Flush();
        });
      },
      [w, ex] {
        net::post(ex, [w] {
          if (auto s = w.lock()) s->Gone();
        });
      });
  {
    std::lock_guard lock(sh_->mu);
    // Over proxy.limits.max_connections: the connection's first request
    // is read (so that the answer is not lost to a reset) and answered 429.
    over_connections_ = sh_->sessions.size() >= sh_->limits.max_connections;
    sh_->sessions.insert(this);
  }
  Touch();
  ArmIdleTimer(Idle());  // also bounds a slow TLS handshake
  socket_.async_handshake([self = shared_from_this()](ErrorCode ec) {
    if (ec) return self->Gone();  // not TLS, or a certificate refused
    self->DoRead();
  });
}

void Session::CancelLifecycle() {
  std::shared_ptr<proxy::RequestLifecycle> lc;
  {
    std::lock_guard lock(lc_mu_);
    lc = std::move(lc_);
  }
  if (lc) lc->Cancel();
}

void Session::Stop() {
  net::post(socket_.get_executor(), [w = weak_from_this()] {
    if (auto s = w.lock()) s->Gone();
  });
}

Session::SteadyClock::duration Session::Idle() const {
  return std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(sh_->limits.idle_timeout_seconds));
}
void Session::ArmIdleTimer(SteadyClock::duration after) {
  idle_timer_.expires_after(after);
  idle_timer_.async_wait([w = weak_from_this()](ErrorCode ec) {
    if (ec) return;
    if (auto s = w.lock()) s->OnIdleTimer();
  });
}

void Session::OnIdleTimer() {
  if (gone_) return;
  const auto quiet = SteadyClock::now() - last_activity_;
  const bool idle = !busy_ && !active_ && !outbox_->Writing() && pending_.empty();
  if (idle && quiet >= Idle()) return Gone();
  ArmIdleTimer(idle ? Idle() - quiet : Idle());
}

void Session::DoRead() {
  reading_ = true;
  parser_.emplace();
  parser_->body_limit(sh_->limits.max_body_bytes);
  parser_->header_limit(static_cast<uint32_t>(sh_->limits.max_header_bytes));
  bhttp::async_read_header(
      socket_, buf_, *parser_,
      [self = shared_from_this()](ErrorCode ec, size_t) { self->OnHeader(ec); });
}

void Session::OnHeader(ErrorCode ec) {
  if (ec) return OnReadError(ec);
  if (gone_) return Linger(0);  // closing: what comes now is discarded
  Touch();
  const auto& h = parser_->get();
  if (beast::iequals(h[bhttp::field::expect], "100-continue")) {
    Enqueue("HTTP/1.1 100 Continue\r\n\r\n");
  }
  bhttp::async_read(socket_, buf_, *parser_,
                    [self = shared_from_this()](ErrorCode ec, size_t) { self->OnRead(ec); });
}

void Session::OnRead(ErrorCode ec) {
  reading_ = false;
  if (ec) return OnReadError(ec);
  if (gone_) return Linger(0);
  // A request read ahead past proxy.limits.max_pipelined_requests waiting
  // ones is answered 429 in its turn, and the connection closes after it.
  const bool over = pending_.size() >= sh_->limits.max_pipelined;
  pending_.push_back(Pending{parser_->release(), over});
  if (over) {
    stop_reading_ = true;  // nothing after it is read
    // No read in flight holds the session now: hold it until it closes.
    hold_ = shared_from_this();
  } else {
    DoRead();
  }
  MaybeServe();
}

void Session::OnReadError(ErrorCode ec) {
  reading_ = false;
  // Closing, and the client closed too; after our close_notify a TLS read
  // ends at once, so the TCP socket says whether the client has closed.
  if (gone_) return notified_ ? Linger(0) : EndLinger();
  const bool parse_error = ec.category() == ErrorCode(bhttp::error::end_of_stream).category() &&
                           ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message;
  if (parse_error && !busy_) {
    // Answer what we could not parse, then close (the stream is out of sync).
    pending_.clear();
    close_after_ = true;
    busy_ = true;
    // No read holds the session now: hold it until it closes (else it went
    // with this handler, before its answer was flushed or its linger ran).
    hold_ = shared_from_this();
    const int code = ec == bhttp::error::body_limit     ? 413
                     : ec == bhttp::error::header_limit ? 431
                                                        : 400;
    Respond(
        code, "application/json",
        ErrorBody(code, code == 413 ? fmt::format("the request body exceeds the limit of {} bytes "
                                                  "(proxy.limits.max_http_body_bytes)",
                                                  sh_->limits.max_body_bytes)
                        : code == 431
                            ? fmt::format("the request's header exceeds the limit of {} bytes "
                                          "(proxy.limits.max_http_header_bytes)",
                                          sh_->limits.max_header_bytes)
                            : fmt::format("malformed HTTP request: {}", ec.message())));
    return;
  }
  Gone();  // closed or reset: the client went away
}

// ---- serving ------------------------------------------------------------
void Session::MaybeServe() {
  if (busy_ || gone_ || pending_.empty()) return;
  busy_ = true;
  Pending next = std::move(pending_.front());
  pending_.pop_front();
  const Request& req = next.req;
  keep_alive_ = req.keep_alive() && req.version() >= 11;
  if (!keep_alive_) close_after_ = true;
  if (next.over_pipeline_limit || over_connections_) {
    pending_.clear();
    close_after_ = true;
    retry_after_seconds_ = 1;
    const std::string why = over_connections_
                                ? fmt::format(
                                      "the proxy has its limit of {} open HTTP connections "
                                      "(proxy.limits.max_connections); retry later",
                                      sh_->limits.max_connections)
                                : fmt::format(
                                      "more than {} requests pipelined on one connection "
                                      "(proxy.limits.max_pipelined_requests); send them after the "
                                      "earlier answers",
                                      sh_->limits.max_pipelined);
    if (auto* m = sh_->fe->deps().metrics) m->CountOutcome("rejected");
    return Respond(429, "application/json", ErrorBody(429, why));
  }
  if (!reading_ && !close_after_ && !stop_reading_) DoRead();
  Serve(req);
}

void Session::Respond(int status, std::string_view content_type, const std::string& body) {
  std::string head = fmt::format(
      "HTTP/1.1 {} {}\r\nServer: tandem\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}", status,
      Reason(status), content_type, body.size(), close_after_ ? "Connection: close\r\n" : "");
  if (status == 503 || status == 429) {
    // Whole seconds, at least 1: when a rate limit's bucket holds enough again.
    const double after = std::max(retry_after_seconds_, 1.0);
    head += fmt::format("Retry-After: {}\r\n", static_cast<long long>(std::ceil(after)));
    retry_after_seconds_ = 0;
  }
  Enqueue(head + "\r\n" + (head_ ? std::string() : body));
  Finished();
}

void Session::Finished() {
  busy_ = false;
  Touch();
  if (close_after_) {
    close_when_written_ = true;
    if (!outbox_->Writing()) Close();
    return;
  }
  MaybeServe();
}

void Session::Flush() {
  if (gone_ || writing_) return;
  if (!outbox_->TakePending(flushing_)) return OnWritten();
  writing_ = true;
  net::async_write(socket_, net::buffer(flushing_),
                   [self = shared_from_this()](ErrorCode ec, size_t) { self->OnFlushed(ec); });
}

void Session::OnFlushed(ErrorCode ec) {
  writing_ = false;
  // A completed write's handler may run after the read side already saw
  // the client go (Gone/Close): then there is nothing more to write, and a
  // close_notify may wait for this write to end.
  if (gone_) {
    if (after_write_) CloseNotifyThen(std::exchange(after_write_, nullptr));
    return;
  }
  if (ec) return Gone();
  Flush();
}

void Session::OnWritten() {
  if (close_when_written_) Close();
}

void Session::Gone() {
  if (gone_) return;
  gone_ = true;
  hold_.reset();
  if (active_) {
    CancelLifecycle();
    EndGeneration();
  }
  // flushing_, the buffer of a write in flight, lives until its handler runs.
  outbox_->Close();
  pending_.clear();
  ErrorCode ignored;
  if (socket_.tls()) {
    // close_notify before the close (after the write in flight, if any).
    ArmCloseTimer();
    if (reading_ && !writing_) {
      // The read waiting for the next request (an idle timeout): cancelled,
      // its handler sees gone_ and ends here (EndLinger). (With a write in
      // flight nothing is cancelled, which would cut its record: the
      // close_notify follows the write and the close ends the read.)
      socket_.socket().cancel(ignored);
      return;
    }
    return EndLinger();  // close_notify, then the close
  }
  socket_.socket().close(ignored);
}

void Session::ArmCloseTimer() {
  idle_timer_.cancel();
  idle_timer_.expires_after(sh_->limits.linger);
  idle_timer_.async_wait([self = shared_from_this()](ErrorCode ec) {
    if (ec) return;
    ErrorCode ignored;
    self->socket_.socket().close(ignored);
  });
}

void Session::CloseNotifyThen(std::function<void()> then) {
  if (!socket_.tls() || notified_) return then();
  if (writing_) {
    // After the write in flight (OnFlushed); both run when two wait.
    if (after_write_) {
      then = [first = std::move(after_write_), second = std::move(then)] {
        first();
        second();
      };
    }
    after_write_ = std::move(then);
    return;
  }
  notified_ = true;
  socket_.async_close_notify(
      [self = shared_from_this(), then = std::move(then)](ErrorCode) { then(); });
}

void Session::Close() {
  hold_.reset();  // the linger's handlers hold it from here
  outbox_->Close();
  gone_ = true;
  if (active_) {
    CancelLifecycle();
    EndGeneration();
  }
  ArmCloseTimer();
  HalfClose();
}

void Session::HalfClose() {
  // TLS: our close_notify first (a write, which may go beside the parser's
  // read in flight), then the half-close.
  CloseNotifyThen([self = shared_from_this()] {
    ErrorCode ignored;
    self->socket_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    // A read in flight (the parser's) ends with the client's close too.
    if (!self->reading_) self->Linger(0);
  });
}

void Session::Linger(size_t discarded) {
  if (discarded >= kLingerBytes) return EndLinger();
  // (Gone's path: a read that ended as it closed. No read is in flight.)
  if (socket_.tls() && !notified_) return HalfClose();
  // What is there already is read here, without the reactor: asio reads at
  // once only while the socket's last read filled its buffer, and otherwise
  // waits for the next readiness edge. When the read before this one (the
  // TLS layer's, under our close_notify) already met the client's close,
  // that edge never comes, and the socket stayed open until the close
  // timer (ArmCloseTimer).
  const int fd = socket_.socket().native_handle();
  for (;;) {
    const ssize_t n = ::recv(fd, linger_buf_.data(), linger_buf_.size(), MSG_DONTWAIT);
    if (n == 0) return EndLinger();  // the client has closed
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;  // nothing yet: wait for it
      return EndLinger();
    }
    discarded += static_cast<size_t>(n);
    if (discarded >= kLingerBytes) return EndLinger();
  }
  socket_.socket().async_read_some(net::buffer(linger_buf_),
                                   [self = shared_from_this(), discarded](ErrorCode ec, size_t n) {
                                     if (ec) return self->EndLinger();
                                     self->Linger(discarded + n);
                                   });
}

void Session::EndLinger() {
  CloseNotifyThen([self = shared_from_this()] {
    ErrorCode ignored;
    self->idle_timer_.cancel();
    self->socket_.socket().close(ignored);
  });
}

}  // namespace tandem::http::detail
