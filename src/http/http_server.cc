#include "http/http_server.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <ctime>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "common/net.h"
#include "common/tracing.h"
#include "http/http_stream.h"
#include "http/openai.h"
#include "model/chat_template.h"
#include "proxy/generation_service.h"

namespace tandem::http {
namespace {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using ErrorCode = boost::system::error_code;
using Request = bhttp::request<bhttp::string_body>;

class Session;

// What every connection shares; owned by HttpServer::Impl.
struct Shared {
  proxy::Frontend* fe = nullptr;
  proxy::Fleet* fleet = nullptr;
  MetricsRegistry* metrics = nullptr;
  std::optional<model::ChatTemplate> chat;
  std::string chat_error;  // why chat is refused when `chat` is empty
  int64_t started = 0;
  ServerOptions opts;

  TlsFiles tls_files;  // security.public_tls; empty: plaintext
  std::atomic<int> jobs{0};  // requests on the work pool (Shutdown waits for them)
  // Set once every worker registered at that moment had its KV snapshot in
  // the index: later joiners do not make a serving proxy unready again.
  std::atomic<bool> warm{false};

  std::mutex mu;
  std::set<Session*> sessions;  // guarded by mu
  bool stopping = false;        // guarded by mu
  // New connections' TLS context (null: plaintext); replaced by a reload.
  std::shared_ptr<net::ssl::context> tls;  // guarded by mu
};

const char* Reason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 409: return "Conflict";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Internal Server Error";
  }
}

std::string Chunk(std::string_view data) {
  return fmt::format("{:x}\r\n", data.size()) + std::string(data) + "\r\n";
}

// "" when a request could be served now; otherwise why not.
std::string Unready(Shared& sh) {
  if (sh.fe->draining()) return "draining";
  bool prefill = false, decode = false, both = false;
  size_t indexed = 0;
  const auto workers = sh.fleet->Workers();
  for (const auto& w : workers) {
    prefill |= w.role == router::WorkerRole::kPrefill;
    decode |= w.role == router::WorkerRole::kDecode;
    both |= w.role == router::WorkerRole::kBoth;
    indexed += w.indexed ? 1 : 0;
  }
  if (!both && !(prefill && decode)) {
    return "starting: no prefill/decode pair (or aggregated worker) has registered yet";
  }
  // Ready means routable with a warm index (issue 21): a (re)started proxy
  // waits until the registered workers' snapshots rebuilt its prefix index.
  if (!sh.warm.load()) {
    if (indexed < workers.size()) {
      return fmt::format("starting: index warming ({} of {} workers' KV snapshots applied)",
                         indexed, workers.size());
    }
    sh.warm.store(true);
  }
  return "";
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Shared* sh, std::shared_ptr<net::ssl::context> tls)
      : socket_(std::move(socket), std::move(tls)), sh_(sh), idle_timer_(socket_.get_executor()) {}

  ~Session() {
    {
      std::lock_guard lock(sh_->mu);
      sh_->sessions.erase(this);
    }
    CancelLifecycle();
    if (admitted_) sh_->fe->Release();
  }

  void Start() {
    {
      std::lock_guard lock(sh_->mu);
      // Over proxy.limits.max_connections: the connection's first request
      // is read (so that the answer is not lost to a reset) and answered 429.
      over_connections_ = sh_->sessions.size() >= sh_->opts.max_connections;
      sh_->sessions.insert(this);
    }
    Touch();
    ArmIdleTimer(Idle());  // also bounds a slow TLS handshake
    socket_.async_handshake([self = shared_from_this()](ErrorCode ec) {
      if (ec) return self->Gone();  // not TLS, or a certificate refused
      self->DoRead();
    });
  }

  // Shutdown, once the I/O threads are joined: the self-reference (hold_).
  std::shared_ptr<Session> TakeHold() { return std::move(hold_); }

  // Any thread (shutdown): the active request is cancelled; nothing more
  // reaches this session from its lifecycle.
  void CancelLifecycle() {
    std::shared_ptr<proxy::RequestLifecycle> lc;
    {
      std::lock_guard lock(lc_mu_);
      lc = std::move(lc_);
    }
    if (lc) lc->Cancel();
  }

 private:
  // ---- idle connections ----------------------------------------------------
  // A connection with no request in progress (keep-alive, or a client that
  // sends its request too slowly) is closed after proxy.http_idle_timeout_seconds.
  using SteadyClock = std::chrono::steady_clock;
  SteadyClock::duration Idle() const {
    return std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(sh_->opts.idle_timeout_seconds));
  }
  void Touch() { last_activity_ = SteadyClock::now(); }

  void ArmIdleTimer(SteadyClock::duration after) {
    idle_timer_.expires_after(after);
    idle_timer_.async_wait([w = weak_from_this()](ErrorCode ec) {
      if (ec) return;
      if (auto s = w.lock()) s->OnIdleTimer();
    });
  }

  void OnIdleTimer() {
    if (gone_) return;
    const auto quiet = SteadyClock::now() - last_activity_;
    const bool idle = !busy_ && !active_ && !writing_ && pending_.empty();
    if (idle && quiet >= Idle()) return Gone();
    ArmIdleTimer(idle ? Idle() - quiet : Idle());
  }

  // ---- reading ----------------------------------------------------------
  void DoRead() {
    reading_ = true;
    parser_.emplace();
    parser_->body_limit(sh_->opts.max_body_bytes);
    parser_->header_limit(static_cast<uint32_t>(sh_->opts.max_header_bytes));
    bhttp::async_read_header(socket_, buf_, *parser_,
                             [self = shared_from_this()](ErrorCode ec, size_t) {
                               self->OnHeader(ec);
                             });
  }

  void OnHeader(ErrorCode ec) {
    if (ec) return OnReadError(ec);
    if (gone_) return Linger(0);  // closing: what comes now is discarded
    Touch();
    const auto& h = parser_->get();
    if (beast::iequals(h[bhttp::field::expect], "100-continue")) {
      Enqueue("HTTP/1.1 100 Continue\r\n\r\n");
    }
    bhttp::async_read(socket_, buf_, *parser_, [self = shared_from_this()](ErrorCode ec, size_t) {
      self->OnRead(ec);
    });
  }

  void OnRead(ErrorCode ec) {
    reading_ = false;
    if (ec) return OnReadError(ec);
    if (gone_) return Linger(0);
    // A request read ahead past proxy.limits.max_pipelined_requests waiting
    // ones is answered 429 in its turn, and the connection closes after it.
    const bool over = pending_.size() >= sh_->opts.max_pipelined;
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

  void OnReadError(ErrorCode ec) {
    reading_ = false;
    if (gone_) return EndLinger();  // closing, and the client closed too
    const bool parse_error = ec.category() == ErrorCode(bhttp::error::end_of_stream).category() &&
                             ec != bhttp::error::end_of_stream &&
                             ec != bhttp::error::partial_message;
    if (parse_error && !busy_) {
      // Answer what we could not parse, then close (the stream is out of sync).
      pending_.clear();
      close_after_ = true;
      busy_ = true;
      const int code = ec == bhttp::error::body_limit     ? 413
                        : ec == bhttp::error::header_limit ? 431
                                                           : 400;
      Respond(code, "application/json",
              ErrorBody(code,
                        code == 413 ? fmt::format("the request body exceeds the limit of {} bytes "
                                                  "(proxy.limits.max_http_body_bytes)",
                                                  sh_->opts.max_body_bytes)
                        : code == 431
                            ? fmt::format("the request's header exceeds the limit of {} bytes "
                                          "(proxy.limits.max_http_header_bytes)",
                                          sh_->opts.max_header_bytes)
                            : fmt::format("malformed HTTP request: {}", ec.message())));
      return;
    }
    Gone();  // closed or reset: the client went away
  }

  // ---- serving ------------------------------------------------------------
  void MaybeServe() {
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
      const std::string why =
          over_connections_
              ? fmt::format("the proxy has its limit of {} open HTTP connections "
                            "(proxy.limits.max_connections); retry later",
                            sh_->opts.max_connections)
              : fmt::format("more than {} requests pipelined on one connection "
                            "(proxy.limits.max_pipelined_requests); send them after the "
                            "earlier answers",
                            sh_->opts.max_pipelined);
      if (auto* m = sh_->fe->deps().metrics) m->CountOutcome("rejected");
      return Respond(429, "application/json", ErrorBody(429, why));
    }
    if (!reading_ && !close_after_ && !stop_reading_) DoRead();
    Serve(req);
  }

  void Serve(const Request& req) {
    std::string_view target(req.target().data(), req.target().size());
    target = target.substr(0, target.find('?'));
    // HEAD is GET without the body (probes such as aiperf's use it).
    head_ = req.method() == bhttp::verb::head;
    const auto method = head_ ? bhttp::verb::get : req.method();
    request_id_header_ = std::string(req["X-Request-Id"]);
    // W3C trace context (read only when tracing is on).
    traceparent_header_.clear();
    if (tracing::Tracer::Get().enabled()) traceparent_header_ = std::string(req["traceparent"]);
    auto only = [&](bhttp::verb v) {
      if (method == v) return true;
      Respond(405, "application/json",
              ErrorBody(405, fmt::format("{} takes {} only", target,
                                         std::string_view(bhttp::to_string(v)))));
      return false;
    };
    if (target == "/health") {
      if (!only(bhttp::verb::get)) return;
      const std::string why = Unready(*sh_);
      if (why.empty()) return Respond(200, "application/json", R"({"status":"ok"})");
      return Respond(503, "application/json", Dump({{"status", why}}));
    }
    if (target == "/metrics") {
      if (!only(bhttp::verb::get)) return;
      return Respond(200, "text/plain; version=0.0.4; charset=utf-8", sh_->metrics->Render());
    }
    const bool v1 = target.rfind("/v1/", 0) == 0;
    const proxy::Tenant* tenant = nullptr;
    if (v1) {
      // proxy::Tenants owns the check (the gRPC front end asks it too).
      const auto h = req[bhttp::field::authorization];
      auto t = sh_->fe->Authenticate(std::string_view(h.data(), h.size()));
      if (!t.ok()) return Respond(401, "application/json", ErrorBody(401, t.status().message()));
      tenant = *t;
    }
    if (target == "/v1/models") {
      if (!only(bhttp::verb::get)) return;
      const auto& lim = sh_->fe->limits();
      nlohmann::json m = {{"id", lim.model},
                          {"object", "model"},
                          {"created", sh_->started},
                          {"owned_by", "tandem"},
                          {"root", lim.model},
                          {"max_model_len", lim.max_model_len}};
      return Respond(200, "application/json",
                     Dump({{"object", "list"}, {"data", nlohmann::json::array({m})}}));
    }
    if (target == "/v1/completions") {
      if (!only(bhttp::verb::post)) return;
      return StartGeneration(Endpoint::kCompletions, req.body(), tenant);
    }
    if (target == "/v1/chat/completions") {
      if (!only(bhttp::verb::post)) return;
      return StartGeneration(Endpoint::kChat, req.body(), tenant);
    }
    Respond(404, "application/json",
            ErrorBody(404, fmt::format("no route {} {}; see docs/http-api.md",
                                       std::string_view(req.method_string().data(),
                                                        req.method_string().size()),
                                       target)));
  }

  void CountOutcome(const Status& st) {
    if (auto* m = sh_->fe->deps().metrics) {
      m->CountOutcome(st.code() == StatusCode::kResourceExhausted ? "rejected" : "invalid");
    }
  }

  // Before the lifecycle starts: gives back the admission slot, if taken.
  void Refuse(const OpenAiRequest* r, const Status& st) {
    if (admitted_ && !active_) {
      sh_->fe->Release();
      admitted_ = false;
    }
    CountOutcome(st);
    const int code = HttpStatus(st.code());
    Respond(code, "application/json",
            ErrorBody(code, r ? ToOpenAiMessage(*r, st.message()) : st.message()));
  }

  // What the work pool hands back: the parsed request and its validation.
  struct Prepared {
    Endpoint endpoint = Endpoint::kCompletions;
    Status error;          // parse, chat template or validation; ok otherwise
    bool parsed = false;   // `request` holds the parsed request
    OpenAiRequest request;
    std::optional<proxy::ValidatedRequest> validated;
    double retry_after = 0;
  };

  // On a work-pool thread: JSON, chat template, tokenization, validation.
  static Prepared Prepare(Shared* sh, Endpoint ep, const std::string& body,
                          const proxy::Tenant* tenant, const std::string& request_id) {
    Prepared p;
    p.endpoint = ep;
    auto parsed = ParseRequest(ep, body);
    if (!parsed.ok()) {
      p.error = parsed.status();
      return p;
    }
    p.parsed = true;
    p.request = std::move(parsed).value();
    OpenAiRequest& r = p.request;
    if (ep == Endpoint::kChat) {
      if (!sh->chat) {
        p.error = InvalidArgumentError("messages: " + sh->chat_error);
        return p;
      }
      auto text = sh->chat->Render(r.messages);
      if (!text.ok()) {
        p.error = text.status();
        return p;
      }
      r.request.prompt_token_ids = sh->fe->deps().tokenizer->Encode(*text, false);
    }
    r.request.request_id = request_id;
    auto v = sh->fe->Validate(r.request, tenant, &p.retry_after);
    if (!v.ok()) {
      p.error = v.status();
      return p;
    }
    p.validated = std::move(v).value();
    return p;
  }

  void StartGeneration(Endpoint ep, const std::string& body, const proxy::Tenant* tenant) {
    // TTFT and e2e count from here (the body is read): parsing, the chat
    // template and tokenization included.
    const auto arrival = std::chrono::steady_clock::now();
    // Nothing is parsed or tokenized before the caller is within its rate
    // and admitted (the body's size is bounded by the parser already).
    if (sh_->fe->draining()) {
      return Refuse(nullptr, UnavailableError("the proxy is draining; send new requests elsewhere"));
    }
    if (proxy::RateRefusal r = sh_->fe->ChargeRequest(tenant); !r.status.ok()) {
      retry_after_seconds_ = r.retry_after_seconds;
      return Refuse(nullptr, r.status);
    }
    if (Status st = sh_->fe->Admit(); !st.ok()) return Refuse(nullptr, st);
    admitted_ = true;
    // The work runs on the proxy's work pool, off this I/O thread; the
    // result comes back to this connection's strand (busy_ stays set, so
    // pipelined requests wait their turn).
    sh_->jobs.fetch_add(1);
    sh_->fe->work().Submit([self = shared_from_this(), sh = sh_, ex = socket_.get_executor(), ep,
                            body, tenant, id = request_id_header_, arrival,
                            traceparent = traceparent_header_] {
      Prepared p = Prepare(sh, ep, body, tenant, id);
      if (p.validated) p.validated->trace = tracing::Tracer::Get().StartRequest(traceparent);
      net::post(ex, [self, p = std::move(p), arrival]() mutable {
        self->OnPrepared(std::move(p), arrival);
      });
      sh->jobs.fetch_sub(1);
    });
  }

  void OnPrepared(Prepared p, std::chrono::steady_clock::time_point arrival) {
    if (gone_) {  // the client left meanwhile
      if (admitted_) sh_->fe->Release();
      admitted_ = false;
      return;
    }
    if (!p.error.ok()) {
      retry_after_seconds_ = p.retry_after;
      return Refuse(p.parsed ? &p.request : nullptr, p.error);
    }
    OpenAiRequest& r = p.request;
    proxy::ValidatedRequest* v = &*p.validated;
    const Endpoint ep = p.endpoint;

    active_ = true;
    headers_sent_ = false;
    first_delta_ = true;
    text_.clear();
    stream_ = r.stream;
    include_usage_ = r.include_usage;
    meta_.endpoint = ep;
    meta_.id = (ep == Endpoint::kChat ? "chatcmpl-" : "cmpl-") + v->client_request_id;
    meta_.created = static_cast<int64_t>(std::time(nullptr));
    meta_.model = v->model;
    openai_req_ = std::move(r);

    std::weak_ptr<Session> w = weak_from_this();
    auto ex = socket_.get_executor();
    proxy::ResponseSink sink;
    sink.on_delta = [w, ex](std::vector<uint32_t>, std::string text) {
      net::post(ex, [w, text = std::move(text)]() mutable {
        if (auto s = w.lock()) s->OnDelta(std::move(text));
      });
    };
    sink.on_finish = [w, ex](proxy::Finish reason, proxy::Usage usage) {
      net::post(ex, [w, reason, usage] {
        if (auto s = w.lock()) s->OnFinish(reason, usage);
      });
    };
    sink.on_error = [w, ex](Status st) {
      net::post(ex, [w, st = std::move(st)] {
        if (auto s = w.lock()) s->OnError(st);
      });
    };
    auto lc = proxy::RequestLifecycle::Start(sh_->fe->deps(), std::move(*v),
                                             std::move(sink),
                                             std::chrono::system_clock::time_point::max(), arrival);
    {
      std::lock_guard lock(lc_mu_);
      lc_ = std::move(lc);
    }
    bool stopping;
    {
      std::lock_guard lock(sh_->mu);
      stopping = sh_->stopping;
    }
    if (stopping) CancelLifecycle();
  }

  void SendStreamHeaders() {
    if (headers_sent_) return;
    headers_sent_ = true;
    Enqueue(fmt::format(
        "HTTP/1.1 200 OK\r\nServer: tandem\r\nContent-Type: text/event-stream\r\n"
        "Cache-Control: no-cache\r\nX-Request-Id: {}\r\nTransfer-Encoding: chunked\r\n{}\r\n",
        meta_.id, keep_alive_ ? "" : "Connection: close\r\n"));
  }

  void OnDelta(std::string text) {
    if (gone_ || !active_) return;
    if (!stream_) {
      text_ += text;
      return;
    }
    SendStreamHeaders();
    if (text.empty()) return;
    Enqueue(Chunk(StreamDelta(meta_, text, first_delta_, include_usage_)));
    first_delta_ = false;
  }

  void OnFinish(proxy::Finish reason, proxy::Usage usage) {
    if (gone_ || !active_) return;
    EndGeneration();
    if (!stream_) {
      return Respond(200, "application/json", FullResponse(meta_, text_, reason, usage));
    }
    SendStreamHeaders();
    Enqueue(Chunk(StreamEnd(meta_, reason, usage, include_usage_)) + "0\r\n\r\n");
    Finished();
  }

  void OnError(const Status& st) {
    if (gone_ || !active_) return;
    EndGeneration();
    const int code = HttpStatus(st.code());
    const std::string msg = ToOpenAiMessage(openai_req_, st.message());
    if (stream_ && headers_sent_) {
      Enqueue(Chunk(StreamError(code, msg)) + "0\r\n\r\n");
      return Finished();
    }
    Respond(code, "application/json", ErrorBody(code, msg));
  }

  void EndGeneration() {
    {
      std::lock_guard lock(lc_mu_);
      lc_.reset();
    }
    if (admitted_) sh_->fe->Release();
    admitted_ = false;
    active_ = false;
  }

  // ---- writing -------------------------------------------------------------
  void Respond(int status, std::string_view content_type, const std::string& body) {
    std::string head = fmt::format(
        "HTTP/1.1 {} {}\r\nServer: tandem\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}",
        status, Reason(status), content_type, body.size(),
        close_after_ ? "Connection: close\r\n" : "");
    if (status == 503 || status == 429) {
      // Whole seconds, at least 1: when a rate limit's bucket holds enough again.
      const double after = std::max(retry_after_seconds_, 1.0);
      head += fmt::format("Retry-After: {}\r\n", static_cast<long long>(std::ceil(after)));
      retry_after_seconds_ = 0;
    }
    Enqueue(head + "\r\n" + (head_ ? std::string() : body));
    Finished();
  }

  // The current request is answered (its bytes may still be queued).
  void Finished() {
    busy_ = false;
    Touch();
    if (close_after_) {
      close_when_written_ = true;
      if (!writing_) Close();
      return;
    }
    MaybeServe();
  }

  void Enqueue(std::string bytes) {
    if (gone_) return;
    out_.push_back(std::move(bytes));
    if (!writing_) DoWrite();
  }

  void DoWrite() {
    writing_ = true;
    net::async_write(socket_, net::buffer(out_.front()),
                     [self = shared_from_this()](ErrorCode ec, size_t) { self->OnWrite(ec); });
  }

  void OnWrite(ErrorCode ec) {
    writing_ = false;
    // A completed write's handler may run after the read side already saw
    // the client go (Gone/Close): then there is nothing more to write.
    if (gone_) return;
    if (ec) return Gone();
    out_.pop_front();
    if (!out_.empty()) return DoWrite();
    if (close_when_written_) Close();
  }

  // ---- ending ----------------------------------------------------------------
  // The client closed or reset the connection: cancel what runs for it.
  void Gone() {
    if (gone_) return;
    gone_ = true;
    hold_.reset();
    if (active_) {
      CancelLifecycle();
      EndGeneration();
    }
    // The buffer of a write in flight must live until its handler runs.
    if (writing_) {
      out_.erase(out_.begin() + 1, out_.end());
    } else {
      out_.clear();
    }
    pending_.clear();
    ErrorCode ignored;
    socket_.socket().close(ignored);
  }

  // Our side is done: half-close, then read and discard what the client
  // still sends (a body we refused, requests pipelined past a limit) until
  // its close, kLingerBytes or kLingerTime, whichever first. Closing with
  // unread bytes would make the kernel answer with a reset, which destroys
  // our last response before the client has read it.
  static constexpr size_t kLingerBytes = 1u << 20;
  static constexpr auto kLingerTime = std::chrono::seconds(2);

  void Close() {
    hold_.reset();  // the linger's handlers hold it from here
    ErrorCode ignored;
    socket_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    gone_ = true;
    if (active_) {
      CancelLifecycle();
      EndGeneration();
    }
    idle_timer_.cancel();
    idle_timer_.expires_after(kLingerTime);
    idle_timer_.async_wait([self = shared_from_this()](ErrorCode ec) {
      if (ec) return;
      ErrorCode ignored;
      self->socket_.socket().close(ignored);
    });
    // A read in flight (the parser's) ends with the client's close too.
    if (!reading_) Linger(0);
  }

  // Under TLS the discarded bytes are read (and decrypted) through the TLS
  // stream; the client's close_notify or TCP close ends the linger.
  void Linger(size_t discarded) {
    if (discarded >= kLingerBytes) return EndLinger();
    socket_.async_read_some(net::buffer(linger_buf_),
                            [self = shared_from_this(), discarded](ErrorCode ec, size_t n) {
                              if (ec) return self->EndLinger();
                              self->Linger(discarded + n);
                            });
  }

  void EndLinger() {
    ErrorCode ignored;
    idle_timer_.cancel();
    socket_.socket().close(ignored);
  }

  HttpStream socket_;  // TCP, or TLS over it
  Shared* sh_;
  net::steady_timer idle_timer_;
  std::chrono::steady_clock::time_point last_activity_;
  beast::flat_buffer buf_;
  std::array<char, 4096> linger_buf_{};
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  struct Pending {
    Request req;
    bool over_pipeline_limit = false;  // answered 429 (proxy.limits.max_pipelined_requests)
  };
  std::deque<Pending> pending_;
  std::deque<std::string> out_;
  bool reading_ = false, busy_ = false, gone_ = false, writing_ = false;
  bool keep_alive_ = true, close_after_ = false, close_when_written_ = false;
  std::string request_id_header_;
  std::string traceparent_header_;
  bool over_connections_ = false;  // opened past proxy.limits.max_connections
  bool stop_reading_ = false;  // a request over max_pipelined_requests is queued
  std::shared_ptr<Session> hold_;  // this, while no read holds it (stop_reading_)
  double retry_after_seconds_ = 0;  // the next 429/503's Retry-After (0: 1 s)
  bool head_ = false;  // the request being answered is a HEAD

  // The request being generated (strand only).
  bool active_ = false, admitted_ = false, stream_ = false, include_usage_ = false;
  bool headers_sent_ = false, first_delta_ = true;
  OpenAiRequest openai_req_;
  ResponseMeta meta_;
  std::string text_;

  std::mutex lc_mu_;
  std::shared_ptr<proxy::RequestLifecycle> lc_;  // guarded by lc_mu_
};

}  // namespace

struct HttpServer::Impl {
  Shared shared;  // declared first: outlives the io_context and its sessions
  net::io_context ioc;
  std::optional<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
  std::string address;
  bool stopped = false;

  void Accept() {
    acceptor->async_accept(net::make_strand(ioc), [this](ErrorCode ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted) return;
      if (!ec) {
        ErrorCode ignored;
        socket.set_option(tcp::no_delay(true), ignored);
        std::shared_ptr<net::ssl::context> tls;
        {
          std::lock_guard lock(shared.mu);
          tls = shared.tls;
        }
        std::make_shared<Session>(std::move(socket), &shared, std::move(tls))->Start();
      } else {
        spdlog::warn("http: accept failed: {}", ec.message());
      }
      if (acceptor->is_open()) Accept();
    });
  }
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Shutdown(); }

const std::string& HttpServer::address() const { return impl_->address; }

size_t HttpServer::open_connections() const {
  std::lock_guard lock(impl_->shared.mu);
  return impl_->shared.sessions.size();
}

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& address,
                                                      const proxy::HttpContext& context,
                                                      const ServerOptions& options) {
  TANDEM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  auto impl = std::make_unique<Impl>();
  Shared& sh = impl->shared;
  sh.fe = context.frontend;
  sh.fleet = context.fleet;
  sh.metrics = context.metrics;
  sh.opts = options;
  sh.opts.idle_timeout_seconds = context.config->proxy.http_idle_timeout_seconds;
  const ProxyLimitsConfig& limits = context.config->proxy.limits;
  sh.opts.max_body_bytes = limits.max_http_body_bytes;
  sh.opts.max_header_bytes = limits.max_http_header_bytes;
  sh.opts.max_pipelined = limits.max_pipelined_requests;
  sh.opts.max_connections = limits.max_connections;
  sh.started = static_cast<int64_t>(std::time(nullptr));
  sh.tls_files = context.public_tls;
  if (!sh.tls_files.empty()) {
    auto ctx = MakeServerTlsContext(sh.tls_files);
    if (!ctx.ok()) return ctx.status().WithContext("security.public_tls (HTTP)");
    sh.tls = std::move(ctx).value();
  }
  const std::string tmpl_name =
      context.config->proxy.chat_template.empty() ? "auto" : context.config->proxy.chat_template;
  auto chat = model::ChatTemplate::Load(context.config->model.path, tmpl_name);
  if (chat.ok()) {
    spdlog::info("http: chat template '{}' (from {})", chat->name(), chat->origin());
    sh.chat = std::move(chat).value();
  } else if (tmpl_name == "auto") {
    sh.chat_error = chat.status().message();
    spdlog::warn("http: /v1/chat/completions is off: {}", sh.chat_error);
  } else {
    return chat.status();
  }

  ErrorCode ec;
  tcp::resolver resolver(impl->ioc);
  auto endpoints = resolver.resolve(hp.host, std::to_string(hp.port), ec);
  if (ec || endpoints.empty()) {
    return InvalidArgumentError(fmt::format("proxy.http '{}': cannot resolve '{}': {}", address,
                                            hp.host, ec.message()));
  }
  const tcp::endpoint ep = endpoints.begin()->endpoint();
  impl->acceptor.emplace(impl->ioc);
  impl->acceptor->open(ep.protocol(), ec);
  if (!ec) impl->acceptor->set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor->bind(ep, ec);
  if (!ec) impl->acceptor->listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return UnavailableError(
        fmt::format("cannot serve the HTTP API on {}: {}", address, ec.message()));
  }
  const tcp::endpoint bound = impl->acceptor->local_endpoint();
  impl->address = HostPort{hp.host, bound.port()}.ToString();
  impl->Accept();
  for (int i = 0; i < std::max(1, options.io_threads); ++i) {
    impl->threads.emplace_back([ioc = &impl->ioc] { ioc->run(); });
  }
  spdlog::info("http: OpenAI-compatible API on {}://{} ({} I/O threads)",
               sh.tls ? "https" : "http", impl->address, std::max(1, options.io_threads));
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

Status HttpServer::ReloadTls() {
  Shared& sh = impl_->shared;
  if (sh.tls_files.empty()) return Status::Ok();
  TANDEM_ASSIGN_OR_RETURN(auto ctx, MakeServerTlsContext(sh.tls_files));
  std::lock_guard lock(sh.mu);
  sh.tls = std::move(ctx);  // open sessions keep the context they started with
  return Status::Ok();
}

void HttpServer::Shutdown() {
  if (!impl_ || impl_->stopped) return;
  impl_->stopped = true;
  {
    std::lock_guard lock(impl_->shared.mu);
    impl_->shared.stopping = true;
    for (Session* s : impl_->shared.sessions) s->CancelLifecycle();
  }
  net::post(impl_->ioc, [impl = impl_.get()] {
    ErrorCode ignored;
    impl->acceptor->close(ignored);
  });
  impl_->ioc.stop();
  for (auto& t : impl_->threads) t.join();
  impl_->threads.clear();
  // A request still on the work pool posts its result to the io_context:
  // it must live until the last one has (they always finish: bounded input).
  while (impl_->shared.jobs.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Sessions that hold themselves (a request queued past the pipelining
  // limit) let go, so that they end with the io_context's handlers.
  std::vector<std::shared_ptr<Session>> held;
  {
    std::lock_guard lock(impl_->shared.mu);
    for (Session* s : impl_->shared.sessions) {
      if (auto h = s->TakeHold()) held.push_back(std::move(h));
    }
  }
  held.clear();
}

proxy::HttpFactory Factory(const ServerOptions& options) {
  return [options](const std::string& address, const proxy::HttpContext& context)
             -> Result<std::unique_ptr<proxy::HttpFrontEnd>> {
    TANDEM_ASSIGN_OR_RETURN(auto server, HttpServer::Start(address, context, options));
    return std::unique_ptr<proxy::HttpFrontEnd>(std::move(server));
  };
}

}  // namespace tandem::http
