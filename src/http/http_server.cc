#include "http/http_server.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <ctime>
#include <thread>
#include <vector>

#include "common/net.h"
#include "http/http_session.h"

namespace tandem::http {

using detail::ErrorCode;
using detail::Session;
using detail::Shared;
namespace net = detail::net;
using tcp = detail::tcp;

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

bool HttpServer::WaitForNoConnections(double seconds) const {
  std::unique_lock lock(impl_->shared.mu);
  return impl_->shared.sessions_changed.wait_for(lock, std::chrono::duration<double>(seconds),
                                                 [&] { return impl_->shared.sessions.empty(); });
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
  sh.limits.idle_timeout_seconds = context.config->proxy.http_idle_timeout_seconds;
  const ProxyLimitsConfig& limits = context.config->proxy.limits;
  sh.limits.max_body_bytes = limits.max_http_body_bytes;
  sh.limits.max_header_bytes = limits.max_http_header_bytes;
  sh.limits.max_pipelined = limits.max_pipelined_requests;
  sh.limits.max_connections = limits.max_connections;
  sh.limits.linger = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options.linger_seconds));
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
    return InvalidArgumentError(
        fmt::format("proxy.http '{}': cannot resolve '{}': {}", address, hp.host, ec.message()));
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
  spdlog::info("http: OpenAI-compatible API on {}://{} ({} I/O threads)", sh.tls ? "https" : "http",
               impl->address, std::max(1, options.io_threads));
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
    // Every open connection ends as an idle timeout ends it (Stop), so that
    // a TLS client reads our close_notify rather than a bare TCP close (RFC
    // 8446 6.1); then the I/O threads stop.
    std::lock_guard lock(impl_->shared.mu);
    impl_->shared.stopping = true;
    for (Session* s : impl_->shared.sessions) {
      s->CancelLifecycle();
      s->Stop();
    }
  }
  net::post(impl_->ioc, [impl = impl_.get()] {
    ErrorCode ignored;
    impl->acceptor->close(ignored);
  });
  // Bounded: a session still there after the linger time (one whose close
  // waits for the client's) ends with the io_context, as before.
  WaitForNoConnections(std::chrono::duration<double>(impl_->shared.limits.linger).count());
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
  return
      [options](const std::string& address,
                const proxy::HttpContext& context) -> Result<std::unique_ptr<proxy::HttpFrontEnd>> {
        TANDEM_ASSIGN_OR_RETURN(auto server, HttpServer::Start(address, context, options));
        return std::unique_ptr<proxy::HttpFrontEnd>(std::move(server));
      };
}

}  // namespace tandem::http
