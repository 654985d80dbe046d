// One HTTP/1.1 connection of the OpenAI-compatible API (internal to
// tandem_http; HttpServer owns the listener and the I/O threads).
//
// A Session reads requests with Beast's parser (pipelined ones queue, one is
// served at a time), answers them in order and closes idle connections. Its
// members are split by concern over three files:
//   http_session.cc     reading, writing, idle timeout, closing (the socket)
//   http_routes.cc      the routes: /health, /metrics, /v1/models, 404/405
//   http_generation.cc  /v1/completions and /v1/chat/completions: admission,
//                       the work pool, the lifecycle's sink, SSE framing
//
// Thread-safety: everything runs on the connection's strand, except
// CancelLifecycle (any thread) and the lifecycle's sink: it hands a streamed
// token to the connection's Outbox (http_outbox.h), which sends it from the
// sink's thread, and posts the end of a request to the strand.
#pragma once

// <utility> before Asio: Boost 1.74's awaitable.hpp uses std::exchange
// without including it (an error under C++20).
// clang-format off
#include <utility>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
// clang-format on

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "common/tls.h"
#include "http/http_outbox.h"
#include "http/http_server.h"
#include "http/http_stream.h"
#include "http/openai.h"
#include "model/chat_template.h"
#include "proxy/generation_service.h"

namespace tandem::http::detail {

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
  // Set by HttpServer::Start: the first five from the fleet file's proxy
  // section, `linger` from ServerOptions.
  struct Limits {
    size_t max_body_bytes = 0;    // a larger request body gets 413
    size_t max_header_bytes = 0;  // a larger header gets 431
    size_t max_pipelined = 0;     // requests waiting on one connection; one more gets 429
    size_t max_connections = 0;   // open connections; a connection past it gets 429
    double idle_timeout_seconds = 0;
    std::chrono::steady_clock::duration linger{};  // ServerOptions::linger_seconds
  } limits;

  TlsFiles tls_files;        // security.public_tls; empty: plaintext
  std::atomic<int> jobs{0};  // requests on the work pool (Shutdown waits for them)
  // Set once every worker registered at that moment had its KV snapshot in
  // the index: later joiners do not make a serving proxy unready again.
  std::atomic<bool> warm{false};

  std::mutex mu;
  std::set<Session*> sessions;  // guarded by mu
  std::condition_variable sessions_changed;  // a session left `sessions`
  bool stopping = false;        // guarded by mu
  // New connections' TLS context (null: plaintext); replaced by a reload.
  std::shared_ptr<net::ssl::context> tls;  // guarded by mu
};

// "OK", "Not Found", ... for the status line.
const char* Reason(int status);

// "" when a request could be served now; otherwise why not (GET /health).
std::string Unready(Shared& sh);

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Shared* sh, std::shared_ptr<net::ssl::context> tls);
  ~Session();

  void Start();

  // Shutdown, once the I/O threads are joined: the self-reference (hold_).
  std::shared_ptr<Session> TakeHold() { return std::move(hold_); }

  // Any thread (shutdown): the active request is cancelled; nothing more
  // reaches this session from its lifecycle.
  void CancelLifecycle();
  // Any thread (shutdown): the connection ends on its strand as an idle
  // timeout ends it (Gone: under TLS our close_notify, then the close).
  void Stop();

 private:
  // ---- idle connections (http_session.cc) ----------------------------------
  // A connection with no request in progress (keep-alive, or a client that
  // sends its request too slowly) is closed after proxy.http_idle_timeout_seconds.
  using SteadyClock = std::chrono::steady_clock;
  SteadyClock::duration Idle() const;
  void Touch() { last_activity_ = SteadyClock::now(); }
  void ArmIdleTimer(SteadyClock::duration after);
  void OnIdleTimer();

  // ---- reading (http_session.cc) -------------------------------------------
  void DoRead();
  void OnHeader(ErrorCode ec);
  void OnRead(ErrorCode ec);
  void OnReadError(ErrorCode ec);
  void MaybeServe();

  // ---- routes (http_routes.cc) ---------------------------------------------
  void Serve(const Request& req);

  // ---- generation (http_generation.cc) -------------------------------------
  struct Prepared;
  void CountOutcome(const Status& st);
  // Before the lifecycle starts: gives back the admission slot, if taken.
  void Refuse(const OpenAiRequest* r, const Status& st);
  static Prepared Prepare(Shared* sh, Endpoint ep, const std::string& body,
                          const proxy::Tenant* tenant, const std::string& request_id);
  void StartGeneration(Endpoint ep, const std::string& body, const proxy::Tenant* tenant);
  void OnPrepared(Prepared p, std::chrono::steady_clock::time_point arrival);
  void OnFinish(proxy::Finish reason, proxy::Usage usage);
  void OnError(const Status& st);
  void EndGeneration();

  // ---- writing (http_session.cc) -------------------------------------------
  void Respond(int status, std::string_view content_type, const std::string& body);
  // The current request is answered (its bytes may still be queued).
  void Finished();
  void Enqueue(std::string_view bytes) { outbox_->Write(bytes); }
  // The bytes the Outbox could not send at once, written in order by
  // async_write until none wait.
  void Flush();
  void OnFlushed(ErrorCode ec);
  // Nothing waits any more.
  void OnWritten();

  // ---- ending (http_session.cc) --------------------------------------------
  // The client closed or reset the connection: cancel what runs for it.
  void Gone();
  // Our side is done: half-close, then read and discard what the client
  // still sends (a body we refused, requests pipelined past a limit) until
  // its close, kLingerBytes or Limits::linger, whichever first. Closing with
  // unread bytes would make the kernel answer with a reset, which destroys
  // our last response before the client has read it.
  static constexpr size_t kLingerBytes = 1u << 20;
  void Close();
  // Our close_notify (TLS), the TCP half-close, then the linger unless the
  // parser's read is in flight (it lingers when it ends).
  void HalfClose();
  // Under TLS our close_notify goes first (RFC 8446 6.1), then the TCP
  // half-close; the discarded bytes are read from the TCP socket (TLS is
  // over for us), so the client's TCP close ends the linger.
  void Linger(size_t discarded);
  void EndLinger();
  // TLS, after the handshake: sends close_notify once (after the write in
  // flight, if one is), then runs `then`; otherwise `then` at once. Every
  // end of a TLS connection goes through it: the client's close (Gone,
  // EndLinger), ours (Close), the idle timeout (Gone, which cancels the
  // read waiting for the next request first).
  void CloseNotifyThen(std::function<void()> then);
  // The socket closes after Limits::linger whatever else waits (a linger, a
  // close_notify behind a write the client does not read).
  void ArmCloseTimer();

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
  std::shared_ptr<Outbox> outbox_;  // shared with the lifecycle's sink
  std::string flushing_;            // the bytes of the async_write in flight
  bool reading_ = false, busy_ = false, gone_ = false;
  bool writing_ = false;               // an async_write (Flush) is in flight
  bool notified_ = false;              // TLS: our close_notify has been sent (or tried)
  std::function<void()> after_write_;  // CloseNotifyThen's, behind the write in flight
  bool keep_alive_ = true, close_after_ = false, close_when_written_ = false;
  std::string request_id_header_;
  std::string traceparent_header_;
  bool over_connections_ = false;   // opened past proxy.limits.max_connections
  bool stop_reading_ = false;       // a request over max_pipelined_requests is queued
  std::shared_ptr<Session> hold_;   // this, while no read holds it (stop_reading_)
  double retry_after_seconds_ = 0;  // the next 429/503's Retry-After (0: 1 s)
  bool head_ = false;               // the request being answered is a HEAD

  // The request being generated (strand only).
  bool active_ = false, admitted_ = false, stream_ = false, include_usage_ = false;
  OpenAiRequest openai_req_;
  ResponseMeta meta_;

  std::mutex lc_mu_;
  std::shared_ptr<proxy::RequestLifecycle> lc_;  // guarded by lc_mu_
};

}  // namespace tandem::http::detail
